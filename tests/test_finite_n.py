"""The finite-n layer averaged over queries: softmax scale, heavy-tail threshold, self-token term, fits."""

import math

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.analysis import stats as st
from attnlib.model import finite_n as fn

f64 = torch.float64


@pytest.fixture(scope="module")
def t2():
    """Chapter 2's task and one of its balanced minima."""
    task = al.Task.random(4, 2, cond=4.0, signal=1.0, noise_std=0.2, seed=3)
    A, B, _ = al.random_manifold_point(task, seed=4)
    return task, A, B


# ---------------------------------------------------------------------------- softmax scale


def test_softmax_scale_known_diagonal_case():
    # Sigma = diag(s), B = diag(b): C = diag(s b), lambda_max(C^T C) = max (s_i b_i)^2
    s = torch.tensor([0.5, 2.0, 1.0], dtype=f64)
    b = torch.tensor([1.0, 0.3, -0.9], dtype=f64)
    A = torch.ones(2, 3, dtype=f64)
    assert fn.softmax_scale(A, torch.diag(b), torch.diag(s)) == pytest.approx(0.81, rel=1e-12)


def test_softmax_scale_is_the_largest_softmax_exponent(t2):
    task, A, B = t2
    lam = fn.softmax_scale(A, B, task)
    # a^T Sigma a = z^T C^T C z for q = Sigma^{1/2} z: the maximum over unit z is lambda_max
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20000, 4, generator=g, dtype=f64)
    z = z / z.norm(dim=1, keepdim=True)
    a = (z @ task.Sigma_sqrt) @ B
    quad = ((a @ task.Sigma) * a).sum(1)
    assert float(quad.max()) <= lam * (1 + 1e-12)
    assert float(quad.max()) > 0.99 * lam


def test_softmax_scale_at_balanced_minima_is_top_singular_value_of_T():
    for seed in range(3):
        task = al.Task.random(6, 3, cond=10.0, signal=1.0, seed=seed)
        s1 = float(task.svd[1][0])
        for w in range(3):
            A, B, _ = al.random_manifold_point(task, seed=10 + w)
            assert fn.softmax_scale(A, B, task) == pytest.approx(s1, rel=1e-10)


def test_softmax_scale_validates(t2):
    task, A, B = t2
    with pytest.raises(ValueError, match="B"):
        fn.softmax_scale(A, B[:3], task)
    with pytest.raises(ValueError, match="A"):
        fn.softmax_scale(A[:, :3], B, task)


# ---------------------------------------------------------------------------- averaged 1/n constant


def test_averaged_error_constant_one_dimensional_closed_form():
    # d = 1: At = alpha sigma, C = sigma^2 b; kappa = E exp(c^2 z^2) alpha^2 sigma^2 (1 + c^2 z^2)
    sigma2, b, alpha = 1.7, 0.3, 0.8
    A, B, Sigma = (
        torch.tensor([[alpha]], dtype=f64),
        torch.tensor([[b]], dtype=f64),
        torch.tensor([[sigma2]], dtype=f64),
    )
    c2 = (sigma2 * b) ** 2
    x, w = np.polynomial.hermite_e.hermegauss(200)  # probabilists' Hermite: weight exp(-z^2/2)
    integrand = np.exp(c2 * x**2) * alpha**2 * sigma2 * (1 + c2 * x**2)
    expected = float(np.sum(w * integrand) / math.sqrt(2 * math.pi))
    assert fn.averaged_error_constant(A, B, Sigma) == pytest.approx(expected, rel=1e-8)


def test_averaged_error_constant_matches_the_average_of_the_fixed_query_constant(t2):
    task, A, B = t2
    A, B = al.orbit_to_scale(A, B, task, 0.15)
    Q, _ = task.sample(400_000, seed=1)
    per_query = al.limit_error_prediction(A, B, task, Q, 1)  # n = 1: the constant itself
    mc, se = float(per_query.mean()), float(per_query.std() / math.sqrt(per_query.numel()))
    assert abs(mc - fn.averaged_error_constant(A, B, task)) < 4 * se


def test_averaged_error_constant_is_infinite_from_the_threshold_on(t2):
    task, A, B = t2
    for scale in (0.5, 0.6, 2.0):
        assert fn.averaged_error_constant(*al.orbit_to_scale(A, B, task, scale), task) == math.inf
    assert math.isfinite(fn.averaged_error_constant(*al.orbit_to_scale(A, B, task, 0.49), task))


def test_averaged_error_exponent(t2):
    task, A, B = t2
    assert fn.averaged_error_exponent(*al.orbit_to_scale(A, B, task, 0.3), task) == (-1.0, -1.0)
    fast, slow = fn.averaged_error_exponent(*al.orbit_to_scale(A, B, task, 1.25), task)
    assert fast == pytest.approx(-0.7) and slow == pytest.approx(-0.4)
    # continuous at the threshold
    fast, slow = fn.averaged_error_exponent(*al.orbit_to_scale(A, B, task, 0.5 + 1e-9), task)
    assert fast == pytest.approx(-1.0, abs=1e-8) and slow == pytest.approx(-1.0, abs=1e-8)


