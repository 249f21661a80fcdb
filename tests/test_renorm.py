"""The light-tail renormalization, its step rule, regime-(i) training with it, and the orbit distance."""

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib import renorm as rn
from attnlib.train import Objective


@pytest.fixture(scope="module")
def task():
    return al.Task.random(4, 2, cond=10.0, signal=1.0, noise_std=0.1, seed=0)


def _product(A, B, task):
    At, C = al.to_factor(A, B, task)
    return At @ C


@pytest.mark.parametrize("mode,kappa", [("balance", None), ("cap", 0.25), ("cap", 5.0), ("fix", 0.25), ("fix", 2.0)])
def test_renormalize_scaled_keeps_the_product_and_sets_the_scale(task, mode, kappa):
    A, B, _ = al.random_manifold_point(task, seed=0)
    A, B = al.apply_symmetry(A, B, torch.diag(torch.tensor([3.0, 1.0, 0.5, 2.0], dtype=torch.float64)), task)
    A, B = al.perturb(A, B, task, 0.05, seed=1)
    A2, B2 = rn.renormalize_scaled(A, B, task, mode, kappa)
    assert torch.allclose(_product(A2, B2, task), _product(A, B, task), atol=1e-10)
    s1 = float(torch.linalg.matrix_norm(_product(A, B, task), ord=2))
    lam = rn.softmax_scale(A2, B2, task)
    want = {"balance": s1, "cap": min(s1, kappa or 0), "fix": kappa}[mode]
    assert lam == pytest.approx(want, rel=1e-8)
    if mode == "balance":
        Ab, Bb = al.renormalize(A, B, task, "balance")
        assert torch.allclose(A2, Ab) and torch.allclose(B2, Bb)


def test_scaled_step_is_the_structured_step_for_balance(task):
    X, Y = task.sample(256, seed=3)
    h_ref = al.train(X, Y, steps=6, lr=0.5, task=task)
    h = rn.train_sequence(X, Y, steps=6, lr=0.5, mode="balance", task=task)
    # the regularizer of al.train is inert at balanced iterates: the same algorithm
    assert np.allclose(h.excess, h_ref.excess, rtol=1e-8, atol=1e-14)
    assert torch.allclose(h.A, h_ref.A, atol=1e-10) and torch.allclose(h.B, h_ref.B, atol=1e-10)


def test_capped_training_keeps_the_scale_bounded(task):
    X, Y = task.sample(256, seed=3)
    h = rn.train_sequence(X, Y, steps=20, lr=0.5, mode="cap", kappa=0.25, task=task)
    emp = al.empirical_task(X, Y)
    assert rn.softmax_scale(h.A, h.B, emp) <= 0.25 * (1 + 1e-9)
    assert not h.diverged and h.excess[-1] < 0.05
    assert h.config["renormalize"] == "cap" and h.config["kappa"] == 0.25


def test_scaled_step_is_plain_gd_in_the_balanced_coordinates():
    """On the population loss, the capped iteration from a rescaled point equals the balanced one, rescaled."""
    task = al.Task.random(3, 2, cond=4.0, signal=1.0, seed=1)
    A, B, _ = al.random_manifold_point(task, seed=0)
    A, B = al.perturb(A, B, task, 0.1, seed=2)
    A, B = al.renormalize(A, B, task, "balance")
    kappa = 0.2
    Af, Bf = rn.renormalize_scaled(A, B, task, "fix", kappa)
    obj = Objective(lambda A_, B_, idx: task.population_loss(A_, B_), geometry=task)
    for A0, B0, mode, kap in ((A, B, "balance", None), (Af, Bf, "fix", kappa)):
        step = rn.ScaledStructuredStep(0.3, task, mode, kap)
        A_, B_ = A0.clone().requires_grad_(), B0.clone().requires_grad_()
        g = torch.autograd.grad(task.population_loss(A_, B_), (A_, B_))
        step.update(obj, A_, B_, g)
        if mode == "balance":
            P_bal = _product(A_.detach(), B_.detach(), task)
        else:
            P_fix = _product(A_.detach(), B_.detach(), task)
    assert torch.allclose(P_bal, P_fix, atol=1e-12)


def test_orbit_distance(task):
    A, B, _ = al.random_manifold_point(task, seed=0)
    A2, B2 = al.perturb(A, B, task, 0.2, seed=1)
    d = rn.orbit_distance(A2, B2, A, B, task)
    assert 0 < d <= 0.2 + 1e-12
    Q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    At, C = al.to_factor(A, B, task)
    Ar, Br = al.from_factor(At @ Q, Q.T @ C, task)  # the same orbit
    assert rn.orbit_distance(Ar, Br, A, B, task) < 1e-12
    assert rn.orbit_distance(A2, B2, Ar, Br, task) == pytest.approx(d, rel=1e-10)


def test_validation(task):
    A, B, _ = al.random_manifold_point(task, seed=0)
    with pytest.raises(ValueError, match="mode"):
        rn.renormalize_scaled(A, B, task, "nope", 0.2)
    with pytest.raises(ValueError, match="kappa"):
        rn.renormalize_scaled(A, B, task, "cap")
    with pytest.raises(ValueError, match="kappa"):
        rn.ScaledStructuredStep(0.1, task, "fix", -1.0)
    X, Y = task.sample(3, seed=0)
    with pytest.raises(ValueError, match="n >= d"):
        rn.train_sequence(X, Y, steps=2, lr=0.1, mode="cap", kappa=0.2)


def test_one_heavy_tail_index():
    """renorm uses the finite-n module's softmax scale (one definition in the library)."""
    import attnlib.finite_n as fn

    assert rn.softmax_scale is fn.softmax_scale
