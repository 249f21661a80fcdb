"""Initializations: the spectral initialization of Algorithm 1 and a seeded random one."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._validate import check_nonneg_float, check_positive_int, check_samples, resolve_device, resolve_dtype
from ..geometry import from_factor
from ..model.task import empirical_task
from ..rng import make_generator

__all__ = ["spectral_init", "random_init"]


def spectral_init(X, Y, rank: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Spectral initialization ``(A0, B0)`` from one sample.

    ``Sigmahat = X^T X / n``, ``Mhat = Y^T X (X^T X)^{-1}`` (needs ``n >= d``),
    ``That = Mhat Sigmahat^{1/2} = Uh Sh Vh^T`` truncated to ``rank`` (default
    ``min(k, d)``), then ``At0 = Uh Sh^{1/2} Vh^T``, ``C0 = Vh Sh^{1/2} Vh^T``
    mapped back with ``Sigmahat``. The result is balanced
    (``At0^T At0 = C0 C0^T``) and, at full rank, lies exactly on the manifold
    of minima of :func:`~attnlib.model.task.empirical_task` ``(X, Y)``; its limiting
    map is ``A0 Sigmahat B0^T = Mhat``.

    Returns tensors with the dtype and device of ``X``.
    """
    X, Y = check_samples(X, Y)
    n, d = X.shape
    if n < d:
        raise ValueError(f"X: spectral initialization needs n >= d (least squares), got n = {n}, d = {d}")
    emp = empirical_task(X, Y)
    k = emp.k
    if rank is None:
        rank = min(k, d)
    rank = check_positive_int(rank, "rank")
    if rank > min(k, d):
        raise ValueError(f"rank: expected 1 <= rank <= min(k, d) = {min(k, d)}, got {rank}")
    U, s, Vh = torch.linalg.svd(emp.T, full_matrices=False)
    U, sh, V = U[:, :rank], s[:rank].sqrt(), Vh[:rank].T
    At0 = (U * sh) @ V.T
    C0 = (V * sh) @ V.T
    return from_factor(At0, C0, emp)


def random_init(
    d: int,
    k: int,
    *,
    std: float = 1e-2,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    dtype=None,
    device=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random ``(A, B)`` with i.i.d. ``N(0, std^2 / d)`` entries (``A``: k x d, ``B``: d x d)."""
    d = check_positive_int(d, "d")
    k = check_positive_int(k, "k")
    std = check_nonneg_float(std, "std")
    g = make_generator(seed, generator)
    f64 = torch.float64
    A = torch.randn(k, d, generator=g, dtype=f64) * (std / d**0.5)
    B = torch.randn(d, d, generator=g, dtype=f64) * (std / d**0.5)
    dtype, device = resolve_dtype(dtype), resolve_device(device)
    return A.to(device, dtype), B.to(device, dtype)
