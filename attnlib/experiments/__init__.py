"""Every sweep of the book (``SWEEPS``: chapter 2's heavy tail, chapters 6 and 7), their CLI and the
helpers that select their rows for the analysis (:mod:`attnlib.analysis.stats`). The runs go through the one
resumable runner, :func:`attnlib.experiments.runner.run_sweep`, and are read back with the one reader,
:func:`attnlib.experiments.runner.read_sweep` (re-exported here as :func:`read_sweep`).

Command line (from the repository root; ``--workers N`` fans the runs out over a local Dask
cluster of N processes, ``--scheduler ADDRESS`` over an existing cluster, default: in process)::

    python -m attnlib.experiments spectral --out book/data/regime1_spectral.csv --workers 2
    python -m attnlib.experiments trained  --out book/data/regime1_trained.csv  --workers 2
    python -m attnlib.experiments rate     --out book/data/regime1_rate.csv     --workers 2
    python -m attnlib.experiments prompts  --out book/data/regime2_prompts.csv  --workers 2
    python -m attnlib.experiments heavy_tail --out book/data/heavy_tail.csv --workers 2
    python -m attnlib.experiments prompts --quick --out /tmp/q.csv             # seconds (tests)

(the README lists every sweep and its command). The sections below describe the four sweeps of
chapter 6's first design; the others are described where they are defined.

Regime (i), ``n`` = the number of tokens of the one training sequence:

* ``spectral``: the spectral initialization's population excess (and ``dist_P``), 400 independent
  sequences per ``n`` (16 .. 16384) and noise level (0, 0.1); every ``(n, noise, seed)`` has its
  own stream, so no sequence is a prefix of another;
* ``trained``: Algorithm 1 for 80 steps (step 0.5) with the balancing renormalization (exactly
  ``attnlib.train(method="structured")``) and with the capped one (``renormalize="cap"``,
  ``nu_cap = 0.25``), noise 0 and 0.1 on independent sequences, 40 seeds per ``n`` (32 .. 1024);
  rows at steps 0 (spectral initialization), 1, 2, 3, 5, 10, 20, 40, 60, 80; test loss on fresh
  sequences of length ``n`` at steps 0 and 80;
* ``rate``: 300 steps recorded at every step (4 seeds, ``n`` = 128, 512, 1024, both renormalizations,
  noise 0.1), with ``orbit_dist`` the P-distance (in the
  coordinates of ``Sigmahat``) to the orbit of the last iterate: the optimization rate on
  orbit-invariant quantities.

Regime (ii), ``n`` = context length, infinitely many prompts:

* ``prompts``: ``attnlib.optim.run_chain`` on ``L_n`` for ``n`` = 16 .. 1024 (120 steps, the
  last 90 averaged), four softmax scales ``lambda_max(C^T C)`` (renormalizations ``cap`` 0.25,
  ``fix`` 0.375, ``fix`` 0.7 and ``balance``, which gives ``s_1(T) = 0.94`` for this task), 6
  independent chains each; a row per chain holds the averaged residual ``R`` (entries ``r0..``)
  from which :func:`prompt_excess` forms the unbiased U-statistic.

The sweeps of chapter 6 share one task: ``d = 4``, ``k = 2``, ``cond(Sigma) = 10``, ``||T||_F = 1``
(seed 0); chapter 7's sweeps use ``optimizer_task``, the heavy-tail sweep chapter 2's task
(``HEAVY_TAIL_TASK``).
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..analysis.stats import ExponentFit, excess_ustat, fit_exponent, ustat_exponent
from ..geometry import distance_to_manifold, orbit_distance, orbit_to_scale, random_manifold_point
from ..model.finite_n import heldout_loss, query_averaged_error, softmax_scale
from ..model.task import Task
from ..optim import ChainConfig, Snapshots, run_chain, run_chains, train, train_prompts
from ..optim.grid import grid_search
from ..optim.init import spectral_init
from ..optim.lockstep import PER_CHAIN
from ..rng import derive_seed
from .runner import Sweep, read_sweep, run_sweep

__all__ = [
    "OPT_NAMES",
    "TASK",
    "TaskSpec",
    "FULL",
    "make_task",
    "SWEEPS",
    "sweep",
    "chain_of_spec",
    "read_sweep",
    "HEAVY_TAIL_TASK",
    "HEAVY_TAIL_DESIGN",
    "heavy_tail_point",
    "heavy_tail_errors",
    "values_by_n",
    "trained_values",
    "series",
    "fit_floor",
    "spectral_constant",
    "lower_bound_constant",
    "van_trees_bound",
    "prompt_residuals",
    "prompt_excess",
    "fit_prompt_exponent",
    "main",
]

#: The task every sweep uses (arguments of :meth:`attnlib.model.task.Task.random`).
TASK = dict(d=4, k=2, cond=10.0, signal=1.0, seed=0)


@dataclass(frozen=True)
class TaskSpec:
    """The sweeps' task as attributes (what :meth:`attnlib.model.task.Task.random` receives, seed as ``task_seed``)."""

    d: int
    k: int
    cond: float
    signal: float
    task_seed: int


#: The sweeps' task as attributes (``FULL.d``, ``FULL.k``, ``FULL.cond``, ``FULL.signal``,
#: ``FULL.task_seed``); the name is kept for chapters that read the task of the scaling chapter from it.
FULL = TaskSpec(TASK["d"], TASK["k"], TASK["cond"], TASK["signal"], TASK["seed"])


def make_task(noise_std: float = 0.0) -> Task:
    """The sweeps' task with label noise ``noise_std`` (float64, CPU)."""
    return Task.random(
        TASK["d"], TASK["k"], cond=TASK["cond"], signal=TASK["signal"], noise_std=noise_std, seed=TASK["seed"]
    )


def _stream(kind: str, noise: float, n: int) -> str:
    return f"{kind}:noise={float(noise)!r}:n={int(n)}"


def _sequence(task: Task, kind: str, n: int, seed: int):
    return task.sample(int(n), seed=derive_seed(int(seed), _stream(kind, task.noise_std, n)))


# ----------------------------------------------------------------------------- regime (i): spectral


def _run_spectral(spec: dict) -> List[dict]:
    task = make_task(spec["noise_std"])
    rows = []
    for seed in range(int(spec["seeds"])):
        X, Y = _sequence(task, "regime-i", spec["n"], seed)
        A, B = spectral_init(X, Y)
        rows.append(
            dict(
                seed=seed,
                excess=float(task.excess_risk(A, B)),
                dist=float(distance_to_manifold(A, B, task)),
                nu=softmax_scale(A, B, task),
            )
        )
    return rows


def _spectral_specs(ns, noises, seeds) -> List[dict]:
    return [
        dict(run=f"n={n}:noise={s}", n=int(n), noise_std=float(s), seeds=int(seeds), cost=float(n) * seeds)
        for n in ns
        for s in noises
    ]


# ----------------------------------------------------------------------------- regime (i): trained

RECORD_STEPS = (0, 1, 2, 3, 5, 10, 20, 40, 60, 80)


def _train(spec: dict, task: Task, X, Y, hooks=()):
    """Algorithm 1 on one sequence: the book's default (with the regularizer) for ``"balance"`` without
    hooks (the trained sweep), else without the regularizer and with the spec's renormalization."""
    if spec["renormalize"] == "balance" and not hooks:
        return train(X, Y, steps=int(spec["steps"]), lr=float(spec["lr"]), task=task, on_divergence="stop")
    nu_cap = None if spec["renormalize"] == "balance" else float(spec["nu_cap"])
    return train(
        X, Y, steps=int(spec["steps"]), lr=float(spec["lr"]), regularize=False, renormalize=spec["renormalize"],
        nu_cap=nu_cap, task=task, hooks=hooks, on_divergence="stop",
    )  # fmt: skip


