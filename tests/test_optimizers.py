"""attnlib.optim.optimizers: practitioners' optimizers as step rules of the one training loop, and their measures."""

import math

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib import experiments as ex
from attnlib.optim import METHODS, History, grid
from attnlib.optim import optimizers as opt

F64 = torch.float64


def _train_with_step(task, **kw):
    """A population run and the step rule it used (its state is what the optimizer learned)."""
    h = al.train_population(task, **kw)
    return h, h.step_rule


def _task(cond=1.0, seed=0):
    return al.Task.random(4, 2, cond=cond, signal=1.0, noise_std=0.1, seed=seed)


def test_methods_are_registered():
    for name in ("adamw", "muon", "muon_decay", "shampoo", "shampoo_explained", "soap"):
        assert name in METHODS and not METHODS[name].preconditionable
    with pytest.raises(ValueError, match="name"):
        opt.make_optimizer("lbfgs", [torch.zeros(2, 2, requires_grad=True)], 0.1)
    with pytest.raises(ValueError, match="precondition"):
        al.train_population(_task(), steps=1, lr=0.1, method="shampoo", precondition=True)


def test_explained_shampoo_matches_the_library_to_round_off():
    # same variant: statistics from eps I, inverse fourth roots at every step, no momentum, no grafting
    from pytorch_optimizer import Shampoo

    g = torch.Generator().manual_seed(3)
    W1 = torch.randn(3, 5, generator=g, dtype=F64).requires_grad_(True)
    W2 = W1.detach().clone().requires_grad_(True)
    lib = Shampoo([W1], lr=0.05, momentum=0.0, matrix_eps=opt.SHAMPOO_EPS, preconditioning_compute_steps=1)
    mine = opt.ExplainedShampoo([W2], lr=0.05, eps=opt.SHAMPOO_EPS)
    target = torch.randn(3, 5, generator=g, dtype=F64)
    for _ in range(6):
        for W, o in ((W1, lib), (W2, mine)):
            W.grad = None
            ((W - target) ** 3).square().sum().backward()
            o.step()
    assert torch.allclose(W1, W2, rtol=1e-10, atol=1e-12)
    # and through the training loop, on the population objective
    task = _task(cond=30.0)
    h1 = al.train_population(task, steps=8, lr=0.1, method="shampoo", seed=2)
    h2 = al.train_population(task, steps=8, lr=0.1, method="shampoo_explained", seed=2)
    assert np.allclose(h1.excess, h2.excess, rtol=1e-9, atol=0)
    assert torch.allclose(h1.B, h2.B, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize(
    "method,lr",
    [
        ("adam", 0.01),
        ("adamw", 0.01),
        ("muon", 0.01),
        ("muon_decay", 0.03),
        ("shampoo", 0.1),
        ("shampoo_explained", 0.1),
        ("soap", 0.01),
    ],
)
def test_each_optimizer_decreases_the_population_loss(method, lr):
    task = _task(cond=1.0)
    A0, B0, _ = al.random_manifold_point(task, seed=1)
    A0, B0 = al.perturb(A0, B0, task, 0.3, seed=2)
    h = al.train_population(task, steps=60, lr=lr, method=method, init=(A0, B0))
    assert not h.diverged
    assert h.excess[-1] < 0.1 * h.excess[0], (method, h.excess[0], h.excess[-1])
    assert h.loss[-1] < h.loss[0]


def test_muon_update_has_a_fixed_spectral_norm():
    # the reason Muon at a constant step cannot converge: ||Delta W||_2 ~ lr whatever the gradient's size
    for scale in (1e-6, 1.0, 1e4):
        W = torch.zeros(4, 4, dtype=F64, requires_grad=True)
        o = torch.optim.Muon([W], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False)
        g = torch.Generator().manual_seed(5)
        W.grad = scale * torch.randn(4, 4, generator=g, dtype=F64)
        o.step()
        s = torch.linalg.svdvals(W.detach()) / 0.1
        assert 0.6 < float(s.min()) and float(s.max()) < 1.25, (scale, s)


def test_muon_decay_schedule():
    task = _task()
    h, st = _train_with_step(task, method="muon_decay", steps=5, lr=0.02)
    assert st.t == 5
    assert math.isclose(st.opt.param_groups[0]["lr"], 0.02 * opt.MUON_DECAY**4, rel_tol=1e-12)
    _, st_c = _train_with_step(task, method="muon", steps=5, lr=0.02)
    assert st_c.opt.param_groups[0]["lr"] == 0.02


def test_preconditioner_slope_of_gd_and_structured():
    task = _task(cond=100.0)
    _, st = _train_with_step(task, method="structured", steps=3, lr=0.3)
    assert abs(opt.preconditioner_slope(st, task) + 1.0) < 1e-9
    assert abs(opt.preconditioner_slope(st, task, which=1) + 1.0) < 1e-9
    _, st = _train_with_step(task, method="gd", steps=3, lr=1e-3)
    assert abs(opt.preconditioner_slope(st, task)) < 1e-12
    _, st = _train_with_step(task, method="muon", steps=3, lr=1e-3)
    assert math.isnan(opt.preconditioner_slope(st, task))
    with pytest.raises(ValueError, match="which"):
        opt.preconditioner_map(st, 2)


def test_preconditioner_slope_of_a_known_kronecker_map():
    # Shampoo's map is L^-1/4 G R^-1/4: the slope is that of log(v_i^T R^-1/4 v_i) against log(lambda_i)
    task = _task(cond=50.0, seed=4)
    lam, V = torch.linalg.eigh(task.Sigma)
    _, st = _train_with_step(task, method="shampoo_explained", steps=4, lr=0.05)
    R = st.opt.state[st.opt.param_groups[0]["params"][0]]["R"]
    Ri = opt.ExplainedShampoo.inv_root(R)
    q = torch.einsum("ji,jk,ki->i", V, Ri, V)
    want = np.polyfit(np.log(lam.numpy()), np.log(q.numpy()), 1)[0]
    assert abs(opt.preconditioner_slope(st, task) - want) < 1e-10
    # the library's Shampoo stores the same root
    _, st2 = _train_with_step(task, method="shampoo", steps=4, lr=0.05)
    assert abs(opt.preconditioner_slope(st2, task) - want) < 1e-8
    # a known diagonal Adam state: D = 1 / (sqrt(v_hat) + eps)
    _, st3 = _train_with_step(task, method="adam", steps=4, lr=0.01)
    P = opt.preconditioner_map(st3, 0)
    G = torch.ones(2, 4, dtype=F64)
    s = st3.opt.state[st3.opt.param_groups[0]["params"][0]]
    assert torch.allclose(P(G), 1 / ((s["exp_avg_sq"] / (1 - 0.999**4)).sqrt() + 1e-8))


def test_imbalance():
    task = _task(cond=10.0)
    A, B, _ = al.random_manifold_point(task, seed=0)
    assert opt.imbalance(A, B, task) < 1e-12
    assert opt.imbalance(2.0 * A, B / 2.0, task) > 0.5


def _hist(excess):
    h = History(method="x", config={})
    h.steps = list(range(len(excess)))
    h.excess = list(excess)
    return h


def test_steps_to_and_max_after():
    h = _hist([1.0, 1e-3, 1e-7, 1e-5, 1e-11, 1e-12])
    assert opt.steps_to(h, 1e-6) == 2 and opt.steps_to(h, 1e-10) == 4
    assert opt.max_after(h, 1e-6) == 1e-5  # reached, then left again
    assert opt.max_after(h, 1e-10) == 1e-11
    assert opt.steps_to(h, 1e-20) is None and opt.max_after(h, 1e-20) is None
    assert grid.log_excess_score(_hist([1.0, 1e-20])) == pytest.approx(-8.0)
    with pytest.raises(ValueError, match="tol"):
        opt.steps_to(h, -1.0)


def test_grid_search_extends_until_interior():
    def run(lr, on_divergence="stop"):
        h = _hist([1.0, (math.log10(lr) - 1.0) ** 2 + 1e-3])  # best at lr = 10
        h.diverged = lr > 300
        return h

    res = grid.grid_search(run, [0.01, 0.1, 1.0], score=lambda h: h.excess[-1])
    assert res["position"] == "interior" and math.isclose(res["lr"], 10.0)
    assert len(res["lrs"]) == 5 and math.isclose(max(res["lrs"]), 100.0)
    # every run diverges above 1e-3: the grid moves down
    res = grid.grid_search(lambda lr, on_divergence: _hist([1, 1]) if lr < 1e-3 else _div(), [0.01, 0.1, 1.0], extend=6)
    assert res["lr"] is not None and res["lr"] < 1e-3
    with pytest.raises(ValueError, match="lrs"):
        grid.grid_search(run, [0.1, 1.0])


def _div():
    h = _hist([1.0])
    h.diverged = True
    return h


def test_measure_at_the_structured_minimum():
    task = _task(cond=10.0)
    h, _ = _train_with_step(task, method="structured", steps=120, lr=1.0)
    m = opt.measure(h, task, n=64, n_sequences=2)
    assert m["steps_1e-10"] <= 120 and m["max_after_1e-10"] <= 1e-10
    assert m["imbalance"] < 1e-8
    assert abs(m["nu"] - float(task.svd[1][0])) < 1e-6  # balanced: nu = s_1(T) (to the excess left after 120 steps)
    assert m["heldout"] > 0 and m["time_per_step"] > 0


def test_optimizers_sweep_quick():
    s = ex.sweep("optimizers", quick=True)
    rows = s.func(s.specs[1])
    assert sum(r["selected"] for r in rows) == 1
    assert {r["position"] for r in rows} == {"interior"}
    assert set(rows[0]) <= set(s.columns)
    with pytest.raises(ValueError, match="start"):
        ex.optimizer_start(_task(), "far", 0)


def test_optimizers_sequence_quick_selects_on_fresh_sequences():
    s = ex.sweep("optimizers_sequence", quick=True)
    rows = s.func(s.specs[0])
    sel = [r for r in rows if r["selected"]]
    assert len(sel) == 1 and sel[0]["position"] == "interior"
    # the selection score is the loss on fresh sequences: it is what the selected row's lr scored
    assert min(r["selection_loss"] for r in rows if not r["diverged"]) == sel[0]["selection_loss"]
    assert sel[0]["heldout"] > 0 and np.isfinite(sel[0]["excess"])


# ----------------------------------------------------------------------------- four factors


def test_factored_gradient_is_the_chain_rule_of_the_closed_form():
    task = _task(cond=30.0)
    F = [W.requires_grad_(True) for W in opt.factored_start(task, 3, seed=4)]
    WQ, WK, WV, WO = F
    task.excess_risk(*opt.factored_product(*F)).backward()
    gA, gB = task.population_grad(*(X.detach() for X in opt.factored_product(*F)))
    want = (WK.detach() @ gB.T, WQ.detach() @ gB, WO.detach().T @ gA, gA @ WV.detach().T)
    for W, g in zip(F, want):
        assert torch.allclose(W.grad, g, rtol=1e-10, atol=1e-14)


def test_factored_start_is_the_same_in_whitened_coordinates():
    t1, t2 = _task(cond=1.0, seed=2), _task(cond=1e4, seed=2)
    F1, F2 = opt.factored_start(t1, 2, seed=7), opt.factored_start(t2, 2, seed=7)
    # W Sigma W^T = Wt Wt^T: the whitened factors' Gram matrices agree
    for W1, W2 in zip(F1[:3], F2[:3]):
        assert torch.allclose(W1 @ t1.Sigma @ W1.T, W2 @ t2.Sigma @ W2.T, rtol=1e-9, atol=1e-12)
    assert torch.equal(F1[3], F2[3])
    with pytest.raises(ValueError, match="d_h"):
        opt.factored_start(t1, 0)


def test_factored_imbalance_and_nu_at_a_balanced_minimum():
    task = _task(cond=100.0, seed=3)
    F = opt.factored_balanced(task, 3, seed=1)
    assert F[0].shape == (3, 4) and F[3].shape == (2, 3)
    with pytest.raises(ValueError, match="d_h"):
        opt.factored_balanced(task, 1)
    A, B = opt.factored_product(*F)
    assert float(task.excess_risk(A, B)) < 1e-20
    w = opt.factored_imbalance(*F, task)
    assert w["qk"] < 1e-10 and w["ov"] < 1e-10
    assert opt.imbalance(A, B, task) < 1e-10
    assert abs(opt.softmax_scale(A, B, task) - float(task.svd[1][0])) < 1e-10
    # the symmetry W_Q -> 2 W_Q, W_K -> W_K / 2 leaves the product and breaks the balance
    G = (2.0 * F[0], F[1] / 2.0, F[2], F[3])
    assert torch.allclose(opt.factored_product(*G)[1], B, atol=1e-13)
    assert opt.factored_imbalance(*G, task)["qk"] > 0.5
    # the Euclidean balance is a different condition when Sigma is not I
    assert opt.factored_imbalance(*F, task, whitened=False)["qk"] > 1e-3


def test_structured_four_factor_run_is_independent_of_cond():
    # GD with Sigma^-1 on the right of W_Q, W_K, W_V is GD on the four-factor factorization of T
    hs = [
        opt.train_factored(_task(cond=c, seed=1), method="structured", d_h=2, steps=100, lr=0.3, seed=5)
        for c in (1.0, 1e3)
    ]
    assert not any(h.diverged for h in hs)
    assert np.allclose(hs[0].excess, hs[1].excess, rtol=1e-6, atol=1e-14)
    assert hs[0].excess[-1] < 0.05 * hs[0].excess[0]
    # at cond 1 (Sigma = I to round-off) it is plain GD
    g = opt.train_factored(_task(cond=1.0, seed=1), method="gd", d_h=2, steps=100, lr=0.3, seed=5)
    assert np.allclose(g.excess, hs[0].excess, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("method,lr", [("gd", 0.3), ("adam", 0.01), ("shampoo", 0.03), ("muon_decay", 0.1)])
def test_each_optimizer_on_four_factors_decreases_the_excess(method, lr):
    task = _task(cond=1.0)
    h = opt.train_factored(task, method=method, d_h=4, steps=100, lr=lr, seed=1)
    assert not h.diverged and h.excess[-1] < 0.1 * h.excess[0], (method, h.excess[0], h.excess[-1])
    m = opt.measure_factored(h, task)
    assert set(m) >= {"steps_1e-6", "imb_qk", "imb_ov", "imb_qk_euclid", "nu_over_s1"}
    assert len(h.config["factors"]) == 4 and h.B.shape == (4, 4) and h.A.shape == (2, 4)


def test_train_factored_bad_input_and_divergence():
    task = _task()
    with pytest.raises(ValueError, match="method"):
        opt.train_factored(task, method="soap", d_h=2, steps=2, lr=0.1)
    with pytest.raises(ValueError, match="on_divergence"):
        opt.train_factored(task, method="gd", d_h=2, steps=2, lr=0.1, on_divergence="ignore")
    h = opt.train_factored(task, method="gd", d_h=2, steps=50, lr=1e3, on_divergence="stop")
    assert h.diverged and np.all(np.isfinite(h.excess))
    with pytest.raises(FloatingPointError):
        opt.train_factored(task, method="gd", d_h=2, steps=50, lr=1e3, on_divergence="raise")


def test_optimizers_factored_sweep_quick():
    s = ex.sweep("optimizers_factored", quick=True)
    rows = s.func(s.specs[0])
    sel = [r for r in rows if r["selected"]]
    assert len(sel) == 1 and {r["position"] for r in rows} == {"interior"}
    assert set(rows[0]) <= set(s.columns) and set(sel[0]) <= set(s.columns)
    # the recorded run is reproduced by run_factored at its step size
    h = ex.run_factored(s.specs[0], sel[0]["lr"])
    assert h.excess[-1] == sel[0]["final_excess"]


def test_gradient_flow_conserves_the_query_key_gap():
    # at a small step: the whitened gap for the structured map, the Euclidean one for plain GD
    task = _task(cond=100.0, seed=2)
    S = task.Sigma
    for method, W in (("structured", S), ("gd", torch.eye(4, dtype=F64))):
        F0 = opt.factored_start(task, 4, seed=6)
        h = opt.train_factored(task, method=method, d_h=4, steps=100, lr=1e-3, seed=6)
        F1 = h.config["factors"]
        gap = lambda F: F[0] @ W @ F[0].T - F[1] @ W @ F[1].T  # noqa: E731
        ov = lambda F: F[3].T @ F[3] - F[2] @ W @ F[2].T  # noqa: E731
        assert h.excess[-1] < 0.9 * h.excess[0], method
        for f in (gap, ov):
            assert float(torch.linalg.norm(f(F1) - f(F0)) / torch.linalg.norm(f(F0))) < 1e-3, method


# ----------------------------------------------------------------------------- regime (ii)


def test_train_prompts_is_seeded_and_the_structured_method_stays_balanced():
    task = _task(cond=10.0)
    init = ex.optimizer_start(task, "near", 0)
    h1 = al.train_prompts(task, 16, method="structured", prompts=4, steps=20, lr=0.3, init=init, seed=3)
    h2 = al.train_prompts(task, 16, method="structured", prompts=4, steps=20, lr=0.3, init=init, seed=3)
    h3 = al.train_prompts(task, 16, method="structured", prompts=4, steps=20, lr=0.3, init=init, seed=4)
    assert h1.loss == h2.loss and h1.loss != h3.loss
    assert opt.imbalance(h1.A, h1.B, task) < 1e-8  # the balancing renormalization, with the true Sigma
    assert h1.excess[-1] < h1.excess[0]
    h = al.train_prompts(task, 16, method="adam", prompts=4, steps=20, lr=0.01, init=init, seed=3)
    assert not h.diverged and opt.imbalance(h.A, h.B, task) > 1e-6  # no renormalization: it leaves the balance
    with pytest.raises(ValueError, match="method"):
        al.train_prompts(task, 16, method="lbfgs", prompts=4, steps=2, lr=0.1, init=init)
    with pytest.raises(ValueError, match="prompts"):
        al.train_prompts(task, 16, method="gd", prompts=0, steps=2, lr=0.1, init=init)


def test_optimizers_prompts_sweep_quick_selects_on_fresh_prompts():
    s = ex.sweep("optimizers_prompts", quick=True)
    rows = s.func(s.specs[0])
    sel = [r for r in rows if r["selected"]]
    assert len(sel) == 1 and {r["position"] for r in rows} == {"interior"}
    assert set(sel[0]) <= set(s.columns)
    assert min(r["selection_loss"] for r in rows if not r["diverged"]) == sel[0]["selection_loss"]
    assert 0.0 <= sel[0]["below_bayes"] <= 1.0 and np.isfinite(sel[0]["heldout"])


def test_train_prompts_counts_a_kernel_underflow_as_divergence(monkeypatch):
    def boom(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    import attnlib.optim.api as api

    monkeypatch.setattr(api, "fit", boom)
    task = _task()
    init = ex.optimizer_start(task, "near", 0)
    h = al.train_prompts(task, 16, method="gd", prompts=2, steps=3, lr=0.1, init=init, seed=0, on_divergence="stop")
    assert h.diverged and len(h.steps) == 0
    with pytest.raises(FloatingPointError, match="diverged"):
        al.train_prompts(task, 16, method="gd", prompts=2, steps=3, lr=0.1, init=init, seed=0)
