r"""Practitioners' optimizers on the book's objectives, through the one training loop.

Any ``torch.optim.Optimizer`` over the two parameters ``A`` and ``B`` is a step rule
(:class:`attnlib.optim.TorchOptimizerStep`): the loop evaluates the full objective and its gradient,
the step rule hands the gradient to the optimizer and calls ``optimizer.step()``, with an optional
step-size schedule. Importing this module (``attnlib.optim`` does) registers
(:func:`attnlib.optim.register_method`) the methods

* ``"adamw"``: ``torch.optim.AdamW`` (torch's defaults: betas (0.9, 0.999), eps 1e-8, decoupled
  weight decay 0.01); ``"adam"`` (``torch.optim.Adam``) is already a method of ``attnlib.optim.steps``;
* ``"muon"``: ``torch.optim.Muon`` at a constant step (momentum 0.95, Nesterov, five quintic
  Newton-Schulz iterations in bfloat16, weight decay 0, torch's shape adjustment of the step);
  Muon is defined for 2-D parameters only, which ``A`` (k x d) and ``B`` (d x d) are;
* ``"muon_decay"``: the same with the step ``lr * MUON_DECAY**t`` (an exponential decay: an
  orthogonalized update has a fixed spectral norm, so without a decaying step it cannot converge);
* ``"shampoo"``: ``pytorch_optimizer.Shampoo`` (Gupta, Koren, Singer 2018), the original variant:
  statistics ``L += G G^T``, ``R += G^T G`` started at ``eps I`` (eps = :data:`SHAMPOO_EPS`),
  inverse fourth roots recomputed at every step, no momentum, no grafting,
  update ``L^{-1/4} G R^{-1/4}``; :class:`ExplainedShampoo` is the same in 15 lines (tested to
  round-off against the library's);
* ``"soap"``: ``pytorch_optimizer.SOAP`` (Vyas et al. 2024: Adam in the eigenbasis of Shampoo's
  statistics), eigenbasis updated every step, weight decay 0, its default betas (0.95, 0.95).

The measurements of chapter 7: :func:`steps_to` and :func:`max_after` (steps to an excess
threshold, and whether the excess stays below it afterwards), :func:`preconditioner_slope` (the
learned preconditioner's log-slope over the eigenvectors of ``Sigma``: the structured method's is
``-1``, plain gradient descent's ``0``; the run's ``History.step_rule`` holds what it learned),
:func:`imbalance`, and :func:`measure`, which adds the softmax scale ``nu``
(:func:`attnlib.model.finite_n.softmax_scale`) and the held-out loss at context length ``n``
(:func:`attnlib.model.finite_n.heldout_loss`). Step sizes come from :func:`attnlib.optim.grid.grid_search`.

The parameterization practitioners train: :func:`train_factored` runs the four factors
``B = W_Q^T W_K``, ``A = W_O W_V`` (head dimension ``d_h``) on the population objective through a thin loop over
``torch.optim`` (:func:`factored_start`, :func:`factored_balanced`, :func:`factored_imbalance`,
:func:`measure_factored`). Regime (ii) for any method is :func:`attnlib.optim.train_prompts`.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, Optional

import numpy as np
import torch

from .._validate import check_nonneg_float, check_positive_int
from ..geometry import to_factor
from ..model.finite_n import heldout_loss, softmax_scale
from ..model.task import Task, as_covariance
from .loop import History
from .steps import GradientStep, Method, Step, TorchOptimizerStep, register_method

__all__ = [
    "ExplainedShampoo",
    "OPTIMIZERS",
    "MUON_DECAY",
    "SHAMPOO_EPS",
    "make_optimizer",
    "preconditioner_map",
    "preconditioner_slope",
    "imbalance",
    "steps_to",
    "max_after",
    "measure",
    "FACTOR_METHODS",
    "factored_product",
    "factored_start",
    "factored_balanced",
    "factored_imbalance",
    "train_factored",
    "measure_factored",
]

#: Per-step decay factor of ``"muon_decay"``'s step size.
MUON_DECAY = 0.97
#: Shampoo's initial statistics ``eps I`` (pytorch_optimizer's ``matrix_eps``).
SHAMPOO_EPS = 1e-6


class ExplainedShampoo(torch.optim.Optimizer):
    """Shampoo in a few lines: ``L += G G^T``, ``R += G^T G``, ``W -= lr L^{-1/4} G R^{-1/4}`` (2-D parameters).

    Statistics start at ``eps I``; inverse roots from an eigendecomposition at every step; no momentum,
    no grafting. The same variant as ``pytorch_optimizer.Shampoo(momentum=0, matrix_eps=eps,
    preconditioning_compute_steps=1)`` (the tests compare the two to round-off).
    """

    def __init__(self, params, lr: float, eps: float = SHAMPOO_EPS):
        super().__init__(params, dict(lr=lr, eps=eps))

    @staticmethod
    def inv_root(S: torch.Tensor, p: int = 4) -> torch.Tensor:
        ev, Q = torch.linalg.eigh(S)
        return (Q * ev.clamp_min(0) ** (-1.0 / p)) @ Q.T

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for W in group["params"]:
                G, st = W.grad, self.state[W]
                if not st:
                    st["L"] = group["eps"] * torch.eye(W.shape[0], dtype=W.dtype, device=W.device)
                    st["R"] = group["eps"] * torch.eye(W.shape[1], dtype=W.dtype, device=W.device)
                st["L"] += G @ G.T
                st["R"] += G.T @ G
                W -= group["lr"] * self.inv_root(st["L"]) @ G @ self.inv_root(st["R"])


def _pytorch_optimizer():
    try:
        import pytorch_optimizer
    except ImportError as exc:  # pragma: no cover - pinned in requirements.txt
        msg = "attnlib.optim.optimizers needs pytorch-optimizer (pip install pytorch-optimizer==4.1.0)"
        raise ImportError(msg) from exc
    return pytorch_optimizer


def _adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr)


def _muon(params, lr):
    return torch.optim.Muon(params, lr=lr, weight_decay=0.0)


def _shampoo(params, lr):
    return _pytorch_optimizer().Shampoo(
        params, lr=lr, momentum=0.0, matrix_eps=SHAMPOO_EPS, preconditioning_compute_steps=1
    )


def _explained_shampoo(params, lr):
    return ExplainedShampoo(params, lr=lr)


def _soap(params, lr):
    return _pytorch_optimizer().SOAP(params, lr=lr, weight_decay=0.0, precondition_frequency=1)


#: Optimizer factories ``make(params, lr)`` by method name.
OPTIMIZERS: Dict[str, Callable] = {
    "adamw": _adamw,
    "muon": _muon,
    "muon_decay": _muon,
    "shampoo": _shampoo,
    "shampoo_explained": _explained_shampoo,
    "soap": _soap,
}

#: Step-size schedules ``factor(t)`` (t = 0, 1, ...: the update's index) by method name.
SCHEDULES: Dict[str, Callable[[int], float]] = {"muon_decay": lambda t: MUON_DECAY**t}


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """The optimizer of method ``name`` (a key of :data:`OPTIMIZERS`) over ``params`` with step ``lr``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"name: expected one of {tuple(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name](params, check_nonneg_float(lr, "lr", positive=True))