def test_orbit_to_scale_keeps_the_limit_map(t2):
    task, A, B = t2
    A2, B2 = al.orbit_to_scale(A, B, task, 0.2)
    assert fn.softmax_scale(A2, B2, task) == pytest.approx(0.2, rel=1e-12)
    assert torch.allclose(A2 @ task.Sigma @ B2.T, A @ task.Sigma @ B.T, atol=1e-12)
    assert float(task.excess_risk(A2, B2)) == pytest.approx(float(task.excess_risk(A, B)), abs=1e-12)
    with pytest.raises(ValueError, match="nu"):
        al.orbit_to_scale(A, B, task, 0.0)
    with pytest.raises(ValueError, match="B"):
        al.orbit_to_scale(A, torch.zeros(4, 4, dtype=f64), task, 0.5)


# ---------------------------------------------------------------------------- measured errors


def test_query_averaged_error_is_the_fused_layer_on_independent_draws(t2):
    task, A, B = t2
    E = fn.query_averaged_error(A, B, task, [16, 32], n_queries=5, n_seeds=2, seed=7)
    assert E.shape == (2, 2)
    assert torch.equal(E, fn.query_averaged_error(A, B, task, [16, 32], n_queries=5, n_seeds=2, seed=7))
    # recompute one entry by hand with the reference (materializing) layer
    g = fn._stream_generator(7, "query_averaged", 32, 1)
    X, _ = task.sample(32, generator=g)
    Q, _ = task.sample(5, generator=g)
    ref = ((al.attention_reference(A, B, X, queries=Q) - al.attention_limit(A, B, task, Q)) ** 2).sum(1).mean()
    assert float(E[1, 1]) == pytest.approx(float(ref), rel=1e-10)
    # include_self: the queries are the sequence's own first tokens
    Es = fn.query_averaged_error(A, B, task, [32], n_queries=5, n_seeds=2, seed=7, include_self=True)
    ref = ((al.attention_reference(A, B, X)[:5] - al.attention_limit(A, B, task, X[:5])) ** 2).sum(1).mean()
    assert float(Es[0, 1]) == pytest.approx(float(ref), rel=1e-10)


def test_sequences_of_different_lengths_are_not_prefixes(t2):
    task, _, _ = t2
    X64 = task.sample(64, generator=fn._stream_generator(0, "query_averaged", 64, 0))[0]
    X128 = task.sample(128, generator=fn._stream_generator(0, "query_averaged", 128, 0))[0]
    assert not torch.allclose(X64, X128[:64])
    # the same holds for finite_n_error (fixed queries)
    Xa = task.sample(64, generator=fn._stream_generator(0, "finite_n_error", 64, 0))[0]
    Xb = task.sample(128, generator=fn._stream_generator(0, "finite_n_error", 128, 0))[0]
    assert not torch.allclose(Xa, Xb[:64])


def test_query_averaged_error_below_threshold_is_kappa_over_n(t2):
    task, A, B = t2
    A, B = al.orbit_to_scale(A, B, task, 0.2)
    n = 2048
    E = fn.query_averaged_error(A, B, task, [n], n_queries=128, n_seeds=96, seed=3)[0]
    mean, se = float(E.mean()), float(E.std() / math.sqrt(E.numel()))
    kappa = fn.averaged_error_constant(A, B, task)
    assert abs(n * mean - kappa) < 4 * n * se, (n * mean, kappa, n * se)


def test_query_averaged_error_above_threshold_decays_slower_than_one_over_n(t2):
    task, A, B = t2
    ratios = {}
    for scale in (0.2, 1.5):
        Ac, Bc = al.orbit_to_scale(A, B, task, scale)
        E = fn.query_averaged_error(Ac, Bc, task, [64, 2048], n_queries=256, n_seeds=32, seed=5)
        ratios[scale] = float(2048 * E[1].mean() / (64 * E[0].mean()))  # n * error, end over start
    # measured: 1.8 below the threshold (1/n up to sampling noise of about 25% with 32 sequences;
    # kappa / n itself is tested above), 5.7 above it (1/n would give 1)
    assert ratios[1.5] > 2.5, ratios
    assert ratios[1.5] > 2 * ratios[0.2], ratios


def test_query_averaged_error_validates(t2):
    task, A, B = t2
    with pytest.raises(ValueError, match="ns"):
        fn.query_averaged_error(A, B, task, [0])
    with pytest.raises(ValueError, match="ns"):
        fn.query_averaged_error(A, B, task, [])
    with pytest.raises(ValueError, match="n_queries"):
        fn.query_averaged_error(A, B, task, [8], n_queries=0)
    with pytest.raises(ValueError, match="include_self"):
        fn.query_averaged_error(A, B, task, [8], include_self="yes")
    with pytest.raises(ValueError, match="task"):
        fn.query_averaged_error(A, B, task.Sigma, [8])


