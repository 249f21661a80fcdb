r"""The finite-n layer around its infinite-data limit: diagnostics and measurements.

The softmax average over ``n`` tokens is a self-normalized importance-sampling
estimate of the tilted mean ``Sigma a`` (``a = B^T q``) with weights
``w = exp(a^T x)``. This module holds what the book measures about it: the
effective sample size, the delta-method prediction of the error for a fixed
query, the softmax scale ``lambda_max(C^T C)`` that decides whether that
error, averaged over queries, still decays like ``1/n`` (the heavy-tail
threshold 1/2), the error averaged over fresh queries or over the sequence's
own tokens, the self-token term, and the held-out loss of a trained layer on
fresh sequences of the same length.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from .._validate import check_matrix, check_positive_int
from ..linalg import sym_sqrt
from ..rng import derive_seed
from .layer import attention, attention_limit, empirical_loss
from .task import SigmaLike, Task, as_covariance, check_task

__all__ = [
    "HEAVY_TAIL_THRESHOLD",
    "effective_sample_size",
    "limit_error_prediction",
    "finite_n_error",
    "softmax_scale",
    "averaged_error_constant",
    "averaged_error_exponent",
    "query_averaged_error",
    "self_token_errors",
    "self_token_term",
    "self_token_prediction",
    "heldout_loss",
]

#: ``E_q exp(a^T Sigma a)`` (``a = B^T q``, ``q ~ N(0, Sigma)``) is finite iff
#: ``lambda_max(C^T C)`` is below this value (see :func:`softmax_scale`).
HEAVY_TAIL_THRESHOLD = 0.5

# at most this many scores (queries x keys) are formed or masked at once
_CHUNK_SCORES = 1 << 22


def _check_ns(ns, name: str = "ns", minimum: int = 1) -> list:
    try:
        vals = list(ns)
    except TypeError as exc:
        raise ValueError(f"{name}: expected a sequence of integers >= {minimum}, got {ns!r}") from exc
    if not vals:
        raise ValueError(f"{name}: expected at least one sequence length")
    return [check_positive_int(v, name, minimum=minimum) for v in vals]


def _layer_params(A, B, Sigma: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    d = Sigma.shape[0]
    A = check_matrix(A, "A", (None, d)).to(Sigma)
    B = check_matrix(B, "B", (d, d)).to(Sigma)
    return A, B


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
    r"""Asymptotic mean squared error of the finite-n layer around its limit, per fixed query.

    The delta method gives ``sqrt(n) (avg - Sigma a) -> N(0, V)`` with
    ``V = exp(a^T Sigma a) (Sigma + Sigma a a^T Sigma)``, so

    .. math:: E\|f(q; X) - A\Sigma B^\top q\|^2 \approx \frac{e^{a^\top\Sigma a}}{n}
              \operatorname{tr}\big(A(\Sigma + \Sigma a a^\top \Sigma)A^\top\big)
              = \frac{\operatorname{tr}(A(\Sigma + \Sigma a a^\top\Sigma)A^\top)}{\mathrm{ESS}} .

    The query is not one of the ``n`` tokens here. When it is (as in
    training), its own token moves the output by ``O(1/n)`` and the mean
    squared error by ``O(1/n^2)`` (:func:`self_token_prediction`), so the
    ``1/n`` term is the same. For each fixed query the constant is finite;
    its average over random queries is not always (:func:`averaged_error_constant`).
    Returns a tensor of shape (m,) for ``queries`` of shape (m, d).
    """
    Sigma = as_covariance(Sigma)
    d = Sigma.shape[0]
    Q = check_matrix(queries, "queries", (None, d)).to(Sigma.dtype)
    A, B = _layer_params(A, B, Sigma)
    n = check_positive_int(n, "n")
    a = Q @ B  # rows a_i^T = (B^T q_i)^T
    Sa = a @ Sigma  # rows (Sigma a_i)^T
    quad = (a * Sa).sum(1)  # a^T Sigma a
    base = torch.trace(A @ Sigma @ A.T)
    rank1 = ((Sa @ A.T) ** 2).sum(1)  # ||A Sigma a||^2
    return torch.exp(quad) * (base + rank1) / n


def _stream_generator(seed: int, stream: str, n: int, index: int) -> torch.Generator:
    """Generator of draw ``index`` at sequence length ``n``: one independent stream per ``n``."""
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, f"{stream}/n={n}", index))


def finite_n_error(
    A, B, task: Task, ns, *, queries, n_seeds: int = 8, seed: int = 0, per_seed: bool = False
) -> torch.Tensor:
    """Measured mean squared error ``E||f(q; X) - A Sigma B^T q||^2`` per sequence length and fixed query.

    For each ``n`` in ``ns``, ``n_seeds`` independent sequences are drawn from
    ``task`` (draw ``s`` at length ``n`` from ``derive_seed(seed, "finite_n_error/n=<n>", s)``,
    so sequences of different lengths are independent, not prefixes of one
    another); the fixed ``queries`` are not part of the sequences. Returns a
    tensor of shape ``(len(ns), m)`` (mean over sequences), or with
    ``per_seed=True`` of shape ``(len(ns), n_seeds, m)`` (one row per sequence).
    """
    task = check_task(task)
    ns = _check_ns(ns)
    n_seeds = check_positive_int(n_seeds, "n_seeds")
    limit = attention_limit(A, B, task, queries)
    out = []
    with torch.no_grad():
        for n in ns:
            errs = []
            for s in range(n_seeds):
                X = task.sample(n, generator=_stream_generator(seed, "finite_n_error", n, s))[0]
                errs.append(((attention(A, B, X, queries=queries) - limit) ** 2).sum(1))
            errs = torch.stack(errs)
            out.append(errs if per_seed else errs.mean(0))
    return torch.stack(out)


# ---------------------------------------------------------------------------- averaged over queries


def _factor_C(B, Sigma: torch.Tensor) -> torch.Tensor:
    R = sym_sqrt(Sigma)
    return R @ B.T @ R


def softmax_scale(A, B, Sigma: SigmaLike) -> float:
    r"""The softmax scale ``lambda_max(C^T C)`` with ``C = Sigma^{1/2} B^T Sigma^{1/2}``.

    For a query ``q = Sigma^{1/2} z`` and ``a = B^T q``, the exponent of the
    effective sample size is ``a^T Sigma a = z^T C^T C z``; for
    ``q ~ N(0, Sigma)`` (``z`` standard normal), ``E_q exp(a^T Sigma a)`` is
    finite iff this value is below :data:`~attnlib.model.finite_n.HEAVY_TAIL_THRESHOLD` ``= 1/2``.
    It is ``||C||_2^2`` (operator norm, not Frobenius); at a balanced minimum
    of a task it equals the top singular value ``s_1(T)`` of ``T = M Sigma^{1/2}``.
    ``A`` is only validated (the scale does not depend on it); the argument
    keeps the parameters-first convention.
    """
    Sigma = as_covariance(Sigma)
    _, B = _layer_params(A, B, Sigma)
    C = _factor_C(B, Sigma)
    return float(torch.linalg.matrix_norm(C, ord=2) ** 2)


def averaged_error_constant(A, B, Sigma: SigmaLike) -> float:
    r"""Query average of the delta-method ``1/n`` constant: ``E_q[n * limit_error_prediction]``.

    With ``q = Sigma^{1/2} z``, ``z ~ N(0, I)``, ``K = C^T C``, ``At = A Sigma^{1/2}`` and
    ``G = C^T At^T At C``, the constant ``exp(a^T Sigma a) tr(A(Sigma + Sigma a a^T Sigma)A^T)``
    is ``exp(z^T K z) (||At||_F^2 + z^T G z)``, whose mean is

    .. math:: \kappa = \det(I - 2K)^{-1/2}\big(\|\tilde A\|_F^2 + \operatorname{tr}(G (I - 2K)^{-1})\big)

    when ``lambda_max(K) < 1/2``, and infinite otherwise (returned as ``math.inf``).
    """
    Sigma = as_covariance(Sigma)
    A, B = _layer_params(A, B, Sigma)
    R = sym_sqrt(Sigma)
    At, C = A @ R, R @ B.T @ R
    K = C.T @ C
    if float(torch.linalg.eigvalsh(K)[-1]) >= HEAVY_TAIL_THRESHOLD * (1 - 1e-12):
        return math.inf  # at the threshold itself det(I - 2K) = 0: the constant is infinite
    I2K = torch.eye(K.shape[0], dtype=K.dtype) - 2 * K
    G = C.T @ At.T @ At @ C
    det = float(torch.linalg.det(I2K))
    return float((torch.sum(At * At) + torch.trace(torch.linalg.solve(I2K, G))) / math.sqrt(det))


def averaged_error_exponent(A, B, Sigma: SigmaLike) -> Tuple[float, float]:
    r"""Heuristic range ``(fast, slow)`` of the exponent of the query-averaged error in ``n``.

    Ours, not the paper's. With ``nu = lambda_max(C^T C)``: ``fast = -min(1, 1/2 + 1/(4 nu))``
    and ``slow = -min(1, 1/(2 nu))``; both are -1 below the threshold 1/2, where the
    averaged constant is finite. Above it, a query of softmax exponent ``u = a^T Sigma a``
    (tail ``P(u > t) ~ exp(-t / (2 nu))``) has error ``kappa(q)/n ~ e^u/n`` once its weights'
    second moment is realized, ``n >> e^{2u}``; the queries with ``u < log(n)/2`` alone
    contribute ``n^{-1/2 - 1/(4 nu)}`` (the fast end). If every query had error at most
    ``min(kappa(q)/n, O(u))``, the average would be ``n^{-1/(2 nu)}`` (the slow end).
    Both up to powers of ``log n``.
    """
    nu = softmax_scale(A, B, Sigma)
    if nu <= HEAVY_TAIL_THRESHOLD:
        return -1.0, -1.0
    return -min(1.0, 0.5 + 0.25 / nu), -min(1.0, 0.5 / nu)


def _chunks(m: int, n: int):
    step = max(1, _CHUNK_SCORES // max(n, 1))
    return [(i, min(i + step, m)) for i in range(0, m, step)]


def _fused(A, B, X, Q, mask=None) -> torch.Tensor:
    """``attention`` for queries ``Q``; with a boolean ``mask`` (True = attend) for leave-one-out rows."""
    q = (Q @ B)[None, None]
    kv = X[None, None]
    out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=None if mask is None else mask[None, None], scale=1.0)
    return out[0, 0] @ A.T


def query_averaged_error(
    A,
    B,
    task: Task,
    ns,
    *,
    n_queries: int = 256,
    n_seeds: int = 32,
    seed: int = 0,
    include_self: bool = False,
) -> torch.Tensor:
    r"""Mean squared error of the finite layer, averaged over random queries: ``E_{q, X}||f(q; X) - A Sigma B^T q||^2``.

    For each ``n`` in ``ns`` and each of ``n_seeds`` independent draws (draw
    ``s`` at length ``n`` uses ``derive_seed(seed, "query_averaged/n=<n>", s)``:
    sequences of different lengths are independent, never prefixes), a
    sequence ``X`` of ``n`` tokens is drawn and the squared error is averaged
    over ``n_queries`` queries:

    * ``include_self=False``: fresh queries ``q ~ N(0, Sigma)``, independent of ``X``;
    * ``include_self=True``: the queries are the sequence's own first
      ``min(n_queries, n)`` tokens ``x_i``, each attending to all ``n`` tokens,
      itself included (as in training); by exchangeability any subset would do.

    The fused kernel is used, in chunks of at most ``2^22`` scores, so memory
    stays bounded for ``n`` up to tens of thousands. Returns a tensor of shape
    ``(len(ns), n_seeds)``: one query average per sequence, so that fits can
    resample sequences (:func:`attnlib.analysis.stats.fit_error_exponent`).
    """
    task = check_task(task)
    ns = _check_ns(ns)
    n_queries = check_positive_int(n_queries, "n_queries")
    n_seeds = check_positive_int(n_seeds, "n_seeds")
    if not isinstance(include_self, bool):
        raise ValueError(f"include_self: expected True or False, got {include_self!r}")
    A, B = _layer_params(A, B, task.Sigma)
    out = torch.empty(len(ns), n_seeds, dtype=torch.float64)
    with torch.no_grad():
        for i, n in enumerate(ns):
            for s in range(n_seeds):
                g = _stream_generator(seed, "query_averaged", n, s)
                X = task.sample(n, generator=g)[0]
                Q = X[: min(n_queries, n)] if include_self else task.sample(n_queries, generator=g)[0]
                total = 0.0
                for lo, hi in _chunks(Q.shape[0], n):
                    err = _fused(A, B, X, Q[lo:hi]) - attention_limit(A, B, task, Q[lo:hi]).to(X)
                    total += float((err**2).sum())
                out[i, s] = total / Q.shape[0]
    return out


def self_token_errors(
    A, B, task: Task, ns, *, n_queries: int = 256, n_seeds: int = 32, seed: int = 0
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Paired errors with and without the query's own token: isolates the self-token term.

    For each sequence ``X`` (drawn as in :func:`query_averaged_error`) and its
    first ``min(n_queries, n)`` tokens ``x_i`` as queries, returns the query
    averages of ``||f(x_i; X) - A Sigma B^T x_i||^2`` (the token attends to
    itself, as in training) and of ``||f(x_i; X_{-i}) - A Sigma B^T x_i||^2``
    (its own token masked out: an independent query on ``n - 1`` tokens).
    Both use the same sequences and queries, so their difference, the
    contribution of the self-token term, has little Monte Carlo noise.
    Returns ``(with_self, without_self)``, each of shape ``(len(ns), n_seeds)``;
    needs ``n >= 2``.
    """
    task = check_task(task)
    ns = _check_ns(ns, minimum=2)
    n_queries = check_positive_int(n_queries, "n_queries")
    n_seeds = check_positive_int(n_seeds, "n_seeds")
    A, B = _layer_params(A, B, task.Sigma)
    with_self = torch.empty(len(ns), n_seeds, dtype=torch.float64)
    without = torch.empty_like(with_self)
    with torch.no_grad():
        for i, n in enumerate(ns):
            for s in range(n_seeds):
                X = task.sample(n, generator=_stream_generator(seed, "query_averaged", n, s))[0]
                m = min(n_queries, n)
                tot_in, tot_out = 0.0, 0.0
                for lo, hi in _chunks(m, n):
                    Q = X[lo:hi]
                    lim = attention_limit(A, B, task, Q).to(X)
                    keep = torch.ones(hi - lo, n, dtype=torch.bool)
                    keep[torch.arange(hi - lo), torch.arange(lo, hi)] = False
                    tot_in += float(((_fused(A, B, X, Q) - lim) ** 2).sum())
                    tot_out += float(((_fused(A, B, X, Q, keep) - lim) ** 2).sum())
                with_self[i, s] = tot_in / m
                without[i, s] = tot_out / m
    return with_self, without


