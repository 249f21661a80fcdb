"""Closed-form population loss: Monte Carlo, gradients, change of variables."""

import math

import numpy as np
import pytest
import torch

import attnlib as al


def _params(task, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    A = scale * torch.randn(task.k, task.d, generator=g, dtype=torch.float64)
    B = scale * torch.randn(task.d, task.d, generator=g, dtype=torch.float64)
    return A, B


def test_task_random_has_requested_cond_signal_rank():
    t = al.Task.random(6, 4, cond=100.0, signal=2.0, rank=2, seed=1)
    assert t.cond == pytest.approx(100.0, rel=1e-8)
    assert float(torch.linalg.det(t.Sigma)) == pytest.approx(1.0, rel=1e-8)
    assert float(torch.linalg.norm(t.M @ t.Sigma_sqrt)) == pytest.approx(2.0, rel=1e-10)
    assert t.rank == 2
    # same seed, other cond: same factorization target T
    t2 = al.Task.random(6, 4, cond=1.0, signal=2.0, rank=2, seed=1)
    assert torch.allclose(t.T, t2.T, atol=1e-12)


def test_sample_shapes_reproducible_and_covariance(task):
    X, Y = task.sample(50_000, seed=7)
    X2, Y2 = task.sample(50_000, seed=7)
    assert X.shape == (50_000, task.d) and Y.shape == (50_000, task.k)
    assert torch.equal(X, X2) and torch.equal(Y, Y2)
    assert not torch.equal(X, task.sample(50_000, seed=8)[0])
    Sigma_hat = X.T @ X / X.shape[0]
    assert torch.allclose(Sigma_hat, task.Sigma, atol=0.05 * float(task.Sigma.abs().max()))
    resid = Y - X @ task.M.T
    assert float(resid.std()) == pytest.approx(task.noise_std, rel=0.02)


def test_population_loss_matches_monte_carlo_of_the_limit(task):
    """L = E 1/2 ||A Sigma B^T x - y||^2 over fresh (x, y): within 4 standard errors."""
    A, B = _params(task)
    X, Y = task.sample(400_000, seed=11)
    per = 0.5 * ((X @ (A @ task.Sigma @ B.T).T - Y) ** 2).sum(1)
    mc, se = float(per.mean()), float(per.std() / math.sqrt(per.numel()))
    L = float(task.population_loss(A, B))
    assert abs(mc - L) < 4 * se, (mc, L, se)


def test_population_loss_is_the_large_n_limit_of_the_empirical_loss():
    """E Lhat_n -> L: at n = 8192 the seed average is within 3% (softmax scale kept moderate)."""
    task = al.Task.random(4, 2, cond=4.0, signal=0.5, noise_std=0.2, seed=2)
    A, B, _ = al.random_manifold_point(task, seed=3)
    A, B = al.perturb(A, B, task, 0.3, seed=4)
    L = float(task.population_loss(A, B))
    emp = [float(al.empirical_loss(A, B, *task.sample(8192, seed=50 + s))) for s in range(8)]
    assert sum(emp) / len(emp) == pytest.approx(L, rel=0.03)


def test_bayes_and_excess(task):
    A, B = _params(task)
    assert task.bayes_risk == pytest.approx(task.k * task.noise_std**2 / 2)
    assert float(task.population_loss(A, B) - task.excess_risk(A, B)) == pytest.approx(task.bayes_risk)
    A_star, B_star, _ = al.random_manifold_point(task, seed=0)
    assert float(task.excess_risk(A_star, B_star)) < 1e-25


def test_closed_form_gradients_match_autograd_and_finite_differences(task):
    A, B = _params(task, seed=3)
    gA, gB = task.population_grad(A, B)
    A_ = A.clone().requires_grad_()
    B_ = B.clone().requires_grad_()
    aA, aB = torch.autograd.grad(task.population_loss(A_, B_), (A_, B_))
    assert torch.allclose(gA, aA, atol=1e-12) and torch.allclose(gB, aB, atol=1e-12)
    h = 1e-6
    for i, j in [(0, 0), (1, 3), (2, 4)]:
        E = torch.zeros_like(A)
        E[i, j] = h
        fd = (task.population_loss(A + E, B) - task.population_loss(A - E, B)) / (2 * h)
        assert float(fd) == pytest.approx(float(gA[i, j]), rel=1e-6, abs=1e-9)
    for i, j in [(0, 0), (3, 1), (4, 2)]:
        E = torch.zeros_like(B)
        E[i, j] = h
        fd = (task.population_loss(A, B + E) - task.population_loss(A, B - E)) / (2 * h)
        assert float(fd) == pytest.approx(float(gB[i, j]), rel=1e-6, abs=1e-9)


def test_change_of_variables_identities(task):
    A, B = _params(task, seed=5)
    At, C = al.to_factor(A, B, task)
    T = task.M @ task.Sigma_sqrt
    # L - L* = 1/2 ||At C - T||_F^2
    assert float(task.excess_risk(A, B)) == pytest.approx(0.5 * float(((At @ C - T) ** 2).sum()), rel=1e-12)
    # round trip, with a matrix Sigma as well as a Task
    A2, B2 = al.from_factor(*al.to_factor(A, B, task.Sigma), task.Sigma)
    assert torch.allclose(A2, A, atol=1e-12) and torch.allclose(B2, B, atol=1e-12)
    # the regularizer in both forms
    R = al.regularizer(A, B, task, lam=2.0)
    assert float(R) == pytest.approx(0.5 * float(((At.T @ At - C @ C.T) ** 2).sum()), rel=1e-12)
    # P-norm is the Euclidean norm in (At, C)
    assert float(al.p_norm(A, B, task)) == pytest.approx(math.sqrt(float((At**2).sum() + (C**2).sum())))


def test_scale_invariance_of_the_factor_coordinates(task):
    """x -> c x with (A/c, B/c^2): same (At, C), same population loss, same finite-n outputs."""
    c = 3.0
    A, B = _params(task, seed=6)
    scaled = al.Task(c**2 * task.Sigma, task.M / c, task.noise_std)
    At, C = al.to_factor(A, B, task)
    At2, C2 = al.to_factor(A / c, B / c**2, scaled)
    assert torch.allclose(At, At2, atol=1e-12) and torch.allclose(C, C2, atol=1e-12)
    assert float(scaled.population_loss(A / c, B / c**2)) == pytest.approx(float(task.population_loss(A, B)))
    assert float(al.regularizer(A / c, B / c**2, scaled)) == pytest.approx(float(al.regularizer(A, B, task)))
    X, _ = task.sample(100, seed=1)
    assert torch.allclose(al.attention(A / c, B / c**2, c * X), al.attention(A, B, X), atol=1e-12)


def test_empirical_task_recovers_least_squares():
    task = al.Task.random(4, 2, cond=3.0, signal=1.0, noise_std=0.1, seed=0)
    X, Y = task.sample(20_000, seed=1)
    emp = al.empirical_task(X, Y)
    assert torch.allclose(emp.Sigma, X.T @ X / 20_000)
    assert torch.allclose(emp.M, torch.linalg.lstsq(X, Y).solution.T, atol=1e-10)
    assert emp.noise_std == pytest.approx(0.1, rel=0.03)


def test_heldout_loss_on_fresh_sequences():
    task = al.Task.random(4, 2, cond=4.0, signal=0.5, noise_std=0.2, seed=2)
    A, B, _ = al.random_manifold_point(task, seed=3)
    tl = al.heldout_loss(A, B, task, 4096, n_sequences=6, seed=10)
    seeds = [al.derive_seed(10, "heldout", i) for i in range(6)]
    assert len(set(seeds)) == 6
    by_hand = np.mean([float(al.empirical_loss(A, B, *task.sample(4096, seed=s))) for s in seeds])
    assert tl == pytest.approx(by_hand, rel=1e-12)
    # at a population minimum the finite layer's held-out loss is close to the Bayes risk: within the
    # Monte Carlo error of the label noise (relative sd sqrt(2 / (n k n_sequences)) ~ 0.6%) plus the
    # finite-n error of the layer, which only adds
    assert 0.97 * task.bayes_risk < tl < 1.5 * task.bayes_risk
    # without label noise the held-out loss is the finite-n error alone: positive and small
    clean = al.Task(task.Sigma, task.M, 0.0)
    tl0 = al.heldout_loss(A, B, clean, 4096, n_sequences=6, seed=10)
    assert 0 < tl0 < 0.5 * task.bayes_risk
    with pytest.raises(ValueError, match="n_sequences"):
        al.heldout_loss(A, B, task, 100, n_sequences=0)