def _register():
    for name, make in OPTIMIZERS.items():
        register_method(
            Method(
                name,
                (lambda m, s: lambda lr, ctx: TorchOptimizerStep(lr, m, s))(make, SCHEDULES.get(name)),
                preconditionable=False,
            )
        )


_register()


# ----------------------------------------------------------------------------- what the step learned


def preconditioner_map(step: Step, which: int = 0) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The linear map ``G -> direction`` that ``step`` applies to the gradient of parameter ``which``
    (0: ``A``, 1: ``B``) at its current state, or ``None`` where the update is not such a map.

    Gradient descent: the identity, or ``Sigma^{-1}`` on the right of ``A`` and on both sides of
    ``B`` (the structured method). Adam and AdamW: division by ``sqrt(v_hat) + eps`` entrywise
    (momentum left out). Shampoo (both implementations): ``L^{-1/4} G R^{-1/4}``. SOAP:
    ``Q_L [(Q_L^T G Q_R) / (sqrt(v) + eps)] Q_R^T`` (up to its scalar bias correction). Muon's
    orthogonalized update is not a linear map of the gradient (``None``).
    """
    if which not in (0, 1):
        raise ValueError(f"which: expected 0 (A) or 1 (B), got {which!r}")
    if isinstance(step, GradientStep):
        S = step.S_inv
        if S is None:
            return lambda G: G
        return (lambda G: G @ S) if which == 0 else (lambda G: S @ G @ S)
    opt = getattr(step, "opt", None)
    if opt is None:
        return None
    p = opt.param_groups[0]["params"][which]
    st = opt.state[p]
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        b2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
        t = float(st["step"])
        D = 1.0 / ((st["exp_avg_sq"] / (1 - b2**t)).sqrt() + eps)
        return lambda G: G * D
    if isinstance(opt, ExplainedShampoo):
        Li, Ri = ExplainedShampoo.inv_root(st["L"]), ExplainedShampoo.inv_root(st["R"])
        return lambda G: Li @ G @ Ri
    name = type(opt).__name__
    if name == "Shampoo":
        Li, Ri = st["inv_pre_cond_0"], st["inv_pre_cond_1"]
        return lambda G: Li @ G @ Ri
    if name == "SOAP":
        QL, QR = st["Q"]
        D = 1.0 / (st["exp_avg_sq"].sqrt() + opt.param_groups[0]["eps"])  # the bias correction is a scalar
        return lambda G: QL @ ((QL.T @ G @ QR) * D) @ QR.T
    return None


def preconditioner_slope(step: Step, Sigma, which: int = 0) -> float:
    r"""Log-slope of the learned right preconditioner over the eigenvectors of ``Sigma``.

    With ``P`` = :func:`preconditioner_map` of parameter ``which`` and ``v_i`` the eigenvectors of
    ``Sigma`` (eigenvalues ``lambda_i``), ``q_i = (1/m) sum_j <e_j v_i^T, P(e_j v_i^T)>`` (``m`` rows);
    for a Kronecker map ``P(G) = L G R`` this is ``tr(L)/m * v_i^T R v_i``. The slope of ``log q_i``
    against ``log lambda_i`` (least squares) is ``-1`` for the structured method (``R = Sigma^{-1}``)
    and ``0`` for gradient descent. NaN when the map is undefined (Muon), when ``Sigma`` is a multiple of
    the identity, or when some ``q_i <= 0``.
    """
    P = preconditioner_map(step, which)
    S = as_covariance(Sigma)
    eigs, V = torch.linalg.eigh(S)
    if P is None or float(eigs[-1] / eigs[0]) < 1.0 + 1e-9:
        return float("nan")
    d = S.shape[0]
    opt = getattr(step, "opt", None)
    rows = int(opt.param_groups[0]["params"][which].shape[0]) if opt is not None else (1 if which == 0 else d)
    q = []
    for i in range(d):
        tot = 0.0
        for j in range(rows):
            U = torch.zeros(rows, d, dtype=S.dtype, device=S.device)
            U[j] = V[:, i]
            tot += float(torch.sum(U * P(U)))
        q.append(tot / rows)
    q = np.asarray(q)
    if np.any(~np.isfinite(q)) or np.any(q <= 0):
        return float("nan")
    return float(np.polyfit(np.log(eigs.cpu().numpy()), np.log(q), 1)[0])


def imbalance(A, B, Sigma) -> float:
    r"""``||At^T At - C C^T||_F / ||At C||_*``: 0 exactly on the balanced factorizations (:mod:`attnlib.geometry`)."""
    At, C = to_factor(A, B, Sigma)
    P = At @ C
    nuc = float(torch.linalg.matrix_norm(P, ord="nuc"))
    return float(torch.linalg.norm(At.T @ At - C @ C.T)) / max(nuc, 1e-300)


# ----------------------------------------------------------------------------- convergence measures


def steps_to(h: History, tol: float) -> Optional[int]:
    """First recorded step with population excess ``<= tol`` (``None`` if never)."""
    return h.steps_to(check_nonneg_float(tol, "tol", positive=True), "excess")


def max_after(h: History, tol: float) -> Optional[float]:
    """Largest excess at or after the first step with excess ``<= tol`` (``None`` if never reached).

    Below ``tol`` means the run stayed there; above, that it reached the threshold and left it again.
    """
    s = steps_to(h, tol)
    if s is None:
        return None
    i = h.steps.index(s)
    return float(max(h.excess[i:]))


def measure(h: History, task: Task, *, n: int = 256, n_sequences: int = 4, seed: int = 0) -> Dict[str, float]:
    """What a finished run ended at: convergence measures, imbalance, softmax scale, held-out loss.

    ``steps_1e-6``, ``steps_1e-10`` (``nan``: never), ``max_after_1e-6``, ``max_after_1e-10``,
    ``final_excess``, ``imbalance``, ``nu`` (softmax scale; the heavy-tail threshold is 1/2),
    ``heldout`` (mean empirical loss on ``n_sequences`` fresh sequences of ``n`` tokens, minus the
    Bayes risk), ``time_per_step`` (seconds, wall time of the updates).
    """
    out = _convergence(h)
    out["imbalance"] = imbalance(h.A, h.B, task)
    out["nu"] = softmax_scale(h.A, h.B, task)
    out["heldout"] = heldout_loss(h.A, h.B, task, n, n_sequences=n_sequences, seed=seed) - task.bayes_risk
    out["time_per_step"] = h.time[-1] / max(h.steps[-1], 1)
    return out


# ----------------------------------------------------------------------------- four factors (query, key, value, output)
#
# The parameterization practitioners train: ``B = W_Q^T W_K`` with ``W_Q, W_K`` (d_h x d) and ``A = W_O W_V`` with
# ``W_V`` (d_h x d), ``W_O`` (k x d_h). The objective is the book's closed-form population loss composed with the
# maps (autograd gives the gradient). In the whitened coordinates ``Wt = W Sigma^{1/2}`` (for Q, K, V; ``W_O`` is
# unchanged) it is ``1/2 ||W_O Wt_V Wt_K^T Wt_Q - T||_F^2 + L*``: a four-factor factorization of ``T`` that does not
# see ``Sigma``. Gradient descent in those coordinates, mapped back, is gradient descent with the gradients of
# ``W_Q, W_K, W_V`` multiplied by ``Sigma^{-1}`` on the right (method ``"structured"`` here: the book's
# preconditioner in these coordinates; no spectral start, regularizer or renormalization).

#: Methods of the four-factor runs (``"muon_decay"``: Muon with the step ``lr * MUON_DECAY**t``).
FACTOR_METHODS = ("structured", "gd", "adam", "shampoo", "muon_decay")


def factored_product(WQ, WK, WV, WO) -> tuple:
    """``(A, B) = (W_O W_V, W_Q^T W_K)``: the layer's two matrices from the four factors."""
    return WO @ WV, WQ.T @ WK