def _run_trained(spec: dict) -> List[dict]:
    task = make_task(spec["noise_std"])
    n, seed = int(spec["n"]), int(spec["seed"])
    X, Y = _sequence(task, "regime-i-trained", n, seed)
    h = _train(spec, task, X, Y)
    A0, B0 = spectral_init(X, Y)
    tl0 = heldout_loss(A0, B0, task, n, n_sequences=2, seed=seed)
    tl1 = heldout_loss(h.A, h.B, task, n, n_sequences=2, seed=seed)
    last = h.steps[-1]
    rows = []
    for i, st in enumerate(h.steps):
        if st not in RECORD_STEPS and st != last:
            continue
        rows.append(
            dict(
                step=int(st),
                excess=h.excess[i],
                dist=h.dist[i],
                objective=h.objective[i],
                test_loss=tl0 if st == 0 else (tl1 if st == last else math.nan),
                diverged=int(h.diverged),
            )
        )
    rows[-1]["nu"] = softmax_scale(h.A, h.B, task)
    return rows


def _product_specs(run_id, axes: Dict, fixed, cost=None, after: Optional[dict] = None) -> List[dict]:
    """One spec per point of the product of ``axes`` (field -> values, the last field varying fastest; a tuple
    of fields takes tuples of values), then the ``fixed`` fields (a dict, or a function of the spec so far):
    ``run`` = ``run_id(spec)`` first, then ``cost`` = ``cost(spec)`` (if given), then the fields ``after``."""
    out = []
    for values in itertools.product(*axes.values()):
        spec = {}
        for key, v in zip(axes, values):
            spec.update(zip(key, v) if isinstance(key, tuple) else [(key, v)])
        spec.update(fixed(spec) if callable(fixed) else fixed)
        out.append({"run": run_id(spec), **spec, **({} if cost is None else {"cost": cost(spec)}), **(after or {})})
    return out


def _cap(nu_cap):
    """A renormalization's cap as written in a spec (``""`` for none)."""
    return nu_cap if nu_cap is not None else ""


def _sequence_run_id(s: dict) -> str:
    return f"{s['renormalize']}:noise={s['noise_std']}:n={s['n']}:seed={s['seed']}"


def _trained_specs(configs, ns, seeds, steps=80, lr=0.5) -> List[dict]:
    """One regime-(i) run per renormalization (and its cap), noise level and sequence ``(n, seed)``."""
    return _product_specs(
        _sequence_run_id,
        {
            ("renormalize", "nu_cap", "noise_std"): [(r, _cap(k), float(z)) for r, k, z in configs],
            "n": ns,
            "seed": range(seeds),
        },
        dict(steps=int(steps), lr=float(lr)),
        cost=lambda s: float(s["n"]) ** 2 * steps + 2e4 * steps,
    )


# ----------------------------------------------------------------------------- regime (i): rate


def _run_rate(spec: dict) -> List[dict]:
    task = make_task(spec["noise_std"])
    n, seed = int(spec["n"]), int(spec["seed"])
    X, Y = _sequence(task, "regime-i-rate", n, seed)
    rec = Snapshots()
    h = _train(spec, task, X, Y, hooks=(rec,))
    from ..model.task import empirical_task

    geom = empirical_task(X, Y)
    A_inf, B_inf = rec.iterates[-1]
    rows = []
    for i, st in enumerate(h.steps):
        A, B = rec.iterates[i]
        rows.append(
            dict(
                step=int(st),
                excess=h.excess[i],
                dist=h.dist[i],
                orbit_dist=orbit_distance(A, B, A_inf, B_inf, geom),
                objective=h.objective[i],
            )
        )
    return rows


# ----------------------------------------------------------------------------- regime (ii)

PROMPT_SCALES = (
    ("cap0.25", "cap", 0.25),
    ("fix0.375", "fix", 0.375),
    ("fix0.7", "fix", 0.7),
    ("balance", "balance", None),
)


