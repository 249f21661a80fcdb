r"""The loss landscape: symmetries, stationary points, Hessians, slices and local diagnostics.

Work in the coordinates ``(At, C)`` of :mod:`attnlib.geometry`, where the excess
population loss is ``f(At, C) = 1/2 ||At C - T||_F^2``.

* Symmetry: ``(At, C) -> (At G, G^{-1} C)`` for invertible ``G`` leaves ``At C``
  and hence ``L`` unchanged (:func:`apply_symmetry`).
* Stationary points: for a subset ``J`` of the singular triplets of ``T``,
  ``(U_J S_J^{1/2} W_J^T, W_J S_J^{1/2} V_J^T)`` with orthonormal ``W_J`` has
  ``At C = T_J`` (the truncated SVD over ``J``); the gradient ``(E C^T, At^T E)``
  with ``E = T_J - T`` vanishes because ``E`` is orthogonal to the kept singular
  vectors. ``J`` = all gives the global minima, ``J`` = {} gives ``(0, 0)``.
* Diagnostics near the minima: one-point strong-convexity and smoothness
  ratios (:func:`one_point_ratios`) and the split of a step into its part
  along the rotation orbit and the rest (:func:`orbit_tangent_part`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence, Tuple

import numpy as np
import torch

from ._validate import check_matrix, check_nonneg_float, check_positive_int
from .geometry import (
    SigmaLike,
    from_factor,
    perturb,
    project_to_manifold,
    random_manifold_point,
    regularizer,
    to_factor,
)
from .rng import derive_seed
from .task import Task

__all__ = [
    "apply_symmetry",
    "stationary_point",
    "hessian",
    "classify_hessian",
    "landscape_slice",
    "one_point_ratios",
    "sample_one_point_ratios",
    "orbit_tangent_part",
]


def apply_symmetry(A, B, G, Sigma: SigmaLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """Apply the symmetry ``(At, C) -> (At G, G^{-1} C)`` and return the new ``(A, B)``."""
    At, C = to_factor(A, B, Sigma)
    G = check_matrix(G, "G", (At.shape[1], At.shape[1])).to(At)
    try:
        Ginv = torch.linalg.inv(G)
    except RuntimeError as exc:
        raise ValueError("G: expected an invertible matrix") from exc
    return from_factor(At @ G, Ginv @ C, Sigma)


def stationary_point(task: Task, subset: Iterable[int], W: Optional[torch.Tensor] = None):
    """The stationary point of ``L`` built from the singular triplets ``subset`` of ``T``.

    ``W`` (d x r with orthonormal columns; default ``V``, the right singular
    vectors of ``T``) supplies the free directions; only its columns in
    ``subset`` are used. Returns ``(A, B)``.
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
    ``"perturbation"`` of :func:`~attnlib.rng.derive_seed`). Returns a dict of numpy arrays."""
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
