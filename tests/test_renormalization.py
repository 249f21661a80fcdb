"""The renormalizations (geometry.Renormalization), the scaled structured step, training with them, orbit distance."""

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.optim import GradientStep, Objective


@pytest.fixture(scope="module")
def task():
    return al.Task.random(4, 2, cond=10.0, signal=1.0, noise_std=0.1, seed=0)


def _product(A, B, task):
    At, C = al.to_factor(A, B, task)
    return At @ C


@pytest.mark.parametrize("mode,nu_cap", [("balance", None), ("cap", 0.25), ("cap", 5.0), ("fix", 0.25), ("fix", 2.0)])
def test_renormalization_keeps_the_product_and_sets_the_scale(task, mode, nu_cap):
    A, B, _ = al.random_manifold_point(task, seed=0)
    A, B = al.apply_symmetry(A, B, torch.diag(torch.tensor([3.0, 1.0, 0.5, 2.0], dtype=torch.float64)), task)
    A, B = al.perturb(A, B, task, 0.05, seed=1)
    A2, B2 = al.renormalize(A, B, task, mode, nu_cap)
    A3, B3 = al.Renormalization(mode, task, nu_cap)(A, B)
    assert torch.equal(A2, A3) and torch.equal(B2, B3)  # the function is the object, validated
    assert torch.allclose(_product(A2, B2, task), _product(A, B, task), atol=1e-10)
    s1 = float(torch.linalg.matrix_norm(_product(A, B, task), ord=2))
    lam = al.softmax_scale(A2, B2, task)
    want = {"balance": s1, "cap": min(s1, nu_cap or 0), "fix": nu_cap}[mode]
    assert lam == pytest.approx(want, rel=1e-8)
    if mode == "balance":
        Ab, Bb = al.renormalize(A, B, task, "balance")
        assert torch.allclose(A2, Ab) and torch.allclose(B2, Bb)


def test_scaled_step_is_the_structured_step_for_balance(task):
    X, Y = task.sample(256, seed=3)
    h_ref = al.train(X, Y, steps=6, lr=0.5, task=task)
    h = al.train(X, Y, steps=6, lr=0.5, regularize=False, task=task)
    # the regularizer is inert at balanced iterates: the same algorithm
    assert np.allclose(h.excess, h_ref.excess, rtol=1e-8, atol=1e-14)
    assert torch.allclose(h.A, h_ref.A, atol=1e-10) and torch.allclose(h.B, h_ref.B, atol=1e-10)


def test_capped_training_keeps_the_scale_bounded(task):
    X, Y = task.sample(256, seed=3)
    h = al.train(X, Y, steps=20, lr=0.5, renormalize="cap", nu_cap=0.25, task=task)
    emp = al.empirical_task(X, Y)
    assert al.softmax_scale(h.A, h.B, emp) <= 0.25 * (1 + 1e-9)
    assert not h.diverged and h.excess[-1] < 0.05
    assert h.config["renormalize"] == "cap" and h.config["nu_cap"] == 0.25 and not h.config["regularize"]


def test_scaled_step_is_plain_gd_in_the_balanced_coordinates():
    """On the population loss, the capped iteration from a rescaled point equals the balanced one, rescaled."""
    task = al.Task.random(3, 2, cond=4.0, signal=1.0, seed=1)
    A, B, _ = al.random_manifold_point(task, seed=0)
    A, B = al.perturb(A, B, task, 0.1, seed=2)
    A, B = al.renormalize(A, B, task, "balance")
    nu_cap = 0.2
    Af, Bf = al.renormalize(A, B, task, "fix", nu_cap)
    obj = Objective(lambda A_, B_, idx: task.population_loss(A_, B_), geometry=task)
    for A0, B0, mode, cap in ((A, B, "balance", None), (Af, Bf, "fix", nu_cap)):
        renorm = al.Renormalization(mode, task, cap)
        step = GradientStep(0.3, torch.linalg.inv(task.Sigma), renorm.gamma2 if mode == "fix" else None)
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
    d = al.orbit_distance(A2, B2, A, B, task)
    assert 0 < d <= 0.2 + 1e-12
    Q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    At, C = al.to_factor(A, B, task)
    Ar, Br = al.from_factor(At @ Q, Q.T @ C, task)  # the same orbit
    assert al.orbit_distance(Ar, Br, A, B, task) < 1e-12
    assert al.orbit_distance(A2, B2, Ar, Br, task) == pytest.approx(d, rel=1e-10)


def test_validation(task):
    A, B, _ = al.random_manifold_point(task, seed=0)
    with pytest.raises(ValueError, match="renormalize"):
        al.renormalize(A, B, task, "nope", 0.2)
    with pytest.raises(ValueError, match="nu_cap"):
        al.renormalize(A, B, task, "cap")
    with pytest.raises(ValueError, match="nu_cap"):
        al.Renormalization("fix", task, -1.0)
    with pytest.raises(ValueError, match="nu_cap"):
        al.Renormalization("balance", task, 0.25)  # a bound that would be ignored
    with pytest.raises(ValueError, match="nu_cap"):
        al.train_population(task, steps=2, lr=0.1, renormalize="fix")
    X, Y = task.sample(3, seed=0)
    with pytest.raises(ValueError, match="n >= d"):
        al.train(X, Y, steps=2, lr=0.1, renormalize="cap", nu_cap=0.2)


def test_the_loop_renormalizes_and_nothing_else_does(task):
    """One place: a run with the capped renormalization equals the loop's steps done by hand (step rule, then
    Renormalization), and the step rule alone does not renormalize."""
    X, Y = task.sample(128, seed=5)
    h = al.train(X, Y, steps=3, lr=0.4, renormalize="cap", nu_cap=0.2, record_every=3)
    emp = al.empirical_task(X, Y)
    renorm = al.Renormalization("cap", emp, 0.2)
    step = GradientStep(0.4, torch.linalg.inv(emp.Sigma), renorm.gamma2)
    A, B = al.spectral_init(X, Y)
    for _ in range(3):
        A_, B_ = A.clone().requires_grad_(), B.clone().requires_grad_()
        step.update(None, A_, B_, torch.autograd.grad(al.empirical_loss(A_, B_, X, Y), (A_, B_)))
        A, B = renorm(A_.detach(), B_.detach())
        assert not torch.allclose(A, A_.detach(), atol=1e-8)  # the step rule itself does not renormalize
    assert torch.equal(A, h.A) and torch.equal(B, h.B)
