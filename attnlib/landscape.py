r"""The loss landscape: symmetries, stationary points, Hessians and slices.

Work in the coordinates ``(At, C)`` of :mod:`attnlib.geometry`, where the excess
population loss is ``f(At, C) = 1/2 ||At C - T||_F^2``.

* Symmetry: ``(At, C) -> (At G, G^{-1} C)`` for invertible ``G`` leaves ``At C``
  and hence ``L`` unchanged (:func:`act`).
* Stationary points: for a subset ``J`` of the singular triplets of ``T``,
  ``(U_J S_J^{1/2} W_J^T, W_J S_J^{1/2} V_J^T)`` with orthonormal ``W_J`` has
  ``At C = T_J`` (the truncated SVD over ``J``); the gradient ``(E C^T, At^T E)``
  with ``E = T_J - T`` vanishes because ``E`` is orthogonal to the kept singular
  vectors. ``J`` = all gives the global minima, ``J`` = {} gives ``(0, 0)``.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence, Tuple

import torch

from ._validate import check_matrix
from .geometry import SigmaLike, from_factor, regularizer, to_factor
from .task import Task

__all__ = ["act", "stationary_point", "hessian", "classify_hessian", "landscape_slice"]


def act(A, B, G, Sigma: SigmaLike) -> Tuple[torch.Tensor, torch.Tensor]:
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


def hessian(task: Task, A, B, *, lam: float = 0.0, coords: str = "factor") -> torch.Tensor:
    """Hessian of ``Q = L + R_lam`` at ``(A, B)`` as a dense matrix.

    ``coords="factor"``: with respect to ``(At, C)`` flattened (the P-geometry);
    ``coords="original"``: with respect to ``(A, B)``. Size
    ``(k d + d^2) x (k d + d^2)``.
    """
    if coords not in ("factor", "original"):
        raise ValueError(f"coords: expected 'factor' or 'original', got {coords!r}")
    k, d = task.k, task.d
    if coords == "factor":
        x0 = torch.cat([t.reshape(-1) for t in to_factor(A, B, task)])
    else:
        x0 = torch.cat([check_matrix(A, "A", (k, d)).reshape(-1), check_matrix(B, "B", (d, d)).reshape(-1)])
    x0 = x0.to(task.Sigma).detach()

    def f(x):
        P1, P2 = x[: k * d].reshape(k, d), x[k * d:].reshape(d, d)
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


def landscape_slice(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], origin, towards, across,
                    alphas: Sequence[float], betas: Sequence[float], Sigma: SigmaLike) -> torch.Tensor:
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
