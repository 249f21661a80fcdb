r"""Regime (ii), first-order theory (ours): the ``1/n`` term of ``L_n`` and the constant ``c2``.

Coordinates of the true ``Sigma``: ``At = A Sigma^{1/2}``, ``C = Sigma^{1/2} B^T Sigma^{1/2}``,
``T = M Sigma^{1/2}``, tokens ``x = Sigma^{1/2} z`` with ``z ~ N(0, I)``. A query ``z`` tilts the
softmax by ``a = C z``; the layer's output is ``At m`` with ``m`` the self-normalized average of
the ``n`` tokens (the query's own among them) under the weights ``exp(a^T z_j)``. Expanding
``m = a + delta`` (the Gaussian tilt gives the limit ``a``):

* bias ``E[delta | z] = b(z) / n + O(n^-2)``, ``b(z) = -e^{|a|^2} a + e^{z^T H z} (z - a)`` with
  ``H = C_sym - K / 2``, ``K = C^T C``: the self-normalized importance-sampling bias and the
  self token (weight ``exp(z^T C z - |a|^2 / 2)`` relative to the mean weight);
* covariance ``Cov(delta | z) = e^{|a|^2} (I + a a^T) / n + O(n^-2)``.

Hence ``L_n = L + D_1 / n + O(n^-2)`` with, for ``G = At^T At``, ``F = At^T (At C - T)``,
``S_K = (I - 2K)^{-1}``, ``S_H = (I - 2H)^{-1}``,

.. math:: D_1 = \det(I - 2K)^{-1/2}\Big[\tfrac12\operatorname{tr} G + \tfrac12\operatorname{tr}(C^\top G C S_K)
          - \operatorname{tr}(C^\top F S_K)\Big] + \det(I - 2H)^{-1/2}\operatorname{tr}\big((I - C)^\top F S_H\big),

(the Gaussian integrals ``E e^{z^T Q z} = det(I - 2Q)^{-1/2}``, ``E e^{z^T Q z} z z^T =
det(I - 2Q)^{-1/2} (I - 2Q)^{-1}``), finite only when ``lambda_max(K) < 1/2`` and
``lambda_max(H) < 1/2`` (:func:`thresholds`). :func:`d1` evaluates it (differentiable).

The chains of :func:`attnlib.optim.run_chain` compute the fixed point of "step on ``L_n``, then
renormalize", not the minimizer of ``L_n`` on the constraint set. The renormalization keeps the
product ``P = At C``, so at a fixed point the step leaves the product unchanged; to first order in
``1/n`` (the step's quadratic term is ``O(n^-2)``) the residual ``E = P - T = E_1 / n`` solves the
Sylvester equation

.. math:: U S U^\top E_1 + E_1 V S V^\top
          = -\big(\gamma\,\nabla_{\tilde A} D_1\, C_b + \tilde A_b\,\nabla_C D_1 / \gamma\big),

at the point ``(gamma At_b, C_b / gamma)`` of the minimum set (``At_b = U S^{1/2} W^T``,
``C_b = W S^{1/2} V^T``, ``gamma`` set by the renormalization; :func:`displacement`), independently
of the step size. Then ``c2 = lim n^2 (L(theta_n) - L*) = ||E_1||_F^2 / 2`` (:func:`c2`): it
depends on the softmax scale ``nu = s_1(T) / gamma^2`` and on the rotation ``W`` (which point of the
minimum set), not on the step size. Along ``W`` the population loss is flat and the iteration
moves at a rate ``O(1/n)`` per step, so a chain of a few hundred steps stays near its start.

Tails (:func:`tail_exponent`): the expansion's next order needs ``E_z e^{c z^T K z}`` and
``E_z e^{c z^T H z}`` for ``c > 1``. Cutting the query average where the expansion fails (a
weight ``e^{|a|^2}`` or ``e^{z^T H z}`` of order ``n``) and using the Gaussian tails
``P(z^T Q z > s) ~ e^{-s / (2 lambda_max(Q))}`` gives a relative correction to
``n^2 x excess`` of order ``n^{-zeta}``, ``zeta = min(1, 1/(2 nu) - 1, 1/(2 h) - 1)`` with
``nu = lambda_max(K)``, ``h = lambda_max(H)`` (a heuristic, up to logarithms).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import numpy as np
import torch

from .._validate import check_matrix, check_nonneg_float
from ..geometry import _check_nu_cap, to_factor
from ..model.task import Task, check_task
from .fixedpoint import IteratedMap

__all__ = [
    "thresholds",
    "d1_factor",
    "d1",
    "first_order_loss",
    "point",
    "displacement",
    "c2",
    "best_scale",
    "tail_exponent",
    "exact_fit",
    "approach",
    "paired_precision",
]


def _HK(C):
    K = C.T @ C
    H = 0.5 * (C + C.T) - 0.5 * K
    return H, K


def thresholds(A, B, task: Task) -> Dict[str, float]:
    """``{"nu": lambda_max(C^T C), "h": lambda_max(C_sym - K/2)}`` at ``(A, B)``; ``D_1`` needs both below 1/2."""
    task = check_task(task)
    _, C = to_factor(A, B, task)
    H, K = _HK(C)
    return {"nu": float(torch.linalg.eigvalsh(K)[-1]), "h": float(torch.linalg.eigvalsh(H)[-1])}


def d1_factor(At, C, T, *, parts: bool = False):
    """``D_1`` in the coordinates ``(At, C)`` of the true ``Sigma`` (differentiable), target ``T = M Sigma^{1/2}``.

    ``parts=True`` returns ``{"variance", "is_bias", "self_token", "total"}`` (the three terms of
    the module docstring). Raises ``ValueError`` when ``lambda_max(C^T C) >= 1/2`` or
    ``lambda_max(C_sym - K/2) >= 1/2`` (the integrals diverge).
    """
    d = C.shape[0]
    H, K = _HK(C)
    I = torch.eye(d, dtype=C.dtype, device=C.device)
    lk, lh = float(torch.linalg.eigvalsh(K.detach())[-1]), float(torch.linalg.eigvalsh(H.detach())[-1])
    if lk >= 0.5 or lh >= 0.5:
        raise ValueError(
            f"C: D_1 is infinite (lambda_max(C^T C) = {lk:.4g}, lambda_max(C_sym - K/2) = {lh:.4g}; both must be < 1/2)"
        )
    G = At.T @ At
    F = At.T @ (At @ C - T)
    MK, MH = I - 2 * K, I - 2 * H
    SK, SH = torch.linalg.inv(MK), torch.linalg.inv(MH)
    dk, dh = torch.linalg.det(MK) ** -0.5, torch.linalg.det(MH) ** -0.5
    variance = 0.5 * dk * (torch.trace(G) + torch.trace(C.T @ G @ C @ SK))
    is_bias = -dk * torch.trace(C.T @ F @ SK)
    self_token = dh * torch.trace((I - C).T @ F @ SH)
    total = variance + is_bias + self_token
    if parts:
        return {"variance": variance, "is_bias": is_bias, "self_token": self_token, "total": total}
    return total


def d1(A, B, task: Task, *, parts: bool = False):
    """``D_1(theta) = lim n (L_n(theta) - L(theta))`` for Gaussian tokens (see :func:`d1_factor`)."""
    task = check_task(task)
    At, C = to_factor(A, B, task)
    return d1_factor(At, C, task.T, parts=parts)


def first_order_loss(A, B, task: Task, n: float):
    """``L(theta) + D_1(theta) / n``: the first-order approximation of ``L_n`` (differentiable)."""
    task = check_task(task)
    n = check_nonneg_float(n, "n", positive=True)
    return task.population_loss(A, B) + d1(A, B, task) / n


def _gamma2(task: Task, renormalize: str, nu_cap: Optional[float]) -> float:
    """``gamma^2`` of the orbit move that the renormalization makes at the balanced minimum (validates both)."""
    if renormalize not in ("balance", "cap", "fix"):
        raise ValueError(f"renormalize: expected 'balance', 'cap' or 'fix', got {renormalize!r}")
    nu_cap = _check_nu_cap(renormalize, nu_cap)
    s1 = float(task.svd[1][0])
    if renormalize == "balance":
        return 1.0
    return s1 / nu_cap if renormalize == "fix" else max(1.0, s1 / nu_cap)


def point(task: Task, W=None, *, renormalize: str = "balance", nu_cap: Optional[float] = None):
    """The point ``(gamma At_b, C_b / gamma)`` of the minimum set (factor coordinates) that the renormalization
    ``renormalize``/``nu_cap`` keeps, for rotation ``W`` (d x r, default ``V``, the chains' start).

    Returns ``(At, C, gamma)``."""
    task = check_task(task)
    U, s, V = task.svd
    W = V if W is None else check_matrix(W, "W", (task.d, len(s))).to(V)
    sh = s.sqrt()
    gamma = math.sqrt(_gamma2(task, renormalize, nu_cap))
    return gamma * (U * sh) @ W.T, (W * sh) @ V.T / gamma, gamma


def displacement(task: Task, W=None, *, renormalize: str = "balance", nu_cap: Optional[float] = None) -> torch.Tensor:
    """``E_1 = lim n (P_n - T)``: the first-order residual of the iteration's fixed point (k x d, factor coordinates).

    Solves the Sylvester equation of the module docstring at :func:`point` ``(task, W, renormalize, nu_cap)``.
    """
    task = check_task(task)
    At, C, gamma = point(task, W, renormalize=renormalize, nu_cap=nu_cap)
    U, s, V = task.svd
    At_ = At.detach().clone().requires_grad_(True)
    C_ = C.detach().clone().requires_grad_(True)
    gA, gC = torch.autograd.grad(d1_factor(At_, C_, task.T), (At_, C_))
    rhs = -(gamma * gA @ (C * gamma) + (At / gamma) @ gC / gamma)  # gamma gA C_b + At_b gC / gamma
    k, d = task.k, task.d
    UU = ((U * s) @ U.T).contiguous()  # U S U^T (k x k)
    VV = ((V * s) @ V.T).contiguous()  # V S V^T (d x d)
    # vec(UU E + E VV) = (I_d (x) UU + VV^T (x) I_k) vec(E), column-major vec
    Op = torch.kron(torch.eye(d, dtype=UU.dtype), UU.contiguous()) + torch.kron(
        VV.T.contiguous(), torch.eye(k, dtype=UU.dtype)
    )
    e = torch.linalg.solve(Op, rhs.T.reshape(-1))
    return e.reshape(d, k).T


def c2(task: Task, W=None, *, renormalize: str = "balance", nu_cap: Optional[float] = None) -> float:
    """``c2 = lim n^2 (L(theta_n) - L*) = ||E_1||_F^2 / 2`` for the fixed point near rotation ``W`` (default ``V``)."""
    E1 = displacement(task, W, renormalize=renormalize, nu_cap=nu_cap)
    return 0.5 * float(torch.sum(E1**2))


def best_scale(task: Task, W=None, *, nus=None) -> Dict[str, object]:
    """``c2`` against the softmax scale ``nu`` (renormalization ``"fix"`` at ``nu_cap = nu``) and its minimizer.

    ``nus``: the grid (default 200 points in ``[0.02, 0.49]``); scales where ``D_1`` diverges give
    ``inf``. Returns ``{"nus", "c2", "nu_best", "c2_best"}``.
    """
    task = check_task(task)
    grid = np.linspace(0.02, 0.49, 200) if nus is None else np.asarray(nus, dtype=float)
    vals = []
    for nu in grid:
        try:
            vals.append(c2(task, W, renormalize="fix", nu_cap=float(nu)))
        except ValueError:
            vals.append(math.inf)
    vals = np.array(vals)
    i = int(np.argmin(vals))
    return {"nus": grid, "c2": vals, "nu_best": float(grid[i]), "c2_best": float(vals[i])}


def tail_exponent(
    task: Task, W=None, *, renormalize: str = "balance", nu_cap: Optional[float] = None
) -> Dict[str, float]:
    """The heuristic exponent ``zeta`` of the relative correction ``n^2 x excess / c2 - 1 ~ n^-zeta``.

    ``zeta = min(1, 1/(2 nu) - 1, 1/(2 h) - 1)``, ``nu = lambda_max(K)`` (importance weights),
    ``h = lambda_max(C_sym - K/2)`` (self token) at :func:`point`; a non-positive ``h`` puts no limit.
    Returns ``{"nu", "h", "zeta_weights", "zeta_self", "zeta"}``.
    """
    At, C, _ = point(task, W, renormalize=renormalize, nu_cap=nu_cap)
    H, K = _HK(C)
    nu, h = float(torch.linalg.eigvalsh(K)[-1]), float(torch.linalg.eigvalsh(H)[-1])
    gw = 1 / (2 * nu) - 1 if nu > 0 else math.inf
    gs = 1 / (2 * h) - 1 if h > 0 else math.inf
    return {"nu": nu, "h": h, "zeta_weights": gw, "zeta_self": gs, "zeta": min(1.0, gw, gs)}


def approach(
    task: Task,
    ns,
    scaled,
    se,
    *,
    W=None,
    renormalize: str = "balance",
    nu_cap: Optional[float] = None,
    n_min: Optional[float] = None,
) -> Dict[str, object]:
    r"""The predicted correction to ``n^2 x excess``: ``c2 (1 - alpha n^-zeta)``, its amplitude fitted to data.

    Form (ours, heuristic; the chapter derives it): cutting the query average of ``D_1`` where a weight
    ``e^{|a|^2}`` or ``e^{z^T H z}`` reaches order ``n`` leaves out a tail of relative size ``n^{-zeta_t}``
    (``zeta_t`` of :func:`tail_exponent`), and the next order of the expansion adds ``1/n``; so the
    fixed point's displacement is ``E_1 (1 + O(n^{-zeta}))`` and
    ``n^2 (L(theta_n) - L*) / c2 = 1 - alpha n^{-zeta} + o(n^{-zeta})`` with ``zeta`` the smallest of
    them. ``c2`` and ``zeta`` are predicted; the amplitude ``alpha`` (it depends on where the cut lies and
    on logarithms) is not: it is fitted, ONE parameter, by weighted least squares of
    ``1 - scaled / c2`` on ``n^{-zeta}`` over ``n >= n_min``, weights ``(c2 / se)^2``.

    ``ns``, ``scaled`` (measured ``n^2 x excess``) and ``se`` (its standard errors): equal lengths.
    Returns ``{"c2", "zeta", "alpha", "alpha_se", "chi2", "dof", "z", "used", "curve"}``: ``z`` the
    residuals of every ``n`` in standard errors (also those below ``n_min``), ``used`` the mask of the
    fitted ``n``, ``curve(n)`` the fitted prediction of ``n^2 x excess``.
    """
    ns = np.asarray(ns, dtype=float)
    scaled = np.asarray(scaled, dtype=float)
    se = np.asarray(se, dtype=float)
    if ns.ndim != 1 or scaled.shape != ns.shape or se.shape != ns.shape:
        raise ValueError(
            f"ns, scaled, se: expected 1-d arrays of equal length, got {ns.shape}, {scaled.shape}, {se.shape}"
        )
    if np.any(ns <= 0) or np.any(se <= 0):
        raise ValueError("ns, se: expected positive context lengths and standard errors")
    const = c2(task, W, renormalize=renormalize, nu_cap=nu_cap)
    zeta = tail_exponent(task, W, renormalize=renormalize, nu_cap=nu_cap)["zeta"]
    used = ns >= (n_min if n_min is not None else -np.inf)
    if used.sum() < 2:
        raise ValueError(f"n_min: expected at least two n >= n_min to fit one amplitude, got {int(used.sum())}")
    x, y, w = ns**-zeta, 1 - scaled / const, (const / se) ** 2
    alpha = float(np.sum((w * x * y)[used]) / np.sum((w * x * x)[used]))
    z = (scaled - const * (1 - alpha * x)) / se
    return {
        "c2": const,
        "zeta": zeta,
        "alpha": alpha,
        "alpha_se": float(np.sum((w * x * x)[used]) ** -0.5),
        "chi2": float(np.sum(z[used] ** 2)),
        "dof": int(used.sum()) - 1,
        "z": z,
        "used": used,
        "curve": lambda n: const * (1 - alpha * np.asarray(n, dtype=float) ** -zeta),
    }


def paired_precision(Rs_a, Rs_b, Sigma) -> Dict[str, float]:
    r"""Paired comparison of two versions of the same chains (e.g. float32 against float64 attention on the
    same seeds and prompts): does the estimator's bias and variance change?

    ``Rs_a``, ``Rs_b``: ``(K, k, d)`` averaged residuals of chains ``1..K``, chain ``c`` of ``a`` paired with
    chain ``c`` of ``b``. The bias is estimated by the U-statistic of :func:`attnlib.analysis.stats.excess_ustat`,
    the variance by ``v = 1/(2 (K - 1)) sum_c tr((R_c - Rbar) Sigma (R_c - Rbar)^T)`` (the chains' noise in
    the excess metric). Returns ``{"excess_a", "excess_b", "se_a", "se_b", "diff", "diff_se", "var_a",
    "var_b", "var_diff", "var_diff_se", "max_rel_change", "K"}``: ``diff = excess_a - excess_b`` and
    ``var_diff = var_a - var_b`` with jackknife standard errors over the pairs (leave one pair out), and
    ``max_rel_change`` the largest ``||R_a,c - R_b,c||`` over ``sqrt(2 var_b)`` (both in the ``Sigma`` metric).
    """
    from .stats import excess_ustat

    Ra, Rb = np.asarray(Rs_a, dtype=float), np.asarray(Rs_b, dtype=float)
    if Ra.ndim != 3 or Ra.shape != Rb.shape or Ra.shape[0] < 3:
        raise ValueError(
            f"Rs_a, Rs_b: expected at least three paired (k, d) residuals each, got shapes {Ra.shape}, {Rb.shape}"
        )
    S = np.asarray(Sigma.cpu().numpy() if isinstance(Sigma, torch.Tensor) else Sigma, dtype=float)
    K = Ra.shape[0]

    def var(R):
        D = R - R.mean(axis=0)
        return 0.5 * float(np.einsum("iab,bc,iac->", D, S, D)) / (R.shape[0] - 1)

    def stats(idx):
        ua, ub = excess_ustat(Ra[idx], S)["excess"], excess_ustat(Rb[idx], S)["excess"]
        return ua - ub, var(Ra[idx]) - var(Rb[idx])

    loo = np.array([stats(np.delete(np.arange(K), c)) for c in range(K)])
    jk = np.sqrt((K - 1) / K * np.sum((loo - loo.mean(axis=0)) ** 2, axis=0))
    ea, eb = excess_ustat(Ra, S), excess_ustat(Rb, S)
    va, vb = var(Ra), var(Rb)
    D = Ra - Rb
    change = np.sqrt(np.einsum("iab,bc,iac->i", D, S, D))
    return {
        "excess_a": ea["excess"],
        "excess_b": eb["excess"],
        "se_a": ea["se"],
        "se_b": eb["se"],
        "diff": ea["excess"] - eb["excess"],
        "diff_se": float(jk[0]),
        "var_a": va,
        "var_b": vb,
        "var_diff": va - vb,
        "var_diff_se": float(jk[1]),
        "max_rel_change": float(change.max() / math.sqrt(2 * vb)),
        "K": K,
    }


def _lm_step(residual, p, r, f: float, damp: float, n: int):
    """One accepted Levenberg-Marquardt step: ``(p, r, loss, damping)``, or ``None`` if no damping lowers the loss."""
    J = torch.autograd.functional.jacobian(residual, p, vectorize=True)
    H, g_ = J.T @ J, J.T @ r
    while damp < 1e12:
        step = torch.linalg.solve(H + damp * torch.diag(torch.diag(H) + 1e-12), -g_)
        r2 = residual(p + step)
        f2 = float(r2 @ r2) / (2 * n)
        if f2 < f:
            return p + step, r2, f2, max(damp / 3, 1e-12)
        damp *= 4
    return None


def exact_fit(X, Y, init=None, *, iters: int = 300, seed: int = 0, tol: float = 1e-28) -> Dict[str, object]:
    """Levenberg-Marquardt on the residuals of the one-sequence loss ``Lhat_n`` (regime (i)): does a finite
    point fit all ``n`` targets exactly?

    The layer is the book's (:func:`attnlib.model.layer.attention_reference`: each token attends to all
    ``n`` tokens, itself included). ``init = (A, B)`` or, by default, a random start (entries
    ``N(0, 1/4)``, from ``seed``). Each iteration solves ``(J^T J + damp diag(J^T J)) step = -J^T r``
    and keeps the step only if it lowers the loss (so the recorded losses never increase); stops when
    ``Lhat_n < tol`` or after ``iters`` iterations. Returns ``{"A", "B", "loss", "losses", "norms",
    "iterations"}``: ``losses[t]`` and ``norms[t]`` (``||(A, B)||_F``) after accepted step ``t``.
    A loss near round-off at a bounded norm exhibits a finite exact fit; a loss that keeps falling only
    while the norm grows is what an infimum approached at infinity looks like (a numerical sign, not a proof).
    """
    from .._validate import check_positive_int, check_samples
    from ..model.layer import attention_reference

    X, Y = check_samples(X, Y)
    if Y is None:
        raise ValueError("Y: expected an (n, k) array of targets")
    iters = check_positive_int(iters, "iters")
    tol = check_nonneg_float(tol, "tol")
    n, d = X.shape
    k = Y.shape[1]
    if init is None:
        g = torch.Generator().manual_seed(int(seed))
        p = 0.5 * torch.randn(k * d + d * d, generator=g, dtype=torch.float64).to(X)
    else:
        A0 = check_matrix(init[0], "init[0] (A)", (k, d)).to(X)
        B0 = check_matrix(init[1], "init[1] (B)", (d, d)).to(X)
        p = torch.cat([A0.reshape(-1), B0.reshape(-1)])

    def residual(q):
        return (attention_reference(q[: k * d].reshape(k, d), q[k * d :].reshape(d, d), X) - Y).reshape(-1)

    r = residual(p)
    f = float(r @ r) / (2 * n)
    losses, norms, damp = [f], [float(torch.linalg.norm(p))], 1e-2
    for _ in range(iters):
        if f < tol:
            break
        nxt = _lm_step(residual, p, r, f, damp, n)
        if nxt is None:
            break  # no step lowers the loss at any damping
        p, r, f, damp = nxt
        losses.append(f)
        norms.append(float(torch.linalg.norm(p)))
    return {
        "A": p[: k * d].reshape(k, d).detach(),
        "B": p[k * d :].reshape(d, d).detach(),
        "loss": f,
        "losses": np.array(losses),
        "norms": np.array(norms),
        "iterations": len(losses) - 1,
    }


class SurrogateMap(IteratedMap):
    """The chains' map on the first-order objective ``L + D_1 / n``, deterministic (no Monte Carlo).

    ``G(v)``: the structured step of :class:`attnlib.optim.GradientStep` scaled to the balanced coordinates
    (``At -= lr gamma^2 grad``, ``C -= lr grad / gamma^2``, ``gamma^2 = ||At||_F / ||C||_F``) in the factor
    coordinates of the true
    ``Sigma``, then the balanced (Procrustes) factorization and the orbit move of ``renormalize``; the
    same interface as :class:`attnlib.analysis.fixedpoint.SequenceMap` (``size``, ``unpack``, ``pack``,
    ``jacobian``, ``to_params``), so :func:`attnlib.analysis.fixedpoint.fixed_point` finds its fixed point.
    """

    def __init__(
        self, task: Task, n: float, lr: float = 0.5, *, renormalize: str = "balance", nu_cap: Optional[float] = None
    ):
        self.task = check_task(task)
        self.n = check_nonneg_float(n, "n", positive=True)
        self.lr = check_nonneg_float(lr, "lr", positive=True)
        _gamma2(task, renormalize, nu_cap)  # validates renormalize and nu_cap
        self.mode, self.nu_cap = renormalize, nu_cap
        self.k, self.d = task.k, task.d
        self.size = self.k * self.d + self.d * self.d

    def loss(self, v):
        At, C = self.unpack(v)
        return 0.5 * torch.sum((At @ C - self.task.T) ** 2) + d1_factor(At, C, self.task.T) / self.n

    def to_params(self, v):
        from ..geometry import from_factor

        return from_factor(*self.unpack(v.detach()), self.task)

    def __call__(self, v, create_graph: Optional[bool] = None):
        from .fixedpoint import SequenceMap

        if create_graph is None:
            create_graph = torch.is_grad_enabled() and v.requires_grad
        with torch.enable_grad():
            u = v if v.requires_grad else v.detach().requires_grad_(True)
            g = torch.autograd.grad(self.loss(u), u, create_graph=create_graph)[0]
            At, C = self.unpack(u)
            gA, gC = self.unpack(g)
            g2 = 1.0 if self.mode == "balance" else torch.linalg.norm(At) / torch.linalg.norm(C)
            out = self.pack(*SequenceMap.renormalize(self, At - self.lr * g2 * gA, C - (self.lr / g2) * gC))
        return out if create_graph else out.detach()
