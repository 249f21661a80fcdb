"""Reproducible experiment runner: the scaling law of the excess risk in n and m.

Command line (from the repository root)::

    python -m attnlib.experiments scaling --out book/data/scaling.csv          # full grid
    python -m attnlib.experiments scaling --quick --out /tmp/scaling_quick.csv  # small grid (CI)

For every sequence length ``n``, noise level and seed, one sequence is drawn,
Algorithm 1 (``attnlib.train``, ``method="structured"``) runs for ``--steps``
steps, and every step is written as one row of a tidy CSV: ``n, noise_std,
seed, step, excess, dist, objective, time_s`` plus, at the first and last
step, ``test_loss`` (the empirical loss of the finite layer on fresh sequences
of the same length) and ``spectral_excess`` at step 0 (the spectral
initialisation). Runs already in the output file are skipped, so an
interrupted sweep resumes where it stopped; progress is shown with tqdm.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ._validate import check_positive_int, resolve_device, resolve_dtype
from .finite_n import heldout_loss
from .fits import fit_geometric_rate, fit_power_law
from .init import spectral_init
from .rng import derive_seed
from .task import Task
from .train import train

__all__ = [
    "ScalingConfig",
    "QUICK",
    "FULL",
    "run_scaling",
    "read_rows",
    "floor_by_run",
    "fit_floor",
    "fit_optimisation_rate",
    "main",
]

COLUMNS = ["n", "noise_std", "seed", "step", "excess", "dist", "objective", "time_s", "test_loss", "diverged"]


@dataclass
class ScalingConfig:
    """The grid and the task of a scaling sweep (all runs share the task; seeds vary the sequence)."""

    ns: Sequence[int] = (256, 512, 1024, 2048, 4096, 8192, 16384)
    noise_stds: Sequence[float] = (0.0, 0.1)
    seeds: Sequence[int] = (0, 1, 2, 3, 4)
    steps: int = 80
    lr: float = 0.5
    d: int = 4
    k: int = 2
    cond: float = 10.0
    signal: float = 1.0
    task_seed: int = 0
    test_sequences: int = 2
    dtype: str = "float64"

    def task(self, noise_std: float, device=None) -> Task:
        return Task.random(
            self.d,
            self.k,
            cond=self.cond,
            signal=self.signal,
            noise_std=noise_std,
            seed=self.task_seed,
            dtype=resolve_dtype(self.dtype),
            device=resolve_device(device),
        )


FULL = ScalingConfig()
QUICK = ScalingConfig(ns=(64, 256), noise_stds=(0.0, 0.1), seeds=(0, 1), steps=8)
# Step 1.0 (tried first) oscillates on finite sequences (period-2 in the excess at n = 4096 after 40
# steps), so the full grid uses 0.5 and 80 steps.


def _done_runs(path: str) -> set:
    if not os.path.exists(path):
        return set()
    return {(int(r["n"]), float(r["noise_std"]), int(r["seed"])) for r in read_rows(path)}


def run_scaling(config: ScalingConfig, out: str, *, device=None, progress: bool = True) -> Dict[str, float]:
    """Run (or resume) the sweep of ``config``, appending rows to the CSV file ``out``.

    Returns ``{"runs": new runs, "skipped": runs found in out, "wall_s": seconds}``.
    """
    device = resolve_device(device)
    done = _done_runs(out)
    todo = [
        (n, s2, seed)
        for n in config.ns
        for s2 in config.noise_stds
        for seed in config.seeds
        if (int(n), float(s2), int(seed)) not in done
    ]
    new_file = not os.path.exists(out) or os.path.getsize(out) == 0
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    t_start = time.perf_counter()
    from tqdm import tqdm

    with open(out, "a", newline="") as fh:
        writer = csv.writer(fh)
        if new_file:
            writer.writerow(COLUMNS)
        # smallest n first, so an interrupted sweep has the cheap part of the grid
        for n, noise, seed in tqdm(sorted(todo), desc="scaling runs", disable=not progress):
            task = config.task(noise, device)
            X, Y = task.sample(int(n), seed=derive_seed(int(seed), "sequence"))
            h = train(X, Y, steps=config.steps, lr=config.lr, method="structured", task=task, on_divergence="stop")
            tl0 = tl1 = float("nan")
            if h.steps:
                tl1 = heldout_loss(h.A, h.B, task, int(n), n_sequences=config.test_sequences, seed=int(seed))
                A0, B0 = spectral_init(X, Y)
                tl0 = heldout_loss(A0, B0, task, int(n), n_sequences=config.test_sequences, seed=int(seed))
            last = len(h.steps) - 1
            for i, st in enumerate(h.steps):
                tl = tl0 if i == 0 else (tl1 if i == last else float("nan"))
                writer.writerow(
                    [
                        int(n),
                        float(noise),
                        int(seed),
                        int(st),
                        repr(h.excess[i]),
                        repr(h.dist[i]),
                        repr(h.objective[i]),
                        repr(h.time[i]),
                        repr(tl),
                        int(h.diverged),
                    ]
                )
            fh.flush()
    return {"runs": len(todo), "skipped": len(done), "wall_s": time.perf_counter() - t_start}


def read_rows(path: str) -> List[Dict[str, float]]:
    """Read a scaling CSV into a list of dicts with numeric values."""
    rows = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            missing = [c for c in COLUMNS if c not in r]
            if missing:
                raise ValueError(f"path: {path} is not a scaling CSV (missing columns {missing})")
            rows.append({k: float(v) if v not in ("", None) else float("nan") for k, v in r.items()})
    return rows


def floor_by_run(
    rows: Iterable[Dict[str, float]], column: str = "excess", step: Optional[int] = None
) -> Dict[Tuple[int, float, int], float]:
    """Value of ``column`` at ``step`` (default: the last step of each run), keyed by ``(n, noise_std, seed)``."""
    best: Dict[Tuple[int, float, int], Tuple[int, float]] = {}
    for r in rows:
        key = (int(r["n"]), float(r["noise_std"]), int(r["seed"]))
        st = int(r["step"])
        if step is not None:
            if st == step:
                best[key] = (st, r[column])
        elif key not in best or st > best[key][0]:
            best[key] = (st, r[column])
    return {k: v for k, (_, v) in best.items()}


def fit_floor(
    rows,
    noise_std: float,
    *,
    column: str = "excess",
    step: Optional[int] = None,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
):
    """Power-law fit of ``column`` against ``n`` over all runs at ``noise_std`` with a bootstrap CI at ``level``.

    The bootstrap resamples seeds within each ``n`` (runs are the independent
    units); returns a :class:`~attnlib.fits.PowerLawFit`.
    """
    vals = {k: v for k, v in floor_by_run(rows, column, step).items() if k[1] == float(noise_std)}
    if not vals:
        raise ValueError(f"noise_std: no runs with noise_std = {noise_std}")
    if not 0 < float(level) < 1:
        raise ValueError(f"level: expected a number in (0, 1), got {level!r}")
    ns = np.array([k[0] for k in vals])
    ys = np.array(list(vals.values()))
    fit = fit_power_law(ns, ys)
    rng = np.random.default_rng(seed)
    groups = {n: ys[ns == n] for n in np.unique(ns)}
    slopes = []
    for _ in range(n_boot):
        xb, yb = [], []
        for n, g in groups.items():
            pick = g[rng.integers(0, len(g), len(g))]
            xb.extend([n] * len(g))
            yb.extend(pick)
        slopes.append(fit_power_law(xb, yb).slope)
    lo, hi = np.quantile(slopes, [(1 - level) / 2, (1 + level) / 2])
    fit.ci = (float(lo), float(hi))
    return fit


def fit_optimisation_rate(rows, n: int, noise_std: float, *, start: int = 1, rtol: float = 1e-11) -> float:
    """Geometric rate ``mu`` of the optimisation term at one ``n``, from the training objective.

    Averages the objective over seeds, takes the successive decrements
    ``d_m = Q_m - Q_{m+1}`` from step ``start`` on (the first step is a fast
    transient) and fits ``d_m ~ c mu^m``. A geometric sequence has geometric
    decrements with the same ``mu``, so no estimate of the limit is needed. The
    fit stops at the first decrement below ``rtol * |Q_m|`` (rounding level).
    ``mu >= 1`` means the decrements do not shrink: no geometric convergence.
    """
    per_seed: Dict[int, Dict[int, float]] = {}
    for r in rows:
        if int(r["n"]) == int(n) and float(r["noise_std"]) == float(noise_std):
            per_seed.setdefault(int(r["seed"]), {})[int(r["step"])] = r["objective"]
    if not per_seed:
        raise ValueError(f"n, noise_std: no runs with n = {n}, noise_std = {noise_std}")
    start = int(start)
    if start < 0:
        raise ValueError(f"start: expected a step >= 0, got {start}")
    steps = sorted(set.intersection(*[set(v) for v in per_seed.values()]))
    steps = [s for s in steps if s >= start]
    Q = np.mean([[v[s] for s in steps] for v in per_seed.values()], axis=0)
    d = Q[:-1] - Q[1:]
    ok = d > rtol * np.abs(Q[:-1])
    stop = int(np.argmin(ok)) if not ok.all() else len(d)
    if stop < 3:
        raise ValueError("rows: fewer than three decreasing steps after `start`; run more steps")
    return fit_geometric_rate(np.array(steps[:stop]), d[:stop])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m attnlib.experiments", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scaling", help="sweep n, noise and seeds; excess along the iterations")
    s.add_argument("--out", required=True, help="CSV file (appended to; existing runs are skipped)")
    s.add_argument("--quick", action="store_true", help="small grid for CI (n = 64, 256; 2 seeds; 8 steps)")
    s.add_argument("--device", default="cpu", help="torch device (default cpu; 'cuda' where present)")
    s.add_argument("--ns", type=int, nargs="+", help="override the sequence lengths")
    s.add_argument("--seeds", type=int, help="override the number of seeds")
    s.add_argument("--steps", type=int, help="override the number of steps")
    s.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.ns:
        cfg = replace(cfg, ns=tuple(args.ns))
    if args.seeds:
        cfg = replace(cfg, seeds=tuple(range(check_positive_int(args.seeds, "--seeds"))))
    if args.steps:
        cfg = replace(cfg, steps=check_positive_int(args.steps, "--steps"))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device: CUDA was requested but torch.cuda.is_available() is False")
    info = run_scaling(cfg, args.out, device=args.device, progress=not args.no_progress)
    print(f"{info['runs']} runs written, {info['skipped']} already present, wall time {info['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
