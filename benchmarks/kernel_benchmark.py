"""Benchmark: the moment kernel (attnlib.model.kernels) against SDPA + autograd and against this machine's bound.

Usage (from the repository root; the machine may be shared, so run it niced)::

    nice -n 10 python benchmarks/kernel_benchmark.py --out benchmarks/kernel.md
    python benchmarks/kernel_benchmark.py --quick          # small sizes, seconds

Measured in one run, one torch thread (attnlib's default), CPU time per call (``time.process_time``:
a process that another one time-slices with is charged only for its own cycles), median of
``--reps`` calls after one warm-up:

* the regime-(ii) step of one chain (``attnlib.optim.PromptObjective``: draw 16 prompts, the
  control-variate estimate of ``L_n``, its gradient by autograd, the structured update with
  renormalization; d = 4, k = 2, the sweeps' task) for n = 256, 1024, 4096, by engine, and its
  attention part alone (``PromptObjective.attention_loss`` and its gradient on one draw);
* whole chains in lockstep (``--lockstep-n``: n = 256, 1024; ``--chains`` = 24 chains, the prompts
  sweep's four renormalizations in turn, as the sweep groups its 4 x 6 chains at one n, and 1 chain
  alone through the same engine), per chain and
  step: a chain of ``--chain-steps`` = 11 steps minus a chain of 1 step (a record every 10 steps), so
  the once-per-chain start and results are left out, as they nearly are in the sweeps' 121-step chains.
  Split, inside the same runs, into the time in the compiled kernel (one call per step: all chains'
  prompts), in the prompt draws (``torch.randn`` and the two products of ``Task.sample`` for every chain,
  into the lockstep's buffers) and the rest, the Python and launch overhead (the wrappers, the cast
  and transposition of the keys, the compiled step of ``attnlib.optim._fused``: gradient assembly,
  update and renormalization, the checks, the records);
* the single-sequence loss and gradient (``empirical_loss`` and ``torch.autograd.grad``) for
  n = 1024, 4096, 16384 (d = 4);

each with float64 SDPA + autograd (the reference), float32 SDPA + autograd, and the moment kernel
in float64 and float32. The bound: per pair of tokens the computation needs ``F = 4 d + d (d + 1) + 1``
flops (score ``2d``, first moment ``2d``, second moment ``d (d + 1)`` for its upper triangle, the
normalizer 1) and one exponential; ``bound = pairs * (F / GEMM rate + 1 / exp rate)`` with the rates
measured after every timed call (two 512 x 512 matrix products with torch; ``torch.exp`` on 64K-element
arrays, resident in cache), so that a call and its bound see the same machine: the host's speed drifts
by tens of percent within a run. ``fraction of bound`` = median over the calls of bound / time (1 = at
the bound; the kernel's own formulation needs fewer instructions per pair than ``F`` flops suggest:
``attnlib.model.kernels``). Also measured: the compile times of the kernel and of the lockstep's compiled
step (first calls, empty caches) and the same first calls with warm caches, each in a fresh process.
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


_RATE_DATA = {}


def _rate_sample():
    """One measurement of the machine's rates, per CPU second: GEMM (two 512 x 512 products) and ``torch.exp``
    (16 calls on 64K-element arrays, resident in cache), float64 and float32. Taken right after every timed
    call, so that a call and the bound it is compared with see the same machine (its speed drifts by tens
    of percent on a shared host)."""
    import torch

    if not _RATE_DATA:
        for dt in (torch.float64, torch.float32):
            _RATE_DATA[dt] = (torch.randn(512, 512, dtype=dt), -torch.rand(1 << 16, dtype=dt) * 10)
    out = {}
    for dt, (a, x) in _RATE_DATA.items():
        y = torch.empty_like(x)
        t0 = time.process_time()
        a @ a
        a @ a
        t1 = time.process_time()
        for _ in range(16):
            torch.exp(x, out=y)
        t2 = time.process_time()
        out[f"gemm_{dt}"] = 2 * 2 * 512**3 / max(t1 - t0, 1e-9)
        out[f"exp_{dt}"] = 16 * x.numel() / max(t2 - t1, 1e-9)
    return out


def _timed(fn, reps, pairs=None, dtype=None):
    """``fn`` timed ``reps`` times after a warm-up, each call followed by a rate sample: the median CPU time and,
    with ``pairs``, the median over the calls of (the bound from that call's rate sample) / (its time)."""
    fn()
    _rate_sample()
    ts, fr = [], []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        t = time.process_time() - t0
        rates = _rate_sample()
        _RATES_SEEN.append(rates)
        ts.append(t)
        if pairs is not None:
            fr.append(_bound(pairs, dtype, rates) / t)
    return statistics.median(ts), (statistics.median(fr) if fr else None)


_RATES_SEEN = []


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

        t, frac = _timed(call, reps, n * n, dt)
        rows.append(dict(case="single", n=n, impl=label, time=t, fraction=frac, pairs=n * n))
    return rows


def _prompt_step(n, reps):
    """One step of one chain (``PromptObjective``, autograd, ``GradientStep``, renormalization) by engine; its
    attention part (the engine's loss and gradient on one draw) timed right after it, with a rate sample."""
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

        t_step, _ = _timed(full_step, reps)
        t_att, frac = _timed(attention_part, reps, PROMPTS * n * n, adt)
        rows.append(dict(case="prompts", n=n, impl=label, time=t_step, attention=t_att, fraction=frac,
                         pairs=PROMPTS * n * n))  # fmt: skip
    return rows


class _InRun:
    """CPU time spent inside the compiled kernel and inside the prompt draws during a run of ``run_chains``, measured
    in that run (the compiled function that ``attnlib.model.kernels._prepare`` hands out and ``_Stacked.draw`` are
    wrapped): the rest of the run is Python and launch overhead."""

    def __init__(self):
        from attnlib.model import kernels as Km
        from attnlib.optim import lockstep

        self.kernel = self.draws = 0.0
        prepare, draw = Km._prepare, lockstep._Stacked.draw

        def timed_prepare(*a, **kw):
            fn, args = prepare(*a, **kw)

            def call(*x):
                t0 = time.process_time()
                fn(*x)
                self.kernel += time.process_time() - t0

            return call, args

        def timed_draw(est):
            t0 = time.process_time()
            out = draw(est)
            self.draws += time.process_time() - t0
            return out

        self._undo = lambda: (setattr(Km, "_prepare", prepare), setattr(lockstep._Stacked, "draw", draw))
        Km._prepare, lockstep._Stacked.draw = timed_prepare, timed_draw

    def close(self):
        self._undo()


def _chains(n, reps, chains, steps):
    """Whole chains in lockstep (``run_chains``, the moment kernel, float64 and float32 attention), per chain and
    step: a chain of ``steps`` steps minus a chain of 1 step (so the once-per-chain start and results are left
    out). Inside each run the time in the compiled kernel and in the prompt draws is measured (:class:`_InRun`);
    the rest is Python and launch overhead (the wrappers, the cast and transposition of the keys, the gradient
    assembly, the update and renormalization, the checks). The kernel's fraction of bound uses the rates sampled
    after each run."""
    import torch

    import attnlib as al
    from attnlib import experiments as ex
    from attnlib import optim

    task = ex.make_task(0.0)
    seeds = [al.derive_seed(c, "kernel-benchmark") for c in range(chains)]
    scales = [ex.PROMPT_SCALES[c % len(ex.PROMPT_SCALES)] for c in range(chains)]  # the sweep's scales, in turn
    rows = []
    for adt in (torch.float64, torch.float32):
        cfg = dict(prompts=PROMPTS, lr=0.5, attention_dtype=adt, record_every=10, engine="kernel")
        who = (f"{chains} chains in lockstep ({len(set(scales))} renormalizations)" if chains > 1
               else "1 chain")  # fmt: skip
        label = f"run_chains, {who}, moment kernel {str(adt)[6:]}"

        def run(s):
            cfgs = [optim.ChainConfig(**cfg, steps=s, burn_in=s // 2, renormalize=m, nu_cap=cap, seed=0)
                    for _, m, cap in scales]  # fmt: skip
            probe = _InRun()
            try:
                t0 = time.process_time()
                al.run_chains(task, n, seeds, cfgs)
                return time.process_time() - t0, probe.kernel, probe.draws
            finally:
                probe.close()

        run(steps), run(1)  # warm-up
        parts = []
        for _ in range(reps):
            long, short = run(steps), run(1)
            rates = _rate_sample()
            _RATES_SEEN.append(rates)
            per = (steps - 1) * chains
            step, kern, draw = ((a - b) / per for a, b in zip(long, short))
            parts.append((step, kern, draw, step - kern - draw, _bound(PROMPTS * n * n, adt, rates) / kern))
        med = [statistics.median(p[i] for p in parts) for i in range(5)]
        rows.append(dict(case="chains", n=n, impl=label, time=med[0], kernel=med[1], draws=med[2], overhead=med[3],
                         fraction=med[4], pairs=PROMPTS * n * n))  # fmt: skip
    return rows


def _first_call(cache):
    """Seconds for the first kernel call of a fresh process, and then for its first lockstep step (the compiled step
    of ``attnlib.optim._fused``); both compile with an empty ``cache`` (the kernel's and numba's)."""
    code = (
        "import time, torch, attnlib as al;"
        "from attnlib.model import kernels as K; from attnlib import experiments as ex;"
        "X = torch.randn(64, 4, dtype=torch.float64); Y = torch.randn(64, 2, dtype=torch.float64);"
        "A = torch.randn(2, 4, dtype=torch.float64); B = torch.randn(4, 4, dtype=torch.float64);"
        "t = time.perf_counter(); K.loss_and_grad(A, B, X, Y); print(time.perf_counter() - t);"
        "task = ex.make_task(0.0); t = time.perf_counter();"
        "al.run_chains(task, 16, [1, 2], steps=2, burn_in=1, prompts=2, lr=0.5, engine='kernel');"
        "print(time.perf_counter() - t)"
    )
    env = dict(os.environ, ATTNLIB_KERNEL_CACHE=cache, NUMBA_CACHE_DIR=os.path.join(cache, "numba"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return [float(v) for v in out.stdout.strip().splitlines()[-2:]]


def _span(key, scale):
    vals = sorted(r[key] / scale for r in _RATES_SEEN)
    return f"{statistics.median(vals):.2f} (range {vals[0]:.2f}-{vals[-1]:.2f})"


def _table(rows, compile_s, load_s, reps):
    import torch

    import attnlib as al

    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `benchmarks/kernel_benchmark.py` on "
        f"{platform.machine()} ({al.granted_cpus()} CPUs granted), torch {torch.__version__}, one torch thread: "
        f"times are CPU seconds of this process (`time.process_time`), median of {reps} calls after a warm-up. "
        f"d = {D}, k = {K}.",
        "",
        f"Machine rates, sampled right after every timed call (median and range over the run): GEMM "
        f"{_span('gemm_torch.float64', 1e9)} GFLOP/s in float64, {_span('gemm_torch.float32', 1e9)} in float32; "
        f"`torch.exp` {_span('exp_torch.float64', 1e9)} G/s in float64, {_span('exp_torch.float32', 1e9)} in float32. "
        f"Bound per pair of tokens: {_flops_per_pair(D)} flops at the GEMM rate + 1 exponential at the exp rate; "
        "each `fraction of bound` is the median over the calls of (the bound from the rates sampled after that "
        "call) / (that call's time). Compile, in a fresh process with empty caches: the kernel (its first call) "
        f"{compile_s[0]:.1f} s, then the lockstep's compiled step (the first `run_chains` call) {compile_s[1]:.1f} s; "
        f"the same first calls with the caches warm: {load_s[0]:.2f} s (includes importing numba) and "
        f"{load_s[1]:.2f} s.",
        "",
        f"**Regime-(ii) step, one chain: {PROMPTS} prompts of n tokens, control variate, gradient, structured update**",
        "",
        "| n | engine | step (ms) | step speed-up vs reference | attention part (ms) | attention fraction of bound |",
        "|---:|:---|---:|---:|---:|---:|",
    ]
    lines += _engine_rows(rows, "prompts", lambda r, up: f"{1e3 * r['time']:.1f} | {up:.2f}x | "
                          f"{1e3 * r['attention']:.1f} | {r['fraction']:.2f}")  # fmt: skip
    lines += [
        "",
        "**Chains in lockstep, per chain and step: the kernel pass, the prompt draws, and Python and launch overhead**",
        "",
        "Medians over the repetitions; in each, the kernel and draw times are measured inside the same runs and the "
        "overhead is step - kernel - draws.",
        "",
        "| n | engine | step (ms) | in the kernel (ms) | in the prompt draws (ms) | overhead (ms) | overhead share "
        "| kernel fraction of bound | step speed-up vs the one-chain reference |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in rows if r["case"] == "chains"):
        over = r["overhead"]
        ref = next((q["time"] for q in rows if q["case"] == "prompts" and q["n"] == r["n"]), None)
        speed = f"{ref / r['time']:.2f}x" if ref else "-"
        lines.append(f"| {r['n']} | {r['impl']} | {1e3 * r['time']:.2f} | {1e3 * r['kernel']:.2f} | "
                     f"{1e3 * r['draws']:.2f} | {1e3 * over:.3f} | {over / r['time']:.1%} | {r['fraction']:.2f} | "
                     f"{speed} |")  # fmt: skip
    lines += [
        "",
        "**Single-sequence loss + gradient**",
        "",
        "| n | engine | time (ms) | speed-up vs reference | fraction of bound |",
        "|---:|:---|---:|---:|---:|",
    ]
    lines += _engine_rows(rows, "single", lambda r, up: f"{1e3 * r['time']:.1f} | {up:.2f}x | {r['fraction']:.2f}")
    return "\n".join(lines + [""])


def _engine_rows(rows, case, cells):
    """The table rows of one case, by n, each engine's ``cells(row, speed-up against the first row of its n)``."""
    out = []
    for n in sorted({r["n"] for r in rows if r["case"] == case}):
        group = [r for r in rows if r["case"] == case and r["n"] == n]
        out += [f"| {n} | {r['impl']} | {cells(r, group[0]['time'] / r['time'])} |" for r in group]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-n", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--single-n", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--lockstep-n", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--chains", type=int, nargs="+", default=[24, 1],
                   help="chains in lockstep (each count a row), the prompts sweep's scales in turn")  # fmt: skip
    p.add_argument("--chain-steps", type=int, default=11)
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
    rows = []
    for n in args.prompt_n:
        rows += _prompt_step(n, args.reps)
        print(json.dumps(rows[-4:]), file=sys.stderr, flush=True)
    for n in args.lockstep_n:
        for chains in args.chains:
            rows += _chains(n, args.reps, chains, args.chain_steps)
            print(json.dumps(rows[-2:]), file=sys.stderr, flush=True)
    for n in args.single_n:
        rows += _single(n, args.reps)
        print(json.dumps(rows[-4:]), file=sys.stderr, flush=True)
    table = _table(rows, compile_s, load_s, args.reps)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