def prompts_per_step(n: int, base: int = 16, n_ref: int = 256) -> int:
    """Prompts per step of the regime-(ii) chains: ``base * max(1, n_ref / n)`` (more at short contexts,
    where they are cheap, so that the iterate noise, hence its second-order bias, stays small)."""
    return int(base * max(1, n_ref // int(n)))


def _chain_config(spec: dict) -> dict:
    """The :class:`attnlib.optim.ChainConfig` fields of one spec of a regime-(ii) chain sweep, its seed included."""
    nu_cap = None if spec["renormalize"] == "balance" else float(spec["nu_cap"])
    return dict(
        steps=int(spec["steps"]),
        burn_in=int(spec["burn_in"]),
        prompts=int(spec["prompts"]),
        lr=float(spec["lr"]),
        renormalize=spec["renormalize"],
        nu_cap=nu_cap,
        seed=derive_seed(int(spec["chain"]), f"regime-ii:{spec['label']}:n={int(spec['n'])}"),
        attention_dtype=spec.get("attention_dtype") or None,
    )


def chain_of_spec(spec: dict, **options):
    """The chain of one spec of a regime-(ii) chain sweep (:func:`attnlib.optim.run_chain` on the sweeps' task,
    with the spec's seed stream); ``options`` override the config (e.g. ``engine``, ``attention_dtype``)."""
    return run_chain(make_task(0.0), int(spec["n"]), **{**_chain_config(spec), **options})


def _chain_group(spec: dict) -> str:
    """The specs whose chains can run in lockstep: the same ``n`` and everything but the seed and the
    renormalization equal (so the prompts sweep's scales at one ``n`` share the kernel passes)."""
    cfg = _chain_config(spec)
    return repr((int(spec["n"]), sorted((k, v) for k, v in cfg.items() if k not in PER_CHAIN)))


def chains_of_specs(specs: Sequence[dict], **options):
    """:func:`chain_of_spec` of every spec, in lockstep (:func:`attnlib.optim.run_chains`): specs of one
    :func:`_chain_group` (labels and renormalizations may differ), each chain with its own seed stream and
    renormalization; equal to the sequential chains to round-off."""
    keys = {_chain_group(s) for s in specs}
    if len(keys) != 1:
        raise ValueError(f"specs: expected chains of one configuration, got {len(keys)} different ones")
    cfgs = [ChainConfig(**{**_chain_config(s), **options}) for s in specs]
    return run_chains(make_task(0.0), int(specs[0]["n"]), [c.seed for c in cfgs], cfgs)


def _chain_row(res) -> dict:
    row = {f"r{i}": float(v) for i, v in enumerate(res.R.ravel())}
    row.update(
        naive_excess=res.naive_excess,
        test_excess=res.test_excess,
        nu=res.nu,
        last_excess=res.history.excess[-1],
        batches=res.batches,
    )
    return row


def _run_chain(spec: dict) -> List[dict]:
    return [_chain_row(chain_of_spec(spec))]


def _run_chains(specs: List[dict]) -> List[List[dict]]:
    return [[_chain_row(res)] for res in chains_of_specs(specs)]


def _prompt_specs(scales, ns, chains, steps=120, burn_in=30, lr=0.5, attention_dtype=None) -> List[dict]:
    """Independent chains per scale and ``n``; ``attention_dtype`` (e.g. ``"float32"``), when given, is
    the attention part's dtype (:class:`attnlib.optim.PromptObjective`), kept in the spec."""
    return _product_specs(
        lambda s: f"{s['label']}:n={s['n']}:chain={s['chain']}",
        {
            ("label", "renormalize", "nu_cap"): [(lab, m, _cap(k)) for lab, m, k in scales],
            "n": ns,
            "chain": range(chains),
        },
        lambda s: dict(steps=int(steps), burn_in=int(burn_in), prompts=prompts_per_step(s["n"]), lr=float(lr)),
        cost=lambda s: float(s["prompts"]) * s["n"] * s["n"] * steps,
        after={} if attention_dtype is None else dict(attention_dtype=str(attention_dtype)),
    )


# ----------------------------------------------------------------------------- regime (i): the limit (issue 21)

LIMIT_RECORD = (0, 80, 300)  #: steps of G recorded before Newton starts from the last one


def _run_limit(spec: dict) -> List[dict]:
    """One sequence: the spectral initialization, 80 and 300 steps of G, and the stable fixed point of G."""
    from ..analysis.fixedpoint import SequenceMap, fixed_point
    from ..analysis.fixedpoint import spectrum as jac_spectrum

    task = make_task(spec["noise_std"])
    n, seed = int(spec["n"]), int(spec["seed"])
    X, Y = _sequence(task, "regime-i-trained", n, seed)  # the trained sweep's sequences: paired with it
    nu_cap = None if spec["renormalize"] == "balance" else float(spec["nu_cap"])
    g = SequenceMap(X, Y, float(spec["lr"]), renormalize=spec["renormalize"], nu_cap=nu_cap)
    v = g.from_params(*spectral_init(X, Y))
    its = g.iterate(v, max(LIMIT_RECORD))
    row = {f"excess_{m}": float(task.excess_risk(*g.to_params(its[m]))) for m in LIMIT_RECORD}
    fp = fixed_point(g, its[-1], task=task, max_iter=300)  # (one sequence of 104 needed more than 80)
    sp = jac_spectrum(g, fp.v)
    vg = fp.v.clone().requires_grad_(True)
    grad = torch.autograd.grad(g.loss(vg), vg)[0]
    row.update(
        excess_limit=fp.excess,
        residual=fp.residual,
        newton_iterations=fp.iterations,
        converged=int(fp.converged),
        radius=float(np.abs(sp.eigenvalues).max()),
        removed=sp.removed,
        loss_limit=float(g.loss(fp.v)),
        grad_norm=float(torch.linalg.norm(grad)),
        dist_limit=float(distance_to_manifold(fp.A, fp.B, task)),
        dist_300_limit=float(torch.linalg.norm(its[-1] - fp.v)),
        scale_limit=softmax_scale(fp.A, fp.B, task),
        overlap_min=float(sp.rotation_overlap.min()),
        fast_max=float(np.abs(sp.fast).max()) if sp.fast.size else math.nan,
    )
    for i in range(LIMIT_SLOW):
        row[f"mu_slow{i}"] = float(sp.slow[i].real) if i < sp.slow.size else math.nan
        row[f"h_rot{i}"] = float(sp.h_rotation[i]) if i < sp.h_rotation.size else math.nan
    return [row]


LIMIT_SLOW = 5  #: rotation directions of the sweeps' task (d = 4, rank 2: dim St(4, 2) = 5)


def _limit_specs(ns_seeds, renorms=(("balance", None),), noises=(0.0,), lr=0.5) -> List[dict]:
    return _product_specs(
        _sequence_run_id,
        {
            ("renormalize", "nu_cap"): [(r, _cap(k)) for r, k in renorms],
            "noise_std": [float(z) for z in noises],
            ("n", "seed"): [(int(n), s) for n, seeds in ns_seeds for s in range(seeds)],
        },
        dict(lr=float(lr)),
        cost=lambda s: float(s["n"]) ** 2,
    )


#: The limit sweep's design (n, independent sequences); a larger machine would run (4096, 40) too.
LIMIT_DESIGN = ((64, 40), (256, 40), (1024, 24))

# ----------------------------------------------------------------------------- regime (ii): the whole law (issue 21)


def _law_chain(spec: dict, task: Task, seed: int, init):
    """One regime-(ii) chain of a ``law`` run (:func:`attnlib.optim.run_chain` with the spec's ``n``, ``prompts``,
    ``steps``, ``lr``, ``renormalize`` and ``nu_cap``) from ``init`` on the prompt stream ``seed``; the residual
    ``A Sigma B^T - M`` at every step (a hook)."""
    Es = []

    def residual(t, A, B, loss, recorded):
        with torch.no_grad():
            Es.append((A.detach() @ task.Sigma @ B.detach().T - task.M).detach())

    nu_cap = None if spec["renormalize"] == "balance" else float(spec["nu_cap"])
    steps = int(spec["steps"])
    cfg = ChainConfig(steps=steps, burn_in=0, prompts=int(spec["prompts"]), lr=float(spec["lr"]), seed=seed, init=init,
                      renormalize=spec["renormalize"], nu_cap=nu_cap, record_every=steps)  # fmt: skip
    run_chain(task, int(spec["n"]), cfg, hooks=(residual,))
    return Es


def law_starts(spec: dict):
    """The two starts of a ``law`` run: ``(on, start)``, the balanced minimum ``W = V`` and the perturbed
    chain's start, ``on`` moved to P-distance ``radius`` in a random direction or, with ``radius`` empty
    (``start=spectral`` in the run's name), the spectral initialization from the chain's first prompts:
    the ``prompts`` prompts of its first step, pooled (``prompts * n`` tokens). Both before the
    renormalization."""
    from ..geometry import manifold_point, perturb
    from ..model.prompts import sample_prompts
    from ..rng import make_generator

    task = make_task(0.0)
    n, pair = int(spec["n"]), int(spec["pair"])
    on = manifold_point(task, task.svd[2])
    radius = spec["radius"]
    if radius == "" or (isinstance(radius, float) and math.isnan(radius)):
        gen = make_generator(derive_seed(pair, f"regime-ii-law:{spec['label']}:n={n}"))  # the chains' stream
        X, Y = sample_prompts(task, n, int(spec["prompts"]), generator=gen)
        return on, spectral_init(X.reshape(-1, task.d), Y.reshape(-1, task.k))
    return on, perturb(*on, task, float(radius), seed=derive_seed(pair, "regime-ii-law:direction"))


def _run_law(spec: dict) -> List[dict]:
    """A pair of chains on the same prompts (common random numbers): one from the minimum set, one
    from P-distance ``radius`` (before the renormalization), or, with ``radius`` empty, from the spectral
    initialization on the first step's prompts (:func:`law_starts`). Rows: the population excess of both
    iterates, ``gap = ||(E_pert - E_on) Sigma^{1/2}||_F`` and ``cross = <E_on, E_pert - E_on>``."""
    task = make_task(0.0)
    n, pair = int(spec["n"]), int(spec["pair"])
    seed = derive_seed(pair, f"regime-ii-law:{spec['label']}:n={n}")
    on, pert = law_starts(spec)
    E_on, E_pert = _law_chain(spec, task, seed, on), _law_chain(spec, task, seed, pert)
    S_half = task.Sigma_sqrt
    rows = []
    for m, (a, b) in enumerate(zip(E_on, E_pert)):
        a_, b_ = a @ S_half, b @ S_half
        rows.append(
            dict(
                step=m,
                excess_on=0.5 * float(torch.sum(a_**2)),
                excess_pert=0.5 * float(torch.sum(b_**2)),
                gap=float(torch.linalg.norm(b_ - a_)),
                cross=float(torch.sum(a_ * (b_ - a_))),
            )
        )
    return rows


def _law_specs(renormalization, ns, pairs, steps=80, radii=(0.1, 0.5), lr=0.5, spectral=False) -> List[dict]:
    """Pairs of chains per ``n`` and start, at the renormalization ``(label, renormalize, nu_cap)`` (an entry
    of the form of ``PROMPT_SCALES``): P-distance ``radius`` for each of ``radii``, then (``spectral``)
    the spectral initialization from the first prompts (``radius`` empty, ``start=spectral`` in the name)."""
    label, mode, nu_cap = renormalization
    starts = [float(r) for r in radii] + (["spectral"] if spectral else [])
    return [
        dict(
            run=f"{label}:n={n}:radius={radius}:pair={p}"
            if radius != "spectral"
            else f"{label}:n={n}:start=spectral:pair={p}",
            label=label,
            renormalize=mode,
            nu_cap=nu_cap if nu_cap is not None else "",
            n=int(n),
            pair=int(p),
            radius=radius if radius != "spectral" else "",
            steps=int(steps),
            prompts=prompts_per_step(n),
            lr=float(lr),
            cost=2.0 * prompts_per_step(n) * n * n * steps,
        )
        for n in ns
        for radius in starts
        for p in range(pairs)
    ]


#: The cap that minimizes the predicted c2 at the chains' point W = V (``attnlib.analysis.theory.best_scale``: 0.145),
#: run with the design of the ``prompts`` sweep to test the prediction against the cap 1/4 (issue 21).
BEST_SCALE = (("cap0.145", "cap", 0.145),)

#: The whole-law sweep's design: light tails (cap 1/4), n = 64, 128, 256, starts at P-distance 0.1
#: and 0.5 and the spectral initialization from the first prompts, 16 pairs of chains each.
LAW_DESIGN = dict(renormalization=PROMPT_SCALES[0], ns=(64, 128, 256), pairs=16, spectral=True)

#: The light-tailed sweep extended beyond n = 1024 (issue 21): the cap 1/4 at n = 2048 (8 chains) and
#: 4096 (12 chains), float32 attention (the moment kernel; benchmarks/prompts_engines.md), chains sized
#: for a standard error of n^2 x excess below 10% of the predicted c2.
LARGE_DESIGN = (((2048,), 8), ((4096,), 12))


def _large_specs(design=LARGE_DESIGN, scales=PROMPT_SCALES[:1], **kw) -> List[dict]:
    return [s for ns, chains in design for s in _prompt_specs(scales, ns, chains, attention_dtype="float32", **kw)]


#: The other light-tailed scale beyond n = 1024 (issue 21): ``fix0.375`` (balance, then move along the
#: orbit to nu = 0.375, as in the ``prompts`` sweep) with the design of ``prompts_large``.
LARGE_FIX_SCALES = PROMPT_SCALES[1:2]

#: float32 against float64 attention (issue 21): chains of ``prompts_large`` (the cap 1/4, the same labels,
#: hence the same seeds and prompts), all 8 at n = 2048 and the first 4 of 12 at n = 4096, rerun with
#: float64 attention, to pair with them.
PRECISION_DESIGN = (((2048,), 8), ((4096,), 4))


def _precision_specs(design=PRECISION_DESIGN, scales=PROMPT_SCALES[:1], **kw) -> List[dict]:
    return [s for ns, chains in design for s in _prompt_specs(scales, ns, chains, attention_dtype="float64", **kw)]


# ----------------------------------------------------------------------------- the sweeps

_TRAINED_CONFIGS = (("balance", None, 0.0), ("balance", None, 0.1), ("cap", 0.25, 0.0), ("cap", 0.25, 0.1))

#: The spec columns of the regime-(i) sweeps on one sequence (``trained``, ``rate``).
_SEQUENCE_SPEC = ("renormalize", "nu_cap", "noise_std", "n", "seed", "steps", "lr")
#: The spec columns and the columns of the regime-(ii) chain sweeps (``prompts``, ``prompts_best``,
#: ``prompts_large``, which adds ``attention_dtype``): one row per chain, its averaged residual ``r0..``.
_CHAIN_SPEC = ("label", "renormalize", "nu_cap", "n", "chain", "steps", "burn_in", "prompts", "lr")
_CHAIN_COLUMNS = tuple(f"r{i}" for i in range(TASK["k"] * TASK["d"])) + (
    "naive_excess",
    "test_excess",
    "nu",
    "last_excess",
    "batches",
)

#: The regime-(ii) chain sweeps compute the chains of one n and configuration (any renormalization) in lockstep
#: (the runner's ``batch``), up to 48 at a time (the prompts sweep: its 4 scales x 6 chains at each n).
_LOCKSTEP = dict(batch=_run_chains, group=_chain_group, max_group=48)

#: The book's sweeps by name, each a dict of ``func`` (``func(spec) -> rows``, module level), ``spec_columns``
#: (the spec fields written to every row), ``columns`` (what ``func`` returns) and ``full``, ``quick`` (functions
#: returning the spec lists); optionally ``batch`` and ``group`` (the runner computes the runs of one group together).
SWEEPS: Dict[str, dict] = {
    "spectral": dict(
        func=_run_spectral,
        spec_columns=("n", "noise_std"),
        columns=("seed", "excess", "dist", "nu"),
        full=lambda: _spectral_specs([2**i for i in range(4, 15)], (0.0, 0.1), 400),
        quick=lambda: _spectral_specs((16, 64, 256), (0.0, 0.1), 20),
    ),
    "trained": dict(
        func=_run_trained,
        spec_columns=_SEQUENCE_SPEC,
        columns=("step", "excess", "dist", "objective", "test_loss", "diverged", "nu"),
        full=lambda: _trained_specs(_TRAINED_CONFIGS, [2**i for i in range(5, 11)], 40),
        quick=lambda: _trained_specs((("balance", None, 0.1), ("cap", 0.25, 0.1)), (32, 64), 2, steps=5),
    ),
    "rate": dict(
        func=_run_rate,
        spec_columns=_SEQUENCE_SPEC,
        columns=("step", "excess", "dist", "orbit_dist", "objective"),
        full=lambda: _trained_specs((("balance", None, 0.1), ("cap", 0.25, 0.1)), (128, 512, 1024), 4, steps=300),
        quick=lambda: _trained_specs((("balance", None, 0.1),), (32,), 2, steps=20),
    ),
    "prompts": dict(
        func=_run_chain,
        **_LOCKSTEP,
        spec_columns=_CHAIN_SPEC,
        columns=_CHAIN_COLUMNS,
        full=lambda: _prompt_specs(PROMPT_SCALES, [2**i for i in range(4, 11)], 6),
        quick=lambda: _prompt_specs(
            (("balance", "balance", None), ("cap0.25", "cap", 0.25)), (16, 32), 3, steps=12, burn_in=4
        ),
    ),
    "limit": dict(
        func=_run_limit,
        spec_columns=("renormalize", "nu_cap", "noise_std", "n", "seed", "lr"),
        columns=tuple(f"excess_{m}" for m in LIMIT_RECORD)
        + (
            "excess_limit",
            "residual",
            "newton_iterations",
            "converged",
            "radius",
            "removed",
            "loss_limit",
            "grad_norm",
            "dist_limit",
            "dist_300_limit",
            "scale_limit",
            "overlap_min",
            "fast_max",
        )
        + tuple(f"mu_slow{i}" for i in range(LIMIT_SLOW))
        + tuple(f"h_rot{i}" for i in range(LIMIT_SLOW)),
        full=lambda: _limit_specs(LIMIT_DESIGN),
        quick=lambda: _limit_specs(((32, 2),)),
    ),
    "prompts_best": dict(
        func=_run_chain,
        **_LOCKSTEP,
        spec_columns=_CHAIN_SPEC,
        columns=_CHAIN_COLUMNS,
        full=lambda: _prompt_specs(BEST_SCALE, [2**i for i in range(4, 11)], 6),
        quick=lambda: _prompt_specs(BEST_SCALE, (16,), 3, steps=12, burn_in=4),
    ),
    "prompts_large": dict(
        func=_run_chain,
        **_LOCKSTEP,
        spec_columns=_CHAIN_SPEC + ("attention_dtype",),
        columns=_CHAIN_COLUMNS,
        full=lambda: _large_specs(),
        quick=lambda: _large_specs((((16,), 3),), steps=12, burn_in=4),
    ),
    "prompts_large_fix": dict(
        func=_run_chain,
        **_LOCKSTEP,
        spec_columns=_CHAIN_SPEC + ("attention_dtype",),
        columns=_CHAIN_COLUMNS,
        full=lambda: _large_specs(scales=LARGE_FIX_SCALES),
        quick=lambda: _large_specs((((16,), 3),), scales=LARGE_FIX_SCALES, steps=12, burn_in=4),
    ),
    "prompts_float64": dict(
        func=_run_chain,
        **_LOCKSTEP,
        spec_columns=_CHAIN_SPEC + ("attention_dtype",),
        columns=_CHAIN_COLUMNS,
        full=lambda: _precision_specs(),
        quick=lambda: _precision_specs((((16,), 3),), steps=12, burn_in=4),
    ),
    "law": dict(
        func=_run_law,
        spec_columns=("label", "renormalize", "nu_cap", "n", "pair", "radius", "steps", "prompts", "lr"),
        columns=("step", "excess_on", "excess_pert", "gap", "cross"),
        full=lambda: _law_specs(**LAW_DESIGN),
        quick=lambda: _law_specs(PROMPT_SCALES[0], (16,), 2, steps=5, radii=(0.1,), spectral=True),
    ),
}


def sweep(name: str, quick: bool = False, *, lockstep: bool = True) -> Sweep:
    """The ``attnlib.experiments.runner.Sweep`` called ``name`` (``quick``: its seconds-long variant for tests).

    ``lockstep``: where the sweep has a ``batch`` function (the regime-(ii) chain sweeps), compute the chains
    of one configuration together (:func:`attnlib.optim.run_chains`; the same numbers to round-off);
    ``False``: one chain per run, as ``func``."""
    if name not in SWEEPS:
        raise ValueError(f"name: expected one of {tuple(SWEEPS)}, got {name!r}")
    s = SWEEPS[name]
    specs = s["quick" if quick else "full"]()
    batch = dict(batch=s["batch"], group=s["group"]) if lockstep and "batch" in s else {}
    return Sweep(name, s["func"], specs, s["spec_columns"], s["columns"], **batch)


# ----------------------------------------------------------------------------- analysis helpers


def values_by_n(rows, column: str = "excess", **where) -> Dict[int, np.ndarray]:
    """``{n: array of column}`` over the rows matching every ``key=value`` in ``where``."""
    out: Dict[int, list] = {}
    for r in rows:
        if all((r[k] == v) if not isinstance(v, float) else (float(r[k]) == v) for k, v in where.items()):
            out.setdefault(int(r["n"]), []).append(float(r[column]))
    if not out:
        raise ValueError(f"where: no rows match {where}")
    return {n: np.array(v) for n, v in sorted(out.items())}


def trained_values(rows, renormalize: str, noise_std: float, *, step: Optional[int] = None, column: str = "excess"):
    """``{n: values over the seeds}`` of ``column`` in the ``trained`` sweep for one renormalization and noise level.

    ``step``: the recorded step (default: the last, the trained floor; 0 is the spectral
    initialization). The values of each ``n`` are in seed order, so two calls pair up seed by seed.
    """
    sel = [r for r in rows if r["renormalize"] == renormalize and float(r["noise_std"]) == float(noise_std)]
    if not sel:
        raise ValueError(f"renormalize, noise_std: no runs with renormalize = {renormalize!r}, noise_std = {noise_std}")
    last = max(int(r["step"]) for r in sel)
    st = last if step is None else int(step)
    sel = sorted((r for r in sel if int(r["step"]) == st), key=lambda r: (int(r["n"]), int(r["seed"])))
    if not sel:
        raise ValueError(f"step: no rows at step {step} (recorded: 0 .. {last})")
    return values_by_n(sel, column)


def series(rows, column: str, **where):
    """``(steps, values)`` of ``column`` along one run: the rows matching every ``key=value`` in ``where``,
    sorted by ``step`` (e.g. ``series(rows, "orbit_dist", renormalize="cap", n=512, seed=0)``).

    Raises ``ValueError`` when no row matches or when a step occurs twice (``where`` does not pick one run).
    """
    sel = [r for r in rows if all(r[k] == v for k, v in where.items())]
    if not sel:
        raise ValueError(f"where: no rows match {where}")
    sel.sort(key=lambda r: int(r["step"]))
    steps = np.array([int(r["step"]) for r in sel])
    if np.any(np.diff(steps) == 0):
        raise ValueError(
            f"where: {where} matches more than one run (step {int(steps[np.argmin(np.diff(steps))])} repeats)"
        )
    return steps, np.array([float(r[column]) for r in sel])


def fit_floor(
    rows,
    noise_std: float,
    *,
    renormalize: str = "balance",
    step: Optional[int] = None,
    stat: str = "mean",
    level: float = 0.95,
    n_min=None,
) -> ExponentFit:
    """Exponent of the regime-(i) excess against ``n`` over independent seeds (rows of the ``trained`` sweep).

    ``step``: the recorded step (default: the last, the trained floor; 0 is the spectral
    initialization). ``stat``: fit the per-``n`` mean or median (``attnlib.analysis.stats.fit_exponent``).
    """
    sel = [r for r in rows if r["renormalize"] == renormalize and float(r["noise_std"]) == float(noise_std)]
    if not sel:
        raise ValueError(f"noise_std, renormalize: no runs with noise_std = {noise_std}, renormalize = {renormalize!r}")
    last = max(int(r["step"]) for r in sel)
    st = last if step is None else int(step)
    vals = values_by_n([r for r in sel if int(r["step"]) == st], "excess")
    return fit_exponent(vals, stat=stat, level=level, n_min=n_min)


def spectral_constant(task: Task) -> float:
    r"""Leading constant ``c`` of ``E[L(theta_0) - L*] ~ c / n`` for the spectral initialization (regime (i)).

    ``c = (||T||_*^2 + ||T||_F^2) / 2 + sigma^2 k d / 2``: the first part from
    ``Sigmahat - Sigma`` (``Sigmahat = Sigma^{1/2} (I + Z) Sigma^{1/2}``, Wishart fluctuations
    ``E Z_ij Z_kl = (delta_ik delta_jl + delta_il delta_jk) / n``, acting through ``At Z C`` at the
    balanced minimum, where ``||At||_F^2 = ||C||_F^2 = ||T||_*``), the second from least squares.
    """
    s = task.svd[1]
    nuc, fro2 = float(s.sum()), float((s**2).sum())
    return 0.5 * (nuc**2 + fro2) + 0.5 * task.noise_std**2 * task.k * task.d


def lower_bound_constant(task: Task) -> float:
    """``||T||_F^2 / d``: the asymptotic van Trees lower bound on ``n E[L(theta_hat) - L*]`` (regime (i)).

    Any estimator built from one sequence of ``n`` tokens, on the scale family
    ``Sigma = s Sigma_0``; see the book's chapter on the scaling law for the proof.
    """
    return float(torch.sum(task.T**2)) / task.d


def van_trees_bound(task: Task, n: int, h: float = 0.5) -> float:
    r"""Explicit regime-(i) lower bound on the Bayes risk over the scale family ``Sigma = s Sigma_task``.

    Prior ``pi(s) = cos^2(pi (s - 1) / (2 h)) / h`` on ``[1 - h, 1 + h]`` (Fisher information
    ``J(pi) = pi^2 / h^2``); for any estimator built from one sequence of ``n`` tokens,
    ``int E_s[L_s - L*] pi(s) ds >= (a^3 ||T||_F^2 / 2) (E s^-2)^2 / (n d E[s^-2] / 2 + J)`` with
    ``a = 1 - h``. Tends to ``||T||_F^2 / (n d)`` (:func:`lower_bound_constant`) as ``h -> 0`` slowly
    while ``n -> inf``.
    """
    if not 0 < float(h) < 1:
        raise ValueError(f"h: expected a half-width in (0, 1), got {h!r}")
    u = np.linspace(-h, h, 20001)
    prior = np.cos(np.pi * u / (2 * h)) ** 2 / h
    w = prior * (u[1] - u[0])
    e2 = float(np.sum(w / (1 + u) ** 2))
    J = math.pi**2 / h**2
    t2 = float(torch.sum(task.T**2))
    return (1 - h) ** 3 * t2 / 2 * e2**2 / (n * task.d * e2 / 2 + J)


def prompt_residuals(rows, label: str) -> Dict[int, np.ndarray]:
    """Per ``n``: the averaged residuals ``R`` of the chains of the regime-(ii) scale ``label``, shape ``(K, k, d)``."""
    task = make_task(0.0)
    k, d = task.k, task.d
    by_n: Dict[int, list] = {}
    for r in rows:
        if r["label"] == label:
            by_n.setdefault(int(r["n"]), []).append(np.array([r[f"r{i}"] for i in range(k * d)]).reshape(k, d))
    if not by_n:
        raise ValueError(f"label: no chains with label {label!r}")
    return {n: np.array(Rs) for n, Rs in sorted(by_n.items())}


def prompt_excess(rows, label: str) -> Dict[int, dict]:
    """Per ``n``: ``attnlib.analysis.stats.excess_ustat`` of the chains of the regime-(ii) scale ``label``."""
    Sigma = make_task(0.0).Sigma
    return {n: excess_ustat(Rs, Sigma) for n, Rs in prompt_residuals(rows, label).items()}


def fit_prompt_exponent(rows, label: str, *, n_min=None, n_max=None, level: float = 0.95) -> ExponentFit:
    """Exponent of the regime-(ii) excess against ``n``: ``attnlib.analysis.stats.ustat_exponent`` of the
    U-statistics over chains (relative errors pooled over ``n``, Student's t)."""
    est = {
        n: e
        for n, e in prompt_excess(rows, label).items()
        if (n_min is None or n >= n_min) and (n_max is None or n <= n_max)
    }
    ns = sorted(est)
    return ustat_exponent(ns, [est[n] for n in ns], level=level)


# ----------------------------------------------------------------------------- chapter 7: optimizers
#
# ``optimizers``: practitioners' optimizers (attnlib.optim.optimizers) against the structured method on the
# population objective. One run = one (method, cond(Sigma), tokens, start, seed) with its whole step-size
# grid (attnlib.optim.grid.grid_search: log grid, extended until the selected step is interior); one row
# per step size of the final grid, ``selected`` marks the chosen one. Task: d = 4, k = 2, ||T||_F = 1,
# noise 0.1, Task.random seed = ``seed``; starts: ``near`` (a random point of the manifold of minima moved
# by P-norm OPT_NEAR_RADIUS) and ``saddle`` (random_init, scale 1e-2, next to the saddle at 0).

#: Methods of the optimizers sweep: name -> (training method, extra train_population switches, log10 grid).
OPT_METHODS: Dict[str, tuple] = {
    "structured": ("structured", {}, (-1.5, 0.5)),
    "gd": ("gd", {}, (-2.5, -0.5)),
    "adam": ("adam", {}, (-3.0, -1.0)),
    "adamw": ("adamw", {}, (-3.0, -1.0)),
    "muon": ("muon", {}, (-3.0, -1.0)),
    "muon_decay": ("muon_decay", {}, (-2.5, -0.5)),
    "shampoo": ("shampoo", {}, (-2.0, 0.0)),
    "soap": ("soap", {}, (-3.0, -1.0)),
    "shampoo_balance": ("shampoo", {"renormalize": "balance"}, (-2.0, 0.0)),
}
#: The name each method of OPT_METHODS has in the book's tables and legends.
OPT_NAMES: Dict[str, str] = {
    "structured": "structured (Alg. 1)",
    "gd": "GD",
    "adam": "Adam",
    "adamw": "AdamW",
    "muon": "Muon",
    "muon_decay": "Muon, decaying step",
    "shampoo": "Shampoo",
    "soap": "SOAP",
    "shampoo_balance": "Shampoo + balancing",
}
OPT_CONDS = (1.0, 10.0, 100.0, 1e3, 1e4)
OPT_NEAR_RADIUS = 0.3
OPT_STEPS = 300
OPT_HELDOUT_N = 256


def optimizer_task(cond: float, seed: int) -> Task:
    """The optimizers sweep's task: ``d = 4``, ``k = 2``, ``cond(Sigma) = cond``, ``||T||_F = 1``, noise 0.1."""
    return Task.random(4, 2, cond=float(cond), signal=1.0, noise_std=0.1, seed=int(seed))


def optimizer_start(task: Task, start: str, seed: int):
    """The start ``"near"`` (manifold point moved by P-norm ``OPT_NEAR_RADIUS``) or ``"saddle"`` (scale 1e-2)."""
    from ..geometry import perturb, random_manifold_point
    from ..optim.init import random_init

    s = derive_seed(int(seed), f"optimizers:start={start}")
    if start == "near":
        A, B, _ = random_manifold_point(task, seed=s)
        return perturb(A, B, task, OPT_NEAR_RADIUS, seed=derive_seed(s, "perturb"))
    if start == "saddle":
        return random_init(task.d, task.k, std=1e-2, seed=s)
    raise ValueError(f"start: expected 'near' or 'saddle', got {start!r}")


def optimizer_grid(label: str) -> List[float]:
    """The base log grid (half-decade spacing) of method ``label`` of the optimizers sweep."""
    lo, hi = OPT_METHODS[label][2]
    return [float(10.0**e) for e in np.arange(lo, hi + 1e-9, 0.5)]


def run_optimizer(spec: dict, lr: float, *, on_divergence: str = "stop", record_every: int = 1):
    """One training run of the optimizers sweep at step ``lr``: ``(History, step rule)``."""
    from ..optim import train_population

    method, extra, _ = OPT_METHODS[spec["label"]]
    task = optimizer_task(spec["cond"], spec["seed"])
    h = train_population(
        task,
        method=method,
        steps=int(spec["steps"]),
        lr=float(lr),
        init=optimizer_start(task, spec["start"], spec["seed"]),
        whiten=spec["tokens"] == "whitened",
        on_divergence=on_divergence,
        record_every=record_every,
        **extra,
    )
    return h, h.step_rule


def _grid_rows(res: dict, score: str, measure) -> List[dict]:
    """One row per step size of a grid search (``attnlib.optim.grid.grid_search``): ``lr``, its score (column
    ``score``, NaN where the run diverged), ``diverged``, ``selected``, ``position``, and at the selected step
    the columns of ``measure(lr, history)``."""
    rows = []
    for lr, s in zip(res["lrs"], res["scores"]):
        row = {"lr": lr, score: float("nan") if s is None else s, "diverged": s is None}
        row.update(selected=lr == res["lr"], position=res["position"])
        if s is not None and lr == res["lr"]:
            row.update(measure(lr, res["best"]))
        rows.append(row)
    return rows


def _grid_columns(score: str, *measured: str) -> tuple:
    """The columns of :func:`_grid_rows` with the score column ``score`` and the measured columns."""
    return ("lr", score, "diverged", "selected", "position") + measured


#: The columns the chapter-7 sweeps measure at the selected step (``attnlib.optim.optimizers.measure``).
_MEASURED = ("steps_1e-6", "steps_1e-10", "max_after_1e-6", "max_after_1e-10", "final_excess")


def _heldout_selected_rows(spec: dict, task: Task, run, stream: str, n_heldout: int, extra) -> List[dict]:
    """Grid search of ``run(lr, on_divergence)`` over the spec's method grid, the step selected by the loss of
    the finite layer on ``n_heldout`` fresh sequences of length ``spec["n"]`` (stream ``<stream>:select``);
    the selected run is evaluated on ``n_heldout`` other fresh sequences (``<stream>:evaluate``) and measured:
    ``extra(history)``, then ``excess``, ``heldout`` (minus the Bayes risk), ``imbalance``, ``nu``."""
    from ..optim import optimizers as opt

    n = int(spec["n"])
    select_seed = derive_seed(int(spec["seed"]), f"{stream}:select")
    eval_seed = derive_seed(int(spec["seed"]), f"{stream}:evaluate")

    def score(h):
        return heldout_loss(h.A, h.B, task, n, n_sequences=n_heldout, seed=select_seed)

    def measure(lr, h):
        return dict(
            extra(h),
            excess=float(h.excess[-1]),
            heldout=heldout_loss(h.A, h.B, task, n, n_sequences=n_heldout, seed=eval_seed) - task.bayes_risk,
            imbalance=opt.imbalance(h.A, h.B, task),
            nu=opt.softmax_scale(h.A, h.B, task),
        )

    res = grid_search(run, optimizer_grid(spec["label"]), score=score, extend=12)
    return _grid_rows(res, "selection_loss", measure)


def _method_specs(labels, conds, seeds, n: int, steps: int) -> List[dict]:
    """One run per method, cond(Sigma) and seed at sequence or context length ``n`` (chapter 7)."""
    return _product_specs(
        lambda s: f"{s['label']}:cond={s['cond']:g}:n={s['n']}:seed={s['seed']}",
        dict(label=labels, cond=[float(c) for c in conds], n=(int(n),), seed=[int(s) for s in seeds]),
        dict(steps=int(steps)),
    )


def _run_optimizers(spec: dict) -> List[dict]:
    from ..optim import optimizers as opt

    task = optimizer_task(spec["cond"], spec["seed"])
    steps_of: Dict[float, object] = {}

    def run(lr, on_divergence="stop"):
        h, st = run_optimizer(spec, lr, on_divergence=on_divergence)
        steps_of[float(lr)] = st
        return h

    def measure(lr, h):
        row = opt.measure(h, task, n=OPT_HELDOUT_N, seed=derive_seed(int(spec["seed"]), "heldout"))
        # the preconditioner in the coordinates trained on (whitened: Sigma = I there, so the raw Sigma's
        # eigenvectors are read in the raw coordinates only)
        row["slope"] = opt.preconditioner_slope(steps_of[lr], task) if spec["tokens"] == "raw" else float("nan")
        return row

    return _grid_rows(grid_search(run, optimizer_grid(spec["label"]), extend=12), "score", measure)


_OPT_COLUMNS = _grid_columns("score", *_MEASURED, "imbalance", "nu", "heldout", "time_per_step", "slope")


def _optimizer_specs(labels, conds, tokens, starts, seeds, steps=OPT_STEPS) -> List[dict]:
    return _product_specs(
        lambda s: f"{s['label']}:cond={s['cond']:g}:{s['tokens']}:{s['start']}:seed={s['seed']}",
        dict(label=labels, cond=[float(c) for c in conds], tokens=tokens, start=starts, seed=[int(s) for s in seeds]),
        dict(steps=int(steps)),
        cost=lambda s: float(steps) * (3.0 if "shampoo" in s["label"] or s["label"] == "soap" else 1.0),
    )


SWEEPS["optimizers"] = dict(
    func=_run_optimizers,
    spec_columns=("label", "cond", "tokens", "start", "seed", "steps"),
    columns=_OPT_COLUMNS,
    full=lambda: _optimizer_specs(tuple(OPT_METHODS), OPT_CONDS, ("raw", "whitened"), ("near", "saddle"), (0, 1)),
    quick=lambda: _optimizer_specs(("structured", "shampoo"), (10.0,), ("raw",), ("near",), (0,), steps=20),
)


# ``optimizers_sequence``: the same methods on one training sequence of OPT_SEQ_N tokens (regime (i)), from the
# small start by the saddle, step size selected by the loss of the finite layer on fresh sequences (OPT_SEQ_HELDOUT
# of them, never trained on), so that the criterion cannot reward overfitting; evaluated on another set of fresh
# sequences.
OPT_SEQ_N = 256
OPT_SEQ_HELDOUT = 16
OPT_SEQ_STEPS = 300


def _run_optimizers_sequence(spec: dict) -> List[dict]:

    task = optimizer_task(spec["cond"], spec["seed"])
    n = int(spec["n"])
    X, Y = task.sample(n, seed=derive_seed(int(spec["seed"]), f"optimizers-sequence:n={n}"))
    method, extra, _ = OPT_METHODS[spec["label"]]
    start = optimizer_start(task, "saddle", spec["seed"])

    def run(lr, on_divergence="stop"):
        return train(
            X, Y, steps=int(spec["steps"]), lr=float(lr), method=method, init=start, task=task,
            record_every=int(spec["steps"]), on_divergence=on_divergence, **extra,
        )  # fmt: skip

    def train_minus_bayes(h):
        return dict(train_minus_bayes=float(h.loss[-1]) - task.bayes_risk)

    return _heldout_selected_rows(spec, task, run, "optimizers-sequence", OPT_SEQ_HELDOUT, train_minus_bayes)


SWEEPS["optimizers_sequence"] = dict(
    func=_run_optimizers_sequence,
    spec_columns=("label", "cond", "n", "seed", "steps"),
    columns=_grid_columns("selection_loss", "train_minus_bayes", "excess", "heldout", "imbalance", "nu"),
    full=lambda: _method_specs(tuple(OPT_METHODS), (10.0, 1000.0), (0, 1), OPT_SEQ_N, OPT_SEQ_STEPS),
    quick=lambda: _method_specs(("structured", "shampoo"), (10.0,), (0,), n=32, steps=5),
)


# ``optimizers_factored``: the four-factor parameterization (attnlib.optim.optimizers.train_factored: B = W_Q^T W_K,
# A = W_O W_V, head dimension d_h = d or d_h = rank(T)) on the population objective, from a random start
# (attnlib.optim.optimizers.factored_start, std 0.5 in the whitened coordinates, the same for every cond(Sigma)),
# OPT_FACTOR_STEPS steps, step size from a half-decade log grid extended until interior (selection: mean log10
# excess, attnlib.optim.grid.log_excess_score). One row per step size; ``selected`` marks the chosen one.
OPT_FACTOR_GRIDS: Dict[str, tuple] = {
    "structured": (-1.5, 0.0),
    "gd": (-1.5, 0.0),
    "adam": (-3.0, -1.5),
    "shampoo": (-2.0, -0.5),
    "muon_decay": (-2.5, -1.0),
}
OPT_FACTOR_CONDS = (1.0, 100.0, 1e4)
OPT_FACTOR_STEPS = 600


def run_factored(spec: dict, lr: float, *, on_divergence: str = "stop"):
    """One four-factor run of the ``optimizers_factored`` sweep at step ``lr`` (a History)."""
    from ..optim.optimizers import train_factored

    task = optimizer_task(spec["cond"], spec["seed"])
    return train_factored(
        task,
        method=spec["label"],
        d_h=int(spec["d_h"]),
        steps=int(spec["steps"]),
        lr=float(lr),
        seed=derive_seed(int(spec["seed"]), "optimizers-factored:start"),
        on_divergence=on_divergence,
    )


def _run_optimizers_factored(spec: dict) -> List[dict]:
    from ..optim import optimizers as opt

    task = optimizer_task(spec["cond"], spec["seed"])
    lo, hi = OPT_FACTOR_GRIDS[spec["label"]]
    grid = [float(10.0**e) for e in np.arange(lo, hi + 1e-9, 0.5)]
    res = grid_search(
        lambda lr, on_divergence="stop": run_factored(spec, lr, on_divergence=on_divergence), grid, extend=12
    )
    return _grid_rows(res, "score", lambda lr, h: opt.measure_factored(h, task))


def _factored_specs(labels, conds, d_hs, seeds, steps=OPT_FACTOR_STEPS) -> List[dict]:
    return _product_specs(
        lambda s: f"{s['label']}:cond={s['cond']:g}:d_h={s['d_h']}:seed={s['seed']}",
        dict(label=labels, cond=[float(c) for c in conds], d_h=[int(h) for h in d_hs], seed=[int(s) for s in seeds]),
        dict(steps=int(steps)),
        cost=lambda s: float(steps) * (2.5 if s["label"] == "shampoo" else 1.0),
    )


SWEEPS["optimizers_factored"] = dict(
    func=_run_optimizers_factored,
    spec_columns=("label", "cond", "d_h", "seed", "steps"),
    columns=_grid_columns(
        "score", *_MEASURED, "imb_qk", "imb_ov", "imb_qk_euclid", "imb_ov_euclid", "imbalance", "nu", "nu_over_s1"
    ),
    # d_h = d = 4 and d_h = rank(T) = k = 2 (the task of optimizer_task)
    full=lambda: _factored_specs(tuple(OPT_FACTOR_GRIDS), OPT_FACTOR_CONDS, (4, 2), (0, 1)),
    quick=lambda: _factored_specs(("structured", "adam"), (100.0,), (2,), (0,), steps=20),
)


# ``optimizers_prompts``: regime (ii) (context length OPT_PROMPT_N, OPT_PROMPT_BATCH fresh prompts every step,
# attnlib.optim.train_prompts) for five of the methods, from the start near the manifold, OPT_PROMPT_STEPS
# steps; the step size is selected by the loss of the finite layer on OPT_PROMPT_HELDOUT fresh prompts that no run
# trains on (the same prompts for every step size: a criterion that cannot reward overfitting), and the selected run
# is evaluated on OPT_PROMPT_HELDOUT other fresh prompts. ``train_minus_bayes``: the mean training loss of the last
# OPT_PROMPT_TAIL steps minus the Bayes risk; ``below_bayes``: the share of those steps whose loss was below it.
OPT_PROMPT_METHODS = ("structured", "gd", "adam", "shampoo", "muon_decay")
OPT_PROMPT_N = 64
OPT_PROMPT_BATCH = 8
OPT_PROMPT_STEPS = 200
OPT_PROMPT_HELDOUT = 64
OPT_PROMPT_TAIL = 50


def _run_optimizers_prompts(spec: dict) -> List[dict]:

    task = optimizer_task(spec["cond"], spec["seed"])
    n, steps = int(spec["n"]), int(spec["steps"])
    start = optimizer_start(task, "near", spec["seed"])
    train_seed = derive_seed(int(spec["seed"]), "optimizers-prompts:train")

    def run(lr, on_divergence="stop"):
        return train_prompts(
            task, n, method=OPT_METHODS[spec["label"]][0], prompts=OPT_PROMPT_BATCH, steps=steps, lr=float(lr),
            init=start, seed=train_seed, on_divergence=on_divergence,
        )  # fmt: skip

    def tail(h):
        t = np.asarray(h.loss[-OPT_PROMPT_TAIL:]) - task.bayes_risk
        return dict(train_minus_bayes=float(t.mean()), below_bayes=float(np.mean(t < 0)))

    return _heldout_selected_rows(spec, task, run, "optimizers-prompts", OPT_PROMPT_HELDOUT, tail)


SWEEPS["optimizers_prompts"] = dict(
    func=_run_optimizers_prompts,
    spec_columns=("label", "cond", "n", "seed", "steps"),
    columns=_grid_columns("selection_loss", "train_minus_bayes", "below_bayes", "excess", "heldout", "imbalance", "nu"),
    full=lambda: _method_specs(OPT_PROMPT_METHODS, (10.0, 1000.0), (0, 1), OPT_PROMPT_N, OPT_PROMPT_STEPS),
    quick=lambda: _method_specs(("structured", "adam"), (10.0,), (0,), n=16, steps=5),
)


# ----------------------------------------------------------------------------- chapter 2: the heavy tail
#
# ``heavy_tail``: the query-averaged error ``E_{q,X} ||f(q; X) - A Sigma B^T q||^2`` of the finite layer along
# an orbit (chapter 2, section "Averaged over queries"). The point is the balanced minimum
# ``random_manifold_point(task, seed=HEAVY_TAIL_MANIFOLD_SEED)`` of chapter 2's task, moved along the orbit
# ``(t At, C / t)`` to each softmax scale ``lambda_max(C^T C)`` (the population loss is the same at every point);
# one run = one (scale, include_self, n): ``attnlib.model.finite_n.query_averaged_error`` on ``seeds`` independent
# sequences of ``n`` tokens, each with ``n_queries`` fresh queries (``include_self=0``) or its own first
# ``n_queries`` tokens as queries (``include_self=1``, the scales of HEAVY_TAIL_DESIGN["self_scales"]); a row per
# sequence (``seed`` = its draw index). The full sweep took 18 minutes on one core of the shared 2-core machine.

#: Chapter 2's task (arguments of :meth:`attnlib.model.task.Task.random`) and the seed of its balanced minimum.
HEAVY_TAIL_TASK = dict(d=4, k=2, cond=4.0, signal=1.0, noise_std=0.2, seed=3)
HEAVY_TAIL_MANIFOLD_SEED = 4
#: The design of the heavy-tail sweep (softmax scales, the scales also run with the sequence's own tokens as
#: queries, sequence lengths, sequences per length, queries per sequence, the seed of the draws).
HEAVY_TAIL_DESIGN = dict(
    scales=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25, 1.5),
    self_scales=(0.2, 1.0),
    ns=(256, 512, 1024, 2048, 4096, 8192, 16384),
    seeds=96,
    n_queries=1024,
    seed=2026,
)


def heavy_tail_point():
    """``(task, A, B)``: chapter 2's task and the balanced minimum the heavy-tail sweep moves along its orbit."""
    task = Task.random(**HEAVY_TAIL_TASK)
    A, B, _ = random_manifold_point(task, seed=HEAVY_TAIL_MANIFOLD_SEED)
    return task, A, B


def _run_heavy_tail(spec: dict) -> List[dict]:
    task, A, B = heavy_tail_point()
    Ac, Bc = orbit_to_scale(A, B, task, float(spec["nu"]))
    E = query_averaged_error(
        Ac,
        Bc,
        task,
        [int(spec["n"])],
        n_queries=int(spec["n_queries"]),
        n_seeds=int(spec["seeds"]),
        seed=int(spec["base_seed"]),
        include_self=bool(spec["include_self"]),
    )[0]
    return [dict(seed=s, error=float(E[s])) for s in range(E.shape[0])]


def _heavy_tail_specs(scales, self_scales, ns, seeds, n_queries, seed) -> List[dict]:
    """Fresh queries at every scale of ``scales``, then the sequence's own tokens at every scale of ``self_scales``."""
    return [
        dict(
            run=f"scale={float(c)!r}:self={flag}:n={int(n)}",
            nu=float(c),
            include_self=flag,
            n=int(n),
            n_queries=int(n_queries),
            seeds=int(seeds),
            base_seed=int(seed),
            cost=float(n) * n_queries * seeds,
        )
        for flag, cs in ((0, scales), (1, self_scales))
        for c in cs
        for n in ns
    ]


def heavy_tail_errors(rows, nu: float, *, include_self: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """The block of ``heavy_tail`` rows at one softmax scale ``nu``: ``(ns, errors)``.

    ``ns`` is sorted; ``errors`` has shape ``(len(ns), n_seeds)`` with the sequences in the order of
    their draw index (the input of :func:`attnlib.analysis.stats.fit_error_exponent`). Raises ``ValueError``
    if there are no rows for ``nu`` or the lengths have different numbers of sequences.
    """
    flag = int(bool(include_self))
    sel = [r for r in rows if r["nu"] == float(nu) and r["include_self"] == flag]
    if not sel:
        raise ValueError(f"nu: no rows with nu {nu!r} and include_self={bool(include_self)}")
    ns = sorted({int(r["n"]) for r in sel})
    by_n = {n: [r["error"] for r in sorted((r for r in sel if r["n"] == n), key=lambda r: r["seed"])] for n in ns}
    if len({len(v) for v in by_n.values()}) != 1:
        raise ValueError(f"rows: the lengths at nu {nu!r} have different numbers of sequences")
    return np.array(ns), np.array([by_n[n] for n in ns])


SWEEPS["heavy_tail"] = dict(
    func=_run_heavy_tail,
    spec_columns=("nu", "include_self", "n", "n_queries"),
    columns=("seed", "error"),
    full=lambda: _heavy_tail_specs(**HEAVY_TAIL_DESIGN),
    quick=lambda: _heavy_tail_specs((0.2, 1.0), (1.0,), (64, 128), 4, 64, HEAVY_TAIL_DESIGN["seed"]),
)


# ----------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m attnlib.experiments", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("sweep", choices=sorted(SWEEPS), help="which sweep")
    p.add_argument("--out", required=True, help="CSV file (appended to; finished runs are skipped)")
    p.add_argument("--quick", action="store_true", help="the seconds-long variant (tests)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--workers", type=int, default=0, help="start a local Dask cluster with this many processes")
    g.add_argument("--scheduler", help="address of a running Dask scheduler (tcp://host:port)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--sequential", action="store_true", help="chain sweeps: one chain at a time (default: in lockstep)")
    args = p.parse_args(argv)
    if args.workers < 0:
        p.error("--workers: expected an integer >= 0")
    info = run_sweep(
        sweep(args.sweep, args.quick, lockstep=not args.sequential),
        args.out,
        workers=args.workers,
        scheduler=args.scheduler,
        progress=not args.no_progress,
    )
    print(
        f"{info['runs']} runs written, {info['skipped']} already present, wall time {info['wall_s']:.1f} s, "
        f"CPU time of the new runs {info['cpu_s']:.1f} s"
    )
    return 0
