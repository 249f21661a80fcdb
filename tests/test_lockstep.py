"""Chains in lockstep (attnlib.optim.run_chains) against the sequential chains (attnlib.optim.run_chain).

Tolerance: both sides compute the same formulas per chain (the prompts are drawn from the same generators,
the moment kernel's per-query values are equal bit for bit), except that sums over queries and the d x d
algebra run batched, or in the compiled step (attnlib.optim._fused: its own summation order, SVDs by
one-sided Jacobi), which round differently; over a few dozen contracting steps that moves results by
1e-16 to 1e-13 relative (the averaged residual R is a small difference of large terms). We ask 1e-12
relative to the largest entry of each series (a wrong prompt, seed or update moves them by 1e-3 or more).
"""

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib import experiments as ex
from attnlib.geometry import Renormalization, _stacked_distance

TOL = 1e-12
SERIES = ("excess", "loss", "objective", "dist", "grad_norm")


@pytest.fixture(scope="module")
def task():
    return ex.make_task(0.0)


def _assert_same(seq, lock):
    assert len(seq) == len(lock)
    for a, b in zip(seq, lock):
        assert np.abs(a.R - b.R).max() <= TOL * np.abs(a.R).max()
        assert a.batches == b.batches
        assert a.history.steps == b.history.steps
        assert a.history.config == b.history.config
        for key in SERIES:
            x, y = np.asarray(getattr(a.history, key)), np.asarray(getattr(b.history, key))
            assert x.shape == y.shape, key
            assert np.abs(x - y).max() <= TOL * max(np.abs(x).max(), 1e-300), key
        for name in ("naive_excess", "test_excess", "nu"):
            assert abs(getattr(a, name) - getattr(b, name)) <= TOL * max(abs(getattr(a, name)), 1.0), name
        assert torch.allclose(a.history.A, b.history.A, rtol=0, atol=TOL)
        assert torch.allclose(a.history.B, b.history.B, rtol=0, atol=TOL)


@pytest.mark.parametrize(
    "options",
    [
        dict(renormalize="cap", nu_cap=0.25),  # the moment kernel, float64, balanced-coordinate steps
        dict(renormalize="fix", nu_cap=0.7, engine="sdpa"),  # the batched SDPA path
        dict(renormalize="balance", attention_dtype="float32"),  # float32 attention
        dict(renormalize="balance", regularize=True, lam=0.5, control_variate=False),
        dict(renormalize="equalize", record_every=3),
        dict(renormalize="balance", regularize=True, lam=0.5),  # the compiled step with the regularizer
        dict(renormalize="cap", nu_cap=0.3, regularize=True, lam=0.5),  # run one by one (run_chains' docstring)
        dict(renormalize=False),  # no renormalization
    ],
)
def test_lockstep_equals_the_sequential_chains(task, options):
    cfg = dict(steps=10, burn_in=4, prompts=4, lr=0.5, **options)
    seeds = [al.derive_seed(c, "lockstep-test") for c in range(3)]
    seq = [al.run_chain(task, 24, seed=s, **cfg) for s in seeds]
    _assert_same(seq, al.run_chains(task, 24, seeds, **cfg))


def test_a_config_object_and_one_chain(task):
    cfg = al.optim.ChainConfig(steps=6, burn_in=2, prompts=3, lr=0.5, renormalize="cap", nu_cap=0.25, seed=5)
    _assert_same([al.run_chain(task, 16, cfg)], al.run_chains(task, 16, [5], cfg))


def test_a_diverging_chain_hands_over_to_the_sequential_chains(task):
    cfg = dict(steps=8, burn_in=2, prompts=2, lr=40.0, renormalize=None, on_divergence="stop")
    seeds = [1, 2]
    seq = [al.run_chain(task, 16, seed=s, **cfg) for s in seeds]
    assert any(r.history.diverged for r in seq)  # the premise: this step size diverges
    lock = al.run_chains(task, 16, seeds, **cfg)
    for a, b in zip(seq, lock):
        assert b.history.diverged == a.history.diverged
        assert a.history.steps == b.history.steps
        np.testing.assert_array_equal(a.R, b.R)


