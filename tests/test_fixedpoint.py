"""Regime (i): the map G of Algorithm 1 on one sequence, its fixed point (Newton) and its Jacobian spectrum."""

import math

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.analysis import fixedpoint as fp


@pytest.fixture(scope="module")
def task():
    return al.Task.random(4, 2, cond=10.0, signal=1.0, noise_std=0.0, seed=0)


@pytest.fixture(scope="module")
def seq(task):
    return task.sample(48, seed=11)


@pytest.fixture(scope="module")
def limit(task, seq):
    g = fp.SequenceMap(*seq, 0.5)
    return g, fp.fixed_point(g, task=task)


def test_G_is_one_step_of_the_books_algorithm(seq):
    X, Y = seq
    A0, B0 = al.spectral_init(X, Y)
    g = fp.SequenceMap(X, Y, 0.5)
    A, B = g.to_params(g.iterate(g.from_params(A0, B0), 4)[-1])
    h = al.train(X, Y, steps=4, lr=0.5, method="structured")  # balance renormalization, regularizer lam = 1
    assert torch.allclose(A, h.A, atol=1e-12) and torch.allclose(B, h.B, atol=1e-12)
    gc = fp.SequenceMap(X, Y, 0.3, renormalize="cap", nu_cap=0.25)
    A, B = gc.to_params(gc.iterate(gc.from_params(A0, B0), 4)[-1])
    hc = al.train(X, Y, steps=4, lr=0.3, renormalize="cap", nu_cap=0.25)
    assert torch.allclose(A, hc.A, atol=1e-12) and torch.allclose(B, hc.B, atol=1e-12)
    # off the balanced set the regularizer's gradient counts, as in train(): G maps any point the same way
    v = g.from_params(*al.perturb(A0, B0, al.empirical_task(X, Y), 0.3, seed=2))
    Ap, Bp = g.to_params(v)
    h = al.train(X, Y, steps=1, lr=0.5, method="structured", init=(Ap, Bp))
    A1, B1 = g.to_params(g(v))
    assert torch.allclose(A1, h.A, atol=1e-12) and torch.allclose(B1, h.B, atol=1e-12)


def test_fixed_point_has_a_small_residual_and_is_stable(limit):
    g, res = limit
    assert res.converged and res.residual < 1e-11
    assert float(torch.linalg.norm(g(res.v) - res.v)) < 1e-11
    sp = fp.spectrum(g, res.v)
    assert np.abs(sp.eigenvalues).max() < 1  # the iteration converges to it
    # it is not a critical point of Lhat: the gradient does not vanish (no minimizer without noise)
    v = res.v.clone().requires_grad_(True)
    assert float(torch.linalg.norm(torch.autograd.grad(g.loss(v), v)[0])) > 1e-4


def test_plain_newton_also_solves_the_equation(task, seq):
    g = fp.SequenceMap(*seq, 0.5)
    res = fp.fixed_point(g, warmup=300, stable=False, task=task)
    assert res.residual < 1e-10


def test_jacobian_matches_finite_differences(limit):
    g, res = limit
    J = g.jacobian(res.v)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        u = torch.randn(g.size, generator=gen, dtype=torch.float64)
        eps = 1e-5
        fd = (g(res.v + eps * u) - g(res.v - eps * u)) / (2 * eps)
        assert torch.allclose(J @ u, fd, atol=1e-7 * float(torch.linalg.norm(u)))


def test_spectrum_removed_slow_and_fast_modes(limit):
    g, res = limit
    sp = fp.spectrum(g, res.v)
    k, d = 2, 4
    stiefel = d * k - k * (k + 1) // 2
    assert sp.removed == k * d + d * d - (k * d + stiefel)  # the renormalization keeps the product and W only
    assert sp.slow.size == stiefel and np.all(np.abs(sp.slow.imag) < 1e-9)
    # the slow modes are mostly rotations of the factorization (at n = 48 the fastest of them mixes a little)
    assert np.all(sp.rotation_overlap[:3] > 0.95) and np.all(sp.rotation_overlap > 0.7)
    assert np.abs(sp.slow).min() > np.abs(sp.fast).max()
    assert np.all(sp.h_slow > 0) and np.all(sp.h_slow < sp.h_rotation.max())
    # the slow rates do not depend on the step size: mu_slow = 1 - eta h
    g2 = fp.SequenceMap(g.X, g.Y, 0.25)
    res2 = fp.fixed_point(g2, res.v)
    moved = float(torch.linalg.norm(res2.v - res.v))
    assert moved < 1e-3 * float(torch.linalg.norm(res.v))  # nearly the same fixed point
    sp2 = fp.spectrum(g2, res2.v)
    assert np.allclose(sp2.h_slow, sp.h_slow, rtol=0.02), (sp.h_slow, sp2.h_slow)


def test_slow_rate_is_the_long_run_decay_of_the_iteration(limit):
    g, res = limit
    mu = float(np.abs(fp.spectrum(g, res.v).slow).max())
    gen = torch.Generator().manual_seed(5)
    v = res.v + 1e-4 * torch.randn(g.size, generator=gen, dtype=torch.float64)
    its = g.iterate(v, 2000)
    dist = np.array([float(torch.linalg.norm(w - res.v)) for w in its])
    steps = np.arange(1200, 2001)
    rate = al.fit_geometric_rate(steps, dist[1200:2001])
    assert abs(math.log(rate) / math.log(mu) - 1) < 0.03, (rate, mu)


def test_rotation_basis_spans_the_orbit(limit):
    g, res = limit
    Q = fp.rotation_basis(g, res.v)
    assert Q.shape == (g.size, 5)
    assert torch.allclose(Q.T @ Q, torch.eye(5, dtype=torch.float64), atol=1e-10)


def test_bad_input(seq):
    X, Y = seq
    with pytest.raises(ValueError, match="renormalize"):
        fp.SequenceMap(X, Y, 0.5, renormalize="nope")
    with pytest.raises(ValueError, match="nu_cap"):
        fp.SequenceMap(X, Y, 0.5, renormalize="cap")
    with pytest.raises(ValueError, match="lr"):
        fp.SequenceMap(X, Y, -1.0)
    with pytest.raises(ValueError, match="v0"):
        fp.fixed_point(fp.SequenceMap(X, Y, 0.5), torch.zeros(3))
    with pytest.raises(ValueError, match="gmap"):
        fp.fixed_point(object())
