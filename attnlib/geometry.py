r"""The matrix-factorization geometry of the population loss.

Change of variables (``Sigma`` the token covariance, or ``Sigmahat`` for a sample):

.. math:: \tilde A = A \Sigma^{1/2}, \qquad C = \Sigma^{1/2} B^\top \Sigma^{1/2}, \qquad
          T = M \Sigma^{1/2},

under which ``L(A, B) - L* = 1/2 ||At C - T||_F^2``. With a thin SVD
``T = U S V^T`` (rank ``r``, any ``r <= min(k, d)``; repeated singular values allowed,
the singular vectors being the ones :attr:`~attnlib.model.task.Task.svd` returns) the balanced global minima are

.. math:: \mathcal S = \{(U S^{1/2} W^\top,\; W S^{1/2} V^\top) : W \in \mathbb R^{d\times r},\ W^\top W = I\},

(another choice of singular vectors gives the same set, with ``W`` rotated within the blocks
of equal singular values), the P-norm is the Euclidean norm in ``(At, C)``, and the P-norm
projection onto ``S`` is an orthogonal Procrustes problem solved by the polar factor of
``N = At^T U S^{1/2} + C V S^{1/2}`` (unique when ``N`` has rank ``r``; otherwise every
polar factor gives a closest point and the distance is the same).

Functions that need the covariance accept either a matrix ``Sigma`` or a
:class:`~attnlib.model.task.Task` (whose cached square roots are then reused).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from ._validate import check_matrix, check_nonneg_float, check_spd
from .linalg import numerical_rank, polar_factor, sym_inv_sqrt, sym_sqrt
from .model.finite_n import softmax_scale
from .model.task import SigmaLike, Task
from .rng import make_generator

__all__ = [
    "to_factor",
    "from_factor",
    "regularizer",
    "p_norm",
    "p_inner",
    "manifold_point",
    "random_manifold_point",
    "project_to_manifold",
    "distance_to_manifold",
    "renormalize",
    "Renormalization",
    "RENORMALIZATIONS",
    "orbit_distance",
    "perturb",
    "apply_symmetry",
    "orbit_to_scale",
    "SigmaLike",
]


class _Roots:
    """``Sigma``, ``Sigma^{1/2}``, ``Sigma^{-1/2}`` for a matrix or a Task."""

    def __init__(self, Sigma: SigmaLike):
        if isinstance(Sigma, Task):
            self.S, self.half, self.inv_half = Sigma.Sigma, Sigma.Sigma_sqrt, Sigma.Sigma_inv_sqrt
        else:
            self.S = check_spd(Sigma, "Sigma")
            self.half, self.inv_half = sym_sqrt(self.S), sym_inv_sqrt(self.S)
        self.d = self.S.shape[0]


def _params(A, B, d, *, ref: torch.Tensor):
    A = check_matrix(A, "A", (None, d)).to(dtype=ref.dtype, device=ref.device)
    B = check_matrix(B, "B", (d, d)).to(dtype=ref.dtype, device=ref.device)
    return A, B


def to_factor(A, B, Sigma: SigmaLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(At, C) = (A Sigma^{1/2}, Sigma^{1/2} B^T Sigma^{1/2})``."""
    R = _Roots(Sigma)
    A, B = _params(A, B, R.d, ref=R.S)
    return A @ R.half, R.half @ B.T @ R.half