def test_stacked_renormalization_equals_one_call_per_iterate(task):
    g = torch.Generator().manual_seed(3)
    A = torch.randn(4, task.k, task.d, generator=g, dtype=torch.float64)
    B = torch.randn(4, task.d, task.d, generator=g, dtype=torch.float64)
    A[3] = 0.0  # rank 0 next to rank 2: the per-iterate fallback
    for mode, cap in (("balance", None), ("cap", 0.25), ("fix", 0.7), ("equalize", None)):
        R = Renormalization(mode, task, cap)
        As, Bs = R.stacked(A, B)
        for c in range(4):
            a, b = R(A[c], B[c])
            assert torch.allclose(As[c], a, rtol=0, atol=1e-13), (mode, c)
            assert torch.allclose(Bs[c], b, rtol=0, atol=1e-13), (mode, c)
        gam = R.stacked_gamma2(A, B)
        assert np.allclose(gam.numpy(), [R.gamma2(A[c], B[c]) for c in range(4)], rtol=1e-14, atol=0)
    dist = _stacked_distance(A, B, task)
    assert np.allclose(dist.numpy(), [float(al.distance_to_manifold(A[c], B[c], task)) for c in range(4)], rtol=1e-13)
    # a different renormalization per iterate, in one call
    each = [Renormalization(m, task, cap) for m, cap in (("cap", 0.25), ("balance", None), ("fix", 0.7), ("fix", 0.3))]
    As, Bs = Renormalization.stacked_each(each, A, B)
    for c in range(4):
        a, b = each[c](A[c], B[c])
        assert torch.allclose(As[c], a, rtol=0, atol=1e-13) and torch.allclose(Bs[c], b, rtol=0, atol=1e-13), c
    with pytest.raises(ValueError, match="^renorms"):
        Renormalization.stacked_each(each[:3], A, B)
    with pytest.raises(ValueError, match="^renorms"):
        Renormalization.stacked_each([Renormalization("equalize", task)] * 4, A, B)


def test_bad_input(task):
    with pytest.raises(ValueError, match="method"):
        al.run_chains(task, 16, [1, 2], steps=4, burn_in=1, prompts=2, lr=0.5, method="gd")
    with pytest.raises(ValueError, match="seeds"):
        al.run_chains(task, 16, [], steps=4, burn_in=1, prompts=2, lr=0.5)
    with pytest.raises(ValueError, match="burn_in"):
        al.run_chains(task, 16, [1], steps=4, prompts=2, lr=0.5)


@pytest.mark.cuda
def test_lockstep_on_cuda_equals_the_cpu_chains():
    """On CUDA the lockstep runs batched SDPA + autograd on the same prompts (drawn on the CPU, then moved)."""
    task = ex.make_task(0.0)
    cfg = dict(steps=6, burn_in=2, prompts=4, lr=0.5, renormalize="cap", nu_cap=0.25)
    cpu = al.run_chains(task, 32, [1, 2], **cfg)
    gpu = al.run_chains(task.to(device="cuda"), 32, [1, 2], **cfg)
    for a, b in zip(cpu, gpu):
        assert np.abs(a.R - b.R).max() <= 1e-10 * np.abs(a.R).max()
        assert b.history.A.device.type == "cuda"


def test_lockstep_draws_are_the_sequential_prompts_bit_for_bit():
    """The buffers the lockstep draws into hold exactly what ``sample_prompts`` returns for each chain's generator."""
    from attnlib.model.prompts import sample_prompts
    from attnlib.optim import lockstep

    task = al.Task.random(4, 2, cond=5.0, signal=1.0, noise_std=0.3, seed=1)
    cfg = lockstep._config(None, dict(steps=3, burn_in=1, prompts=3, seed=5))
    est = lockstep._Stacked(task, 7, cfg, [5, 6])
    for _ in range(2):
        X, Y = est.draw()
        for c, s in enumerate([5, 6]):
            g = al.make_generator(s)
            for _ in range(est.calls):
                Xs, Ys = sample_prompts(task, 7, 3, generator=g)
            assert torch.equal(X[c], Xs) and torch.equal(Y[c], Ys)
    with pytest.raises(ValueError, match="^out"):
        task.sample(4, seed=0, out=(torch.empty(4, 3, dtype=torch.float64), torch.empty(4, 2, dtype=torch.float64)))


@pytest.mark.parametrize("engine", ["kernel", "sdpa"])
def test_chains_of_different_renormalizations_in_one_lockstep(task, engine):
    """One config per chain, differing in the renormalization (as the prompts sweep's scales at one n): each chain
    equals its sequential chain; other differences are refused with a one-line error naming ``config``."""
    C = al.optim.ChainConfig
    base = dict(steps=10, burn_in=4, prompts=4, lr=0.5, engine=engine, seed=0)
    cfgs = [C(**base, renormalize="cap", nu_cap=0.25), C(**base, renormalize="balance"),
            C(**base, renormalize="fix", nu_cap=0.7), C(**base, renormalize="cap", nu_cap=0.25),
            C(**base, renormalize="fix", nu_cap=0.375)]  # fmt: skip
    seeds = [al.derive_seed(c, "lockstep-mixed") for c in range(len(cfgs))]
    seq = [al.run_chain(task, 24, c, seed=s) for c, s in zip(cfgs, seeds)]
    _assert_same(seq, al.run_chains(task, 24, seeds, cfgs))
    with pytest.raises(ValueError, match="^config.*'lr'"):
        al.run_chains(task, 24, seeds[:2], [cfgs[0], C(**{**base, "lr": 0.4}, renormalize="balance")])
    with pytest.raises(ValueError, match="^config.*one ChainConfig per seed"):
        al.run_chains(task, 24, seeds, cfgs[:2])
