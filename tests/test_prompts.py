"""Regime (ii): batched attention, the control variate, the chains and the unbiased excess estimator."""

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.analysis import stats as st
from attnlib.model import prompts as pr


@pytest.fixture(scope="module")
def task():
    return al.Task.random(3, 2, cond=5.0, signal=1.0, seed=2)


def test_batched_attention_matches_attention_per_prompt(task):
    X, Y = pr.sample_prompts(task, 17, 5, seed=0)
    assert X.shape == (5, 17, 3) and Y.shape == (5, 17, 2)
    A, B, _ = al.random_manifold_point(task, seed=1)
    out = pr.batched_attention(A, 2.0 * B, X)
    losses = pr.prompt_losses(A, 2.0 * B, X, Y)
    for b in range(5):
        assert torch.allclose(out[b], al.attention_reference(A, 2.0 * B, X[b]), atol=1e-12)
        assert float(losses[b]) == pytest.approx(float(al.empirical_loss(A, 2.0 * B, X[b], Y[b])), rel=1e-12)


def test_prompts_are_independent_draws_of_the_task(task):
    X, Y = pr.sample_prompts(task, 8, 3, seed=4)
    Xf, Yf = task.sample(24, seed=4)
    assert torch.equal(X.reshape(24, 3), Xf) and torch.equal(Y.reshape(24, 2), Yf)


def test_limit_loss_is_unbiased_for_the_population_loss(task):
    A, B, _ = al.random_manifold_point(task, seed=1)
    A, B = al.perturb(A, B, task, 0.5, seed=2)
    X, Y = pr.sample_prompts(task, 32, 4000, seed=5)
    v = pr.limit_losses(A, B, task, X, Y)
    mean, se = float(v.mean()), float(v.std() / len(v) ** 0.5)
    assert abs(mean - float(task.population_loss(A, B))) < 4 * se


def _grads(obj, A, B, reps):
    out = []
    for _ in range(reps):
        A_, B_ = A.clone().requires_grad_(), B.clone().requires_grad_()
        gA, gB = torch.autograd.grad(obj(A_, B_), (A_, B_))
        out.append(torch.cat([gA.ravel(), gB.ravel()]).numpy())
    return np.array(out)


def test_control_variate_is_unbiased_and_reduces_the_variance(task):
    """Same expectation (L_n and its gradient) with and without the control variate; less noise off the minimum."""
    A, B, _ = al.random_manifold_point(task, seed=1)
    A, B = al.perturb(A, B, task, 0.4, seed=3)
    n, P, reps = 16, 8, 300
    cv = al.optim.PromptObjective(task, n, P, al.make_generator(11), control_variate=True)
    plain = al.optim.PromptObjective(task, n, P, al.make_generator(12), control_variate=False)
    g_cv, g_pl = _grads(cv, A, B, reps), _grads(plain, A, B, reps)
    assert cv.calls == reps and plain.calls == reps
    diff = g_cv.mean(0) - g_pl.mean(0)
    se = np.sqrt(g_cv.var(0) / reps + g_pl.var(0) / reps)
    assert np.all(np.abs(diff) < 4.5 * se), np.max(np.abs(diff) / se)
    # variance on the same prompts (paired: the heavy-tailed noise makes unpaired variances noisy).
    # The limit part of the gradient is proportional to the residual A Sigma B^T - M, so the
    # control variate removes more noise the farther the point is from the minimum set.
    ratios = {}
    for radius in (0.05, 1.0):
        A1, B1 = al.perturb(*al.random_manifold_point(task, seed=1)[:2], task, radius, seed=3)
        gen = al.make_generator(5)
        pairs = []
        for _ in range(150):
            Xb, Yb = pr.sample_prompts(task, n, 4, generator=gen)
            pairs.append([_grads(lambda A_, B_: o.estimate(A_, B_, Xb, Yb), A1, B1, 1)[0] for o in (cv, plain)])
        pairs = np.array(pairs)
        ratios[radius] = pairs[:, 0].var(0).sum() / pairs[:, 1].var(0).sum()
    assert ratios[1.0] < 0.8 and ratios[1.0] < ratios[0.05] <= 1.0, ratios
    # the loss values too, and on the same prompts the estimate differs from the plain one by L - Lhat_lim
    X, Y = pr.sample_prompts(task, n, P, seed=9)
    delta = float(cv.estimate(A, B, X, Y) - plain.estimate(A, B, X, Y))
    expect = float(task.population_loss(A, B) - pr.limit_losses(A, B, task, X, Y).mean())
    assert delta == pytest.approx(expect, abs=1e-12)