# ---------------------------------------------------------------------------- self-token term


def test_self_token_errors_are_the_layer_with_and_without_the_own_token(t2):
    task, A, B = t2
    with_self, without = fn.self_token_errors(A, B, task, [40], n_queries=6, n_seeds=2, seed=1)
    X = task.sample(40, generator=fn._stream_generator(1, "query_averaged", 40, 1))[0]
    lim = al.attention_limit(A, B, task, X[:6])
    ref_in = ((al.attention_reference(A, B, X)[:6] - lim) ** 2).sum(1).mean()
    out = torch.stack(
        [al.attention_reference(A, B, torch.cat([X[:i], X[i + 1 :]]), queries=X[i : i + 1])[0] for i in range(6)]
    )
    ref_out = ((out - lim) ** 2).sum(1).mean()
    assert float(with_self[0, 1]) == pytest.approx(float(ref_in), rel=1e-10)
    assert float(without[0, 1]) == pytest.approx(float(ref_out), rel=1e-10)
    # the exact identity f(x_i; X) = (1 - pi_ii) f(x_i; X_{-i}) + pi_ii A x_i
    pi = al.attention_weights(B, X)[:6].diagonal()
    f_in = al.attention(A, B, X)[:6]
    assert torch.allclose(f_in, (1 - pi)[:, None] * out + pi[:, None] * (X[:6] @ A.T), atol=1e-12)
    with pytest.raises(ValueError, match="ns"):
        fn.self_token_errors(A, B, task, [1])


def test_self_token_shift_and_bias_leading_order(t2):
    task, A, B = t2
    A, B = al.orbit_to_scale(A, B, task, 0.5)
    x = torch.tensor([[0.8, -0.4, 0.3, 1.1]], dtype=f64)
    pred = fn.self_token_prediction(A, B, task, x)
    n, R = 1024, 400
    lim = al.attention_limit(A, B, task, x)[0]
    shifts, errs = [], []
    for r in range(R):
        Xo, _ = task.sample(n - 1, seed=1000 + r)
        f_out = al.attention(A, B, Xo, queries=x)[0]
        f_in = al.attention(A, B, torch.cat([Xo, x]), queries=x)[0]
        shifts.append(n * (f_in - f_out))
        errs.append((n - 1) * (f_out - lim))
    shifts, errs = torch.stack(shifts), torch.stack(errs)
    # the shift is nearly deterministic: within 2% of p r
    assert torch.allclose(shifts.mean(0), pred["shift"][0], rtol=0.02, atol=0.02 * float(pred["shift"].norm()))
    # the self-normalization bias -exp(s) A Sigma a / n: within 4 standard errors
    se = errs.std(0) / math.sqrt(R)
    assert bool(((errs.mean(0) - pred["bias"][0]).abs() < 4 * se).all()), (errs.mean(0), pred["bias"], se)


def test_self_token_prediction_validates(t2):
    task, A, B = t2
    with pytest.raises(ValueError, match="queries"):
        fn.self_token_prediction(A, B, task, torch.zeros(3, 5, dtype=f64))


# ---------------------------------------------------------------------------- fits and sweeps


def test_fit_error_exponent_recovers_the_exponent_and_covers_it():
    ns = np.array([256, 512, 1024, 2048, 4096])
    rng = np.random.default_rng(0)
    hits, slopes = 0, []
    reps = 200
    for _ in range(reps):
        # per-sequence values with a skewed spread (chi-square with 3 degrees of freedom)
        E = 5.0 * ns[:, None] ** -0.7 * rng.chisquare(3, size=(len(ns), 24)) / 3
        fit = st.fit_error_exponent(ns, E, n_boot=300, seed=int(rng.integers(1 << 30)))
        hits += fit.ci[0] < -0.7 < fit.ci[1]
        slopes.append(fit.slope)
    assert abs(np.mean(slopes) + 0.7) < 0.01
    # percentile bootstrap with 24 sequences per n: coverage close to the nominal 95%
    assert 0.88 <= hits / reps <= 0.99, hits / reps


def test_fit_error_exponent_validates():
    with pytest.raises(ValueError, match="errors"):
        st.fit_error_exponent([1, 2], np.ones((3, 4)))
    with pytest.raises(ValueError, match="errors"):
        st.fit_error_exponent([1, 2], np.ones((2, 1)))
    with pytest.raises(ValueError, match="errors"):
        st.fit_error_exponent([1, 2], -np.ones((2, 4)))
    with pytest.raises(ValueError, match="level"):
        st.fit_error_exponent([1, 2], np.ones((2, 4)), level=1.5)
