"""Benchmark: how long each chapter takes to execute, alone and next to a competing CPU-bound process.

Usage (from the repository root)::

    python benchmarks/contention.py --out benchmarks/contention.md            # every chapter
    python benchmarks/contention.py --chapters ch1_model ch5_algorithm        # a subset
    python benchmarks/contention.py --steps-only                              # the training-step probe only
    python benchmarks/contention.py --write                                   # also save the executed chapters

For every chapter the notebook is executed top to bottom in a fresh kernel
(nbclient, as nbval and jupyter-book do), first alone, then while a busy-loop
process (one pure-Python ``while True`` per ``--load`` CPU) runs. A second
table probes the cause: 200 structured training steps at n = 1024 with one
and with two torch threads, alone and under load. The machine is described in
the header (CPUs granted, torch version). This script only measures; no test
asserts a time (times depend on the machine).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ["ch1_model", "ch2_population", "ch3_factorization", "ch4_geometry", "ch5_algorithm", "ch6_scaling"]

_PROBE = """
import os, time, torch
import attnlib as al
al.configure_threads(int(os.environ["PROBE_THREADS"]))
task = al.Task.random(4, 2, cond=10.0, signal=0.8, noise_std=0.1, seed=0)
X, Y = task.sample(1024, seed=1)
t0 = time.perf_counter()
al.train(X, Y, steps=200, lr=0.5)
print(time.perf_counter() - t0)
"""


def _busy() -> None:  # pragma: no cover - runs in a child process
    x = 0
    while True:
        x += 1


class Load:
    """``n`` busy-loop processes for the duration of a ``with`` block."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_busy, daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join()


def run_notebook(chapter: str, timeout: int, write: bool = False) -> float:
    """Execute ``book/<chapter>.ipynb`` in a fresh kernel (cwd ``book/``); returns seconds.

    ``write=True`` saves the executed notebook in place (outputs and execution counts).
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(ROOT / "book" / f"{chapter}.ipynb"), 4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(ROOT / "book")}},
    )
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0
    if write:
        nbformat.write(nb, str(ROOT / "book" / f"{chapter}.ipynb"))
    return elapsed


def probe(threads: int) -> float:
    env = dict(os.environ, PROBE_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chapters", nargs="+", default=CHAPTERS)
    p.add_argument("--load", type=int, default=1, help="number of busy-loop processes (default 1)")
    p.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    p.add_argument("--steps-only", action="store_true", help="only the training-step probe")
    p.add_argument("--out", help="write the Markdown tables here")
    p.add_argument("--write", action="store_true", help="save each chapter executed by the run alone, in place")
    args = p.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    import torch

    import attnlib as al

    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {al.granted_cpus()} CPUs granted, "
        f"torch {torch.__version__}; competing load: {args.load} busy-loop process(es). "
        f"attnlib's default of one torch thread per process (ATTNLIB_NUM_THREADS unset).",
        "",
    ]
    if not args.steps_only:
        lines += ["| chapter | alone (s) | with load (s) | ratio |", "|:---|---:|---:|---:|"]
        for ch in args.chapters:
            alone = run_notebook(ch, args.timeout, write=args.write)
            with Load(args.load):
                loaded = run_notebook(ch, args.timeout)
            row = f"| {ch} | {alone:.1f} | {loaded:.1f} | {loaded / alone:.2f} |"
            print(row, file=sys.stderr, flush=True)
            lines.append(row)
        lines.append("")
    lines += [
        "200 structured training steps, n = 1024, d = 4, k = 2 (the cause: threads that wait for each other):",
        "",
        "| torch threads | alone (s) | with load (s) | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for threads in (1, 2):
        alone = probe(threads)
        with Load(args.load):
            loaded = probe(threads)
        row = f"| {threads} | {alone:.2f} | {loaded:.2f} | {loaded / alone:.2f} |"
        print(row, file=sys.stderr, flush=True)
        lines.append(row)
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
