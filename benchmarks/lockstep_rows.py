"""Rerun committed rows of the chain sweeps in lockstep and compare them with the committed numbers.

Usage (from the repository root; a few minutes on one core)::

    nice -n 10 python benchmarks/lockstep_rows.py

For each case (sweep file, sweep name, label, n, chains), the chains of that configuration are rerun
together with ``attnlib.experiments.chains_of_specs`` (``attnlib.optim.run_chains``, what the chain sweeps
run by default) and every committed column is compared: the largest relative difference of the averaged
residual ``R`` (relative to the run's largest entry) and of the other numbers. ``batches`` must be equal.
``benchmarks/prompts_engines.py`` does the same over the whole ``prompts`` design (its ``lock64`` column).
"""

from __future__ import annotations

import sys
import time

CASES = (
    ("book/data/regime2_prompts.csv", "prompts", "fix0.7", 64, 6),
    ("book/data/regime2_prompts.csv", "prompts", "cap0.25", 256, 6),
    ("book/data/regime2_prompts.csv", "prompts", "balance", 1024, 6),
    ("book/data/regime2_prompts_large.csv", "prompts_large", "cap0.25", 2048, 3),
)


def main() -> int:
    import attnlib as al
    from attnlib import experiments as ex

    al.configure_threads(1)
    worst_R = 0.0
    for path, name, label, n, chains in CASES:
        rows = sorted((r for r in ex.read_sweep(path) if r["label"] == label and r["n"] == n), key=lambda r: r["chain"])
        rows = rows[:chains]
        wanted = {r["chain"] for r in rows}
        specs = sorted(
            (s for s in ex.sweep(name).specs if s["label"] == label and s["n"] == n and s["chain"] in wanted),
            key=lambda s: s["chain"],
        )
        t0 = time.process_time()
        got = [g[0] for g in ex._run_chains(specs)]
        cpu = time.process_time() - t0
        worst = {}
        for r, g in zip(rows, got):
            scale = max(abs(r[f"r{i}"]) for i in range(8))
            worst["R"] = max([worst.get("R", 0.0)] + [abs(g[f"r{i}"] - r[f"r{i}"]) / scale for i in range(8)])
            for c in ("naive_excess", "test_excess", "nu", "last_excess"):
                worst[c] = max(worst.get(c, 0.0), abs(g[c] - r[c]) / abs(r[c]))
            if g["batches"] != r["batches"]:
                raise SystemExit(f"{path}: run {r['run']} drew {g['batches']} batches, committed {r['batches']}")
        worst_R = max(worst_R, worst["R"])
        print(
            f"{path} {label} n = {n}, {len(rows)} chains: largest relative difference "
            + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
            + f" ({cpu:.1f} CPU s in lockstep)",
            flush=True,
        )
    print(f"largest relative difference of R over all cases: {worst_R:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