def factored_start(task: Task, d_h: int, *, std: float = 0.5, seed: int = 0) -> tuple:
    r"""A random start ``(W_Q, W_K, W_V, W_O)`` with head dimension ``d_h`` (value dimension ``d_h`` too).

    Entries of the whitened factors ``Wt_Q, Wt_K, Wt_V`` and of ``W_O`` are ``std`` times standard normal
    (seeded); ``W = Wt Sigma^{-1/2}``. The start in the whitened coordinates is the same for every ``Sigma`` with the
    same seed.
    """
    d_h = check_positive_int(d_h, "d_h")
    std = check_nonneg_float(std, "std", positive=True)
    g = torch.Generator().manual_seed(int(seed))
    f64 = torch.float64
    d, k = task.d, task.k
    Wt = [std * torch.randn(d_h, d, generator=g, dtype=f64) for _ in range(3)]
    WO = std * torch.randn(k, d_h, generator=g, dtype=f64)
    ev, Q = torch.linalg.eigh(task.Sigma.to("cpu", f64))
    inv_half = (Q * ev.rsqrt()) @ Q.T
    out = [W @ inv_half for W in Wt] + [WO]
    return tuple(W.to(task.device, task.dtype) for W in out)


def factored_balanced(task: Task, d_h: int, *, seed: int = 0) -> tuple:
    r"""A balanced minimum ``(W_Q, W_K, W_V, W_O)`` of the four-factor problem (head dimension ``d_h >= rank(T)``).

    With ``T = U diag(s) V^T`` (thin, rank ``r``) and ``R`` (d x r) orthonormal (seeded): ``W_O = U s^{1/4}``,
    ``Wt_V = Wt_K = s^{1/4} R^T``, ``Wt_Q = s^{1/4} V^T`` (rows beyond ``r`` zero), ``W = Wt Sigma^{-1/2}``. Then
    ``At C = T`` (zero excess), query/key and output/value balanced in the whitened coordinates, and ``nu = s_1(T)``.
    """
    d_h = check_positive_int(d_h, "d_h")
    U, s, V = task.svd
    r = int(s.numel())
    if d_h < r:
        raise ValueError(f"d_h: expected a head dimension >= rank(T) = {r}, got {d_h}")
    g = torch.Generator().manual_seed(int(seed))
    R, _ = torch.linalg.qr(torch.randn(task.d, r, generator=g, dtype=torch.float64))
    R = R.to(task.Sigma)
    q = torch.zeros(d_h, r, dtype=task.dtype, device=task.device)
    q[:r] = torch.diag(s**0.25)
    ev, Q = torch.linalg.eigh(task.Sigma)
    inv_half = (Q * ev.rsqrt()) @ Q.T
    return (q @ V.T @ inv_half, q @ R.T @ inv_half, q @ R.T @ inv_half, U @ q.T)


