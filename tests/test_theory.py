"""Regime (ii), first-order theory: the 1/n term D_1 of L_n against Monte Carlo, its gradient, and c2."""

import math

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.analysis import fixedpoint as fp
from attnlib.analysis import stats as st
from attnlib.analysis import theory as th
from attnlib.geometry import renormalize
from attnlib.model import prompts as pr


@pytest.fixture(scope="module")
def task():
    return al.Task.random(4, 2, cond=10.0, signal=1.0, noise_std=0.0, seed=0)


def _point(task, nu_cap, radius, seed=3):
    A, B = al.manifold_point(task, task.svd[2])
    A, B = renormalize(A, B, task, "fix", nu_cap)
    return al.perturb(A, B, task, radius, seed=seed) if radius else (A, B)


def _mc_gap(task, A, B, n, prompts, batches, seed):
    """Monte Carlo of n (L_n - L) with its standard error (control variate: exact limit layer on the same prompts)."""
    gen = al.make_generator(seed)
    vals = []
    for _ in range(batches):
        X, Y = pr.sample_prompts(task, n, prompts, generator=gen)
        vals.append((pr.prompt_losses(A, B, X, Y) - pr.limit_losses(A, B, task, X, Y)).numpy())
    v = np.concatenate(vals) * n
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))


@pytest.mark.parametrize("radius", [0.0, 0.2])
def test_d1_matches_monte_carlo(task, radius):
    # a light-tailed point (nu = 0.05): the O(1/n) remainder is small against the Monte Carlo error
    A, B = _point(task, 0.05, radius)
    D = float(th.d1(A, B, task))
    mc, se = _mc_gap(task, A, B, 128, 2000, 5, seed=1)
    assert abs(mc - D) < 4 * se + 0.01 * abs(D), (mc, se, D)
    assert se < 0.02 * abs(D)  # the check has power


