r"""Regime (ii): context length ``n``, infinitely many prompts.

Here ``n`` is the length of each prompt and the training objective is the expected loss over
independent prompts,

.. math:: L_n(\theta) = \mathbb E_X\,\hat L_n(\theta; X), \qquad
          \hat L_n(\theta; X) = \frac1{2n}\sum_{i=1}^n \|f_\theta(x_i; X) - y_i\|^2 ,

minimized with fresh prompts at every step. Ingredients (each tested in ``tests/test_prompts.py``):

* :func:`sample_prompts`, :func:`batched_attention`, :func:`prompt_losses`: ``P`` prompts of ``n``
  tokens at once, through the fused kernel (``scaled_dot_product_attention`` on a
  ``(P, 1, n, d)`` batch); in training, the mean loss and its gradient come from the moment kernel
  :func:`attnlib.kernels.kernel_loss` on CPU (one pass over the pairs, no backward; SDPA on CUDA);
* :class:`PromptObjective`: the stochastic objective for :func:`attnlib.train.run`. With the
  control variate (default) one evaluation is
  ``L(theta) + mean_b [Lhat_n(theta; X_b) - Lhat_lim(theta; X_b)]``, where
  ``Lhat_lim(theta; X) = 1/(2n) sum_i ||A Sigma B^T x_i - y_i||^2`` is the limit layer on the same
  tokens (its expectation is the closed-form population loss ``L``). Unbiased for ``L_n`` and its
  gradient; the limit part of the Monte Carlo noise cancels;
* :func:`run_chain`: the structured algorithm on ``L_n`` (preconditioner and renormalization with
  the true ``Sigma``, which infinitely many prompts reveal; :mod:`attnlib.renorm` for the
  renormalization) from a point of the minimum set, with iterate averaging of the limit map
  ``A Sigma B^T`` after a burn-in;
* :func:`excess_ustat`: from ``K`` independent chains, an estimate of ``L(theta_n) - L*`` that is
  unbiased under the Monte Carlo noise of the chains (a U-statistic over pairs), with a
  jackknife standard error.

Label noise does not move the minimizer: ``L_n`` with noise ``sigma`` equals ``L_n`` without it
plus ``k sigma^2 / 2`` (the layer's output does not depend on the labels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ._validate import check_matrix, check_nonneg_float, check_positive_int, resolve_dtype
from .geometry import manifold_point
from .kernels import ENGINES, _kernel_loss_unchecked, resolve_engine
from .renorm import ScaledStructuredStep, renormalize_scaled, softmax_scale
from .rng import make_generator
from .task import SigmaLike, Task, as_covariance
from .train import DivergenceGuard, History, Objective, Recorder, run

__all__ = [
    "sample_prompts",
    "batched_attention",
    "prompt_losses",
    "limit_losses",
    "PromptObjective",
    "ChainResult",
    "run_chain",
]


def _check_task(task) -> Task:
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    return task


def _check_prompts(X, Y=None):
    X = check_matrix(X, "X", (None, None, None))
    if min(X.shape) < 1:
        raise ValueError(f"X: expected a non-empty (P, n, d) array, got shape {tuple(X.shape)}")
    if Y is not None:
        Y = check_matrix(Y, "Y", (X.shape[0], X.shape[1], None), dtype=X.dtype, device=X.device)
    return X, Y


def sample_prompts(task: Task, n: int, prompts: int, *, seed=None, generator=None):
    """``prompts`` independent prompts of ``n`` tokens: ``X`` (P, n, d) and ``Y`` (P, n, k).

    Drawn with :meth:`attnlib.task.Task.sample` (float64 on the CPU from the seed or generator, then moved
    to the task's dtype and device); prompt ``b`` is rows ``b n .. (b + 1) n - 1`` of one draw.
    """
    task = _check_task(task)
    n = check_positive_int(n, "n")
    prompts = check_positive_int(prompts, "prompts")
    X, Y = task.sample(n * prompts, seed=seed, generator=generator)
    return X.reshape(prompts, n, task.d), Y.reshape(prompts, n, task.k)


def batched_attention(A, B, X) -> torch.Tensor:
    """Self-attention of every prompt at once, fused kernel: ``X`` (P, n, d) -> (P, n, k).

    Row ``i`` of prompt ``b`` is ``A sum_j pi_ij x_j`` with ``pi_i = softmax_j(x_i^T B x_j)`` over
    the ``n`` tokens of that prompt (itself included): :func:`attnlib.attention.attention` per prompt.
    """
    X, _ = _check_prompts(X)
    d = X.shape[2]
    A = check_matrix(A, "A", (None, d)).to(dtype=X.dtype, device=X.device)
    B = check_matrix(B, "B", (d, d)).to(dtype=X.dtype, device=X.device)
    kv = X[:, None]  # (P, 1, n, d)
    out = F.scaled_dot_product_attention((X @ B)[:, None], kv, kv, scale=1.0)[:, 0]
    return out @ A.T


def prompt_losses(A, B, X, Y) -> torch.Tensor:
    """``Lhat_n(theta; X_b)`` for every prompt ``b``: a tensor of shape (P,)."""
    X, Y = _check_prompts(X, Y)
    out = batched_attention(A, B, X)
    return 0.5 * ((out - Y) ** 2).sum(dim=(1, 2)) / X.shape[1]


def limit_losses(A, B, Sigma: SigmaLike, X, Y) -> torch.Tensor:
    """``Lhat_lim(theta; X_b) = 1/(2n) sum_i ||A Sigma B^T x_i - y_i||^2`` for every prompt: shape (P,).

    Its expectation over a prompt is the population loss ``L(theta)``.
    """
    X, Y = _check_prompts(X, Y)
    S = as_covariance(Sigma).to(X)
    d = X.shape[2]
    A = check_matrix(A, "A", (None, d)).to(X)
    B = check_matrix(B, "B", (d, d)).to(X)
    return _limit_losses(A, B, S, X, Y)


def _limit_losses(A, B, S, X, Y) -> torch.Tensor:
    """:func:`limit_losses` without the checks (validated inputs, ``S`` the covariance matrix)."""
    out = X @ (A @ S @ B.T).T
    return 0.5 * ((out - Y) ** 2).sum(dim=(1, 2)) / X.shape[1]


def _prompt_losses(A, B, X, Y) -> torch.Tensor:
    """:func:`prompt_losses` without the checks (validated inputs of one dtype)."""
    kv = X[:, None]
    out = F.scaled_dot_product_attention((X @ B)[:, None], kv, kv, scale=1.0)[:, 0] @ A.T
    return 0.5 * ((out - Y) ** 2).sum(dim=(1, 2)) / X.shape[1]


class PromptObjective:
    """The stochastic training loss of regime (ii), a ``loss(A, B, idx)`` for :class:`attnlib.train.Objective`.

    Every call draws ``prompts`` fresh prompts of ``n`` tokens from ``generator`` and returns
    an unbiased estimate of ``L_n(A, B)`` (a 0-dim tensor, differentiable):
    ``mean_b Lhat_n(X_b)`` (``control_variate=False``) or
    ``L(A, B) + mean_b [Lhat_n(X_b) - Lhat_lim(X_b)]`` (default). ``idx`` is ignored.
    ``calls`` counts the evaluations (= batches drawn).

    ``engine``: how ``mean_b Lhat_n(X_b)`` and its gradient are computed: ``"auto"`` (default) the
    moment kernel :func:`attnlib.kernels.kernel_loss` on CPU (one pass, no backward), SDPA and
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
        self.task = _check_task(task)
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
        corr = self._attention_loss(A, B, X, Y) - _limit_losses(A, B, self.task.Sigma, X, Y).mean()
        return self.task.population_loss(A, B) + corr


class _AveragingRecorder(Recorder):
    """Records every ``keep_every`` steps; from ``burn_in`` on, accumulates ``A Sigma B^T`` and the loss."""

    def __init__(self, history, task, guard, *, burn_in: int, keep_every: int, last: int):
        super().__init__(history, task, guard)
        self.burn_in, self.keep_every, self.last = burn_in, keep_every, last
        self.G_sum = torch.zeros_like(task.M)
        self.loss_sum, self.count, self.scales = 0.0, 0, []

    def record(self, t, A, B, loss, obj, grads, elapsed) -> bool:
        if t >= self.burn_in:
            with torch.no_grad():
                self.G_sum += A.detach() @ self.task.Sigma @ B.detach().T
            self.loss_sum += float(loss.detach())
            self.count += 1
        if t % self.keep_every == 0 or t == self.last:
            self.scales.append(softmax_scale(A.detach(), B.detach(), self.task))
            return super().record(t, A, B, loss, obj, grads, elapsed)
        return self.guard.ok(t, obj.detach(), A.detach(), B.detach())


@dataclass
class ChainResult:
    """One chain of :func:`run_chain`.

    ``R``: the averaged residual ``mean_m A_m Sigma B_m^T - M`` over the steps after the burn-in
    (k x d numpy array); ``naive_excess``: ``1/2 ||R Sigma^{1/2}||^2`` (biased upwards by the
    Monte Carlo noise; :func:`excess_ustat` removes it); ``test_excess``: mean over the same
    steps of the estimates of ``L_n - L*`` (what a user of the layer at length ``n`` sees,
    minus the Bayes risk); ``scale``: ``lambda_max(C^T C)`` at the last iterate; ``history``:
    the engine's record (every ``keep_every`` steps); ``batches``: prompt batches drawn.
    """

    R: np.ndarray
    naive_excess: float
    test_excess: float
    scale: float
    history: History
    batches: int


def run_chain(
    task: Task,
    n: int,
    *,
    steps: int,
    burn_in: int,
    prompts: int,
    lr: float = 0.5,
    mode: str = "balance",
    kappa: Optional[float] = None,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    control_variate: bool = True,
    init=None,
    keep_every: int = 10,
    engine: str = "auto",
    attention_dtype=None,
) -> ChainResult:
    """The structured algorithm on the expected loss ``L_n`` (regime (ii)), one chain.

    Start: ``init = (A, B)`` or, by default, the balanced minimum ``W = V`` of ``task``
    (:func:`attnlib.geometry.manifold_point`), renormalized with ``mode``/``kappa``. Each of ``steps``
    updates draws ``prompts`` fresh prompts (:class:`PromptObjective`), takes the step of
    :class:`attnlib.renorm.ScaledStructuredStep` (preconditioner ``Sigma^{-1}``; no regularizer)
    and renormalizes. The limit map ``A Sigma B^T`` is averaged over iterates ``burn_in .. steps``.
    The seeds of independent chains must differ (e.g. ``derive_seed``). ``engine`` and
    ``attention_dtype``: as in :class:`PromptObjective`.
    """
    task = _check_task(task)
    n = check_positive_int(n, "n")
    steps = check_positive_int(steps, "steps")
    burn_in = check_positive_int(burn_in, "burn_in", minimum=0)
    if burn_in >= steps:
        raise ValueError(f"burn_in: expected fewer than steps = {steps} burn-in steps, got {burn_in}")
    prompts = check_positive_int(prompts, "prompts")
    lr = check_nonneg_float(lr, "lr", positive=True)
    keep_every = check_positive_int(keep_every, "keep_every")
    gen = make_generator(seed, generator)
    if init is None:
        A, B = manifold_point(task, task.svd[2])
    else:
        A = check_matrix(init[0], "init[0] (A)", (task.k, task.d)).to(task.Sigma)
        B = check_matrix(init[1], "init[1] (B)", (task.d, task.d)).to(task.Sigma)
    step = ScaledStructuredStep(lr, task, mode, kappa)
    A, B = renormalize_scaled(A, B, task, mode, kappa)
    loss = PromptObjective(task, n, prompts, gen, control_variate, engine=engine, attention_dtype=attention_dtype)
    objective = Objective(loss, geometry=task)
    hist = History(
        method="structured",
        config=dict(
            n=n,
            steps=steps,
            burn_in=burn_in,
            prompts=prompts,
            lr=lr,
            mode=mode,
            kappa=kappa,
            control_variate=control_variate,
            engine=engine,
            attention_dtype=str(loss.attention_dtype).replace("torch.", ""),
            objective="expected loss L_n",
        ),
    )
    guard = DivergenceGuard("raise", "structured", lr, task.dtype)
    rec = _AveragingRecorder(hist, task, guard, burn_in=burn_in, keep_every=keep_every, last=steps)
    hist.A, hist.B = run(objective, step, A, B, steps=steps, renormalize=None, recorder=rec, guard=guard)
    R = rec.G_sum / rec.count - task.M
    naive = 0.5 * float(torch.sum((R @ task.Sigma) * R))
    return ChainResult(
        R=R.cpu().numpy(),
        naive_excess=naive,
        test_excess=rec.loss_sum / rec.count - task.bayes_risk,
        scale=softmax_scale(hist.A, hist.B, task),
        history=hist,
        batches=loss.calls,
    )