def factored_imbalance(WQ, WK, WV, WO, task: Task, *, whitened: bool = True) -> Dict[str, float]:
    r"""Imbalance of query vs key and of output vs value, relative to the nuclear norm of the product.

    ``qk = ||Wt_Q Wt_Q^T - Wt_K Wt_K^T||_F / ||C||_*`` and ``ov = ||W_O^T W_O - Wt_V Wt_V^T||_F / ||At||_*`` with
    ``Wt = W Sigma^{1/2}`` (``whitened=True``: the balance of the four-factor factorization of ``T``) or
    ``Wt = W`` (``whitened=False``: the Euclidean balance that plain gradient flow conserves). Both are 0 exactly
    where the two factors of the product are balanced.
    """
    S = as_covariance(task)
    if whitened:
        ev, Q = torch.linalg.eigh(S)
        half = (Q * ev.sqrt()) @ Q.T
        WQ, WK, WV = WQ @ half, WK @ half, WV @ half
    C, At = WK.T @ WQ, WO @ WV

    def rel(X, Y, P):
        return float(torch.linalg.norm(X - Y)) / max(float(torch.linalg.matrix_norm(P, ord="nuc")), 1e-300)

    return dict(qk=rel(WQ @ WQ.T, WK @ WK.T, C), ov=rel(WO.T @ WO, WV @ WV.T, At))


