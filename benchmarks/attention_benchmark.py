"""Benchmark: loss-plus-gradient time and peak memory of the fused and the reference attention.

Usage (from the repository root)::

    python benchmarks/attention_benchmark.py                 # full table, n = 1024 .. 32768
    python benchmarks/attention_benchmark.py --n 1024 4096   # a subset
    python benchmarks/attention_benchmark.py --out benchmarks/results.md

Each configuration runs in a fresh subprocess, so the peak resident memory
(``ru_maxrss``) belongs to that configuration alone. ``peak MB`` is the growth of
the peak resident set during the timed loss-plus-gradient calls, over the
process's footprint after importing torch and creating the data; ``time`` is
the median over ``--reps`` calls after one warm-up. The reference path forms
the n x n weight matrix; configurations whose estimated footprint exceeds
``--max-reference-gb`` are skipped (and say so) rather than risk swapping the
machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

D = 8
K = 2


def _worker(n: int, dtype_name: str, impl: str, reps: int) -> dict:
    import torch

    import attnlib as al

    al.configure_threads("auto")  # all granted CPUs: the benchmark runs alone, one process at a time
    dtype = getattr(torch, dtype_name)
    task = al.Task.random(D, K, cond=10.0, signal=1.0, noise_std=0.1, seed=0).to(dtype=dtype)
    X, Y = task.sample(n, seed=1)
    A, B, _ = al.random_manifold_point(task, seed=2)
    A = A.clone().requires_grad_()
    B = B.clone().requires_grad_()
    fused = impl == "fused"

    def step():
        loss = al.empirical_loss(A, B, X, Y, fused=fused)
        gA, gB = torch.autograd.grad(loss, (A, B))
        return float(loss) + float(gA.sum()) + float(gB.sum())

    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times.sort()
    return {
        "n": n,
        "dtype": dtype_name,
        "impl": impl,
        "time_s": times[len(times) // 2],
        "peak_mb": (peak_kb - base_kb) / 1024,
        "process_peak_mb": peak_kb / 1024,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--max-reference-gb",
        type=float,
        default=10.0,
        help="skip the reference path when 4 n^2 * bytes exceeds this (default 10)",
    )
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        n, dt, impl, reps = args.worker
        print(json.dumps(_worker(int(n), dt, impl, int(reps))))
        return 0

    rows = []
    for dt in args.dtype:
        nbytes = 4 if dt == "float32" else 8
        for n in args.n:
            row = {"n": n, "dtype": dt}
            for impl in ("fused", "reference"):
                est_gb = 4 * n * n * nbytes / 1e9
                if impl == "reference" and est_gb > args.max_reference_gb:
                    row[impl] = None
                    row[impl + "_skip"] = f"skipped (~{est_gb:.0f} GB)"
                    continue
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", str(n), dt, impl, str(args.reps)],
                    capture_output=True,
                    text=True,
                )
                if out.returncode != 0:
                    row[impl] = None
                    row[impl + "_skip"] = "failed: " + out.stderr.strip().splitlines()[-1][:60]
                    continue
                row[impl] = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            f, r = row.get("fused"), row.get("reference")
            print(
                f"n={n:6d} {dt}: fused {f['time_s']:.3f}s {f['peak_mb']:.0f}MB" if f else f"n={n} {dt}: fused failed",
                "| reference " + (f"{r['time_s']:.3f}s {r['peak_mb']:.0f}MB" if r else row.get("reference_skip", "")),
                file=sys.stderr,
                flush=True,
            )

    lines = [
        f"Loss + gradient of the empirical loss, d = {D}, k = {K}; median of {args.reps} calls; "
        f"{__import__('attnlib').granted_cpus()} CPU threads (ATTNLIB_NUM_THREADS=auto), "
        f"torch {__import__('torch').__version__}, {platform.machine()}.",
        "",
        "| n | dtype | fused time (s) | fused peak (MB) | fused process peak (MB) | reference time (s) "
        "| reference peak (MB) | speed-up |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        f, r = row.get("fused"), row.get("reference")
        fcell = (
            (f"{f['time_s']:.3f}", f"{f['peak_mb']:.0f}", f"{f['process_peak_mb']:.0f}")
            if f
            else (row.get("fused_skip", "-"), "-", "-")
        )
        rcell = (f"{r['time_s']:.3f}", f"{r['peak_mb']:.0f}") if r else (row.get("reference_skip", "-"), "-")
        speed = f"{r['time_s'] / f['time_s']:.1f}x" if (f and r) else "-"
        lines.append(
            f"| {row['n']} | {row['dtype']} | {fcell[0]} | {fcell[1]} | {fcell[2]} | {rcell[0]} | {rcell[1]} "
            f"| {speed} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
