"""Benchmark: the moment kernel (attnlib.model.kernels) against SDPA + autograd and against this machine's bound.

Usage (from the repository root; the machine may be shared, so run it niced)::

    nice -n 10 python benchmarks/kernel_benchmark.py --out benchmarks/kernel.md
    python benchmarks/kernel_benchmark.py --quick          # small sizes, seconds

Measured in one run, one torch thread (attnlib's default), CPU time per call (``time.process_time``:
a process that another one time-slices with is charged only for its own cycles), median of
``--reps`` calls after one warm-up:

* the regime-(ii) step (``attnlib.model.prompts``: draw 16 prompts, the control-variate estimate of
  ``L_n``, its gradient, the structured update with renormalization; d = 4, k = 2, the sweeps'
  task) for n = 256, 1024, 4096, and the attention part alone (``PromptObjective.attention_loss`` and
  its gradient), timed alternately with the step: ``overhead`` = median of the paired differences
  step minus attention part (Python, sampling the prompts, the d x d algebra, autograd of the rest);
* the same step inside whole chains (``--lockstep-n``: n = 256, 1024): ``run_chain`` (one chain, the moment
  kernel) and ``run_chains`` (``--chains`` = 6 chains in lockstep, as the chain sweeps run them), per chain and
  step: a chain of ``--chain-steps`` = 20 steps minus a chain of 1 step (the balancing renormalization, a
  record every 10 steps), so the once-per-chain start and results are left out, as they nearly are in the
  sweeps' 121-step chains; their attention part is the kernel's loss and gradient on the
  same number of prompts (all chains' prompts in one call for the lockstep), timed alternately with the
  chains, and ``overhead`` is again the median paired difference;
* the single-sequence loss and gradient (``empirical_loss`` and ``torch.autograd.grad``) for
  n = 1024, 4096, 16384 (d = 4);

each with float64 SDPA + autograd (the reference), float32 SDPA + autograd, and the moment kernel
in float64 and float32. The bound: per pair of tokens the kernel needs ``F = 4 d + d (d + 1) + 1``
flops (score ``2d``, first moment ``2d``, second moment ``d (d + 1)`` for the upper triangle, the
normalizer 1) and one exponential; ``bound = pairs * (F / GEMM rate + 1 / exp rate)`` with the
rates measured here (a 512 x 512 matrix product with torch; ``torch.exp`` on 64K-element arrays,
resident in cache). ``fraction of bound`` = bound / measured time (1 = at the bound). Also
measured: the kernel's compile time (first call, empty cache) and its first call with a warm cache,
each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

D, K, PROMPTS = 4, 2, 16


def _cpu_time(fn, reps):
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def _paired(step, part, reps):
    """Medians of ``step`` and ``part`` timed alternately, and the median of their paired differences
    (both see the same load on a shared machine)."""
    step()
    part()
    ts, tp = [], []
    for _ in range(reps):
        t0 = time.process_time()
        step()
        t1 = time.process_time()
        part()
        t2 = time.process_time()
        ts.append(t1 - t0)
        tp.append(t2 - t1)
    return statistics.median(ts), statistics.median(tp), statistics.median(a - b for a, b in zip(ts, tp))


def _rates(reps):
    import torch

    out = {}
    for dt in (torch.float64, torch.float32):
        a = torch.randn(512, 512, dtype=dt)
        t = _cpu_time(lambda: a @ a, reps)
        out[f"gemm_{dt}"] = 2 * 512**3 / t
        x = -torch.rand(1 << 16, dtype=dt) * 10
        y = torch.empty_like(x)
        t = _cpu_time(lambda: [torch.exp(x, out=y) for _ in range(50)], reps)
        out[f"exp_{dt}"] = 50 * x.numel() / t
    return out


def _flops_per_pair(d):
    return 4 * d + d * (d + 1) + 1


def _bound(pairs, dtype, rates):
    return pairs * (_flops_per_pair(D) / rates[f"gemm_{dtype}"] + 1.0 / rates[f"exp_{dtype}"])


def _single(n, reps):
    import torch

    import attnlib as al

    task = al.Task.random(D, K, cond=10.0, signal=1.0, noise_std=0.1, seed=0)
    X, Y = task.sample(n, seed=1)
    A, B, _ = al.random_manifold_point(task, seed=2)
    rows = []
    for label, engine, dt in (
        ("SDPA + autograd float64 (reference)", "sdpa", torch.float64),
        ("SDPA + autograd float32", "sdpa", torch.float32),
        ("moment kernel float64", "kernel", torch.float64),
        ("moment kernel float32", "kernel", torch.float32),
    ):
        Xd, Yd = X.to(dt), Y.to(dt)
        Ad, Bd = A.to(dt).requires_grad_(), B.to(dt).requires_grad_()

        def call():
            loss = al.empirical_loss(Ad, Bd, Xd, Yd, engine=engine)
            return torch.autograd.grad(loss, (Ad, Bd))

        rows.append(dict(case="single", n=n, impl=label, dtype=str(dt), time=_cpu_time(call, reps), pairs=n * n))
    return rows


def _prompt_step(n, reps):
    import torch

    import attnlib as al
    from attnlib import experiments as ex
    from attnlib import optim

    task = ex.make_task(0.0)
    rows = []
    for label, engine, adt in (
        ("SDPA + autograd float64 (reference)", "sdpa", torch.float64),
        ("SDPA + autograd float32", "sdpa", torch.float32),
        ("moment kernel float64", "kernel", torch.float64),
        ("moment kernel float32", "kernel", torch.float32),
    ):
        A, B = al.manifold_point(task, task.svd[2])
        renorm = al.Renormalization("balance", task)
        A, B = renorm(A, B)
        A, B = A.clone().requires_grad_(), B.clone().requires_grad_()
        loss = optim.PromptObjective(task, n, PROMPTS, al.make_generator(0), engine=engine, attention_dtype=adt)
        objective = loss.objective()
        step = optim.GradientStep(0.5, torch.linalg.inv(task.Sigma))

        def full_step():
            _, obj = objective(A, B)
            grads = torch.autograd.grad(obj, (A, B))
            step.update(objective, A, B, grads)
            with torch.no_grad():
                An, Bn = renorm(A, B)
                A.copy_(An)
                B.copy_(Bn)

        X, Y = loss.draw()

        def attention_part():
            value = loss.attention_loss(A, B, X, Y)
            return torch.autograd.grad(value, (A, B))

        t_step, t_att, over = _paired(full_step, attention_part, reps)
        rows.append(
            dict(
                case="prompts",
                n=n,
                impl=label,
                dtype=str(adt),
                time=t_step,
                attention=t_att,
                overhead=over,
                draws=_draw_time(task, n, reps),
                pairs=PROMPTS * n * n,
            )
        )
    return rows


def _draw_time(task, n, reps):
    """CPU time of one chain's prompt draws per step (``PROMPTS`` prompts of n tokens, float64, its generator)."""
    import attnlib as al
    from attnlib.model.prompts import sample_prompts

    g = al.make_generator(0)
    return _cpu_time(lambda: sample_prompts(task, n, PROMPTS, generator=g), reps)


