r"""What is minimized: the objectives of the one training loop, as composable pieces.

An :class:`Objective` is a loss ``loss(A, B, idx)`` (``idx``: a LongTensor of query rows for a
minibatch, or ``None``), the task whose covariance the structured components use (``geometry``:
``Sigmahat`` for a sample, ``Sigma`` on the population and in regime (ii)), and optionally the
balancing regularizer (``with_regularizer(lam)``). Three losses:

* :func:`empirical_objective`: ``Lhat_n`` on one sequence ``(X, Y)`` (regime (i));
* :func:`population_objective`: the closed-form population loss ``L`` of a task;
* :class:`PromptObjective`: the expected loss ``L_n`` of regime (ii), estimated on fresh prompts
  at every call (control variate by default).

Every input is validated once, when the objective is built; evaluations inside the loop are not
re-validated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .._validate import check_matrix, check_positive_int, check_samples, resolve_dtype
from ..geometry import regularizer
from ..model.kernels import ENGINES, _kernel_loss_unchecked, _kernel_losses_cv, resolve_engine
from ..model.layer import _empirical_loss
from ..model.prompts import _check_prompts, _limit_losses, _prompt_losses, sample_prompts
from ..model.task import Task, check_task, empirical_task
from ..rng import make_generator

__all__ = ["Objective", "empirical_objective", "population_objective", "PromptObjective"]


@dataclass(frozen=True)
class Objective:
    """A loss, the geometry the structured components use, and the balancing regularizer's weight.

    ``loss(A, B, idx)``: the training loss; ``geometry``: a :class:`~attnlib.model.task.Task` or
    ``None`` (no structured component possible); ``lam``: the regularizer's weight (``0``: off);
    ``n_queries``: the number of query rows a minibatch can draw from (``None``: no minibatches).
    Calling it returns ``(loss, objective)``, both 0-dim tensors.
    """

    loss: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
    geometry: Optional[Task] = None
    lam: float = 0.0
    n_queries: Optional[int] = None

    def __call__(self, A, B, idx=None) -> Tuple[torch.Tensor, torch.Tensor]:
        loss = self.loss(A, B, idx)
        if self.lam:
            return loss, loss + regularizer(A, B, self.geometry, self.lam)
        return loss, loss

    def with_regularizer(self, lam: float) -> "Objective":
        """The same objective plus the balancing regularizer ``lam/4 ||At^T At - C C^T||_F^2`` of ``geometry``."""
        if lam and self.geometry is None:
            raise ValueError("lam: the balancing regularizer needs the objective's geometry (a covariance)")
        return dataclasses.replace(self, lam=float(lam))


def empirical_objective(X, Y, *, geometry: bool = True) -> Objective:
    """``Lhat_n`` on one sequence (``X`` (n, d), ``Y`` (n, k)); ``geometry``: attach ``Sigmahat = X^T X / n``."""
    X, Y = check_samples(X, Y)
    n, d = X.shape
    if geometry and n < d:
        raise ValueError(f"X: the structured components need n >= d (Sigmahat invertible), got n = {n}, d = {d}")
    return Objective(
        lambda A, B, idx: _empirical_loss(A, B, X, Y, idx),
        geometry=empirical_task(X, Y) if geometry else None,
        n_queries=n,
    )


def population_objective(task: Task) -> Objective:
    """The closed-form population loss ``L(A, B)`` of ``task`` (its ``Sigma`` is the geometry)."""
    task = check_task(task)
    return Objective(lambda A, B, idx: task.population_loss(A, B), geometry=task)


class PromptObjective:
    """The stochastic training loss of regime (ii), a ``loss(A, B, idx)`` for :class:`Objective`.

    Every call draws ``prompts`` fresh prompts of ``n`` tokens from ``generator`` and returns
    an unbiased estimate of ``L_n(A, B)`` (a 0-dim tensor, differentiable):
    ``mean_b Lhat_n(X_b)`` (``control_variate=False``) or
    ``L(A, B) + mean_b [Lhat_n(X_b) - Lhat_lim(X_b)]`` (default). ``idx`` is ignored.
    ``calls`` counts the evaluations (= batches drawn). :meth:`objective` wraps it in an
    :class:`Objective` with the task as geometry.

    ``engine``: how ``mean_b Lhat_n(X_b)`` and its gradient are computed: ``"auto"`` (default) the
    moment kernel :func:`attnlib.model.kernels.kernel_loss` on CPU (one pass, no backward), SDPA and
    autograd on CUDA; ``"kernel"`` or ``"sdpa"`` to choose (equal to round-off,
    ``tests/test_kernels.py``). ``attention_dtype``: the dtype of that attention part (default: the
    task's); ``torch.float32`` runs it in float32 on the same prompts (drawn in the task's dtype) with
    the sums over queries and the control variate in the task's dtype.
    """

    def __init__(
        self,
        task: Task,
        n: int,
        prompts: int,
        generator: torch.Generator,
        control_variate: bool = True,
        *,
        engine: str = "auto",
        attention_dtype=None,
    ):
        self.task = check_task(task)
        self.n = check_positive_int(n, "n")
        self.prompts = check_positive_int(prompts, "prompts")
        self.gen = make_generator(None, generator)
        self.control_variate = bool(control_variate)
        if engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
        self.engine = engine
        try:
            self.attention_dtype = task.dtype if attention_dtype is None else resolve_dtype(attention_dtype)
        except ValueError as err:
            raise ValueError(f"attention_dtype: {str(err).split(': ', 1)[1]}") from None
        self.calls = 0

    def objective(self) -> Objective:
        """This loss as an :class:`Objective` (geometry: the task; no regularizer)."""
        return Objective(self, geometry=self.task)

    def draw(self):
        self.calls += 1
        return sample_prompts(self.task, self.n, self.prompts, generator=self.gen)

    def _check(self, A, B, X, Y):
        X, Y = _check_prompts(X, Y)
        d, k = self.task.d, self.task.k
        if X.shape[2] != d or Y.shape[2] != k:
            raise ValueError(f"X, Y: expected prompts of dimension d = {d}, k = {k}, got {X.shape[2]}, {Y.shape[2]}")
        check_matrix(A, "A", (k, d))
        check_matrix(B, "B", (d, d))
        return X.to(self.task.Sigma), Y.to(self.task.Sigma)

    def attention_loss(self, A, B, X, Y) -> torch.Tensor:
        """``mean_b Lhat_n(theta; X_b)`` with this objective's engine and attention dtype (0-dim, differentiable)."""
        return self._attention_loss(A, B, *self._check(A, B, X, Y))

    def estimate(self, A, B, X, Y) -> torch.Tensor:
        """The estimate on given prompts ``(X, Y)`` (no draw)."""
        return self._estimate(A, B, *self._check(A, B, X, Y))

    def __call__(self, A, B, idx=None) -> torch.Tensor:
        return self._estimate(A, B, *self.draw())  # the objective's own draws: validated once, by construction

    def _attention_loss(self, A, B, X, Y) -> torch.Tensor:
        Xa, Ya = X.to(self.attention_dtype), Y.to(self.attention_dtype)
        if resolve_engine(self.engine, Xa) == "kernel":
            return _kernel_loss_unchecked(A, B, Xa, Ya).to(A.dtype)
        return _prompt_losses(A.to(Xa.dtype), B.to(Xa.dtype), Xa, Ya).mean().to(A.dtype)

    def _estimate(self, A, B, X, Y) -> torch.Tensor:
        if not self.control_variate:
            return self._attention_loss(A, B, X, Y)
        if resolve_engine(self.engine, X[:0].to(self.attention_dtype)) == "kernel":  # both losses from one pass
            att, lim = _kernel_losses_cv(A, B, A @ self.task.Sigma @ B.mT, X, Y, adt=self.attention_dtype)
            corr = att - lim
        else:
            corr = self._attention_loss(A, B, X, Y) - _limit_losses(A, B, self.task.Sigma, X, Y).mean()
        return self.task.population_loss(A, B) + corr