_SELF_TOKEN_BLOCK = 256  # sequences drawn per generator in self_token_term


def self_token_term(
    A, B, task: Task, queries, n: int, *, n_seeds: int = 1024, seed: int = 0
) -> Dict[str, torch.Tensor]:
    r"""The self-token term for fixed query tokens, measured on many independent sequences.

    For each of ``n_seeds`` sequences ``X'`` of ``n - 1`` tokens and each fixed
    query ``x`` (a row of ``queries``), compares the layer on the ``n`` tokens
    ``X' + {x}`` (the query attends to itself, as in training) with the layer on
    ``X'`` alone (an independent query). Sequences are drawn in blocks of 256,
    block ``b`` from ``derive_seed(seed, "self_token/n=<n>", b)``; the fused
    kernel is batched over the sequences of a block. Returns a dict of tensors:

    * ``"shift"`` (n_seeds, m, k): ``f(x; X' + {x}) - f(x; X')``;
    * ``"with_self"`` (n_seeds, m): ``||f(x; X' + {x}) - A Sigma B^T x||^2``;
    * ``"without_self"`` (n_seeds, m): ``||f(x; X') - A Sigma B^T x||^2``;
    * ``"deviation"`` (n_seeds, m, k): ``f(x; X') - A Sigma B^T x`` (its mean is the
      self-normalization bias of an independent query on ``n - 1`` tokens).

    :func:`self_token_prediction` gives the leading orders of their means.
    """
    task = check_task(task)
    n = check_positive_int(n, "n", minimum=2)
    n_seeds = check_positive_int(n_seeds, "n_seeds")
    A, B = _layer_params(A, B, task.Sigma)
    d = task.d
    Q = check_matrix(queries, "queries", (None, d)).to(task.Sigma)
    m = Q.shape[0]
    lim = attention_limit(A, B, task, Q)  # (m, k)
    qB = Q @ B  # rows (B^T x)^T
    shifts, w_in, w_out, devs = [], [], [], []
    with torch.no_grad():
        for b, lo in enumerate(range(0, n_seeds, _SELF_TOKEN_BLOCK)):
            bs = min(_SELF_TOKEN_BLOCK, n_seeds - lo)
            g = torch.Generator(device="cpu").manual_seed(derive_seed(seed, f"self_token/n={n}", b))
            Xo = torch.randn(bs, n - 1, d, generator=g, dtype=torch.float64).to(task.Sigma) @ task.Sigma_sqrt
            kv = Xo[:, None]
            f_out = F.scaled_dot_product_attention(qB.expand(bs, 1, m, d), kv, kv, scale=1.0)[:, 0] @ A.T
            f_in = torch.empty_like(f_out)
            for j in range(m):
                kvj = torch.cat([Xo, Q[j].expand(bs, 1, d)], dim=1)[:, None]
                f_in[:, j] = (
                    F.scaled_dot_product_attention(qB[j].expand(bs, 1, 1, d), kvj, kvj, scale=1.0)[:, 0, 0] @ A.T
                )
            shifts.append(f_in - f_out)
            devs.append(f_out - lim)
            w_in.append(((f_in - lim) ** 2).sum(-1))
            w_out.append(((f_out - lim) ** 2).sum(-1))
    return {
        "shift": torch.cat(shifts),
        "with_self": torch.cat(w_in),
        "without_self": torch.cat(w_out),
        "deviation": torch.cat(devs),
    }


