r"""Finite-n softmax self-attention for linear regression.

For a sequence ``X`` (n x d) and a query ``q`` the layer computes

.. math:: f_\theta(q; X) = A \sum_j \pi_j(q)\, x_j, \qquad
          \pi_j(q) = \frac{\exp(q^\top B x_j)}{\sum_l \exp(q^\top B x_l)} .

In transformer notation: queries ``B^T q`` (``W_Q^T W_K = B``), keys ``x_j``,
values ``x_j``, output map ``A`` (``W_O W_V = A``), softmax scale 1.

:func:`attention` uses :func:`torch.nn.functional.scaled_dot_product_attention`
(a fused, memory-efficient kernel that never forms the n x n matrix of
scores, on CPU as on CUDA); :func:`attention_reference` forms the matrix and
is meant for tests and teaching. Both subtract the row maximum of the scores
inside the softmax, so large softmax scales never overflow.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ._validate import check_matrix
from .task import check_samples

__all__ = [
    "attention",
    "attention_reference",
    "attention_weights",
    "attention_limit",
    "empirical_loss",
    "effective_sample_size",
    "limit_error_prediction",
    "finite_n_error",
    "test_loss",
]


def _check_layer(X, A, B, queries):
    X, _ = check_samples(X)
    d = X.shape[1]
    A = check_matrix(A, "A", (None, d)).to(dtype=X.dtype, device=X.device)
    B = check_matrix(B, "B", (d, d)).to(dtype=X.dtype, device=X.device)
    if queries is None:
        Q = X
    else:
        Q = check_matrix(queries, "queries", (None, d)).to(dtype=X.dtype, device=X.device)
    return X, A, B, Q


def attention(X, A, B, queries=None) -> torch.Tensor:
    """Softmax self-attention output, fused kernel (no n x n matrix).

    Parameters
    ----------
    X : (n, d) tokens (keys and values).
    A : (k, d) output map.
    B : (d, d) query-key matrix.
    queries : (m, d) query tokens; default ``X`` (each token attends to all n
        tokens, itself included).

    Returns
    -------
    (m, k) tensor whose row ``i`` is ``A sum_j pi_ij x_j``; differentiable in
    ``X``, ``A``, ``B`` and ``queries``.
    """
    X, A, B, Q = _check_layer(X, A, B, queries)
    q = (Q @ B)[None, None]           # (1, 1, m, d): row i is (B^T q_i)^T
    kv = X[None, None]                # (1, 1, n, d)
    out = F.scaled_dot_product_attention(q, kv, kv, scale=1.0)[0, 0]
    return out @ A.T


def attention_weights(X, B, queries=None) -> torch.Tensor:
    """The (m, n) matrix of softmax weights ``pi_ij`` (materialised; for pictures and tests)."""
    X, _ = check_samples(X)
    d = X.shape[1]
    X, _, B, Q = _check_layer(X, torch.zeros(1, d, dtype=X.dtype, device=X.device), B, queries)
    return torch.softmax((Q @ B) @ X.T, dim=-1)


def attention_reference(X, A, B, queries=None) -> torch.Tensor:
    """Same as :func:`attention`, but forms the (m, n) weight matrix explicitly."""
    X, A, B, Q = _check_layer(X, A, B, queries)
    scores = (Q @ B) @ X.T                                   # (m, n)
    scores = scores - scores.max(dim=-1, keepdim=True).values.detach()
    W = torch.exp(scores)
    W = W / W.sum(dim=-1, keepdim=True)
    return (W @ X) @ A.T


def attention_limit(queries, A, B, Sigma) -> torch.Tensor:
    """The infinite-data limit ``q -> A Sigma B^T q`` applied to each row of ``queries`` (m, d)."""
    Sigma = check_matrix(Sigma, "Sigma", (None, None))
    d = Sigma.shape[0]
    Q = check_matrix(queries, "queries", (None, d)).to(Sigma.dtype)
    A = check_matrix(A, "A", (None, d)).to(Sigma.dtype)
    B = check_matrix(B, "B", (d, d)).to(Sigma.dtype)
    return Q @ B @ Sigma @ A.T


def empirical_loss(A, B, X, Y, *, queries: Optional[torch.Tensor] = None,
                   fused: bool = True) -> torch.Tensor:
    r"""``Lhat_n(A, B) = 1/(2n) sum_i ||f(x_i; X) - y_i||^2`` on one sequence.

    With ``queries`` given as a LongTensor of row indices, the mean runs over
    those rows only (the keys are still all ``n`` tokens): the minibatch loss of
    SGD. ``fused=False`` uses :func:`attention_reference`.
    """
    X, Y = check_samples(X, Y)
    layer = attention if fused else attention_reference
    if queries is None:
        out, target = layer(X, A, B), Y
    else:
        if not (isinstance(queries, torch.Tensor) and queries.dtype == torch.long):
            raise ValueError("queries: expected a LongTensor of row indices into X")
        out, target = layer(X, A, B, queries=X[queries]), Y[queries]
    return 0.5 * torch.sum((out - target) ** 2) / out.shape[0]


def effective_sample_size(n: int, a, Sigma) -> float:
    r"""Kish effective sample size ``n exp(-a^T Sigma a)`` of the softmax weights ``exp(a^T x_j)``.

    For ``x ~ N(0, Sigma)``, ``E[w]^2 / E[w^2] = exp(-a^T Sigma a)`` with
    ``w = exp(a^T x)``; here ``a = B^T q`` for a query ``q``.
    """
    Sigma = check_matrix(Sigma, "Sigma", (None, None))
    a = check_matrix(a, "a", (Sigma.shape[0],)).to(Sigma.dtype)
    return float(n) * math.exp(-float(a @ Sigma @ a))


def limit_error_prediction(queries, A, B, Sigma, n: int) -> torch.Tensor:
    r"""Asymptotic mean squared error of the finite-n layer around its limit, per query.

    The softmax average is a self-normalised importance-sampling estimate of the
    tilted mean ``Sigma a`` (``a = B^T q``) with weights ``w = exp(a^T x)``; the
    delta method gives ``sqrt(n) (avg - Sigma a) -> N(0, V)`` with
    ``V = exp(a^T Sigma a) (Sigma + Sigma a a^T Sigma)``, so

    .. math:: E\|f(q; X) - A\Sigma B^\top q\|^2 \approx \frac{e^{a^\top\Sigma a}}{n}
              \operatorname{tr}\big(A(\Sigma + \Sigma a a^\top \Sigma)A^\top\big)
              = \frac{\operatorname{tr}(A(\Sigma + \Sigma a a^\top\Sigma)A^\top)}{\mathrm{ESS}} .

    Returns a tensor of shape (m,) for ``queries`` of shape (m, d).
    """
    Sigma = check_matrix(Sigma, "Sigma", (None, None))
    d = Sigma.shape[0]
    Q = check_matrix(queries, "queries", (None, d)).to(Sigma.dtype)
    A = check_matrix(A, "A", (None, d)).to(Sigma.dtype)
    B = check_matrix(B, "B", (d, d)).to(Sigma.dtype)
    if int(n) < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    a = Q @ B                                    # rows a_i^T = (B^T q_i)^T
    Sa = a @ Sigma                               # rows (Sigma a_i)^T
    quad = (a * Sa).sum(1)                       # a^T Sigma a
    base = torch.trace(A @ Sigma @ A.T)
    rank1 = ((Sa @ A.T) ** 2).sum(1)             # ||A Sigma a||^2
    return torch.exp(quad) * (base + rank1) / n


def finite_n_error(task, A, B, ns, *, queries, n_seeds: int = 8, seed: int = 0) -> torch.Tensor:
    """Measured mean squared error ``E||f(q; X) - A Sigma B^T q||^2`` per sequence length and query.

    For each ``n`` in ``ns``, ``n_seeds`` independent sequences are drawn from
    ``task`` (seeds ``seed, seed + 1, ...``); returns a tensor of shape
    ``(len(ns), m)`` (mean over sequences).
    """
    limit = attention_limit(queries, A, B, task.Sigma)
    out = []
    for n in ns:
        errs = [((attention(task.sample(int(n), seed=seed + s)[0], A, B, queries=queries) - limit) ** 2).sum(1)
                for s in range(n_seeds)]
        out.append(torch.stack(errs).mean(0))
    return torch.stack(out)


def test_loss(A, B, task, n: int, *, n_sequences: int = 4, seed: int = 0) -> float:
    """Mean empirical loss of the finite layer on ``n_sequences`` fresh sequences of length ``n``.

    This is what a user of the trained finite-n layer sees on new data of the
    same length (seeds ``seed, seed + 1, ...``). Runs without gradients.
    """
    if int(n_sequences) < 1:
        raise ValueError(f"n_sequences: expected an integer >= 1, got {n_sequences!r}")
    with torch.no_grad():
        vals = [float(empirical_loss(A, B, *task.sample(int(n), seed=seed + s))) for s in range(int(n_sequences))]
    return sum(vals) / len(vals)
