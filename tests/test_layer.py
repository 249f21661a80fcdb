"""The finite-n layer: fused kernel against the reference, limit, stability."""

import math

import numpy as np
import pytest
import torch

import attnlib as al


def _layer_inputs(dtype, n=300, m=None, scale=1.0, seed=0):
    task = al.Task.random(6, 3, cond=5.0, signal=1.0, seed=seed).to(dtype=dtype)
    X, _ = task.sample(n, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    A = torch.randn(3, 6, generator=g, dtype=torch.float64).to(dtype)
    B = (scale * torch.randn(6, 6, generator=g, dtype=torch.float64)).to(dtype)
    Q = None if m is None else task.sample(m, seed=seed + 3)[0]
    return X, A, B, Q


@pytest.mark.parametrize("m", [None, 17])
def test_fused_matches_reference_float64(m):
    X, A, B, Q = _layer_inputs(torch.float64, m=m)
    out = al.attention(A, B, X, queries=Q)
    ref = al.attention_reference(A, B, X, queries=Q)
    assert out.shape == (X.shape[0] if m is None else m, 3)
    assert torch.allclose(out, ref, rtol=0, atol=1e-10), float((out - ref).abs().max())


def test_fused_matches_reference_float32():
    X, A, B, Q = _layer_inputs(torch.float32, m=50)
    out = al.attention(A, B, X, queries=Q)
    ref = al.attention_reference(A, B, X, queries=Q)
    ref64 = al.attention_reference(A.double(), B.double(), X.double(), queries=Q.double())
    scale = float(ref64.abs().max())
    assert out.dtype == torch.float32
    assert float((out.double() - ref64).abs().max()) < 1e-5 * scale
    assert float((ref.double() - ref64).abs().max()) < 1e-5 * scale


def test_fused_gradients_match_reference():
    X, A, B, _ = _layer_inputs(torch.float64, n=200)
    Y = torch.randn(200, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for fused in (True, False):
        A_ = A.clone().requires_grad_()
        B_ = B.clone().requires_grad_()
        loss = al.empirical_loss(A_, B_, X, Y, fused=fused)
        grads.append(torch.autograd.grad(loss, (A_, B_)))
    for g1, g2 in zip(*grads):
        assert torch.allclose(g1, g2, rtol=0, atol=1e-10)


def test_weights_are_a_softmax():
    X, A, B, _ = _layer_inputs(torch.float64, n=40)
    W = al.attention_weights(B, X)
    assert W.shape == (40, 40)
    assert torch.allclose(W.sum(1), torch.ones(40, dtype=torch.float64))
    assert torch.allclose(W @ X @ A.T, al.attention(A, B, X), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_softmax_scale_stays_finite(dtype):
    # scores of order 1e4: exp() would overflow without the max subtraction
    X, A, B, _ = _layer_inputs(dtype, n=256, scale=1e3)
    for fn in (al.attention, al.attention_reference):
        out = fn(A, B, X)
        assert torch.isfinite(out).all()
    # at this scale the softmax is (numerically) a hard argmax
    W = al.attention_weights(B.double(), X.double())
    hard = (W.max(1).values > 1 - 1e-6).float().mean()
    assert hard > 0.9
    out64 = al.attention(A.double(), B.double(), X.double())
    assert torch.allclose(out64, al.attention_reference(A.double(), B.double(), X.double()), atol=1e-8)


def test_empirical_loss_minibatch_rows():
    X, A, B, _ = _layer_inputs(torch.float64, n=64)
    Y = torch.zeros(64, 3, dtype=torch.float64)
    full = al.empirical_loss(A, B, X, Y)
    idx = torch.arange(64)
    assert torch.allclose(al.empirical_loss(A, B, X, Y, queries=idx), full)
    part = al.empirical_loss(A, B, X, Y, queries=torch.tensor([0, 5]))
    out = al.attention(A, B, X)
    assert torch.allclose(part, 0.5 * (out[[0, 5]] ** 2).sum() / 2)


def _limit_rms(signal, ns, n_seeds=24):
    task = al.Task.random(4, 2, cond=4.0, signal=signal, seed=3)
    A, B, _ = al.random_manifold_point(task, seed=4)
    Q, _ = task.sample(32, seed=5)
    limit = al.attention_limit(A, B, task.Sigma, Q)
    rms = []
    for n in ns:
        errs = [
            ((al.attention(A, B, task.sample(n, seed=100 + s)[0], queries=Q) - limit) ** 2).sum(1).mean()
            for s in range(n_seeds)
        ]
        rms.append(math.sqrt(float(torch.stack(errs).mean())))
    return np.array(rms)


def test_finite_n_output_converges_to_the_limit_at_rate_n_minus_half():
    """RMS error of f(q; X) against A Sigma B^T q, fitted on log-log axes.

    Measured (24 seeds, n = 256..16384): slope -0.46 at signal 0.5; at signal 1
    the softmax weights are heavier-tailed and the pre-asymptotic slope is only
    about -0.37, with a larger error at every n.
    """
    ns = [256, 1024, 4096, 16384]
    small = _limit_rms(0.5, ns)
    slope = np.polyfit(np.log(ns), np.log(small), 1)[0]
    assert -0.58 < slope < -0.42, (slope, small)
    large = _limit_rms(1.0, ns)
    assert np.all(large > small)


def test_effective_sample_size_formula():
    Sigma = torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64))
    a = torch.tensor([0.5, -0.5], dtype=torch.float64)
    ess = al.effective_sample_size(a, Sigma, 1000)
    assert ess == pytest.approx(1000 * math.exp(-(0.25 + 0.5)))
    # Monte Carlo check of E[w]^2 / E[w^2] = exp(-a^T Sigma a)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, 2, generator=g, dtype=torch.float64) @ Sigma.sqrt()
    w = torch.exp(x @ a)
    ratio = float(w.mean() ** 2 / (w**2).mean())
    assert ratio == pytest.approx(math.exp(-0.75), rel=0.02)


@pytest.mark.cuda
def test_cuda_matches_cpu():
    X, A, B, Q = _layer_inputs(torch.float32, m=20)
    out_cpu = al.attention(A, B, X, queries=Q)
    out_gpu = al.attention(A.cuda(), B.cuda(), X.cuda(), queries=Q.cuda())
    assert out_gpu.device.type == "cuda"
    assert torch.allclose(out_gpu.cpu(), out_cpu, atol=1e-4)
