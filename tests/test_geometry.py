"""Manifold of balanced minima, Procrustes projection, renormalization, spectral init."""

import pytest
import torch

import attnlib as al


def task_with_svd(d, k, s, *, cond=30.0, seed=0):
    """A task whose T = M Sigma^{1/2} has the singular values ``s`` (repeats and rank < k allowed)."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    U, _ = torch.linalg.qr(torch.randn(k, len(s), generator=g, dtype=f64))
    V, _ = torch.linalg.qr(torch.randn(d, len(s), generator=g, dtype=f64))
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=f64))
    Sigma = (Q * torch.logspace(0, torch.log10(torch.tensor(cond)).item(), d, dtype=f64)) @ Q.T
    return al.Task(Sigma, (U * torch.tensor(s, dtype=f64)) @ V.T @ al.sym_inv_sqrt(Sigma))


@pytest.fixture(
    params=[(5, 3, None), (6, 2, None), (5, 4, 2), (6, 4, (1.0, 1.0, 0.5))], ids=["d5k3", "d6k2", "d5k4r2", "d6k4rep"]
)
def gtask(request):
    d, k, r = request.param
    if isinstance(r, tuple):  # repeated singular values, rank 3 < k = 4
        return task_with_svd(d, k, r, seed=d + k)
    return al.Task.random(d, k, cond=30.0, signal=1.5, rank=r, seed=d + k)


def test_every_balanced_minimum_is_on_the_manifold_with_repeated_singular_values():
    task = task_with_svd(6, 4, (1.0, 1.0, 0.5), seed=1)
    U, s, V = task.svd
    assert task.rank == 3 < task.k and abs(float(s[0] - s[1])) < 1e-12
    g = torch.Generator().manual_seed(2)
    f64 = torch.float64
    # (i) from another SVD of T: rotate the singular vectors of the repeated pair
    c, sn = 0.6, 0.8
    Qb = torch.eye(3, dtype=f64)
    Qb[:2, :2] = torch.tensor([[c, -sn], [sn, c]], dtype=f64)
    U2, V2 = U @ Qb, V @ Qb
    assert torch.allclose((U2 * s) @ V2.T, task.T, atol=1e-12)
    W, _ = torch.linalg.qr(torch.randn(6, 3, generator=g, dtype=f64))
    sh = s.sqrt()
    A, B = al.from_factor((U2 * sh) @ W.T, (W * sh) @ V2.T, task)
    # (ii) the balanced re-factorization of a minimum moved by a general G
    Am, Bm, _ = al.random_manifold_point(task, seed=3)
    G = torch.eye(6, dtype=f64) + 0.3 * torch.randn(6, 6, generator=g, dtype=f64)
    A3, B3 = al.renormalize(*al.apply_symmetry(Am, Bm, G, task), task, "balance")
    for A_, B_ in ((A, B), (A3, B3)):
        At, C = al.to_factor(A_, B_, task)
        assert float(task.excess_risk(A_, B_)) < 1e-20 and torch.allclose(At.T @ At, C @ C.T, atol=1e-10)
        assert float(al.distance_to_manifold(A_, B_, task)) < 1e-10  # it is (U S^1/2 W^T, W S^1/2 V^T) for some W


def test_manifold_points_are_balanced_minima_at_distance_zero(gtask):
    for s in range(3):
        A, B, W = al.random_manifold_point(gtask, seed=s)
        At, C = al.to_factor(A, B, gtask)
        assert float(gtask.excess_risk(A, B)) < 1e-24
        assert torch.allclose(At.T @ At, C @ C.T, atol=1e-12)
        assert float(al.distance_to_manifold(A, B, gtask)) < 1e-10


def test_distance_is_invariant_along_the_orbit(gtask):
    A, B = al.perturb(*al.random_manifold_point(gtask, seed=1)[:2], gtask, 0.4, seed=2)
    At, C = al.to_factor(A, B, gtask)
    d0 = float(al.distance_to_manifold(A, B, gtask))
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        O, _ = torch.linalg.qr(torch.randn(gtask.d, gtask.d, generator=g, dtype=torch.float64))
        A2, B2 = al.from_factor(At @ O, O.T @ C, gtask)
        assert float(al.distance_to_manifold(A2, B2, gtask)) == pytest.approx(d0, rel=1e-10)
        assert float(gtask.population_loss(A2, B2)) == pytest.approx(float(gtask.population_loss(A, B)))


def test_projection_lands_on_the_manifold_and_is_closer_than_the_start(gtask):
    A, B = al.perturb(*al.random_manifold_point(gtask, seed=3)[:2], gtask, 0.5, seed=4)
    Ap, Bp = al.project_to_manifold(A, B, gtask)
    assert float(al.distance_to_manifold(Ap, Bp, gtask)) < 1e-10
    assert float(al.p_norm(A - Ap, B - Bp, gtask)) == pytest.approx(float(al.distance_to_manifold(A, B, gtask)))
    assert float(al.distance_to_manifold(A, B, gtask)) <= 0.5 + 1e-12


def _brute_force_distance(task, A, B, restarts=8, iters=300):
    """min over Stiefel W = Z (Z^T Z)^{-1/2} by LBFGS over the free matrix Z, from random starts."""
    At, C = al.to_factor(A, B, task)
    U, s, V = task.svd
    sh = s.sqrt()
    best = float("inf")
    g = torch.Generator().manual_seed(0)
    for _ in range(restarts):
        Z = torch.randn(task.d, len(s), generator=g, dtype=torch.float64).requires_grad_()
        opt = torch.optim.LBFGS(
            [Z], max_iter=iters, tolerance_grad=1e-14, tolerance_change=1e-16, line_search_fn="strong_wolfe"
        )

        def value():
            W = Z @ al.sym_inv_sqrt(Z.T @ Z)  # smooth polar retraction onto the Stiefel manifold
            return ((At - (U * sh) @ W.T) ** 2).sum() + ((C - (W * sh) @ V.T) ** 2).sum()

        def closure():
            opt.zero_grad()
            f = value()
            f.backward()
            return f

        opt.step(closure)
        with torch.no_grad():
            best = min(best, float(value()))
    return best**0.5


@pytest.mark.parametrize("radius", [0.1, 1.0, 3.0])
def test_distance_equals_brute_force_minimization(gtask, radius):
    A, B = al.perturb(*al.random_manifold_point(gtask, seed=5)[:2], gtask, radius, seed=6)
    exact = float(al.distance_to_manifold(A, B, gtask))
    brute = _brute_force_distance(gtask, A, B)
    assert brute >= exact - 1e-8  # Procrustes is a global minimum
    assert brute == pytest.approx(exact, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("mode", ["equalize", "balance"])
def test_renormalize_keeps_the_product(gtask, mode):
    g = torch.Generator().manual_seed(2)
    A = torch.randn(gtask.k, gtask.d, generator=g, dtype=torch.float64) * 3
    B = torch.randn(gtask.d, gtask.d, generator=g, dtype=torch.float64) * 0.1
    A2, B2 = al.renormalize(A, B, gtask, mode)
    At, C = al.to_factor(A, B, gtask)
    At2, C2 = al.to_factor(A2, B2, gtask)
    assert torch.allclose(At @ C, At2 @ C2, atol=1e-10)
    assert float(gtask.population_loss(A2, B2)) == pytest.approx(float(gtask.population_loss(A, B)), rel=1e-10)
    if mode == "equalize":
        assert float(torch.linalg.norm(At2)) == pytest.approx(float(torch.linalg.norm(C2)), rel=1e-12)
    else:
        assert torch.allclose(At2.T @ At2, C2 @ C2.T, atol=1e-10)
        nuc = float(torch.linalg.svdvals(At @ C).sum())
        assert float((C2**2).sum()) == pytest.approx(nuc, rel=1e-10)
        # least total norm among factorizations of the product: (||At||^2 + ||C||^2) / 2 = ||P||_*
        assert 0.5 * float((At2**2).sum() + (C2**2).sum()) == pytest.approx(nuc, rel=1e-10)
        assert float((At2**2).sum() + (C2**2).sum()) <= float((At**2).sum() + (C**2).sum()) + 1e-12
        # the softmax scale of the balanced factorization is set by the product: lambda_max(C^T C) = s_1(P)
        s1 = float(torch.linalg.svdvals(At @ C)[0])
        assert float(torch.linalg.eigvalsh(C2.T @ C2)[-1]) == pytest.approx(s1, rel=1e-10)
        # but ||C||_F^2 alone is not minimal: (2 At, C / 2) factors the same product with a quarter of it
        assert float(((C2 / 2) ** 2).sum()) < float((C2**2).sum())
        assert torch.allclose((2 * At2) @ (C2 / 2), At @ C, atol=1e-10)


def test_balanced_factorization_minimises_the_total_norm(gtask):
    g = torch.Generator().manual_seed(3)
    A = torch.randn(gtask.k, gtask.d, generator=g, dtype=torch.float64)
    B = torch.randn(gtask.d, gtask.d, generator=g, dtype=torch.float64)
    Ab, Bb = al.renormalize(A, B, gtask, "balance")
    At, C = al.to_factor(Ab, Bb, gtask)
    best = 0.5 * float((At**2).sum() + (C**2).sum())
    for _ in range(200):  # every other factorization (At G, G^{-1} C) has at least this total norm
        G = torch.randn(gtask.d, gtask.d, generator=g, dtype=torch.float64)
        other = 0.5 * float(((At @ G) ** 2).sum() + ((torch.linalg.inv(G) @ C) ** 2).sum())
        assert other >= best - 1e-9


def test_renormalize_of_an_overflowing_product_is_nan(gtask):
    """A diverging iterate whose product overflows has no renormalization: NaN, so the training guard stops."""
    A = torch.full((gtask.k, gtask.d), 1e200, dtype=torch.float64)
    B = torch.full((gtask.d, gtask.d), 1e200, dtype=torch.float64)
    A2, B2 = al.renormalize(A, B, gtask, "balance")
    assert torch.isnan(A2).all() and torch.isnan(B2).all()


def test_spectral_init_is_balanced_and_exact_on_its_empirical_manifold():
    task = al.Task.random(6, 3, cond=20.0, signal=1.0, noise_std=0.5, seed=4)
    X, Y = task.sample(500, seed=5)
    A0, B0 = al.spectral_init(X, Y)
    emp = al.empirical_task(X, Y)
    At, C = al.to_factor(A0, B0, emp)
    assert torch.allclose(At.T @ At, C @ C.T, atol=1e-12)
    assert float(al.distance_to_manifold(A0, B0, emp)) < 1e-12
    assert torch.allclose(A0 @ emp.Sigma @ B0.T, emp.M, atol=1e-12)
    # and close (not equal) to the population manifold
    d_pop = float(al.distance_to_manifold(A0, B0, task))
    assert 1e-4 < d_pop < 0.5


def test_spectral_init_improves_with_n():
    task = al.Task.random(5, 2, cond=10.0, signal=1.0, noise_std=0.5, seed=1)
    ex = []
    for n in (100, 10_000):
        vals = [float(task.excess_risk(*al.spectral_init(*task.sample(n, seed=s)))) for s in range(5)]
        ex.append(sum(vals) / len(vals))
    assert ex[1] < ex[0] / 20


def test_spectral_init_rank_truncation():
    task = al.Task.random(6, 4, cond=5.0, signal=1.0, rank=2, noise_std=0.05, seed=2)
    X, Y = task.sample(2000, seed=3)
    A0, B0 = al.spectral_init(X, Y, rank=2)
    At, C = al.to_factor(A0, B0, al.empirical_task(X, Y))
    assert al.numerical_rank(At @ C) == 2
    assert float(al.distance_to_manifold(A0, B0, task)) < 0.1
