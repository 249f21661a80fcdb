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
* the training side lives in :mod:`attnlib.optim`: :class:`attnlib.optim.PromptObjective` (the
  stochastic objective, with the control variate ``L(theta) + mean_b [Lhat_n(X_b) - Lhat_lim(X_b)]``,
  ``Lhat_lim`` the limit layer on the same tokens) and the presets :func:`attnlib.optim.run_chain`
  and :func:`attnlib.optim.train_prompts`;
* :func:`excess_ustat`: from ``K`` independent chains, an estimate of ``L(theta_n) - L*`` that is
  unbiased under the Monte Carlo noise of the chains (a U-statistic over pairs), with a
  jackknife standard error.

Label noise does not move the minimizer: ``L_n`` with noise ``sigma`` equals ``L_n`` without it
plus ``k sigma^2 / 2`` (the layer's output does not depend on the labels).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ._validate import check_matrix, check_positive_int
from .task import SigmaLike, Task, as_covariance

__all__ = [
    "sample_prompts",
    "batched_attention",
    "prompt_losses",
    "limit_losses",
    "excess_ustat",
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
    the ``n`` tokens of that prompt (itself included): :func:`attnlib.layer.attention` per prompt.
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


def excess_ustat(Rs: Sequence[np.ndarray], Sigma) -> dict:
    r"""Estimate ``1/2 ||E[R] Sigma^{1/2}||_F^2`` from independent residuals ``R_1..R_K`` (K >= 2).

    ``U = 1/(K(K-1)) sum_{i != j} 1/2 tr(R_i Sigma R_j^T)`` is unbiased whatever the (zero-mean)
    noise of each ``R_i`` around ``E[R]`` (independent chains: ``E tr(R_i Sigma R_j^T) =
    tr(E R Sigma E R^T)`` for ``i != j``), unlike ``1/2 ||mean_i R_i Sigma^{1/2}||^2``, which is
    biased upwards by ``tr(Cov)/(2K)``. Returns ``{"excess", "se", "naive", "K"}``; ``se`` is the
    jackknife standard error (leave one chain out). ``excess`` may be negative when the noise
    dominates.
    """
    R = np.asarray(Rs, dtype=float)
    if R.ndim != 3 or R.shape[0] < 2:
        raise ValueError(f"Rs: expected at least two residual matrices of equal shape, got shape {R.shape}")
    S = np.asarray(as_covariance(Sigma).cpu().numpy() if not isinstance(Sigma, np.ndarray) else Sigma, dtype=float)
    if S.shape != (R.shape[2], R.shape[2]):
        raise ValueError(f"Sigma: expected shape {(R.shape[2], R.shape[2])}, got {S.shape}")
    K = R.shape[0]
    G = np.einsum("iab,bc,jac->ij", R, S, R)  # Gram matrix tr(R_i S R_j^T)
    diag = np.diag(G)
    total = G.sum()

    def u(tot, dg, m):
        return 0.5 * (tot - dg) / (m * (m - 1))

    est = u(total, diag.sum(), K)
    se = float("nan")
    if K >= 3:
        row = G.sum(axis=1)
        loo = np.array([u(total - 2 * row[i] + G[i, i], diag.sum() - diag[i], K - 1) for i in range(K)])
        se = float(math.sqrt((K - 1) / K * np.sum((loo - loo.mean()) ** 2)))
    Rm = R.mean(axis=0)
    naive = 0.5 * float(np.trace(Rm @ S @ Rm.T))
    return {"excess": float(est), "se": se, "naive": naive, "K": K}