def test_label_noise_only_adds_the_bayes_risk():
    """L_n with noise sigma = L_n without noise + k sigma^2 / 2 (same tokens; noise independent of the layer)."""
    clean = al.Task.random(3, 2, cond=5.0, signal=1.0, seed=2)
    noisy = al.Task(clean.Sigma, clean.M, noise_std=0.3)
    A, B, _ = al.random_manifold_point(clean, seed=1)
    Xn, Yn = pr.sample_prompts(noisy, 16, 3000, seed=6)
    Yc = Xn @ clean.M.T
    d = pr.prompt_losses(A, B, Xn, Yn) - pr.prompt_losses(A, B, Xn, Yc)
    assert abs(float(d.mean()) - noisy.bayes_risk) < 4 * float(d.std()) / len(d) ** 0.5


def test_excess_ustat_is_unbiased_where_the_naive_estimate_is_not():
    rng = np.random.default_rng(0)
    S = np.diag([2.0, 1.0, 0.5])
    ER = np.array([[0.03, -0.01, 0.02], [0.0, 0.01, -0.02]])
    truth = 0.5 * np.trace(ER @ S @ ER.T)
    us, naive, ses = [], [], []
    for _ in range(2000):
        Rs = ER + 0.05 * rng.standard_normal((6, 2, 3))
        e = st.excess_ustat(Rs, torch.tensor(S))
        us.append(e["excess"])
        naive.append(e["naive"])
        ses.append(e["se"])
    us = np.array(us)
    assert abs(us.mean() - truth) < 4 * us.std() / np.sqrt(len(us))
    noise_bias = 0.5 * 0.05**2 * np.trace(S) * 2 / 6  # tr(Cov(mean R) S) / 2
    assert np.mean(naive) == pytest.approx(truth + noise_bias, rel=0.05)
    assert np.median(ses) == pytest.approx(us.std(), rel=0.25)  # the jackknife error is about right
    with pytest.raises(ValueError, match="Rs"):
        st.excess_ustat([ER], S)
    with pytest.raises(ValueError, match="Sigma"):
        st.excess_ustat([ER, ER], np.eye(2))


def test_chain_is_reproducible_and_stays_near_the_minimum_set(task):
    kw = dict(steps=12, burn_in=4, prompts=8, seed=3)
    a = al.run_chain(task, 16, **kw)
    b = al.run_chain(task, 16, **kw)
    assert np.array_equal(a.R, b.R) and a.batches == 13
    assert a.R.shape == (2, 3) and 0 < a.naive_excess < 0.05
    assert a.test_excess > 0  # the finite layer at length 16 is worse than its limit
    assert a.history.steps == [0, 10, 12]
    c = al.run_chain(task, 16, renormalize="cap", nu_cap=0.2, **kw)
    assert c.nu == pytest.approx(0.2, rel=1e-6)  # the cap holds the softmax scale
    assert a.nu == pytest.approx(float(task.svd[1][0]), rel=0.15)  # balance: s_1 of the product, near s_1(T)


def test_chain_on_the_population_limit_is_exact():
    """With a very long context the finite-n correction vanishes: a chain from the minimum stays there."""
    task = al.Task.random(2, 1, cond=2.0, signal=0.2, seed=0)
    r = al.run_chain(task, 512, steps=6, burn_in=2, prompts=2, seed=0)
    assert r.naive_excess < 1e-4


def test_validation(task):
    with pytest.raises(ValueError, match="burn_in"):
        al.run_chain(task, 16, steps=5, burn_in=5, prompts=2, seed=0)
    with pytest.raises(ValueError, match="X"):
        pr.batched_attention(torch.eye(2), torch.eye(2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="task"):
        pr.sample_prompts("task", 4, 2, seed=0)
    with pytest.raises(ValueError, match="seed"):
        al.run_chain(task, 16, steps=5, burn_in=1, prompts=2)


def test_float32_attention_leaves_the_estimator_unchanged(task):
    """Matched seeds, float32 attention (float64 sums and control variate) vs float64: the U-statistic excess
    moves by a tiny fraction of its standard error and the spread of the chains' residuals is the same."""
    kw = dict(steps=16, burn_in=6, prompts=8)
    R = {}
    for dtype in (torch.float64, torch.float32):
        R[dtype] = [al.run_chain(task, 32, seed=100 + c, attention_dtype=dtype, **kw).R for c in range(6)]
    e64, e32 = st.excess_ustat(R[torch.float64], task), st.excess_ustat(R[torch.float32], task)
    assert e64["se"] > 0 and abs(e32["excess"] - e64["excess"]) < 1e-3 * e64["se"]
    assert e32["se"] == pytest.approx(e64["se"], rel=1e-3)
    v64 = np.var(np.array(R[torch.float64]), axis=0, ddof=1).sum()
    v32 = np.var(np.array(R[torch.float32]), axis=0, ddof=1).sum()
    assert v32 == pytest.approx(v64, rel=1e-3)
    assert not np.array_equal(R[torch.float64][0], R[torch.float32][0])  # float32 really ran
