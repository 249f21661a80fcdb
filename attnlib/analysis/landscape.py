r"""The loss landscape: symmetries, stationary points, Hessians, slices and local diagnostics.

Work in the coordinates ``(At, C)`` of :mod:`attnlib.geometry`, where the excess
population loss is ``f(At, C) = 1/2 ||At C - T||_F^2``.

* Symmetry: ``(At, C) -> (At G, G^{-1} C)`` for invertible ``G`` leaves ``At C``
  and hence the population loss ``L`` unchanged (:func:`attnlib.geometry.apply_symmetry`). It is
  *not* a symmetry of the finite-n loss, not even for orthogonal ``G = O``: in
  whitened tokens ``z = Sigma^{-1/2} x`` the score ``x_i^T B x_j`` is ``z_i^T C^T z_j``
  and becomes ``z_i^T C^T O z_j``. For ``j != i`` the scores and values a query
  sees keep their joint law (``O z_j`` has the law of ``z_j`` and is independent of
  ``z_i``), but the self-score ``x_i^T B x_i`` changes its law (mean ``tr(C)`` becomes
  ``tr(C^T O)``; :func:`score_moments`), so the expected finite-n loss changes by
  a term of order ``1/n`` (:func:`paired_loss_difference`).
* Stationary points of ``f`` (``lambda = 0``): for a subset ``J`` of the singular
  triplets of ``T``, ``(U_J S_J^{1/2} W_J^T, W_J S_J^{1/2} V_J^T)`` with orthonormal
  ``W_J`` (:func:`stationary_point`; ``J`` = all gives the global minima, ``J`` = {}
  gives ``(0, 0)``); the points with one factor zero, ``(0, C)`` with ``C V = 0`` and
  ``(At, 0)`` with ``At^T U = 0`` (:func:`zero_factor_stationary_point`); and their
  images under the symmetry group. Every stationary point of ``f`` that is not a
  global minimum has a negative Hessian eigenvalue (:func:`negative_curvature_bound`).
  Repeated singular values of ``T`` and ``rank T < k`` are allowed throughout.
* Diagnostics near the minima: one-point strong-convexity and smoothness
  ratios (:func:`one_point_ratios`) and the split of a step into its part
  along the rotation orbit and the rest (:func:`orbit_tangent_part`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence, Tuple

import numpy as np
import torch

from .._validate import check_matrix, check_nonneg_float, check_positive_int
from ..geometry import (
    SigmaLike,
    from_factor,
    perturb,
    project_to_manifold,
    random_manifold_point,
    regularizer,
    to_factor,
)
from ..model.task import Task, as_covariance
from ..rng import derive_seed, make_generator

__all__ = [
    "score_moments",
    "paired_loss_difference",
    "stationary_point",
    "zero_factor_stationary_point",
    "negative_curvature_bound",
    "hessian",
    "classify_hessian",
    "landscape_slice",
    "one_point_ratios",
    "sample_one_point_ratios",
    "orbit_tangent_part",
]


def score_moments(B, Sigma: SigmaLike) -> dict:
    r"""Exact mean and variance of the softmax scores ``x_i^T B x_j`` for Gaussian tokens ``x ~ N(0, Sigma)``.

    With ``C = Sigma^{1/2} B^T Sigma^{1/2}`` (so that ``x_i^T B x_j = z_i^T C^T z_j`` for whitened
    ``z = Sigma^{-1/2} x``):

    * self-score ``x_i^T B x_i``: mean ``tr(B Sigma) = tr C``, variance
      ``tr(B Sigma B^T Sigma) + tr(B Sigma B Sigma) = ||C||_F^2 + tr(C^2)``;
    * cross score ``x_i^T B x_j``, ``i != j``: mean ``0``, variance ``tr(B Sigma B^T Sigma) = ||C||_F^2``.

    Under the rotation ``(At, C) -> (At O, O^T C)`` the cross moments are unchanged and the
    self-score moments are not (``tr C`` becomes ``tr(C^T O)``). Returns a dict of floats with keys
    ``self_mean``, ``self_var``, ``cross_mean``, ``cross_var``.
    """
    S = as_covariance(Sigma)
    B = check_matrix(B, "B", (S.shape[0], S.shape[0])).to(S)
    BS = B @ S
    fro = float(torch.trace(BS @ B.T @ S))  # ||C||_F^2
    return {
        "self_mean": float(torch.trace(BS)),
        "self_var": fro + float(torch.trace(BS @ BS)),
        "cross_mean": 0.0,
        "cross_var": fro,
    }


def paired_loss_difference(
    theta1, theta2, task: Task, n: int, *, n_prompts: int, seed: int = 0, chunk: Optional[int] = None
) -> dict:
    r"""Monte Carlo estimate of ``L_n(A2, B2) - L_n(A1, B1)``, ``L_n = E_X[Lhat_n]`` over prompts of ``n`` tokens.

    ``theta1 = (A1, B1)`` and ``theta2 = (A2, B2)`` are the two parameter points.

    Both parameter points are evaluated on the same ``n_prompts`` independent prompts (common
    random numbers), so the standard error of the difference is much smaller than that of
    either loss. Prompts are drawn in blocks of ``chunk`` (default: as many as keep a block's
    ``chunk * n * n`` scores below about ``2^22``); block ``b`` is
    ``task.sample(chunk * n, seed=derive_seed(seed, "paired-prompts", b))`` reshaped to
    ``(chunk, n, d)`` (the last block may be shorter). Returns a dict of floats: ``loss1``,
    ``loss2`` (the two Monte Carlo means), ``diff`` (their difference) and ``se`` (the standard
    error of ``diff``).
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    n = check_positive_int(n, "n")
    n_prompts = check_positive_int(n_prompts, "n_prompts")
    if n_prompts < 2:
        raise ValueError(f"n_prompts: expected at least 2 (for a standard error), got {n_prompts}")
    if chunk is None:
        chunk = max(1, min(n_prompts, (1 << 22) // (n * n)))
    chunk = check_positive_int(chunk, "chunk")
    k, d = task.k, task.d
    params = []
    for name_a, name_b, (A, B) in (("A1", "B1", theta1), ("A2", "B2", theta2)):
        A = check_matrix(A, name_a, (k, d)).to(task.Sigma)
        B = check_matrix(B, name_b, (d, d)).to(task.Sigma)
        params.append((A, B))
    l1, l2 = [], []
    done, block = 0, 0
    with torch.no_grad():
        while done < n_prompts:
            m = min(chunk, n_prompts - done)
            X, Y = task.sample(m * n, seed=derive_seed(seed, "paired-prompts", block))
            X, Y = X.reshape(m, n, d), Y.reshape(m, n, k)
            for (A, B), out in zip(params, (l1, l2)):
                F = torch.softmax(X @ B @ X.transpose(1, 2), dim=-1) @ X @ A.T
                out.append(0.5 * ((F - Y) ** 2).sum((1, 2)) / n)
            done += m
            block += 1
    l1, l2 = torch.cat(l1), torch.cat(l2)
    delta = l2 - l1
    return {
        "loss1": float(l1.mean()),
        "loss2": float(l2.mean()),
        "diff": float(delta.mean()),
        "se": float(delta.std() / n_prompts**0.5),
    }


def stationary_point(task: Task, subset: Iterable[int], W: Optional[torch.Tensor] = None):
    """The stationary point of ``L`` built from the singular triplets ``subset`` of ``T``.

    ``subset`` holds 0-based Python indices into ``task.svd`` (the book's index set
    ``J`` is 1-based: ``subset=(0,)`` is ``J = {1}``). With ``T = U S V^T`` the point is
    ``(At, C) = (U_J S_J^{1/2} W_J^T, W_J S_J^{1/2} V_J^T)``; ``W`` (d x r with orthonormal
    columns; default ``V``, the right singular vectors of ``T``) supplies the free
    directions; only its columns in ``subset`` are used. Repeated singular values are
    allowed (the point is then built from the singular vectors ``task.svd`` returns).
    Returns ``(A, B)``.
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    U, s, V = task.svd
    r = len(s)
    J = sorted(set(int(j) for j in subset))
    if any(j < 0 or j >= r for j in J):
        raise ValueError(f"subset: expected indices in 0..{r - 1}, got {J}")
    if W is None:
        W = V
    W = check_matrix(W, "W", (task.d, r)).to(task.Sigma)
    At = torch.zeros(task.k, task.d, dtype=task.dtype, device=task.device)
    C = torch.zeros(task.d, task.d, dtype=task.dtype, device=task.device)
    if J:
        sh = s[J].sqrt()
        At = (U[:, J] * sh) @ W[:, J].T
        C = (W[:, J] * sh) @ V[:, J].T
    return from_factor(At, C, task)


def zero_factor_stationary_point(
    task: Task,
    zero: str = "At",
    *,
    Z: Optional[torch.Tensor] = None,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
):
    r"""A stationary point of ``f`` with one factor zero; returns ``(A, B)``.

    ``zero="At"``: ``(At, C) = (0, Z (I - V V^T))``, so that ``C V = 0`` (``Z``: d x d).
    ``zero="C"``: ``(At, C) = ((I - U U^T) Z, 0)``, so that ``At^T U = 0`` (``Z``: k x d; the
    point is ``(0, 0)`` when ``rank T = k``).
    Here ``T = U S V^T`` is the thin SVD (``task.svd``). The gradient ``(E C^T, At^T E)`` of
    ``f = 1/2 ||At C - T||_F^2`` vanishes: with ``At = 0`` it is ``(-T C^T, 0)`` and ``T C^T = 0``
    iff ``C V = 0``; likewise with ``C = 0``. With the balancing regularizer (``lam > 0``) such a
    point is stationary only if it is ``(0, 0)`` (the gradient of ``R`` in ``C`` at ``(0, C)`` is
    ``lam C C^T C``). ``Z`` defaults to a standard Gaussian matrix from ``seed``/``generator``.
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    if zero not in ("At", "C"):
        raise ValueError(f"zero: expected 'At' or 'C', got {zero!r}")
    U, _, V = task.svd
    k, d = task.k, task.d
    shape = (d, d) if zero == "At" else (k, d)
    if Z is None:
        g = make_generator(seed, generator)
        Z = torch.randn(shape, generator=g, dtype=torch.float64)
    Z = check_matrix(Z, "Z", shape).to(task.Sigma)
    if zero == "At":
        At = torch.zeros(k, d, dtype=task.dtype, device=task.device)
        C = Z - (Z @ V) @ V.T
    else:
        At = Z - U @ (U.T @ Z)
        C = torch.zeros(d, d, dtype=task.dtype, device=task.device)
    return from_factor(At, C, task)


def _kernel_basis(M: torch.Tensor, rtol: float) -> torch.Tensor:
    """Orthonormal basis (columns) of the numerical null space of ``M`` (rows x d)."""
    d = M.shape[1]
    _, sv, Vh = torch.linalg.svd(M, full_matrices=True)
    scale = max(float(sv[0]) if sv.numel() else 0.0, 1.0)
    rank = int((sv > rtol * scale).sum())
    return Vh[rank:d].T


def negative_curvature_bound(A, B, task: Task, *, rtol: float = 1e-10) -> float:
    r"""An upper bound on the smallest eigenvalue of the Hessian of ``f`` (``lambda = 0``) in ``(At, C)``.

    With ``E = At C - T`` and its top singular triplet ``(sigma, u, v)``: for a unit ``w`` with
    ``C^T w = 0``, the Hessian restricted to the directions ``(alpha u w^T, beta w v^T)`` is
    ``[[0, sigma], [sigma, a]]`` (up to the sign of ``alpha``) with ``a = ||At w||^2``, whose smaller
    eigenvalue is ``(a - sqrt(a^2 + 4 sigma^2)) / 2``; symmetrically for ``At w = 0`` with
    ``a = ||C^T w||^2``. The bound minimizes ``a`` over unit ``w`` in the numerical kernels of
    ``C^T`` and of ``At`` (singular values below ``rtol * max(1, s_max)``). It is ``< 0`` whenever
    ``E != 0`` and one of the kernels is nontrivial, which holds at every stationary point that is
    not a global minimum (``E C^T = 0`` with ``E != 0`` makes ``C`` singular). Returns
    ``inf`` when both kernels are trivial (no bound from this construction) and ``0.0`` when
    ``E = 0``.
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    rtol = check_nonneg_float(rtol, "rtol")
    At, C = to_factor(A, B, task)
    E = At @ C - task.T
    sigma = float(torch.linalg.matrix_norm(E, ord=2))
    if sigma <= rtol * max(1.0, float(torch.linalg.matrix_norm(task.T, ord=2))):
        return 0.0
    best = float("inf")
    for kernel_of, weight in ((C.T, At), (At, C.T)):
        Kb = _kernel_basis(kernel_of, rtol)
        if Kb.shape[1] == 0:
            continue
        MK = weight @ Kb  # ||weight w||^2 over unit w in the kernel: smallest eigenvalue of MK^T MK
        a = max(float(torch.linalg.eigvalsh(MK.T @ MK)[0]), 0.0)
        best = min(best, 0.5 * (a - (a * a + 4 * sigma * sigma) ** 0.5))
    return best


def hessian(A, B, task: Task, *, lam: float = 0.0, coords: str = "factor") -> torch.Tensor:
    """Hessian of ``Q = L + R_lam`` at ``(A, B)`` as a dense matrix.

    ``coords="factor"``: with respect to ``(At, C)`` flattened (the P-geometry);
    ``coords="original"``: with respect to ``(A, B)``. Size
    ``(k d + d^2) x (k d + d^2)``.
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    if coords not in ("factor", "original"):
        raise ValueError(f"coords: expected 'factor' or 'original', got {coords!r}")
    k, d = task.k, task.d
    if coords == "factor":
        x0 = torch.cat([t.reshape(-1) for t in to_factor(A, B, task)])
    else:
        x0 = torch.cat([check_matrix(A, "A", (k, d)).reshape(-1), check_matrix(B, "B", (d, d)).reshape(-1)])
    x0 = x0.to(task.Sigma).detach()

    def f(x):
        P1, P2 = x[: k * d].reshape(k, d), x[k * d :].reshape(d, d)
        A_, B_ = from_factor(P1, P2, task) if coords == "factor" else (P1, P2)
        val = task.excess_risk(A_, B_)
        if lam:
            val = val + regularizer(A_, B_, task, lam)
        return val

    return torch.autograd.functional.hessian(f, x0)


def classify_hessian(H: torch.Tensor, tol: float = 1e-8) -> Tuple[str, torch.Tensor]:
    """Classify a stationary point from its Hessian; returns ``(label, eigenvalues)``.

    ``"strict saddle"`` if the smallest eigenvalue is below ``-tol * max|eig|``,
    ``"local minimum (degenerate)"`` if all are ``>= -tol`` (flat directions of the
    symmetry group give zero eigenvalues at the minima).
    """
    ev = torch.linalg.eigvalsh(0.5 * (H + H.T))
    scale = float(ev.abs().max()) or 1.0
    label = "strict saddle" if float(ev[0]) < -tol * scale else "local minimum (degenerate)"
    return label, ev


def landscape_slice(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    origin,
    towards,
    across,
    alphas: Sequence[float],
    betas: Sequence[float],
    Sigma: SigmaLike,
) -> torch.Tensor:
    """Values of ``fn(A, B)`` on the plane ``origin + alpha (towards - origin) + beta across``.

    ``origin``, ``towards`` are points ``(A, B)``; ``across`` a direction ``(dA, dB)``.
    The plane is laid in ``(At, C)`` coordinates. Returns a (len(betas), len(alphas)) tensor.
    """
    o = to_factor(*origin, Sigma)
    t = to_factor(*towards, Sigma)
    a = to_factor(*across, Sigma)
    out = torch.empty(len(betas), len(alphas), dtype=o[0].dtype)
    with torch.no_grad():
        for i, b in enumerate(betas):
            for j, al in enumerate(alphas):
                At = o[0] + al * (t[0] - o[0]) + b * a[0]
                C = o[1] + al * (t[1] - o[1]) + b * a[1]
                out[i, j] = fn(*from_factor(At, C, Sigma))
    return out


def one_point_ratios(A, B, task: Task, lam: float = 1.0) -> dict:
    r"""One-point strong-convexity and smoothness ratios of ``Q = L + R_lam`` at ``(A, B)``.

    With ``theta* = proj(theta)`` the P-projection onto the balanced minima and
    ``Delta = theta - theta*``:

    * P-geometry (``grad_P`` is the gradient in ``(At, C)``, i.e. the preconditioned gradient):
      ``alpha_P = <grad_P Q, Delta>_P / ||Delta||_P^2``, ``beta_P = ||grad_P Q||_P^2 / <grad_P Q, Delta>_P``;
    * Euclidean geometry in ``(A, B)`` (same ``Delta``):
      ``alpha_E = <grad Q, Delta> / ||Delta||^2``, ``beta_E = ||grad Q||^2 / <grad Q, Delta>``.

    One-point strong convexity and smoothness hold at the point with constants
    ``alpha <= alpha_*`` and ``beta >= beta_*``; a gradient step of size ``1/beta`` then
    contracts the distance by ``sqrt(1 - alpha/beta)``. ``beta_*`` is ``inf`` when the
    inner product is not positive. Returns a dict with the four ratios and ``dist_P``.
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    lam = check_nonneg_float(lam, "lam")
    A = check_matrix(A, "A", (task.k, task.d)).to(task.Sigma)
    B = check_matrix(B, "B", (task.d, task.d)).to(task.Sigma)
    Ap, Bp = project_to_manifold(A, B, task)
    A_ = A.detach().clone().requires_grad_(True)
    B_ = B.detach().clone().requires_grad_(True)
    Q = task.excess_risk(A_, B_) + regularizer(A_, B_, task, lam)
    gA, gB = torch.autograd.grad(Q, (A_, B_))
    dA, dB = A - Ap, B - Bp
    Sih = task.Sigma_inv_sqrt
    gAt, gC = gA @ Sih, Sih @ gB.T @ Sih  # gradient with respect to (At, C)
    dAt, dC = to_factor(dA, dB, task)
    ipP = float((gAt * dAt).sum() + (gC * dC).sum())
    d2P = float((dAt**2).sum() + (dC**2).sum())
    g2P = float((gAt**2).sum() + (gC**2).sum())
    ipE = float((gA * dA).sum() + (gB * dB).sum())
    d2E = float((dA**2).sum() + (dB**2).sum())
    g2E = float((gA**2).sum() + (gB**2).sum())
    inf = float("inf")
    return {
        "dist_P": d2P**0.5,
        "alpha_P": ipP / d2P if d2P > 0 else inf,
        "beta_P": g2P / ipP if ipP > 0 else inf,
        "alpha_E": ipE / d2E if d2E > 0 else inf,
        "beta_E": g2E / ipE if ipE > 0 else inf,
    }


def sample_one_point_ratios(task: Task, radius: float, n_samples: int, *, lam: float = 1.0, seed: int = 0) -> dict:
    """:func:`one_point_ratios` at ``n_samples`` random points: a random balanced minimum moved by a
    random direction of P-norm ``radius`` (point ``i`` uses the streams ``"manifold"`` and
    ``"perturbation"`` of ``attnlib.derive_seed``). Returns a dict of numpy arrays."""
    n_samples = check_positive_int(n_samples, "n_samples")
    out = {k: [] for k in ("dist_P", "alpha_P", "beta_P", "alpha_E", "beta_E")}
    for i in range(int(n_samples)):
        A, B, _ = random_manifold_point(task, seed=derive_seed(seed, "manifold", i))
        A, B = perturb(A, B, task, radius, seed=derive_seed(seed, "perturbation", i))
        for key, val in one_point_ratios(A, B, task, lam).items():
            out[key].append(val)
    return {k: np.asarray(v) for k, v in out.items()}


def orbit_tangent_part(A, B, dA, dB, Sigma: SigmaLike) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Split a step ``(dA, dB)`` at ``(A, B)`` into its part along the rotation orbit and the rest.

    The orbit ``(At O, O^T C)``, ``O`` orthogonal, has tangent space
    ``{(At K, -K C) : K = -K^T}`` in the coordinates ``(At, C)``. Returns the P-norms
    ``(along, across)`` of the P-orthogonal projection of the step onto that
    tangent space and of the remainder.
    """
    At, C = to_factor(A, B, Sigma)
    dAt, dC = to_factor(dA, dB, Sigma)
    d = At.shape[1]
    cols = []
    for i in range(d):
        for j in range(i + 1, d):
            K = torch.zeros(d, d, dtype=At.dtype, device=At.device)
            K[i, j], K[j, i] = 1.0, -1.0
            cols.append(torch.cat([(At @ K).reshape(-1), (-K @ C).reshape(-1)]))
    v = torch.cat([dAt.reshape(-1), dC.reshape(-1)])
    if not cols:
        return v.new_zeros(()), torch.linalg.norm(v)
    Tm = torch.stack(cols, 1)
    coef = torch.linalg.lstsq(Tm, v[:, None]).solution
    along = Tm @ coef[:, 0]
    return torch.linalg.norm(along), torch.linalg.norm(v - along)
