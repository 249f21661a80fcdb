"""Regenerate book/data/heavy_tail.csv: the query-averaged error of the finite layer along an orbit.

Chapter 2 (section "Averaged over queries") reads this file. The point is the balanced
minimum ``al.random_manifold_point(task, seed=4)`` of chapter 2's task, moved along the
orbit ``(t At, C / t)`` to each softmax scale ``lambda_max(C^T C)`` in SCALES (the population
loss is the same at every point); for every scale and sequence length the error
``||f(q; X) - A Sigma B^T q||^2`` is averaged over N_QUERIES fresh queries on each of
N_SEEDS independent sequences (``attnlib.finite_n.query_averaged_error``), and, for the
scales in SELF_SCALES, also over the sequence's own tokens as queries (``include_self=True``).

    python tools/heavy_tail_sweep.py                      # full sweep (resumes an interrupted run)
    python tools/heavy_tail_sweep.py --quick --out /tmp/x.csv   # a few seconds, for a smoke test

The full sweep took 18 minutes (1071 s) on one core of the shared 2-core development machine.
"""

from __future__ import annotations

import argparse
import os
import time

import attnlib as al
from attnlib import finite_n as fn

TASK = dict(d=4, k=2, cond=4.0, signal=1.0, noise_std=0.2, seed=3)  # chapter 2's task
MANIFOLD_SEED = 4
SCALES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25, 1.5)
SELF_SCALES = (0.2, 1.0)
NS = (256, 512, 1024, 2048, 4096, 8192, 16384)
N_SEEDS = 96
N_QUERIES = 1024
SEED = 2026
OUT = os.path.join(os.path.dirname(__file__), "..", "book", "data", "heavy_tail.csv")


def base_point():
    task = al.Task.random(**TASK)
    A, B, _ = al.random_manifold_point(task, seed=MANIFOLD_SEED)
    return task, A, B


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=OUT)
    p.add_argument("--quick", action="store_true", help="two scales, two lengths, four sequences")
    args = p.parse_args(argv)
    task, A, B = base_point()
    if args.quick:
        grids = [((0.2, 1.0), (64, 128), 4, 64, False), ((1.0,), (64, 128), 4, 64, True)]
    else:
        grids = [(SCALES, NS, N_SEEDS, N_QUERIES, False), (SELF_SCALES, NS, N_SEEDS, N_QUERIES, True)]
    t0 = time.time()
    for scales, ns, n_seeds, n_queries, include_self in grids:
        for c in scales:
            fn.query_averaged_sweep(
                A,
                B,
                task,
                [c],
                ns,
                n_queries=n_queries,
                n_seeds=n_seeds,
                seed=SEED,
                include_self=include_self,
                out=args.out,
            )
            print(f"scale {c} include_self={include_self}: done at {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
