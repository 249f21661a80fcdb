r"""Regime (i): what Algorithm 1 converges to on one sequence, and how fast.

On one sequence ``(X, Y)`` of ``n`` tokens the algorithm of the book is a map ``G`` on the
parameters: a preconditioned gradient step on ``Qhat = Lhat + Rhat`` (plain gradient descent in
the balanced coordinates ``(At, C)`` of ``Sigmahat``), then the renormalization (``"balance"``,
the book's default, or the ``"cap"`` / ``"fix"`` modes of :class:`attnlib.geometry.Renormalization`, for which the
step is taken in the balanced coordinates and the regularizer is off). Without label noise
``Lhat`` has no minimizer (its infimum 0 is approached at infinity, see the book's chapter on
the scaling law), so the iteration's limit is not a critical point of ``Lhat``: it is a fixed
point ``v* = G(v*)`` of "step, then renormalize". This module computes it directly:

* :class:`SequenceMap`: ``G`` on the flattened balanced coordinates ``v = (At, C)`` of one
  sequence, written with differentiable torch operations (the tokens are whitened,
  ``Z = X Sigmahat^{-1/2}``, so ``Sigmahat_Z = I`` and ``(At, C) = (A_Z, B_Z^T)``; the
  renormalization is the Procrustes-balanced factorization of the product, as in
  :func:`attnlib.geometry.renormalize`); one application equals one step of
  ``attnlib.train(method="structured")`` (with the same ``renormalize``), tested;
* :func:`fixed_point`: Newton's method on ``G(v) - v = 0``, the Jacobian from
  ``torch.autograd.functional.jacobian`` in float64, with step halving on the residual;
  the residual ``||G(v) - v||`` is reported;
* :func:`spectrum`: the eigenvalues of the Jacobian at the fixed point, split into the modes the
  renormalization removes (eigenvalue 0: the directions that change the factorization but not
  its balanced representative), the *slow* modes, and the rest; for the slow modes, their
  overlap with the rotations ``(At Omega, -Omega C)`` (``Omega`` skew) of the factorization and
  the curvature ``h`` of ``Lhat`` along those rotations, to compare with ``mu_slow = 1 - eta h``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .._validate import check_nonneg_float, check_positive_int, check_samples
from ..geometry import _check_nu_cap
from ..linalg import sym_inv_sqrt, sym_sqrt
from ..model.task import Task
from ..optim.init import spectral_init

__all__ = ["SequenceMap", "FixedPoint", "fixed_point", "Spectrum", "spectrum", "rotation_basis", "orbit_curvature"]


class IteratedMap:
    """What every map ``G`` of this module shares: its Jacobian and its iterates.

    A subclass defines ``__call__(v, create_graph=None)`` on packed coordinates ``v`` (``k d + d^2``
    entries: ``At`` (k x d) then ``C`` (d x d), with ``self.k`` and ``self.d``).
    """

    def unpack(self, v):
        """``(At, C)`` of the packed ``v``."""
        k, d = self.k, self.d
        return v[: k * d].reshape(k, d), v[k * d :].reshape(d, d)

    @staticmethod
    def pack(At, C):
        """The packed ``v`` of ``(At, C)``."""
        return torch.cat([At.reshape(-1), C.reshape(-1)])

    def jacobian(self, v) -> torch.Tensor:
        """``dG/dv`` at ``v`` (``size x size``), by ``torch.autograd.functional.jacobian``."""
        return torch.autograd.functional.jacobian(lambda u: self(u, create_graph=True), v.detach().clone())

    def iterate(self, v, steps: int):
        """``G`` applied ``steps`` times; returns the list of iterates (``v`` first)."""
        out = [v.detach()]
        for _ in range(int(steps)):
            out.append(self(out[-1], create_graph=False))
        return out


class SequenceMap(IteratedMap):
    """The map ``G`` (step, then renormalize) of Algorithm 1 on one sequence, in balanced coordinates.

    ``G(v)`` takes the flattened ``v = (At, C)`` (``k d + d^2`` entries, coordinates of
    ``Sigmahat = X^T X / n``) to the next iterate. ``lr``: the step size; ``renormalize``/``nu_cap``:
    the renormalization (``"balance"``, ``"cap"`` or ``"fix"``, as in
    :class:`attnlib.geometry.Renormalization`, whose operations it repeats differentiably, for
    Jacobians); ``lam``: the weight of the balancing regularizer, used with ``"balance"`` only (as
    ``attnlib.train(method="structured")`` does; under ``"cap"``/``"fix"`` the regularizer is off by
    default). Everything is differentiable (float64 recommended for Jacobians).
    """

    def __init__(
        self, X, Y, lr: float, *, renormalize: str = "balance", nu_cap: Optional[float] = None, lam: float = 1.0
    ):
        X, Y = check_samples(X, Y)
        self.n, self.d = X.shape
        self.k = Y.shape[1]
        if self.n < self.d:
            raise ValueError(f"X: the structured components need n >= d, got n = {self.n}, d = {self.d}")
        if renormalize not in ("balance", "cap", "fix"):
            raise ValueError(f"renormalize: expected 'balance', 'cap' or 'fix', got {renormalize!r}")
        self.nu_cap = _check_nu_cap(renormalize, nu_cap)
        self.lr = check_nonneg_float(lr, "lr", positive=True)
        self.mode = renormalize
        self.lam = check_nonneg_float(lam, "lam") if renormalize == "balance" else 0.0
        self.X, self.Y = X, Y
        self.Sh = X.T @ X / self.n
        self.Sh_half, self.Sh_inv_half = sym_sqrt(self.Sh), sym_inv_sqrt(self.Sh)
        self.Z = X @ self.Sh_inv_half
        self.size = self.k * self.d + self.d * self.d

    # -- coordinates
    def from_params(self, A, B):
        """``v`` of parameters ``(A, B)`` in the original coordinates."""
        A, B = A.to(self.X), B.to(self.X)
        return self.pack(A @ self.Sh_half, self.Sh_half @ B.T @ self.Sh_half)

    def to_params(self, v):
        """``(A, B)`` in the original coordinates of the flattened ``v``."""
        At, C = self.unpack(v)
        return At @ self.Sh_inv_half, self.Sh_inv_half @ C.T @ self.Sh_inv_half

    # -- objective
    def loss(self, v):
        """``Lhat_n`` at ``v`` (the materialized softmax over the whitened tokens; twice differentiable)."""
        At, C = self.unpack(v)
        Z = self.Z
        pi = torch.softmax(Z @ C.T @ Z.T, dim=1)  # pi_ij from z_i^T C^T z_j = x_i^T B x_j
        out = pi @ Z @ At.T
        return 0.5 * torch.sum((out - self.Y) ** 2) / self.n

    def objective(self, v):
        """``Qhat = Lhat + Rhat`` (``Rhat = lam/4 ||At^T At - C C^T||_F^2``; ``lam = 0`` for cap/fix)."""
        q = self.loss(v)
        if self.lam:
            At, C = self.unpack(v)
            q = q + 0.25 * self.lam * torch.sum((At.T @ At - C @ C.T) ** 2)
        return q

    def renormalize(self, At, C):
        """The balanced (Procrustes) factorization of ``At C``, then the orbit move of ``mode``."""
        P = At @ C
        U, s, Vh = torch.linalg.svd(P, full_matrices=False)
        sh = torch.sqrt(s)
        Us, Vs = U * sh, Vh.T * sh
        Pn, _, Qh = torch.linalg.svd(At.T @ Us + C @ Vs, full_matrices=False)
        W = Pn @ Qh
        Atb, Cb = Us @ W.T, W @ Vs.T
        if self.mode == "balance":
            return Atb, Cb
        t2 = s[0] / self.nu_cap
        if self.mode == "cap":
            t2 = torch.clamp(t2, min=1.0)
        t = torch.sqrt(t2)
        return t * Atb, Cb / t

    def step(self, v, create_graph: bool = False):
        """The gradient step alone (before the renormalization)."""
        if not v.requires_grad:
            v = v.detach().requires_grad_(True)
        g = torch.autograd.grad(self.objective(v), v, create_graph=create_graph)[0]
        At, C = self.unpack(v)
        gA, gC = self.unpack(g)
        if self.mode == "balance":
            t2 = 1.0
        else:
            t2 = torch.linalg.norm(At) / torch.linalg.norm(C)
        return At - self.lr * t2 * gA, C - (self.lr / t2) * gC

    def __call__(self, v, create_graph: Optional[bool] = None):
        if create_graph is None:
            create_graph = torch.is_grad_enabled() and v.requires_grad
        with torch.enable_grad():
            At, C = self.step(v, create_graph=create_graph)
            out = self.pack(*self.renormalize(At, C))
        return out if create_graph else out.detach()


@dataclass
class FixedPoint:
    """The result of :func:`fixed_point`: ``v`` with ``residual = ||G(v) - v||``, ``(A, B)`` in the
    original coordinates, Newton ``iterations``, the residual after each one, and (with a task)
    the population excess at the fixed point."""

    v: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    residual: float
    iterations: int
    residuals: list = field(default_factory=list)
    excess: float = float("nan")
    converged: bool = False


def _stable_step(J: torch.Tensor, r: torch.Tensor, floor: float) -> torch.Tensor:
    """Newton's step on the contracting modes of ``J``, an amplified iteration step on the others.

    In the eigenbasis of ``J`` (``r = sum_i c_i e_i``), Newton's step is ``c_i / (1 - mu_i)``; for
    ``|mu_i| >= 1`` it would move *against* the iteration, towards a fixed point that the
    iteration leaves (a saddle of the slow flow); there the step is ``c_i / max(|1 - mu_i|, floor)``,
    the iteration's own direction, amplified.
    """
    w, V = torch.linalg.eig(J)
    c = torch.linalg.solve(V, r.to(V.dtype))
    one = torch.ones_like(w)
    stable = w.abs() < 1
    f = torch.where(stable, one / (one - w), one / torch.clamp((one - w).abs(), min=floor).to(w.dtype))
    return (V @ (f * c)).real


def _start(gmap, v0, warmup: int) -> torch.Tensor:
    """The Newton start: ``v0`` (flattened, checked) or the spectral initialization after ``warmup`` steps of ``G``."""
    if v0 is None:
        v = gmap.from_params(*spectral_init(gmap.X, gmap.Y))
        return gmap.iterate(v, warmup)[-1]
    ref = gmap.X if isinstance(gmap, SequenceMap) else torch.zeros((), dtype=torch.float64)
    v = torch.as_tensor(v0).to(ref).detach().reshape(-1)
    if v.numel() != gmap.size:
        raise ValueError(f"v0: expected {gmap.size} entries (k d + d^2), got {v.numel()}")
    return v


def _capped_stable_step(gmap, J, v, r, max_step: float):
    """:func:`_stable_step` capped at P-norm ``max_step``: ``(v, r, residual)`` (the residual may be non-finite)."""
    dv = _stable_step(J, r, floor=1e-3)
    nrm = float(torch.linalg.norm(dv))
    if nrm > max_step:
        dv = dv * (max_step / nrm)
    v = v + dv
    r = gmap(v) - v
    return v, r, float(torch.linalg.norm(r))


def _halving_newton_step(gmap, J, v, r, res: float):
    """Least-squares Newton, halved until the residual decreases: ``(v, r, residual)``; ``None`` after 30 halvings."""
    eye = torch.eye(gmap.size, dtype=v.dtype, device=v.device)
    dv = torch.linalg.lstsq(J - eye, -r.unsqueeze(1)).solution.squeeze(1)
    alpha = 1.0
    for _ in range(30):
        v_new = v + alpha * dv
        r_new = gmap(v_new) - v_new
        res_new = float(torch.linalg.norm(r_new))
        if np.isfinite(res_new) and res_new < res:
            return v_new, r_new, res_new
        alpha /= 2
    return None


def fixed_point(
    gmap: SequenceMap,
    v0=None,
    *,
    warmup: int = 50,
    tol: float = 1e-11,
    max_iter: int = 80,
    max_step: float = 0.05,
    stable: bool = True,
    task: Optional[Task] = None,
) -> FixedPoint:
    """A fixed point of ``G`` by Newton's method, from ``v0`` (default: the spectral initialization,
    then ``warmup`` steps of ``G``).

    ``stable=False``: plain Newton, ``(J - I) dv = -(G(v) - v)`` (least squares), with step halving
    until the residual ``||G(v) - v||_2`` decreases; it converges to the nearest fixed point,
    which may be one the iteration leaves. ``stable=True`` (default): the same on the contracting
    modes of the Jacobian and the iteration's own direction, amplified, on the modes with
    ``|mu| >= 1`` (``_stable_step``), each step capped at P-norm ``max_step``; it settles only
    where every mode contracts, i.e. at a fixed point the iteration converges to. Stops when the
    residual is below ``tol`` (``converged``) or after ``max_iter`` iterations.
    """
    if not (callable(gmap) and hasattr(gmap, "jacobian") and hasattr(gmap, "size")):
        raise ValueError(
            f"gmap: expected an attnlib.analysis.fixedpoint.SequenceMap (or a map like it), got {type(gmap).__name__}"
        )
    if v0 is None and not isinstance(gmap, SequenceMap):
        raise ValueError("v0: a starting point is needed for a map other than a SequenceMap")
    max_iter = check_positive_int(max_iter, "max_iter")
    warmup = check_positive_int(warmup, "warmup", minimum=0)
    tol = check_nonneg_float(tol, "tol", positive=True)
    max_step = check_nonneg_float(max_step, "max_step", positive=True)
    v = _start(gmap, v0, warmup)
    r = gmap(v) - v
    res = float(torch.linalg.norm(r))
    history = [res]
    it = 0
    while res > tol and it < max_iter:
        it += 1
        J = gmap.jacobian(v)
        nxt = _capped_stable_step(gmap, J, v, r, max_step) if stable else _halving_newton_step(gmap, J, v, r, res)
        if nxt is None:
            break
        v, r, res = nxt
        if not np.isfinite(res):
            break
        history.append(res)
    A, B = gmap.to_params(v)
    excess = float(task.to(dtype=A.dtype, device=A.device).excess_risk(A, B)) if task is not None else float("nan")
    return FixedPoint(
        v=v, A=A, B=B, residual=res, iterations=it, residuals=history, excess=excess, converged=res <= tol
    )


def _skew_basis(d: int, like: torch.Tensor) -> list:
    """The skew-symmetric ``d x d`` matrices ``E_ij - E_ji``, ``i < j`` (dtype and device of ``like``)."""
    basis = []
    for i in range(d):
        for j in range(i + 1, d):
            Om = torch.zeros(d, d, dtype=like.dtype, device=like.device)
            Om[i, j], Om[j, i] = 1.0, -1.0
            basis.append(Om)
    return basis


def rotation_basis(gmap: SequenceMap, v) -> torch.Tensor:
    """Orthonormal basis (columns) of the rotation directions ``(At Omega, -Omega C)``, ``Omega`` skew, at ``v``.

    The tangent of the orbit ``(At O, O^T C)`` of the factorization; its dimension is that of the
    Stiefel manifold of the balanced factorizations' ``W`` (``d r - r (r + 1) / 2`` for rank ``r``).
    """
    At, C = gmap.unpack(v.detach())
    M = torch.stack([gmap.pack(At @ Om, -Om @ C) for Om in _skew_basis(gmap.d, v)], dim=1)
    U, s, _ = torch.linalg.svd(M, full_matrices=False)
    r = int((s > s[0] * 1e-8).sum())
    return U[:, :r]


def orbit_curvature(gmap: SequenceMap, v) -> np.ndarray:
    """Curvature of ``Lhat`` along the empirical orbit ``(At e^Omega, e^-Omega C)`` at ``v``, per unit P-norm.

    The Hessian of ``s -> Lhat(At e^{Omega(s)}, e^{-Omega(s)} C)``, ``Omega(s) = sum_a s_a Omega_a``
    over the skew basis, at ``s = 0`` (it contains the gradient term of the curved orbit), in the
    metric of the tangent vectors ``(At Omega_a, -Omega_a C)``; returns its eigenvalues (ascending),
    one per orbit dimension.
    """
    v = v.detach()
    At, C = gmap.unpack(v)
    basis = _skew_basis(gmap.d, v)
    Oms = torch.stack(basis)

    def f(sv):
        O = torch.linalg.matrix_exp(torch.einsum("a,aij->ij", sv, Oms))
        return gmap.loss(gmap.pack(At @ O, O.T @ C))

    s0 = torch.zeros(len(basis), dtype=v.dtype, device=v.device)
    Hs = torch.autograd.functional.hessian(f, s0).cpu().numpy()
    Ut = torch.stack([gmap.pack(At @ Om, -Om @ C) for Om in basis], dim=1).cpu().numpy()
    ev, E = np.linalg.eigh(Ut.T @ Ut)
    keep = ev > ev.max() * 1e-8
    R = E[:, keep] / np.sqrt(ev[keep])
    return np.sort(np.linalg.eigvalsh(R.T @ Hs @ R))


@dataclass
class Spectrum:
    """Eigen-analysis of the Jacobian of ``G`` at a fixed point (see :func:`spectrum`)."""

    eigenvalues: np.ndarray  # all, sorted by modulus, descending
    removed: int  # |mu| < zero_tol: directions the renormalization removes
    slow: np.ndarray  # the eigenvalues of the slow modes (as many as rotation directions)
    fast: np.ndarray  # the remaining non-zero eigenvalues
    rotation_overlap: np.ndarray  # per slow mode: squared norm of its eigenvector's projection on the rotations
    h_rotation: np.ndarray  # curvature of Lhat along the empirical orbit (orbit_curvature)
    h_slow: np.ndarray  # (1 - mu_slow) / lr, the curvature the slow rates imply
    lr: float


def spectrum(gmap: SequenceMap, v, *, zero_tol: float = 1e-8) -> Spectrum:
    """The Jacobian spectrum of ``G`` at ``v`` (a fixed point): removed, slow and fast modes.

    The slow modes are the ``r_rot`` eigenvalues of largest modulus, ``r_rot`` the number of
    rotation directions (:func:`rotation_basis`); ``rotation_overlap`` says how much of each
    slow eigenvector lies in the rotation directions (1 = a pure rotation); ``h_rotation`` is
    the spectrum of the Hessian of ``Lhat`` on the rotation directions (its curvature along the
    empirical orbit), to compare with ``h_slow = (1 - mu_slow) / lr``.
    """
    v = v.detach()
    J = gmap.jacobian(v).cpu().numpy()
    w, Vec = np.linalg.eig(J)
    order = np.argsort(-np.abs(w))
    w, Vec = w[order], Vec[:, order]
    Q = rotation_basis(gmap, v)
    r_rot = Q.shape[1]
    removed = int(np.sum(np.abs(w) < zero_tol))
    slow = w[:r_rot]
    Qn = Q.cpu().numpy()
    overlap = []
    for i in range(r_rot):
        e = Vec[:, i] / np.linalg.norm(Vec[:, i])
        overlap.append(float(np.linalg.norm(Qn.T @ e) ** 2))
    h_rot = orbit_curvature(gmap, v)
    return Spectrum(
        eigenvalues=w,
        removed=removed,
        slow=slow,
        fast=w[r_rot : len(w) - removed],
        rotation_overlap=np.array(overlap),
        h_rotation=h_rot,
        h_slow=np.sort((1.0 - slow.real) / gmap.lr),
        lr=gmap.lr,
    )
