r"""Finite-n softmax self-attention for linear regression.

For a sequence ``X`` (n x d) and a query ``q`` the layer computes

.. math:: f_\theta(q; X) = A \sum_j \pi_j(q)\, x_j, \qquad
          \pi_j(q) = \frac{\exp(q^\top B x_j)}{\sum_l \exp(q^\top B x_l)} .

Convention for ``B`` (the same in the book): ``B = W_Q^T W_K`` (d x d), the product of the
query and key maps ``W_Q, W_K`` (d_h x d, acting on column vectors: query ``W_Q x_i``, key
``W_K x_j``), with no ``1/sqrt(d_h)`` factor (a scaling is absorbed in ``B``). The score of
query ``x_i`` and key ``x_j`` is ``(W_Q x_i)^T (W_K x_j) = x_i^T B x_j``; in the reduced layer
the query is ``B^T x_i``, the keys and values are the tokens ``x_j``, and ``A = W_O W_V``
(k x d) is the value map followed by the output map. The softmax scale is 1.

:func:`attention` uses :func:`torch.nn.functional.scaled_dot_product_attention`
(a fused, memory-efficient kernel that never forms the n x n matrix of
scores, on CPU as on CUDA); :func:`attention_reference` forms the matrix and
is meant for tests and teaching. Both subtract the row maximum of the scores
inside the softmax, so large softmax scales never overflow.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .._validate import check_matrix, check_samples
from .kernels import _kernel_loss_unchecked, resolve_engine
from .task import SigmaLike, as_covariance

__all__ = ["attention", "attention_reference", "attention_weights", "attention_limit", "empirical_loss"]


def _check_layer(A, B, X, queries):
    X, _ = check_samples(X)
    d = X.shape[1]
    A = check_matrix(A, "A", (None, d)).to(dtype=X.dtype, device=X.device)
    B = check_matrix(B, "B", (d, d)).to(dtype=X.dtype, device=X.device)
    if queries is None:
        Q = X
    else:
        Q = check_matrix(queries, "queries", (None, d)).to(dtype=X.dtype, device=X.device)
    return X, A, B, Q


def attention(A, B, X, queries=None) -> torch.Tensor:
    """Softmax self-attention output, fused kernel (no n x n matrix).

    Parameters
    ----------
    A : (k, d) output map.
    B : (d, d) query-key matrix ``W_Q^T W_K``: the score of query ``q`` and key ``x_j`` is
        ``q^T B x_j = (B^T q)^T x_j`` (no ``1/sqrt(d)`` factor).
    X : (n, d) tokens (keys and values).
    queries : (m, d) query tokens; default ``X`` (each token attends to all n
        tokens, itself included).

    Returns
    -------
    (m, k) tensor whose row ``i`` is ``A sum_j pi_ij x_j``; differentiable in
    ``X``, ``A``, ``B`` and ``queries``.
    """
    X, A, B, Q = _check_layer(A, B, X, queries)
    return _attention(A, B, X, Q)


def _attention(A, B, X, Q) -> torch.Tensor:
    """:func:`attention` without the checks (validated tensors of one dtype and device)."""
    q = (Q @ B)[None, None]  # (1, 1, m, d): row i is (B^T q_i)^T
    kv = X[None, None]  # (1, 1, n, d)
    out = F.scaled_dot_product_attention(q, kv, kv, scale=1.0)[0, 0]
    return out @ A.T


def attention_weights(B, X, queries=None) -> torch.Tensor:
    """The (m, n) matrix of weights ``pi_ij = softmax_j(q_i^T B x_j)`` (materialized; for pictures and tests)."""
    X, _ = check_samples(X)
    d = X.shape[1]
    X, _, B, Q = _check_layer(torch.zeros(1, d, dtype=X.dtype, device=X.device), B, X, queries)
    return torch.softmax((Q @ B) @ X.T, dim=-1)


def attention_reference(A, B, X, queries=None) -> torch.Tensor:
    """Same as :func:`attention`, but forms the (m, n) weight matrix explicitly."""
    X, A, B, Q = _check_layer(A, B, X, queries)
    scores = (Q @ B) @ X.T  # (m, n)
    scores = scores - scores.max(dim=-1, keepdim=True).values.detach()
    W = torch.exp(scores)
    W = W / W.sum(dim=-1, keepdim=True)
    return (W @ X) @ A.T


def attention_limit(A, B, Sigma: SigmaLike, queries) -> torch.Tensor:
    """The infinite-data limit ``q -> A Sigma B^T q`` applied to each row of ``queries`` (m, d).

    ``Sigma``: the token covariance, as a matrix or a :class:`~attnlib.model.task.Task`.
    """
    Sigma = as_covariance(Sigma)
    d = Sigma.shape[0]
    Q = check_matrix(queries, "queries", (None, d)).to(Sigma.dtype)
    A = check_matrix(A, "A", (None, d)).to(Sigma.dtype)
    B = check_matrix(B, "B", (d, d)).to(Sigma.dtype)
    return Q @ B @ Sigma @ A.T


def empirical_loss(
    A, B, X, Y, *, queries: Optional[torch.Tensor] = None, fused: bool = True, engine: str = "sdpa"
) -> torch.Tensor:
    r"""``Lhat_n(A, B) = 1/(2n) sum_i ||f(x_i; X) - y_i||^2`` on one sequence.

    With ``queries`` given as a LongTensor of row indices, the mean runs over
    those rows only (the keys are still all ``n`` tokens): the minibatch loss of
    SGD. ``fused=False`` uses :func:`attention_reference`.

    ``engine`` chooses how the (fused) loss and its gradient are computed: ``"sdpa"`` (default)
    :func:`attention` and autograd, differentiable in everything, twice; ``"kernel"``
    :func:`attnlib.model.kernels.kernel_loss`, one moment pass that returns the loss and saves its gradient
    in ``A`` and ``B`` (CPU, ``d <= 8``, numba; ``X``, ``Y`` are data; about 2.5x (float64) to 5x
    (float32) faster, ``benchmarks/kernel.md``); ``"auto"`` the kernel where it applies, else SDPA
    (CUDA). Values and gradients agree to round-off (``tests/test_kernels.py``).
    """
    X, Y = check_samples(X, Y)
    if queries is not None and not (isinstance(queries, torch.Tensor) and queries.dtype == torch.long):
        raise ValueError("queries: expected a LongTensor of row indices into X")
    use_kernel = fused and resolve_engine(engine, X) == "kernel"
    if use_kernel and Y.requires_grad:  # "auto" falls back to SDPA; an explicit "kernel" cannot
        if engine == "kernel":
            raise ValueError("Y: the moment kernel differentiates in A and B only; use engine='sdpa'")
        use_kernel = False
    if use_kernel:
        d = X.shape[1]
        A = check_matrix(A, "A", (Y.shape[1], d))
        B = check_matrix(B, "B", (d, d))
        if queries is None:
            return _kernel_loss_unchecked(A, B, X[None], Y[None])
        if queries.dim() != 1 or queries.numel() == 0 or int(queries.min()) < 0 or int(queries.max()) >= X.shape[0]:
            raise ValueError(f"queries: expected a 1-d LongTensor of row indices in 0 .. {X.shape[0] - 1}")
        return _kernel_loss_unchecked(A, B, X[None], Y[queries][None], X[queries][None])
    if fused:
        X, A, B, _ = _check_layer(A, B, X, None)
        return _empirical_loss(A, B, X, Y, queries)
    if queries is None:
        out, target = attention_reference(A, B, X), Y
    else:
        out, target = attention_reference(A, B, X, queries=X[queries]), Y[queries]
    return 0.5 * torch.sum((out - target) ** 2) / out.shape[0]


def _empirical_loss(A, B, X, Y, queries=None) -> torch.Tensor:
    """The fused SDPA path of :func:`empirical_loss` without the checks (validated tensors of one dtype)."""
    if queries is None:
        out, target = _attention(A, B, X, X), Y
    else:
        out, target = _attention(A, B, X, X[queries]), Y[queries]
    return 0.5 * torch.sum((out - target) ** 2) / out.shape[0]