def _factored_optimizer(method: str, params, lr: float) -> torch.optim.Optimizer:
    if method in ("gd", "structured"):
        return torch.optim.SGD(params, lr=lr)
    if method == "adam":
        return torch.optim.Adam(params, lr=lr)
    return make_optimizer(method, params, lr)


def _factored_update(o, params, e, S_inv, method: str, lr: float, t: int) -> None:
    """One optimizer step on the four factors from the excess ``e`` (preconditioned, scheduled as the method says)."""
    e.backward()
    if S_inv is not None:
        for W in params[:3]:
            W.grad = W.grad @ S_inv
    if method == "muon_decay":
        for group in o.param_groups:
            group["lr"] = lr * MUON_DECAY**t
    o.step()


def train_factored(
    task: Task, *, method: str, d_h: int, steps: int, lr: float, seed: int = 0, init_std: float = 0.5,
    on_divergence: str = "raise",
) -> History:  # fmt: skip
    r"""Train the four factors on the population objective with one of :data:`FACTOR_METHODS` (a loop over torch.optim).

    Every step: the excess ``task.excess_risk(W_O W_V, W_Q^T W_K)``, its gradient by autograd, one optimizer
    step. ``"gd"``: ``torch.optim.SGD``; ``"structured"``: the same with the gradients of ``W_Q, W_K, W_V``
    multiplied by ``Sigma^{-1}`` on the right; ``"adam"``: ``torch.optim.Adam``; ``"shampoo"``, ``"muon_decay"``: as
    in :data:`OPTIMIZERS`. Returns a :class:`~attnlib.optim.History` (``excess`` and ``loss`` at steps 0..steps,
    ``A``, ``B`` the final product, ``config["factors"]`` the final ``(W_Q, W_K, W_V, W_O)``). A non-finite excess or
    one above ``1e6`` times the first raises ``FloatingPointError`` (``on_divergence="raise"``) or stops the run with
    ``diverged`` set (``"stop"``). (The one loop :func:`attnlib.optim.run` trains the two matrices ``(A, B)``;
    this is the parameterization with four factors, with its own divergence criterion.)
    """
    if method not in FACTOR_METHODS:
        raise ValueError(f"method: expected one of {FACTOR_METHODS}, got {method!r}")
    if on_divergence not in ("raise", "stop"):
        raise ValueError(f"on_divergence: expected 'raise' or 'stop', got {on_divergence!r}")
    steps = check_positive_int(steps, "steps")
    lr = check_nonneg_float(lr, "lr", positive=True)
    params = [W.clone().requires_grad_(True) for W in factored_start(task, d_h, std=init_std, seed=seed)]
    o = _factored_optimizer(method, params, lr)
    S_inv = torch.linalg.inv(as_covariance(task)) if method == "structured" else None
    h = History(method=f"factored:{method}", config=dict(d_h=int(d_h), lr=lr, seed=int(seed), init_std=init_std))
    last = [W.detach().clone() for W in params]
    t0 = time.perf_counter()
    for t in range(steps + 1):
        o.zero_grad()
        e = task.excess_risk(*factored_product(*params))
        ev = float(e.detach())
        if not math.isfinite(ev) or (h.excess and ev > 1e6 * max(h.excess[0], 1e-300)):
            if on_divergence == "raise":
                raise FloatingPointError(f"factored {method} diverged at step {t} (lr = {lr:g})")
            h.diverged = True
            break
        last = [W.detach().clone() for W in params]
        h.steps.append(t)
        h.excess.append(ev)
        h.loss.append(ev + task.bayes_risk)
        h.time.append(time.perf_counter() - t0)
        if t == steps:
            break
        _factored_update(o, params, e, S_inv, method, lr, t)
    h.A, h.B = (X.detach() for X in factored_product(*last))
    h.config["factors"] = tuple(last)
    return h


