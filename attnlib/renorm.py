r"""A renormalization that keeps the softmax light-tailed, and the step rule that goes with it.

Background (book, chapter on the scaling law). On the orbit ``(t At, C / t)``, ``t > 0``, the
population loss is constant but the softmax scale is not: with ``q = Sigma^{1/2} z`` the
query-averaged variance of the softmax weights involves ``E_z exp(z^T C^T C z)``, finite only
if ``lambda_max(C^T C) < 1/2``. At a *balanced* factorization of the product ``P = At C``,
``C = W S^{1/2} V^T`` and ``lambda_max(C^T C) = s_1(P)``: the balancing renormalization of
:func:`attnlib.geometry.renormalize` therefore puts the layer in the heavy-tailed regime
whenever the target's largest singular value exceeds ``1/2``.

This module is our design (not the paper's): after balancing, move along the orbit so that
``lambda_max(C^T C)`` is at most ``kappa``:

* ``mode="cap"``: ``t^2 = max(1, s_1(P) / kappa)`` (only ever lowers the softmax scale; equals
  ``"balance"`` when ``s_1(P) <= kappa``);
* ``mode="fix"``: ``t^2 = s_1(P) / kappa`` (puts ``lambda_max(C^T C)`` exactly at ``kappa``, on
  either side of ``1/2``; the experiments use it to scan the softmax scale);
* ``mode="balance"``: ``t = 1`` (the book's default renormalization, for comparison).

All three keep the product ``At C``, hence the population loss. A step size that suits the
balanced point does not suit the rescaled one (the curvature in ``At`` scales like ``1/t^2``, in
``C`` like ``t^2``), so :class:`ScaledStructuredStep` takes the preconditioned step in the
balanced coordinates: the ``A`` block is scaled by ``t^2`` and the ``B`` block by ``1 / t^2``,
with ``t^2 = ||At||_F / ||C||_F`` read off the current iterate (1 at a balanced one). For
``"balance"`` it is exactly the preconditioned step of :class:`attnlib.train.GradientStep`.

The balancing regularizer is not used with ``"cap"``/``"fix"``: it pulls towards ``t = 1`` and
would fight the renormalization (with ``"balance"`` it is inert anyway, its gradient vanishes
at balanced iterates).

Nothing here edits :mod:`attnlib.train`: the renormalization lives in the step rule, which the
engine's :func:`attnlib.train.run` drives with ``renormalize=None``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._validate import check_nonneg_float, check_positive_int, check_samples
from .attention import empirical_loss
from .finite_n import softmax_scale  # re-exported: the heavy-tail index lives in finite_n
from .geometry import from_factor, renormalize, to_factor
from .init import spectral_init
from .task import SigmaLike, Task, as_covariance, empirical_task
from .train import DivergenceGuard, GradientStep, History, Objective, Recorder, run

__all__ = [
    "RENORM_MODES",
    "softmax_scale",
    "renormalize_scaled",
    "ScaledStructuredStep",
    "train_sequence",
    "orbit_distance",
]

#: The renormalization modes of :func:`renormalize_scaled`.
RENORM_MODES = ("balance", "cap", "fix")


def _check_mode(mode: str, kappa) -> Optional[float]:
    if mode not in RENORM_MODES:
        raise ValueError(f"mode: expected one of {RENORM_MODES}, got {mode!r}")
    if mode == "balance":
        return None
    if kappa is None:
        raise ValueError(f"kappa: mode {mode!r} needs a positive bound kappa on lambda_max(C^T C)")
    return check_nonneg_float(kappa, "kappa", positive=True)


def renormalize_scaled(
    A, B, Sigma: SigmaLike, mode: str = "cap", kappa: Optional[float] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Balance, then move along the orbit ``(t At, C / t)`` so that ``lambda_max(C^T C) <= kappa``.

    ``mode``: ``"balance"`` (``t = 1``; same as ``geometry.renormalize(..., "balance")``),
    ``"cap"`` (``t^2 = max(1, s_1(At C) / kappa)``) or ``"fix"`` (``t^2 = s_1(At C) / kappa``).
    The product ``At C`` (hence the population loss) is unchanged. Returns ``(A, B)``.
    """
    kappa = _check_mode(mode, kappa)
    Ab, Bb = renormalize(A, B, Sigma, "balance")
    if mode == "balance":
        return Ab, Bb
    At, C = to_factor(Ab, Bb, Sigma)
    lam = float(torch.linalg.matrix_norm(C, ord=2) ** 2)  # = s_1(At C) at a balanced point
    if lam == 0.0:
        return Ab, Bb
    t2 = lam / kappa
    if mode == "cap":
        t2 = max(1.0, t2)
    t = t2**0.5
    return from_factor(t * At, C / t, Sigma)


