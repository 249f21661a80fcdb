r"""The finite-n layer around its infinite-data limit: diagnostics and measurements.

The softmax average over ``n`` tokens is a self-normalised importance-sampling
estimate of the tilted mean ``Sigma a`` (``a = B^T q``) with weights
``w = exp(a^T x)``. This module holds what the book measures about it: the
effective sample size, the delta-method prediction of the error, the measured
error, and the held-out loss of a trained layer on fresh sequences of the
same length.
"""

from __future__ import annotations

import math

import torch

from ._validate import check_matrix, check_positive_int
from .attention import attention, attention_limit, empirical_loss
from .rng import derive_seed
from .task import SigmaLike, Task, as_covariance

__all__ = ["effective_sample_size", "limit_error_prediction", "finite_n_error", "heldout_loss"]


def _check_task(task) -> Task:
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    return task


def effective_sample_size(a, Sigma: SigmaLike, n: int) -> float:
    r"""Kish effective sample size ``n exp(-a^T Sigma a)`` of the softmax weights ``exp(a^T x_j)``.

    For ``x ~ N(0, Sigma)``, ``E[w]^2 / E[w^2] = exp(-a^T Sigma a)`` with
    ``w = exp(a^T x)``; here ``a = B^T q`` for a query ``q``.
    """
    Sigma = as_covariance(Sigma)
    a = check_matrix(a, "a", (Sigma.shape[0],)).to(Sigma.dtype)
    n = check_positive_int(n, "n")
    return float(n) * math.exp(-float(a @ Sigma @ a))


def limit_error_prediction(A, B, Sigma: SigmaLike, queries, n: int) -> torch.Tensor:
    r"""Asymptotic mean squared error of the finite-n layer around its limit, per query.

    The delta method gives ``sqrt(n) (avg - Sigma a) -> N(0, V)`` with
    ``V = exp(a^T Sigma a) (Sigma + Sigma a a^T Sigma)``, so

    .. math:: E\|f(q; X) - A\Sigma B^\top q\|^2 \approx \frac{e^{a^\top\Sigma a}}{n}
              \operatorname{tr}\big(A(\Sigma + \Sigma a a^\top \Sigma)A^\top\big)
              = \frac{\operatorname{tr}(A(\Sigma + \Sigma a a^\top\Sigma)A^\top)}{\mathrm{ESS}} .

    This leading term ignores the query's own token (which the layer includes);
    its contribution is of order ``1/n`` too and is studied in the book.
    Returns a tensor of shape (m,) for ``queries`` of shape (m, d).
    """
    Sigma = as_covariance(Sigma)
    d = Sigma.shape[0]
    Q = check_matrix(queries, "queries", (None, d)).to(Sigma.dtype)
    A = check_matrix(A, "A", (None, d)).to(Sigma.dtype)
    B = check_matrix(B, "B", (d, d)).to(Sigma.dtype)
    n = check_positive_int(n, "n")
    a = Q @ B  # rows a_i^T = (B^T q_i)^T
    Sa = a @ Sigma  # rows (Sigma a_i)^T
    quad = (a * Sa).sum(1)  # a^T Sigma a
    base = torch.trace(A @ Sigma @ A.T)
    rank1 = ((Sa @ A.T) ** 2).sum(1)  # ||A Sigma a||^2
    return torch.exp(quad) * (base + rank1) / n


def finite_n_error(A, B, task: Task, ns, *, queries, n_seeds: int = 8, seed: int = 0) -> torch.Tensor:
    """Measured mean squared error ``E||f(q; X) - A Sigma B^T q||^2`` per sequence length and query.

    For each ``n`` in ``ns``, ``n_seeds`` independent sequences are drawn from
    ``task`` (seeds ``seed, seed + 1, ...``; the fixed ``queries`` are not part
    of the sequences); returns a tensor of shape ``(len(ns), m)`` (mean over sequences).
    """
    task = _check_task(task)
    n_seeds = check_positive_int(n_seeds, "n_seeds")
    limit = attention_limit(A, B, task, queries)
    out = []
    for n in ns:
        errs = [
            ((attention(A, B, task.sample(int(n), seed=seed + s)[0], queries=queries) - limit) ** 2).sum(1)
            for s in range(n_seeds)
        ]
        out.append(torch.stack(errs).mean(0))
    return torch.stack(out)


def heldout_loss(A, B, task: Task, n: int, *, n_sequences: int = 4, seed: int = 0) -> float:
    """Mean empirical loss of the finite layer on ``n_sequences`` fresh sequences of length ``n``.

    This is what a user of the trained finite-n layer sees on new data of the
    same length. Sequence ``i`` is drawn with ``derive_seed(seed, "heldout", i)``.
    Runs without gradients.
    """
    task = _check_task(task)
    n = check_positive_int(n, "n")
    n_sequences = check_positive_int(n_sequences, "n_sequences")
    with torch.no_grad():
        vals = [
            float(empirical_loss(A, B, *task.sample(n, seed=derive_seed(seed, "heldout", i))))
            for i in range(n_sequences)
        ]
    return sum(vals) / len(vals)