def _convergence(h: History) -> Dict[str, float]:
    """Steps to the excess 1e-6 and 1e-10 (``nan``: never), the largest excess after each, the final excess."""
    nan = float("nan")
    out = {}
    for tol, lab in ((1e-6, "1e-6"), (1e-10, "1e-10")):
        s = steps_to(h, tol)
        out[f"steps_{lab}"] = nan if s is None else float(s)
        m = max_after(h, tol)
        out[f"max_after_{lab}"] = nan if m is None else m
    out["final_excess"] = float(h.excess[-1])
    return out


def measure_factored(h: History, task: Task) -> Dict[str, float]:
    """What a four-factor run ended at: steps to 1e-6 / 1e-10, largest excess after, final excess, the imbalances
    (:func:`factored_imbalance`, whitened and Euclidean; :func:`imbalance` of the product), ``nu`` and ``nu / s_1(T)``
    (1 at a balanced minimum of the product)."""
    out = _convergence(h)
    F = h.config["factors"]
    w, e = factored_imbalance(*F, task), factored_imbalance(*F, task, whitened=False)
    out.update(imb_qk=w["qk"], imb_ov=w["ov"], imb_qk_euclid=e["qk"], imb_ov_euclid=e["ov"])
    out["imbalance"] = imbalance(h.A, h.B, task)
    out["nu"] = softmax_scale(h.A, h.B, task)
    out["nu_over_s1"] = out["nu"] / float(task.svd[1][0])
    return out
