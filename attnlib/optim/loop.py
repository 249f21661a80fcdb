"""The one training loop, its record and its divergence policy.

:func:`run` drives a step rule (:class:`attnlib.optim.Step`) on an objective
(:class:`attnlib.optim.Objective`): evaluate, record, update, renormalize
(:class:`attnlib.geometry.Renormalization`, the one place where iterates move along the orbit),
check. A :class:`DivergenceGuard` is the single place that decides what a non-finite or
overflowing iterate means; a :class:`Recorder` the single place that writes the :class:`History`;
anything else a run needs to watch (iterate averages, snapshots) is a *hook*: a callable
``hook(t, A, B, loss, recorded)`` called at every iteration after the record, composed, not subclassed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..geometry import distance_to_manifold
from ..model.task import Task

__all__ = ["History", "DivergenceError", "DivergenceGuard", "Recorder", "IterateAverage", "Snapshots", "run"]


class DivergenceError(FloatingPointError):
    """Raised when the objective or the parameters stop being finite (step size too large)."""


@dataclass
class History:
    """Record of one training run.

    Lists have one entry per recorded iterate (``steps`` holds the iteration
    numbers, starting at 0 = the initialization). ``objective`` is the
    (regularized) training objective, ``loss`` its unregularized part,
    ``grad_norm`` the Euclidean norm of the objective's gradient (NaN where the
    step rule does not compute the full gradient), ``time`` the cumulative wall
    time of the updates in seconds. ``excess`` (population ``L - L*``) and
    ``dist`` (``dist_P`` to the manifold) are filled when a task is known.
    ``A`` and ``B`` are the final parameters (after a divergence with
    ``on_divergence="stop"``: the last finite iterate, and ``diverged`` is set).
    ``step_rule`` is the step rule the run used (its state is what an optimizer learned).
    """

    method: str
    config: Dict[str, object]
    steps: List[int] = field(default_factory=list)
    objective: List[float] = field(default_factory=list)
    loss: List[float] = field(default_factory=list)
    grad_norm: List[float] = field(default_factory=list)
    time: List[float] = field(default_factory=list)
    excess: List[float] = field(default_factory=list)
    dist: List[float] = field(default_factory=list)
    A: Optional[torch.Tensor] = None
    B: Optional[torch.Tensor] = None
    diverged: bool = False
    step_rule: Optional[object] = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.steps)

    def as_arrays(self) -> Dict[str, np.ndarray]:
        """The recorded series as numpy arrays (empty series are left out)."""
        keys = ("steps", "objective", "loss", "grad_norm", "time", "excess", "dist")
        return {k: np.asarray(getattr(self, k)) for k in keys if len(getattr(self, k))}

    def steps_to(self, tol: float, series: str = "excess") -> Optional[int]:
        """First recorded iteration at which ``series`` is ``<= tol`` (``None`` if never)."""
        for s, v in zip(self.steps, getattr(self, series)):
            if v <= tol:
                return s
        return None


class DivergenceGuard:
    """The one place that decides what a non-finite or overflowing iterate means.

    ``on_divergence="raise"`` raises :class:`DivergenceError`; ``"stop"``
    sets ``History.diverged`` and lets the loop end with the last finite iterate.
    A population excess beyond ``sqrt(finfo.max)`` also counts as divergence:
    the finite-n loss stays bounded when ``B`` blows up (hard attention), the
    population excess does not, and the next matrix products would overflow.
    """

    def __init__(self, on_divergence: str, method: str, lr: float, dtype: torch.dtype):
        self.on_divergence, self.method, self.lr = on_divergence, method, lr
        self.overflow = float(torch.finfo(dtype).max) ** 0.5
        self.diverged = False

    def ok(self, t: int, *values) -> bool:
        """True if every tensor/number in ``values`` is finite (numbers also ``<= overflow``)."""
        for v in values:
            good = bool(torch.isfinite(v).all()) if isinstance(v, torch.Tensor) else v <= self.overflow
            if not good:  # (a comparison with NaN is False)
                self.diverged = True
                if self.on_divergence == "raise":
                    raise DivergenceError(
                        f"training diverged at step {t} (method={self.method!r}, lr={self.lr}): the objective "
                        f"or the parameters are no longer finite; lower lr"
                    )
                return False
        return True


class Recorder:
    """The one place that writes a :class:`History` row (and its population diagnostics).

    ``to_original(A, B)`` maps the trained parameters to those of the layer on
    raw tokens (identity unless the tokens were whitened).
    """

    def __init__(self, history: History, task: Optional[Task], guard: DivergenceGuard, to_original: Callable):
        self.h, self.task, self.guard, self.to_original = history, task, guard, to_original

    def record(self, t, A, B, loss, obj, grads, elapsed) -> bool:
        """Append one row; False if the loop must stop (divergence with ``on_divergence="stop"``)."""
        if not self.guard.ok(t, obj.detach(), A.detach(), B.detach()):
            return False
        h = self.h
        if self.task is not None:
            with torch.no_grad():
                Ao, Bo = self.to_original(A.detach(), B.detach())
                excess = float(self.task.excess_risk(Ao, Bo))
                if not self.guard.ok(t, excess):
                    return False
                h.excess.append(excess)
                h.dist.append(float(distance_to_manifold(Ao, Bo, self.task)))
        h.steps.append(t)
        h.loss.append(float(loss.detach()))
        h.objective.append(float(obj.detach()))
        gn = float("nan") if grads is None else float(torch.sqrt(sum(torch.sum(g * g) for g in grads)))
        h.grad_norm.append(gn)
        h.time.append(elapsed)
        return True


class IterateAverage:
    """Hook: from iteration ``burn_in`` on, the running sums of the limit map ``A Sigma B^T`` and of the loss."""

    def __init__(self, task: Task, burn_in: int):
        self.task, self.burn_in = task, burn_in
        self.G_sum = torch.zeros_like(task.M)
        self.loss_sum, self.count = 0.0, 0

    def __call__(self, t, A, B, loss, recorded) -> None:
        if t >= self.burn_in:
            with torch.no_grad():
                self.G_sum += A.detach() @ self.task.Sigma @ B.detach().T
            self.loss_sum += float(loss.detach())
            self.count += 1


class Snapshots:
    """Hook: a copy of every recorded iterate, in ``iterates`` (for distances to a limit's orbit)."""

    def __init__(self):
        self.iterates: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, t, A, B, loss, recorded) -> None:
        if recorded:
            self.iterates.append((A.detach().clone(), B.detach().clone()))