class ScaledStructuredStep(GradientStep):
    """Preconditioned gradient step taken in the balanced coordinates, then :func:`renormalize_scaled`.

    ``direction``: ``(t^2 gA Sigma^{-1}, t^{-2} Sigma^{-1} gB Sigma^{-1})`` with
    ``t^2 = ||At||_F / ||C||_F`` (``t = 1`` for ``mode="balance"``), i.e. plain gradient descent
    on ``(At / t, t C)``. ``update`` applies it and renormalizes with ``objective.geometry``.
    """

    def __init__(self, lr: float, Sigma: SigmaLike, mode: str = "cap", kappa: Optional[float] = None):
        self.mode, self.kappa = mode, _check_mode(mode, kappa)
        self.Sigma = as_covariance(Sigma)
        super().__init__(lr, torch.linalg.inv(self.Sigma))

    def scale(self, A, B) -> float:
        """``t^2`` of the current iterate (1 for ``"balance"``)."""
        if self.mode == "balance":
            return 1.0
        At, C = to_factor(A.detach(), B.detach(), self.Sigma)
        na, nc = float(torch.linalg.norm(At)), float(torch.linalg.norm(C))
        return na / nc if na > 0 and nc > 0 else 1.0

    def update(self, objective, A, B, grads) -> None:
        t2 = self.scale(A, B)
        gA, gB = self.direction(*grads)
        with torch.no_grad():
            A -= (self.lr * t2) * gA
            B -= (self.lr / t2) * gB
            if bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all()):
                An, Bn = renormalize_scaled(A, B, self.Sigma, self.mode, self.kappa)
                A.copy_(An)
                B.copy_(Bn)


def train_sequence(
    X,
    Y,
    *,
    steps: int,
    lr: float,
    mode: str = "cap",
    kappa: Optional[float] = None,
    init=None,
    task: Optional[Task] = None,
    record_every: int = 1,
    on_divergence: str = "stop",
    recorder_cls=Recorder,
) -> History:
    """Algorithm 1 on one sequence with the renormalization ``mode`` (regime (i), ``n`` = sample size).

    Spectral initialization (or ``init = (A, B)``), preconditioner and renormalization with
    ``Sigmahat = X^T X / n``, no regularizer (see the module docstring), the step of
    :class:`ScaledStructuredStep`. ``task`` records the population excess and ``dist_P`` at
    every recorded step. Returns the engine's :class:`~attnlib.train.History`.
    ``recorder_cls`` may be a subclass of :class:`~attnlib.train.Recorder` (same constructor).
    """
    X, Y = check_samples(X, Y)
    steps = check_positive_int(steps, "steps", minimum=0)
    lr = check_nonneg_float(lr, "lr", positive=True)
    kappa = _check_mode(mode, kappa)
    n, d = X.shape
    if n < d:
        raise ValueError(f"X: the structured components need n >= d, got n = {n}, d = {d}")
    geom = empirical_task(X, Y)
    A, B = spectral_init(X, Y) if init is None else (init[0].to(X).clone(), init[1].to(X).clone())
    objective = Objective(lambda A_, B_, idx: empirical_loss(A_, B_, X, Y, queries=idx), geometry=geom, n_queries=n)
    step = ScaledStructuredStep(lr, geom.Sigma, mode, kappa)
    config = dict(n=n, d=d, k=Y.shape[1], steps=steps, lr=lr, method="structured", renormalize=mode, kappa=kappa)
    hist = History(method="structured", config=config)
    guard = DivergenceGuard(on_divergence, "structured", lr, X.dtype)
    rec = recorder_cls(hist, task.to(dtype=X.dtype, device=X.device) if task is not None else None, guard)
    hist.A, hist.B = run(
        objective, step, A, B, steps=steps, renormalize=None, recorder=rec, guard=guard, record_every=record_every
    )
    hist.diverged = guard.diverged
    return hist


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
