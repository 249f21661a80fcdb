"""The prompts sweep's own design with the old and the new regime-(ii) engines: CPU time and the estimator.

Usage (from the repository root; resumable: finished runs are kept in ``--cache`` and skipped)::

    nice -n 10 python benchmarks/prompts_engines.py --out benchmarks/prompts_engines.md
    python benchmarks/prompts_engines.py --ns 16 32 --chains 3 --out /tmp/p.md     # a small subset

For every run of ``attnlib.experiments.sweep("prompts")`` (or the subset chosen by ``--labels``,
``--ns``, ``--chains``), the chain of ``attnlib.experiments`` with the same seed is rerun with

* ``kernel64``: the moment kernel in float64 (the new default, ``engine="auto"`` on CPU);
* ``kernel32``: the moment kernel with ``attention_dtype=float32`` (float32 attention, float64 sums
  and control variate);
* ``sdpa64``: SDPA + autograd in float64 (the old engine), on chain 0 of each (label, n) only
  (``--old-chains``), for the CPU time;
* ``lock64``, ``lock32``: the chains of each n (all scales: the sweep's lockstep groups,
  ``attnlib.experiments._chain_group``) in lockstep (``attnlib.optim.run_chains``, what the chain sweeps
  run by default), moment kernel in float64 and with float32 attention; CPU time per run = the group's
  CPU time / its chains. ``kernel64`` and ``kernel32`` (one chain at a time) run on the first
  ``--seq-chains`` chains of each (label, n) (default: 1), for the CPU time.

It reports (1) the largest deviation of the averaged residuals ``R`` from the committed
``book/data/regime2_prompts.csv`` (float64 runs: round-off), (2) per (label, n) the U-statistic
estimate of the excess (:func:`attnlib.analysis.stats.excess_ustat`) with its jackknife standard error in
float64 and float32 on matched seeds (the lockstep runs), their difference in units of the standard error, and the
spread of ``R`` across chains (its variance) in both, and (3) CPU seconds per run
(``time.process_time``, one torch thread) by engine and n, with the full design's total.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np


def _run(spec, engine, dtype):
    from attnlib import experiments as ex

    t0 = time.process_time()
    res = ex.chain_of_spec(spec, engine=engine, attention_dtype=dtype)
    return dict(R=res.R.ravel().tolist(), cpu_s=time.process_time() - t0, naive=res.naive_excess)


def _warm_up():
    """Load numba and both dtypes' kernels before anything is timed."""
    import torch

    from attnlib.model import kernels as K

    for dt in (torch.float64, torch.float32):
        K.loss_and_grad(
            torch.eye(2, 4, dtype=dt), torch.eye(4, dtype=dt), torch.ones(3, 4, dtype=dt), torch.ones(3, 2, dtype=dt)
        )


def _run_group(specs, engine, dtype):
    from attnlib import experiments as ex

    t0 = time.process_time()
    res = ex.chains_of_specs(specs, engine=engine, attention_dtype=dtype)
    cpu = (time.process_time() - t0) / len(specs)
    return [dict(R=r.R.ravel().tolist(), cpu_s=cpu, naive=r.naive_excess) for r in res]