def run(
    objective,
    step,
    init: Tuple[torch.Tensor, torch.Tensor],
    config,
    recorder: Recorder,
    *,
    renormalization: Optional[Callable] = None,
    hooks: Sequence[Callable] = (),
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The training loop shared by every method; returns the final ``(A, B)`` (detached).

    From ``init = (A, B)``, iteration ``t = 0..config.steps``: evaluate; record every
    ``config.record_every`` steps and at the last one (``recorder``; between records the guard still
    checks the objective); call every hook; then, unless ``t == steps``, update with ``step``, apply
    ``renormalization`` to a finite iterate, and check the new iterate with the recorder's guard; on
    divergence the last finite iterate is kept. ``config.progress`` shows a tqdm bar. Inputs are
    validated by the caller (:func:`attnlib.optim.fit`).
    """
    guard, steps, record_every = recorder.guard, config.steps, config.record_every
    A = init[0].clone().requires_grad_(True)
    B = init[1].clone().requires_grad_(True)
    elapsed = 0.0
    bar = _progress_bar(config.progress, steps, recorder.h.method)
    for t in range(steps + 1):
        rec = (t % record_every == 0) or t == steps
        t0 = time.perf_counter()
        loss, obj, grads = step.evaluate(objective, A, B, rec)
        if step.timed:
            elapsed += time.perf_counter() - t0
        if rec and not recorder.record(t, A, B, loss, obj, grads, elapsed):
            break
        if not rec and obj is not None and not guard.ok(t, obj.detach()):
            break
        for hook in hooks:
            hook(t, A, B, loss, rec)
        if t == steps:
            break
        t0 = time.perf_counter()
        last_A, last_B = A.detach().clone(), B.detach().clone()
        step.update(objective, A, B, grads)
        with torch.no_grad():
            if renormalization is not None and bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all()):
                A_new, B_new = renormalization(A, B)
                A.copy_(A_new)
                B.copy_(B_new)
        elapsed += time.perf_counter() - t0
        if not guard.ok(t + 1, A.detach(), B.detach()):
            with torch.no_grad():  # keep the last finite iterate, never return NaN parameters
                A.copy_(last_A)
                B.copy_(last_B)
            break
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return A.detach(), B.detach()


def _progress_bar(progress: bool, steps: int, desc: str):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=steps, desc=desc, leave=False)