def from_factor(At, C, Sigma: SigmaLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_factor`: ``(A, B) = (At Sigma^{-1/2}, Sigma^{-1/2} C^T Sigma^{-1/2})``."""
    R = _Roots(Sigma)
    At = check_matrix(At, "At", (None, R.d)).to(R.S)
    C = check_matrix(C, "C", (R.d, R.d)).to(R.S)
    return At @ R.inv_half, R.inv_half @ C.T @ R.inv_half


def regularizer(A, B, Sigma: SigmaLike, lam: float = 1.0) -> torch.Tensor:
    r"""Balancing regularizer ``R = lam/4 ||At^T At - C C^T||_F^2``.

    Equal to ``lam/4 ||Sigma^{1/2} (A^T A - B^T Sigma B) Sigma^{1/2}||_F^2``;
    differentiable; with ``Sigma = Sigmahat`` it is the empirical ``Rhat``.
    """
    lam = check_nonneg_float(lam, "lam")
    S = Sigma.Sigma if isinstance(Sigma, Task) else check_matrix(Sigma, "Sigma", (None, None))
    if S.shape[0] != S.shape[1]:
        raise ValueError(f"Sigma: expected a square matrix, got shape {tuple(S.shape)}")
    A, B = _params(A, B, S.shape[0], ref=S)
    DS = (A.T @ A - B.T @ S @ B) @ S
    # ||S^{1/2} D S^{1/2}||_F^2 = tr(D S D S) for symmetric D
    return 0.25 * lam * torch.sum(DS * DS.T)


def p_inner(dA1, dB1, dA2, dB2, Sigma: SigmaLike) -> torch.Tensor:
    """P-inner product: the Euclidean inner product of the two directions mapped to ``(At, C)``."""
    a1, c1 = to_factor(dA1, dB1, Sigma)
    a2, c2 = to_factor(dA2, dB2, Sigma)
    return torch.sum(a1 * a2) + torch.sum(c1 * c2)


def p_norm(dA, dB, Sigma: SigmaLike) -> torch.Tensor:
    r"""``||(dA, dB)||_P = sqrt(||dA Sigma^{1/2}||_F^2 + ||Sigma^{1/2} dB^T Sigma^{1/2}||_F^2)``."""
    a, c = to_factor(dA, dB, Sigma)
    return torch.sqrt(torch.sum(a * a) + torch.sum(c * c))


def _check_stiefel(W, d: int, r: int, ref: torch.Tensor) -> torch.Tensor:
    W = check_matrix(W, "W", (d, r)).to(ref)
    tol = 1e-4 if W.dtype == torch.float32 else 1e-8
    err = float(torch.linalg.norm(W.T @ W - torch.eye(r, dtype=W.dtype, device=W.device)))
    if err > tol:
        raise ValueError(f"W: expected orthonormal columns (W^T W = I), ||W^T W - I||_F = {err:.2e}")
    return W


def manifold_point(task: Task, W) -> Tuple[torch.Tensor, torch.Tensor]:
    """The balanced minimum ``(At, C) = (U S^{1/2} W^T, W S^{1/2} V^T)`` in original coordinates ``(A, B)``.

    ``W`` is d x r with orthonormal columns (``r = task.rank``).
    """
    U, s, V = task.svd
    W = _check_stiefel(W, task.d, len(s), task.Sigma)
    sh = s.sqrt()
    At = (U * sh) @ W.T
    C = (W * sh) @ V.T
    return from_factor(At, C, task)


def random_manifold_point(task: Task, *, seed: Optional[int] = None, generator: Optional[torch.Generator] = None):
    """A balanced minimum with a Haar-random ``W`` (d x r); returns ``(A, B, W)``."""
    g = make_generator(seed, generator)
    G = torch.randn(task.d, task.rank, generator=g, dtype=torch.float64)
    Q, R = torch.linalg.qr(G)
    W = (Q * torch.sign(torch.diagonal(R))).to(task.Sigma)
    A, B = manifold_point(task, W)
    return A, B, W


def _procrustes(At, C, U, s, V):
    """Closest balanced factorization of ``U diag(s) V^T`` to ``(At, C)`` in Frobenius norm.

    Also for stacks (a leading axis on every argument, or only on ``At``, ``C``): one factorization each.
    """
    sh = s.sqrt().unsqueeze(-2)
    N = At.mT @ (U * sh) + C @ (V * sh)
    W = polar_factor(N)
    return (U * sh) @ W.mT, (W * sh) @ V.mT, W


def project_to_manifold(A, B, task: Task, *, return_W: bool = False):
    """P-norm projection of ``(A, B)`` onto the manifold of balanced minima of ``task``.

    Returns ``(A*, B*)`` (and ``W*`` with ``return_W=True``), where
    ``W* = polar(At^T U S^{1/2} + C V S^{1/2})``. The closest point is unique when that
    matrix has full column rank ``r``; otherwise this is one of the closest points.
    Repeated singular values of ``T`` and ``rank T < k`` are allowed.
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    At, C = to_factor(A, B, task)
    At_p, C_p, W = _procrustes(At, C, *task.svd)
    Ap, Bp = from_factor(At_p, C_p, task)
    return (Ap, Bp, W) if return_W else (Ap, Bp)


def distance_to_manifold(A, B, task: Task) -> torch.Tensor:
    """Exact P-norm distance ``dist_P((A, B), S)`` to the balanced minima (0-dim tensor)."""
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    At, C = to_factor(A, B, task)
    At_p, C_p, _ = _procrustes(At, C, *task.svd)
    return torch.sqrt(torch.sum((At - At_p) ** 2) + torch.sum((C - C_p) ** 2))


def _stacked_distance(A, B, task: Task) -> torch.Tensor:
    """:func:`distance_to_manifold` of a stack ``A`` (C, k, d), ``B`` (C, d, d) (validated): shape (C,)."""
    At, C = A @ task.Sigma_sqrt, task.Sigma_sqrt @ B.mT @ task.Sigma_sqrt
    At_p, C_p, _ = _procrustes(At, C, *task.svd)
    return torch.sqrt(torch.sum((At - At_p) ** 2, dim=(1, 2)) + torch.sum((C - C_p) ** 2, dim=(1, 2)))


#: The renormalizations (moves along the orbit after each update); see :class:`Renormalization`.
RENORMALIZATIONS = ("balance", "cap", "fix", "equalize")


def _balance(A, B, R: _Roots):
    """The closest balanced factorization of the product (NaN if it is not finite, 0 if it is 0)."""
    At, C = A @ R.half, R.half @ B.T @ R.half
    P = At @ C
    if not bool(torch.isfinite(P).all()):
        # the product overflowed (a diverging iterate): no factorization to re-balance; NaN tells the caller
        nan = float("nan")
        return torch.full_like(A, nan), torch.full_like(B, nan)
    r = numerical_rank(P)
    if r == 0:
        return torch.zeros_like(A), torch.zeros_like(B)
    U, s, Vh = torch.linalg.svd(P, full_matrices=False)
    At_b, C_b, _ = _procrustes(At, C, U[:, :r], s[:r], Vh[:r].T)
    return At_b @ R.inv_half, R.inv_half @ C_b.T @ R.inv_half


def _balance_stacked(A, B, R: _Roots):
    """:func:`_balance` of a stack ``A`` (C, k, d), ``B`` (C, d, d): one batched SVD and Procrustes where every
    product is finite with the same numerical rank (the chains of a sweep), else one :func:`_balance` each."""
    At, C = A @ R.half, R.half @ B.mT @ R.half
    P = At @ C
    if bool(torch.isfinite(P).all()):
        s = torch.linalg.svdvals(P)
        rtol = max(P.shape[-2:]) * torch.finfo(P.dtype).eps * 100
        ranks = torch.where(s[:, 0] > 0, (s > rtol * s[:, :1]).sum(dim=1), 0)
        r = int(ranks[0])
        if r > 0 and bool((ranks == r).all()):
            U, s, Vh = torch.linalg.svd(P, full_matrices=False)
            At_b, C_b, _ = _procrustes(At, C, U[..., :r], s[..., :r], Vh[..., :r, :].mT)
            return At_b @ R.inv_half, R.inv_half @ C_b.mT @ R.inv_half
    pairs = [_balance(A[c], B[c], R) for c in range(A.shape[0])]
    return torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])


def _equalize(A, B, R: _Roots):
    """``(At / c, c C)`` with ``c = sqrt(||At||_F / ||C||_F)``: both factors get the same Frobenius norm."""
    na, nc = torch.linalg.norm(A @ R.half), torch.linalg.norm(R.half @ B.T @ R.half)
    if float(na) == 0.0 or float(nc) == 0.0:
        return A, B
    c = torch.sqrt(na / nc)
    return A / c, B * c


def _check_nu_cap(mode: str, nu_cap) -> Optional[float]:
    if mode not in RENORMALIZATIONS:
        raise ValueError(f"renormalize: expected one of {RENORMALIZATIONS}, got {mode!r}")
    if mode not in ("cap", "fix"):
        if nu_cap is not None:
            raise ValueError(f"nu_cap: only the 'cap' and 'fix' renormalizations take a bound, not {mode!r}")
        return None
    if nu_cap is None:
        raise ValueError(f"nu_cap: the {mode!r} renormalization needs a positive bound nu_cap on lambda_max(C^T C)")
    return check_nonneg_float(nu_cap, "nu_cap", positive=True)


class Renormalization:
    r"""The renormalization that follows every update: re-factor ``P = At C`` without changing it.

    The one place where the iterates move along the orbit of the product (the training loop
    :func:`attnlib.optim.run` calls it after each update). ``Sigma`` is factorized once, here;
    calling the object does not re-validate its arguments (the loop's iterates).

    * ``"balance"`` (the structured method's default): the closest (Frobenius) balanced
      factorization of ``P = U S V^T``, ``(U S^{1/2} W^T, W S^{1/2} V^T)`` with ``W`` from
      Procrustes. Among all factorizations of ``P`` the balanced ones minimize the total norm
      ``(||At||_F^2 + ||C||_F^2) / 2``, and the minimum is the nuclear norm ``||P||_*``
      (``||C||_F^2`` alone is *not* minimized: ``(gamma At, C / gamma)`` makes it arbitrarily small).
      At a balanced factorization ``lambda_max(C^T C) = s_1(P)``: the softmax scale ``nu`` is
      fixed by the product.
    * ``"cap"`` (ours): balance, then move along the orbit ``(gamma At, C / gamma)`` with
      ``gamma^2 = max(1, s_1(P) / nu_cap)``, so that ``nu <= nu_cap`` (equals ``"balance"`` when
      ``s_1(P) <= nu_cap``).
    * ``"fix"`` (ours): the same move with ``gamma^2 = s_1(P) / nu_cap``: the cap always active,
      ``nu = nu_cap`` exactly, on either side of the heavy-tail threshold 1/2 (the experiments
      scan the softmax scale with it).
    * ``"equalize"``: ``(At / c, c C)`` with ``c = sqrt(||At||_F / ||C||_F)``, both factors of the
      same Frobenius norm (it does not re-balance).

    All keep ``At C``, hence the population loss. If the product is not finite (a diverging
    iterate) the balancing modes return NaN parameters, so that the loop's divergence guard stops.
    """

    def __init__(self, mode: str, Sigma: SigmaLike, nu_cap: Optional[float] = None):
        self.nu_cap = _check_nu_cap(mode, nu_cap)
        self.mode = mode
        self.roots = _Roots(Sigma)

    def __call__(self, A, B) -> Tuple[torch.Tensor, torch.Tensor]:
        R = self.roots
        if self.mode == "equalize":
            return _equalize(A, B, R)
        Ab, Bb = _balance(A, B, R)
        if self.mode == "balance":
            return Ab, Bb
        At, C = Ab @ R.half, R.half @ Bb.T @ R.half
        nu = float(torch.linalg.matrix_norm(C, ord=2) ** 2)  # = s_1(At C) at a balanced point
        if nu == 0.0:
            return Ab, Bb
        gamma2 = nu / self.nu_cap
        if self.mode == "cap":
            gamma2 = max(1.0, gamma2)
        gamma = gamma2**0.5
        return (gamma * At) @ R.inv_half, R.inv_half @ (C / gamma).T @ R.inv_half

    def stacked(self, A, B) -> Tuple[torch.Tensor, torch.Tensor]:
        """The same renormalization of ``C`` iterates at once: ``A`` (C, k, d), ``B`` (C, d, d), batched (no loop
        over the iterates; :func:`attnlib.optim.run_chains`). Equal to calling the object on each iterate, to
        round-off."""
        R = self.roots
        if self.mode == "equalize":
            na = torch.linalg.matrix_norm(A @ R.half)[:, None, None]
            nc = torch.linalg.matrix_norm(R.half @ B.mT @ R.half)[:, None, None]
            c = torch.where((na == 0) | (nc == 0), 1.0, torch.sqrt(na / nc))
            return A / c, B * c
        return Renormalization.stacked_each([self] * A.shape[0], A, B)

    @staticmethod
    def stacked_each(renorms: Sequence["Renormalization"], A, B) -> Tuple[torch.Tensor, torch.Tensor]:
        """Iterate ``c`` of the stack renormalized by ``renorms[c]``, all at once: ``"balance"``, ``"cap"`` and
        ``"fix"`` with any bounds, one ``Sigma`` (one batched balancing, then each iterate's move along the
        orbit; :func:`attnlib.optim.run_chains` with chains of different renormalizations)."""
        modes = [r.mode for r in renorms]
        if len(renorms) != A.shape[0] or not set(modes) <= {"balance", "cap", "fix"}:
            raise ValueError(
                f"renorms: expected one 'balance', 'cap' or 'fix' renormalization per iterate, got {modes}"
            )
        R = renorms[0].roots
        Ab, Bb = _balance_stacked(A, B, R)
        if all(m == "balance" for m in modes):
            return Ab, Bb
        At, C = Ab @ R.half, R.half @ Bb.mT @ R.half
        nu = torch.linalg.matrix_norm(C, ord=2) ** 2
        cap = torch.tensor([r.nu_cap or 1.0 for r in renorms], dtype=nu.dtype, device=nu.device)
        capped = torch.tensor([m == "cap" for m in modes], device=nu.device)
        gamma2 = torch.where(capped, (nu / cap).clamp_min(1.0), nu / cap)
        gamma = torch.where(nu == 0, 1.0, gamma2**0.5)[:, None, None]
        A_new, B_new = (gamma * At) @ R.inv_half, R.inv_half @ (C / gamma).mT @ R.inv_half
        if any(m == "balance" for m in modes):  # those iterates are the balanced ones themselves
            keep = torch.tensor([m == "balance" for m in modes], device=nu.device)[:, None, None]
            A_new, B_new = torch.where(keep, Ab, A_new), torch.where(keep, Bb, B_new)
        return A_new, B_new

    def stacked_gamma2(self, A, B) -> torch.Tensor:
        """:meth:`gamma2` of a stack ``A`` (C, k, d), ``B`` (C, d, d): shape (C,)."""
        if self.mode not in ("cap", "fix"):
            return torch.ones(A.shape[0], dtype=A.dtype, device=A.device)
        R = self.roots
        na, nc = torch.linalg.matrix_norm(A @ R.half), torch.linalg.matrix_norm(R.half @ B.mT @ R.half)
        return torch.where((na > 0) & (nc > 0), na / nc, 1.0)

    def gamma2(self, A, B) -> float:
        """``gamma^2 = ||At||_F / ||C||_F`` of an iterate, for ``"cap"``/``"fix"`` (1 otherwise).

        The structured step after these renormalizations is taken in the balanced coordinates
        ``(At / gamma, gamma C)``: the ``A`` block scaled by ``gamma^2``, the ``B`` block by ``1/gamma^2``
        (a step size that suits the balanced point does not suit the rescaled one).
        """
        if self.mode not in ("cap", "fix"):
            return 1.0
        R = self.roots
        na, nc = float(torch.linalg.norm(A @ R.half)), float(torch.linalg.norm(R.half @ B.T @ R.half))
        return na / nc if na > 0 and nc > 0 else 1.0


def renormalize(
    A, B, Sigma: SigmaLike, mode: str = "balance", nu_cap: Optional[float] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One renormalization of ``(A, B)`` (see :class:`Renormalization` for the modes); returns ``(A, B)``.

    ``mode``: ``"balance"`` (default), ``"cap"`` or ``"fix"`` (with the bound ``nu_cap`` on the
    softmax scale ``nu = lambda_max(C^T C)``), or ``"equalize"``.
    """
    R = Renormalization(mode, Sigma, nu_cap)
    A, B = _params(A, B, R.roots.d, ref=R.roots.S)
    return R(A, B)


def orbit_distance(A, B, A_ref, B_ref, Sigma: SigmaLike) -> float:
    r"""P-distance from ``(A, B)`` to the orbit ``{(At_ref O, O^T C_ref) : O orthogonal}`` of a reference point.

    ``min_O ||At - At_ref O||_F^2 + ||C - O^T C_ref||_F^2`` (coordinates of ``Sigma``) is an
    orthogonal Procrustes problem: with ``N = At^T At_ref + C C_ref^T = U S V^T`` the minimizer
    is ``O = V U^T``. The distance does not change when either point moves along its orbit,
    so it measures convergence to a limit point without counting drift along the nearly
    flat orbit of the finite-n loss.
    """
    At, C = to_factor(A, B, Sigma)
    Ar, Cr = to_factor(A_ref, B_ref, Sigma)
    N = At.T @ Ar + C @ Cr.T
    U, _, Vh = torch.linalg.svd(N)
    O = Vh.T @ U.T
    return float(torch.sqrt(torch.sum((At - Ar @ O) ** 2) + torch.sum((C - O.T @ Cr) ** 2)))


def apply_symmetry(A, B, G, Sigma: SigmaLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """Apply ``(At, C) -> (At G, G^{-1} C)`` and return the new ``(A, B)``.

    The population loss is unchanged for every invertible ``G``; the finite-n
    loss is not, not even for orthogonal ``G`` (see :func:`attnlib.analysis.landscape.score_moments`).
    """
    At, C = to_factor(A, B, Sigma)
    G = check_matrix(G, "G", (At.shape[1], At.shape[1])).to(At)
    try:
        Ginv = torch.linalg.inv(G)
    except RuntimeError as exc:
        raise ValueError("G: expected an invertible matrix") from exc
    return from_factor(At @ G, Ginv @ C, Sigma)


def orbit_to_scale(A, B, Sigma: SigmaLike, nu: float) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The point ``(gamma A, B / gamma)`` of the orbit ``(gamma At, C / gamma)`` whose softmax scale is ``nu``.

    ``gamma = sqrt(softmax_scale(A, B, Sigma) / nu)``. The limit map ``A Sigma B^T``
    and hence the population loss are the same at every point of the orbit;
    ``lambda_max(C^T C)`` scales like ``1 / gamma^2``. (Unlike the ``"fix"`` renormalization it does
    not balance first.)
    """
    R = _Roots(Sigma)
    A, B = _params(A, B, R.d, ref=R.S)
    try:
        nu = float(nu)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"nu: expected a positive number, got {nu!r}") from exc
    if not (math.isfinite(nu) and nu > 0):
        raise ValueError(f"nu: expected a finite positive number, got {nu!r}")
    current = softmax_scale(A, B, R.S)
    if current == 0:
        raise ValueError("B: the softmax scale is zero (B = 0); no point of the orbit has a positive scale")
    gamma = math.sqrt(current / nu)
    return gamma * A, B / gamma


def perturb(
    A, B, Sigma: SigmaLike, radius: float, *, seed: Optional[int] = None, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` moved by a uniformly random direction of P-norm exactly ``radius``.

    The direction is Gaussian in the coordinates ``(At, C)``, normalized to
    Frobenius norm ``radius`` there (i.e. P-norm ``radius`` in ``(A, B)``).
    """
    radius = check_nonneg_float(radius, "radius")
    g = make_generator(seed, generator)
    At, C = to_factor(A, B, Sigma)
    dAt = torch.randn(At.shape, generator=g, dtype=torch.float64).to(At)
    dC = torch.randn(C.shape, generator=g, dtype=torch.float64).to(C)
    nrm = torch.sqrt(dAt.square().sum() + dC.square().sum())
    return from_factor(At + radius * dAt / nrm, C + radius * dC / nrm, Sigma)