CONFIGS = {
    "kernel64": ("kernel", "float64"),
    "kernel32": ("kernel", "float32"),
    "sdpa64": ("sdpa", "float64"),
    "lock64": ("kernel", "float64"),
    "lock32": ("kernel", "float32"),
}
LOCKSTEP = ("lock64", "lock32")
PAIR = ("lock64", "lock32")  # the float64 / float32 comparison of the estimator


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--labels", nargs="+", default=None)
    p.add_argument("--ns", type=int, nargs="+", default=None)
    p.add_argument("--chains", type=int, default=None, help="chains per (label, n) (default: all of the design)")
    p.add_argument("--old-chains", type=int, default=1, help="chains per (label, n) also run with the old engine")
    p.add_argument("--seq-chains", type=int, default=1, help="chains per (label, n) also run one at a time")
    p.add_argument("--csv", default="book/data/regime2_prompts.csv")
    p.add_argument("--cache", default="runs/prompts_engines.jsonl")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import attnlib as al
    from attnlib import experiments as ex
    from attnlib.analysis.stats import excess_ustat

    al.configure_threads(1)
    _warm_up()
    committed = {r["run"]: r for r in csv.DictReader(open(args.csv))}
    specs = [
        s
        for s in ex.sweep("prompts").specs
        if (args.labels is None or s["label"] in args.labels)
        and (args.ns is None or int(s["n"]) in args.ns)
        and (args.chains is None or int(s["chain"]) < args.chains)
    ]
    done = {}
    if os.path.exists(args.cache):
        for line in open(args.cache):
            rec = json.loads(line)
            done[rec["run"], rec["config"]] = rec
    os.makedirs(os.path.dirname(args.cache) or ".", exist_ok=True)
    from tqdm import tqdm

    limit = {"sdpa64": args.old_chains, "kernel64": args.seq_chains, "kernel32": args.seq_chains}
    todo = [
        (s, c)
        for s in sorted(specs, key=lambda s: s["cost"])
        for c in CONFIGS
        if c not in LOCKSTEP and int(s["chain"]) < limit[c] and (s["run"], c) not in done
    ]
    groups = defaultdict(list)
    for s in specs:  # the sweep's own lockstep groups: the chains of one n, every scale
        groups[ex._chain_group(s)].append(s)
    todo_groups = [
        (g, c)
        for g in sorted(groups.values(), key=lambda g: g[0]["cost"])
        for c in LOCKSTEP
        if any((s["run"], c) not in done for s in g)
    ]
    with open(args.cache, "a") as fh:
        for spec, config in tqdm(todo, desc="runs"):
            rec = dict(run=spec["run"], config=config, **_run(spec, *CONFIGS[config]))
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            done[spec["run"], config] = rec
        for group, config in tqdm(todo_groups, desc="lockstep groups"):
            for spec, res in zip(group, _run_group(group, *CONFIGS[config])):
                rec = dict(run=spec["run"], config=config, **res)
                fh.write(json.dumps(rec) + "\n")
                done[spec["run"], config] = rec
            fh.flush()

    task = ex.make_task(0.0)
    S = task.Sigma.numpy()
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `benchmarks/prompts_engines.py` "
        "(one torch thread; **the machine was shared** with other jobs, run under `nice`; CPU seconds of the "
        "process). The prompts sweep's own design and seeds; float64 R compared with the committed "
        f"`{args.csv}`.",
        "",
    ]
    dev = {c: 0.0 for c in CONFIGS}
    for (run, config), rec in done.items():
        if run in committed:
            ref = np.array([float(committed[run][f"r{i}"]) for i in range(len(rec["R"]))])
            dev[config] = max(dev[config], float(np.abs(np.array(rec["R"]) - ref).max() / np.abs(ref).max()))
    lines += [
        "Largest relative deviation of R (max over entries, relative to the run's largest entry) from the committed "
        "sweep: " + ", ".join(f"{c} {dev[c]:.1e}" for c in CONFIGS if any(k[1] == c for k in done)) + ".",
        "",
        "**The regime-(ii) estimator in float64 and float32 (matched seeds)**: U-statistic excess +- jackknife "
        "s.e., their difference in s.e. units, and the chains' spread `sum Var(R)` in both.",
        "",
        "| label | n | chains | excess float64 | s.e. | excess float32 | s.e. | difference / s.e. | spread float64 "
        "| spread float32 |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups = defaultdict(list)
    for s in specs:
        groups[s["label"], int(s["n"])].append(s["run"])
    worst = 0.0
    for (label, n), runs in sorted(groups.items()):
        if not all((r, c) in done for r in runs for c in PAIR) or len(runs) < 3:
            continue
        R64 = np.array([np.reshape(done[r, PAIR[0]]["R"], (task.k, task.d)) for r in runs])
        R32 = np.array([np.reshape(done[r, PAIR[1]]["R"], (task.k, task.d)) for r in runs])
        e64, e32 = excess_ustat(R64, S), excess_ustat(R32, S)
        z = (e32["excess"] - e64["excess"]) / e64["se"]
        worst = max(worst, abs(z))
        lines.append(
            f"| {label} | {n} | {len(runs)} | {e64['excess']:.4e} | {e64['se']:.1e} | {e32['excess']:.4e} "
            f"| {e32['se']:.1e} | {z:+.1e} | {R64.var(axis=0, ddof=1).sum():.3e} "
            f"| {R32.var(axis=0, ddof=1).sum():.3e} |"
        )
    lines += ["", f"Largest |difference| / s.e.: {worst:.1e}.", ""]
    lines += [
        "**CPU seconds per run** (median over the runs measured; the old engine and the one-chain-at-a-time "
        "kernel on the first chain(s) only; lockstep: the group's CPU time / its chains)",
        "",
        "| n | runs of the design | sdpa64 (old) | kernel64 | kernel32 | lock64 (sweep default) | lock32 "
        "| old / kernel64 | old / lock64 | old / lock32 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    per_n = defaultdict(lambda: defaultdict(list))
    count = defaultdict(int)
    for s in specs:
        count[int(s["n"])] += 1
        for c in CONFIGS:
            if (s["run"], c) in done:
                per_n[int(s["n"])][c].append(done[s["run"], c]["cpu_s"])
    totals = defaultdict(float)
    for n in sorted(per_n):
        med = {c: float(np.median(v)) for c, v in per_n[n].items() if v}
        for c in med:
            totals[c] += med[c] * count[n]
        if len(med) < len(CONFIGS):
            continue
        lines.append(
            f"| {n} | {count[n]} | {med['sdpa64']:.2f} | {med['kernel64']:.2f} | {med['kernel32']:.2f} "
            f"| {med['lock64']:.2f} | {med['lock32']:.2f} | {med['sdpa64'] / med['kernel64']:.1f}x "
            f"| {med['sdpa64'] / med['lock64']:.1f}x | {med['sdpa64'] / med['lock32']:.1f}x |"
        )
    if len(totals) == len(CONFIGS):
        old = totals["sdpa64"]
        lines += [
            "",
            "Estimated CPU time of this design (runs x median per run): "
            + ", ".join(f"{c} {totals[c] / 60:.1f} min" for c in CONFIGS)
            + f"; old / new: {old / totals['kernel64']:.1f}x (kernel, float64, one chain at a time), "
            f"{old / totals['kernel32']:.1f}x (float32 attention, one chain at a time), "
            f"{old / totals['lock64']:.1f}x (lockstep, float64: the sweep's default), "
            f"{old / totals['lock32']:.1f}x (lockstep, float32 attention).",
        ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