def _chains(n, reps, chains, steps):
    """Whole chains, per chain and step: ``run_chain`` (``chains == 1``) or ``run_chains`` in lockstep."""
    import torch

    import attnlib as al
    from attnlib import experiments as ex
    from attnlib.model.kernels import _kernel_loss_unchecked

    task = ex.make_task(0.0)
    seeds = [al.derive_seed(c, "kernel-benchmark") for c in range(chains)]
    rows = []
    for adt in (torch.float64, torch.float32):
        cfg = dict(steps=steps, burn_in=steps // 2, prompts=PROMPTS, lr=0.5, renormalize="balance",
                   attention_dtype=adt, record_every=10, engine="kernel")  # fmt: skip
        if chains == 1:
            label = f"moment kernel {str(adt)[6:]}, run_chain (one chain)"
            run = lambda s: al.run_chain(task, n, seed=seeds[0], **{**cfg, "steps": s, "burn_in": s // 2})  # noqa: E731
        else:
            label = f"moment kernel {str(adt)[6:]}, run_chains ({chains} chains in lockstep)"
            run = lambda s: al.run_chains(task, n, seeds, **{**cfg, "steps": s, "burn_in": s // 2})  # noqa: E731
        X, Y = task.sample(chains * PROMPTS * n, seed=1)
        X, Y = X.reshape(-1, n, D).to(adt), Y.reshape(-1, n, K).to(adt)
        A0, B0 = al.manifold_point(task, task.svd[2])
        A = A0.expand(chains, -1, -1).clone().requires_grad_()
        B = B0.expand(chains, -1, -1).clone().requires_grad_()

        def attention_part(evaluations):
            for _ in range(evaluations):
                torch.autograd.grad(_kernel_loss_unchecked(A, B, X, Y).sum(), (A, B))

        # a chain of S steps minus a chain of 1 step: S - 1 steps, without the start and the results
        long = _paired(lambda: run(steps), lambda: attention_part(steps + 1), reps)
        short = _paired(lambda: run(1), lambda: attention_part(2), reps)
        per = (steps - 1) * chains
        t_step, t_att, over = ((a - b) / per for a, b in zip(long, short))
        rows.append(dict(case="prompts", n=n, impl=label, dtype=str(adt), time=t_step, attention=t_att,
                         overhead=over, draws=_draw_time(task, n, reps), pairs=PROMPTS * n * n))  # fmt: skip
    return rows


def _first_call(cache):
    """Seconds for the first kernel call of a fresh process (compiles with an empty ``cache``)."""
    code = (
        "import time, torch, attnlib as al;"
        "from attnlib.model import kernels as K;"
        "X = torch.randn(64, 4, dtype=torch.float64); Y = torch.randn(64, 2, dtype=torch.float64);"
        "A = torch.randn(2, 4, dtype=torch.float64); B = torch.randn(4, 4, dtype=torch.float64);"
        "t = time.perf_counter(); K.loss_and_grad(A, B, X, Y); print(time.perf_counter() - t)"
    )
    env = dict(os.environ, ATTNLIB_KERNEL_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _table(rows, rates, compile_s, load_s, reps):
    import torch

    import attnlib as al

    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `benchmarks/kernel_benchmark.py` on "
        f"{platform.machine()} ({al.granted_cpus()} CPUs granted), torch {torch.__version__}, one torch thread; "
        f"**the machine was shared** with other jobs (run under `nice`): times are CPU seconds of this process "
        f"(`time.process_time`), median of {reps} calls after a warm-up. d = {D}, k = {K}.",
        "",
        f"Machine rates measured in the same run: GEMM {rates['gemm_torch.float64'] / 1e9:.1f} GFLOP/s (float64), "
        f"{rates['gemm_torch.float32'] / 1e9:.1f} GFLOP/s (float32); exp {rates['exp_torch.float64'] / 1e9:.2f} G/s "
        f"(float64), {rates['exp_torch.float32'] / 1e9:.2f} G/s (float32). Bound per pair: "
        f"{_flops_per_pair(D)} flops + 1 exp. Kernel compile (first call, empty cache, fresh process): "
        f"{compile_s:.1f} s; first call with the cache warm: {load_s:.2f} s (includes importing numba).",
        "",
    ]
    for case, title in (
        ("prompts", f"Regime-(ii) step: {PROMPTS} prompts of n tokens, control variate, gradient, structured update"),
        ("single", "Single-sequence loss + gradient"),
    ):
        lines += [f"**{title}**", ""]
        if case == "prompts":
            lines += [
                "| n | engine | step (ms) | attention part (ms) | overhead (ms) | overhead share | "
                "prompt draws (ms) | overhead less draws, share | "
                "step speed-up vs reference | attention bound (ms) | attention fraction of bound |",
                "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
        else:
            lines += [
                "| n | engine | time (ms) | speed-up vs reference | bound (ms) | fraction of bound |",
                "|---:|:---|---:|---:|---:|---:|",
            ]
        sel = [r for r in rows if r["case"] == case]
        for n in sorted({r["n"] for r in sel}):
            group = [r for r in sel if r["n"] == n]
            ref = group[0]["time"]
            for r in group:
                dt = "torch.float32" if "float32" in r["impl"] else "torch.float64"
                bound = _bound(r["pairs"], dt, rates)
                if case == "prompts":
                    over = r["overhead"]
                    lines.append(
                        f"| {n} | {r['impl']} | {1e3 * r['time']:.1f} | {1e3 * r['attention']:.1f} | {1e3 * over:.1f} "
                        f"| {over / r['time']:.0%} | {1e3 * r['draws']:.2f} | {(over - r['draws']) / r['time']:.0%} "
                        f"| {ref / r['time']:.2f}x | {1e3 * bound:.1f} "
                        f"| {bound / r['attention']:.2f} |"
                    )
                else:
                    lines.append(
                        f"| {n} | {r['impl']} | {1e3 * r['time']:.1f} | {ref / r['time']:.2f}x | {1e3 * bound:.1f} "
                        f"| {bound / r['time']:.2f} |"
                    )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-n", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--single-n", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--lockstep-n", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--chains", type=int, default=6, help="chains in lockstep (the chain sweeps' chains per n)")
    p.add_argument("--chain-steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="n = 64, 128 only, 2 repetitions (a smoke test)")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_n, args.single_n, args.reps, args.lockstep_n, args.chain_steps = [64], [128], 2, [64], 4
    with tempfile.TemporaryDirectory() as cache:
        compile_s = _first_call(cache)
        load_s = _first_call(cache)
    import attnlib as al

    al.configure_threads(1)
    rates = _rates(args.reps)
    print(json.dumps({k: v / 1e9 for k, v in rates.items()}), file=sys.stderr, flush=True)
    rows = []
    for n in args.prompt_n:
        rows += _prompt_step(n, args.reps)
        print(json.dumps(rows[-4:]), file=sys.stderr, flush=True)
        if n in args.lockstep_n:
            for c in (1, args.chains):
                rows += _chains(n, args.reps, c, args.chain_steps)
                print(json.dumps(rows[-2:]), file=sys.stderr, flush=True)
    for n in args.single_n:
        rows += _single(n, args.reps)
        print(json.dumps(rows[-4:]), file=sys.stderr, flush=True)
    table = _table(rows, rates, compile_s, load_s, args.reps)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