def test_d1_parts_and_the_self_token(task):
    A, B = _point(task, 0.05, 0.2)
    p = th.d1(A, B, task, parts=True)
    assert float(p["total"]) == pytest.approx(float(p["variance"] + p["is_bias"] + p["self_token"]))
    Am, Bm = _point(task, 0.05, 0.0)  # on the minimum set the residual vanishes and only the variance is left
    pm = th.d1(Am, Bm, task, parts=True)
    assert abs(float(pm["is_bias"])) < 1e-12 and abs(float(pm["self_token"])) < 1e-12
    # the variance term as a brute-force Gaussian average of e^{|a|^2} (tr G + a^T G a) / 2
    At, C = al.to_factor(Am, Bm, task)
    z = torch.randn(400_000, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = z @ C.T
    G = At.T @ At
    f = 0.5 * torch.exp((a * a).sum(1)) * (torch.trace(G) + ((a @ G) * a).sum(1))
    assert abs(float(f.mean()) - float(pm["variance"])) < 4 * float(f.std()) / math.sqrt(z.shape[0])


def test_d1_gradient_matches_the_finite_n_gradient(task):
    A, B = _point(task, 0.05, 0.2)
    A_, B_ = A.clone().requires_grad_(), B.clone().requires_grad_()
    gD = torch.cat([g.ravel() for g in torch.autograd.grad(th.d1(A_, B_, task), (A_, B_))]).numpy()
    obj = al.optim.PromptObjective(task, 128, 1000, al.make_generator(7))
    gs = []
    for _ in range(8):
        A_, B_ = A.clone().requires_grad_(), B.clone().requires_grad_()
        X, Y = obj.draw()
        gap = obj.estimate(A_, B_, X, Y) - task.population_loss(A_, B_)
        gs.append(128 * torch.cat([g.ravel() for g in torch.autograd.grad(gap, (A_, B_))]).numpy())
    gs = np.array(gs)
    mean, se = gs.mean(0), gs.std(0, ddof=1) / math.sqrt(gs.shape[0])
    err = np.linalg.norm(mean - gD)
    assert err < 4 * np.linalg.norm(se) + 0.03 * np.linalg.norm(gD), (err, np.linalg.norm(se), np.linalg.norm(gD))


def test_d1_refuses_heavy_tails(task):
    A, B = _point(task, 0.6, 0.0)
    with pytest.raises(ValueError, match="infinite"):
        th.d1(A, B, task)
    assert th.thresholds(A, B, task)["nu"] == pytest.approx(0.6)


@pytest.mark.parametrize("mode,nu_cap", [("cap", 0.25), ("fix", 0.15)])
def test_c2_is_the_fixed_point_of_the_first_order_map(task, mode, nu_cap):
    # the chains' map on L + D_1/n, iterated from the minimum set at W = V, settles at n^2 excess = c2(V)
    n = 1e5
    sm = th.SurrogateMap(task, n, 0.5, renormalize=mode, nu_cap=nu_cap)
    At, C, gamma = th.point(task, renormalize=mode, nu_cap=nu_cap)
    v = sm.iterate(sm.pack(At, C), 80)[-1]
    res = fp.fixed_point(sm, v, tol=1e-14)
    At1, C1 = sm.unpack(res.v)
    measured = n**2 * 0.5 * float(torch.sum((At1 @ C1 - task.T) ** 2))
    assert measured == pytest.approx(th.c2(task, renormalize=mode, nu_cap=nu_cap), rel=5e-3)
    # independent of the step size (to first order)
    sm2 = th.SurrogateMap(task, n, 0.25, renormalize=mode, nu_cap=nu_cap)
    v2 = sm2.iterate(sm2.pack(At, C), 160)[-1]
    A2, C2 = sm2.unpack(v2)
    assert n**2 * 0.5 * float(torch.sum((A2 @ C2 - task.T) ** 2)) == pytest.approx(measured, rel=5e-3)


def test_c2_depends_on_the_point_of_the_minimum_set_and_has_a_best_scale(task):
    vals = [th.c2(task, al.random_manifold_point(task, seed=s)[2], renormalize="cap", nu_cap=0.25) for s in range(3)]
    assert max(vals) > 1.1 * min(vals)
    b = th.best_scale(task)
    assert 0.02 < b["nu_best"] < 0.49 and b["c2_best"] <= np.min(b["c2"]) + 1e-12
    assert th.c2(task, renormalize="fix", nu_cap=b["nu_best"]) == pytest.approx(b["c2_best"])


def test_tail_exponent(task):
    e = th.tail_exponent(task, renormalize="fix", nu_cap=0.375)
    assert e["zeta_weights"] == pytest.approx(1 / 0.75 - 1)
    assert e["zeta"] == pytest.approx(min(1.0, e["zeta_weights"], e["zeta_self"]))
    with pytest.raises(ValueError, match="renormalize"):
        th.tail_exponent(task, renormalize="nope", nu_cap=0.2)
    with pytest.raises(ValueError, match="task"):
        th.c2("task")


def _noiseless_sequence(task, n, seed):
    X = torch.randn(n, task.d, generator=al.make_generator(seed), dtype=torch.float64) @ al.sym_sqrt(task.Sigma)
    return X, X @ task.M.T


def test_exact_fit_exists_below_the_count_and_not_above(task):
    # n k <= k d + d^2 (here 16 <= 24): a finite point fits all targets (loss at round-off, bounded norm)
    X, Y = _noiseless_sequence(task, 8, 1)
    best = min((th.exact_fit(X, Y, seed=s, iters=200) for s in range(3)), key=lambda r: r["loss"])
    assert best["loss"] < 1e-25 and best["norms"][-1] < 50
    out = al.attention_reference(best["A"], best["B"], X)
    assert float(torch.max(torch.abs(out - Y))) < 1e-12
    # n k > k d + d^2 (64 > 24): the loss keeps falling only while the norm grows (no exact fit found)
    X, Y = _noiseless_sequence(task, 32, 2)
    r = th.exact_fit(X, Y, seed=0, iters=150)
    assert np.all(np.diff(r["losses"]) <= 0) and r["loss"] > 1e-20
    assert r["norms"][-1] > 2 * r["norms"][0]


def test_exact_fit_rejects_bad_input(task):
    X, Y = _noiseless_sequence(task, 8, 1)
    with pytest.raises(ValueError, match="Y"):
        th.exact_fit(X, None)
    with pytest.raises(ValueError, match="init"):
        th.exact_fit(X, Y, init=(torch.zeros(3, 4), torch.zeros(4, 4)))


def test_approach_recovers_the_amplitude_and_flags_a_wrong_form(task):
    const = th.c2(task, renormalize="cap", nu_cap=0.25)
    zeta = th.tail_exponent(task, renormalize="cap", nu_cap=0.25)["zeta"]
    ns = np.array([128.0, 256, 512, 1024, 2048, 4096])
    se = 0.01 * const * np.ones_like(ns)
    exact = const * (1 - 2.5 * ns**-zeta)
    a = th.approach(task, ns, exact, se, renormalize="cap", nu_cap=0.25)
    assert a["c2"] == pytest.approx(const) and a["zeta"] == pytest.approx(zeta)
    assert a["alpha"] == pytest.approx(2.5, rel=1e-12) and a["chi2"] < 1e-18 and a["dof"] == 5
    assert a["curve"](1e12) == pytest.approx(const, rel=1e-3)  # the correction vanishes: the limit is c2
    # data from another exponent (a much slower approach): the one-amplitude form does not fit
    slow = const * (1 - 2.5 * ns**-0.05)
    b = th.approach(task, ns, slow, se, renormalize="cap", nu_cap=0.25, n_min=256)
    assert b["chi2"] / b["dof"] > 100 and not b["used"][0] and abs(b["z"][0]) > 10
    with pytest.raises(ValueError, match="n_min"):
        th.approach(task, ns, exact, se, renormalize="cap", nu_cap=0.25, n_min=4096)
    with pytest.raises(ValueError, match="equal length"):
        th.approach(task, ns, exact[:-1], se, renormalize="cap", nu_cap=0.25)


def test_paired_precision_against_direct_computation(task):
    rng = np.random.default_rng(5)
    Rb = 0.01 + 0.003 * rng.standard_normal((6, task.k, task.d))
    same = th.paired_precision(Rb, Rb, task.Sigma)
    assert same["diff"] == 0 and same["var_diff"] == 0 and same["diff_se"] == 0 and same["max_rel_change"] == 0
    Ra = 1.1 * Rb  # every chain scaled: the excess by 1.21, the variance by 1.21
    p = th.paired_precision(Ra, Rb, task.Sigma)
    ub = st.excess_ustat(Rb, task.Sigma)["excess"]
    assert p["excess_b"] == pytest.approx(ub) and p["diff"] == pytest.approx(0.21 * ub, rel=1e-10)
    assert p["var_a"] == pytest.approx(1.21 * p["var_b"], rel=1e-10) and p["diff_se"] > 0
    S = task.Sigma.numpy()
    D = Rb - Rb.mean(0)
    assert p["var_b"] == pytest.approx(sum(0.5 * np.trace(x @ S @ x.T) for x in D) / 5, rel=1e-12)
    with pytest.raises(ValueError, match="Rs_a, Rs_b"):
        th.paired_precision(Rb[:2], Rb[:2], task.Sigma)
