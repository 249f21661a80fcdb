"""Small matrix functions used throughout: symmetric square roots and the polar factor."""

from __future__ import annotations

import torch

__all__ = ["sym_sqrt", "sym_inv_sqrt", "sym_pow", "polar_factor", "numerical_rank"]


def sym_pow(S: torch.Tensor, p: float) -> torch.Tensor:
    """``S^p`` for a symmetric positive definite ``S`` (d x d), via ``eigh``.

    Eigenvalues are clamped at the smallest positive normal number before the
    power is taken, so round-off never produces NaN.
    """
    evals, evecs = torch.linalg.eigh(S)
    evals = evals.clamp_min(torch.finfo(S.dtype).tiny)
    return (evecs * evals.pow(p)) @ evecs.T


def sym_sqrt(S: torch.Tensor) -> torch.Tensor:
    """Symmetric square root ``S^{1/2}`` of a symmetric positive definite matrix."""
    return sym_pow(S, 0.5)


def sym_inv_sqrt(S: torch.Tensor) -> torch.Tensor:
    """Symmetric inverse square root ``S^{-1/2}`` of a symmetric positive definite matrix."""
    return sym_pow(S, -0.5)


def polar_factor(N: torch.Tensor) -> torch.Tensor:
    """Orthogonal polar factor of ``N`` (d x r, d >= r): ``P Q^T`` where ``N = P Lambda Q^T``.

    It solves the orthogonal Procrustes problem ``max_{W^T W = I} <N, W>``.
    """
    P, _, Qh = torch.linalg.svd(N, full_matrices=False)
    return P @ Qh


def numerical_rank(T: torch.Tensor, rtol: float | None = None) -> int:
    """Number of singular values of ``T`` above ``rtol * s_max``.

    The default ``rtol`` is ``max(T.shape) * eps * 100`` for the dtype of ``T``.
    """
    s = torch.linalg.svdvals(T)
    if s.numel() == 0 or float(s[0]) == 0.0:
        return 0
    if rtol is None:
        rtol = max(T.shape) * torch.finfo(T.dtype).eps * 100
    return int((s > rtol * s[0]).sum())
