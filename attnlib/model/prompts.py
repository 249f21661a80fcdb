r"""Regime (ii): context length ``n``, infinitely many prompts.

Here ``n`` is the length of each prompt and the training objective is the expected loss over
independent prompts,

.. math:: L_n(\theta) = \mathbb E_X\,\hat L_n(\theta; X), \qquad
          \hat L_n(\theta; X) = \frac1{2n}\sum_{i=1}^n \|f_\theta(x_i; X) - y_i\|^2 ,

minimized with fresh prompts at every step. Ingredients (each tested in ``tests/test_prompts.py``):

* :func:`sample_prompts`, :func:`batched_attention`, :func:`prompt_losses`: ``P`` prompts of ``n``
  tokens at once, through the fused kernel (``scaled_dot_product_attention`` on a
  ``(P, 1, n, d)`` batch); in training, the mean loss and its gradient come from the moment kernel
  :func:`attnlib.model.kernels.kernel_loss` on CPU (one pass over the pairs, no backward; SDPA on CUDA);
* the training side lives in :mod:`attnlib.optim`: :class:`attnlib.optim.PromptObjective` (the
  stochastic objective, with the control variate ``L(theta) + mean_b [Lhat_n(X_b) - Lhat_lim(X_b)]``,
  ``Lhat_lim`` the limit layer on the same tokens) and the presets :func:`attnlib.optim.run_chain`
  and :func:`attnlib.optim.train_prompts`;
* :func:`attnlib.analysis.stats.excess_ustat`: from ``K`` independent chains, an estimate of ``L(theta_n) - L*`` that is
  unbiased under the Monte Carlo noise of the chains (a U-statistic over pairs), with a
  jackknife standard error.

Label noise does not move the minimizer: ``L_n`` with noise ``sigma`` equals ``L_n`` without it
plus ``k sigma^2 / 2`` (the layer's output does not depend on the labels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._validate import check_matrix, check_positive_int
from .task import SigmaLike, Task, as_covariance, check_task

__all__ = [
    "sample_prompts",
    "batched_attention",
    "prompt_losses",
    "limit_losses",
]


def _check_prompts(X, Y=None):
    X = check_matrix(X, "X", (None, None, None))
    if min(X.shape) < 1:
        raise ValueError(f"X: expected a non-empty (P, n, d) array, got shape {tuple(X.shape)}")
    if Y is not None:
        Y = check_matrix(Y, "Y", (X.shape[0], X.shape[1], None), dtype=X.dtype, device=X.device)
    return X, Y


def sample_prompts(task: Task, n: int, prompts: int, *, seed=None, generator=None):
    """``prompts`` independent prompts of ``n`` tokens: ``X`` (P, n, d) and ``Y`` (P, n, k).

    Drawn with :meth:`attnlib.model.task.Task.sample` (float64 on the CPU from the seed or generator, then moved
    to the task's dtype and device); prompt ``b`` is rows ``b n .. (b + 1) n - 1`` of one draw.
    """
    task = check_task(task)
    n = check_positive_int(n, "n")
    prompts = check_positive_int(prompts, "prompts")
    X, Y = task.sample(n * prompts, seed=seed, generator=generator)
    return X.reshape(prompts, n, task.d), Y.reshape(prompts, n, task.k)


def batched_attention(A, B, X) -> torch.Tensor:
    """Self-attention of every prompt at once, fused kernel: ``X`` (P, n, d) -> (P, n, k).

    Row ``i`` of prompt ``b`` is ``A sum_j pi_ij x_j`` with ``pi_i = softmax_j(x_i^T B x_j)`` over
    the ``n`` tokens of that prompt (itself included): :func:`attnlib.model.layer.attention` per prompt.
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