def self_token_prediction(A, B, Sigma: SigmaLike, queries) -> Dict[str, torch.Tensor]:
    r"""Leading orders of the self-token term for queries that are tokens of the sequence.

    For a query token ``x`` with ``a = B^T x``, ``s = a^T Sigma a`` and
    ``r = A(x - Sigma a)``, its own softmax weight is
    ``pi = exp(x^T B x) / sum_l exp(x^T B x_l) = p / n + o(1/n)`` with
    ``p = exp(x^T B x - s/2)``, and exactly
    ``f(x; X) - f(x; X_{-x}) = pi (A x - f_{-x})``, so ``f(x; X) - f(x; X_{-x}) = r p / n + o_p(1/n)``.
    Returns a dict of tensors, one row per query:

    * ``"weight"``: ``p`` (m,);
    * ``"shift"``: ``p r`` (m, k), the limit of ``n (f(x; X) - f(x; X_{-x}))``;
    * ``"bias"``: ``-exp(s) A Sigma a`` (m, k), the limit of ``n (E f(q; X) - A Sigma B^T q)``
      for a query that is not a token (the self-normalization bias);
    * ``"mse"``: the limit of ``n^2 (E||f(x; X) - lim||^2 - E||f(x; X_{-x}) - lim||^2)``,
      ``p^2 ||r||^2 - 2 p exp(s) tr(A(Sigma + Sigma a a^T Sigma)A^T) - 4 p exp(s) <A Sigma a, r>`` (m,).
    """
    Sigma = as_covariance(Sigma)
    d = Sigma.shape[0]
    Q = check_matrix(queries, "queries", (None, d)).to(Sigma)
    A, B = _layer_params(A, B, Sigma)
    a = Q @ B  # rows (B^T x)^T
    Sa = a @ Sigma
    s = (a * Sa).sum(1)
    p = torch.exp((Q @ B * Q).sum(1) - s / 2)
    r = (Q - Sa) @ A.T
    ASa = Sa @ A.T
    trV = torch.exp(s) * (torch.trace(A @ Sigma @ A.T) + (ASa**2).sum(1))
    mse = p**2 * (r**2).sum(1) - 2 * p * trV - 4 * p * torch.exp(s) * (ASa * r).sum(1)
    return {"weight": p, "shift": p[:, None] * r, "bias": -torch.exp(s)[:, None] * ASa, "mse": mse}


def heldout_loss(A, B, task: Task, n: int, *, n_sequences: int = 4, seed: int = 0) -> float:
    """Mean empirical loss of the finite layer on ``n_sequences`` fresh sequences of length ``n``.

    This is what a user of the trained finite-n layer sees on new data of the
    same length. Sequence ``i`` is drawn with ``derive_seed(seed, "heldout", i)``.
    Runs without gradients.
    """
    task = check_task(task)
    n = check_positive_int(n, "n")
    n_sequences = check_positive_int(n_sequences, "n_sequences")
    with torch.no_grad():
        vals = [
            float(empirical_loss(A, B, *task.sample(n, seed=derive_seed(seed, "heldout", i))))
            for i in range(n_sequences)
        ]
    return sum(vals) / len(vals)
