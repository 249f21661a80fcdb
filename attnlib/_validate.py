"""Input validation shared by every public function.

Every check raises :class:`ValueError` with a message that names the argument
and says what was expected, so that a wrong call fails loudly instead of
returning NaN further down the line.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = [
    "as_tensor",
    "check_matrix",
    "check_spd",
    "check_samples",
    "check_positive_int",
    "check_nonneg_float",
    "resolve_dtype",
    "resolve_device",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def resolve_dtype(dtype) -> torch.dtype:
    """Return a floating torch dtype (``None`` means float64)."""
    if dtype is None:
        return torch.float64
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype: expected a floating torch dtype such as torch.float64, got {dtype!r}")
    return dtype


def resolve_device(device) -> torch.device:
    """Return a torch device (``None`` means CPU)."""
    if device is None:
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {device!r}") from exc


def as_tensor(x, name: str, *, dtype=None, device=None) -> torch.Tensor:
    """Convert ``x`` (tensor, array or nested list) to a floating tensor.

    A tensor keeps its dtype and device unless ``dtype``/``device`` are given;
    anything else becomes float64 (or ``dtype``) on CPU (or ``device``).
    """
    if isinstance(x, torch.Tensor):
        t = x
        if not (t.is_floating_point()):
            t = t.to(resolve_dtype(dtype))
    elif isinstance(x, (np.ndarray, list, tuple, float, int, np.generic)):
        try:
            t = torch.as_tensor(np.asarray(x, dtype=np.float64))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: expected a numeric array, got {type(x).__name__}") from exc
        if dtype is None:
            dtype = torch.float64
    else:
        raise ValueError(f"{name}: expected a torch.Tensor or array, got {type(x).__name__}")
    if dtype is not None or device is not None:
        t = t.to(
            dtype=resolve_dtype(dtype) if dtype is not None else t.dtype,
            device=resolve_device(device) if device is not None else t.device,
        )
    return t


def check_matrix(
    x, name: str, shape: Optional[Sequence[Optional[int]]] = None, *, dtype=None, device=None, finite: bool = True
) -> torch.Tensor:
    """Validate a matrix (or array of given ``shape``; ``None`` entries are free).

    Raises ``ValueError`` naming ``name`` if the number of dimensions, a fixed
    dimension, or finiteness is wrong. Returns the tensor (converted as in
    :func:`as_tensor`).
    """
    t = as_tensor(x, name, dtype=dtype, device=device)
    if shape is not None:
        if t.dim() != len(shape):
            raise ValueError(
                f"{name}: expected a {len(shape)}-dimensional array of shape {_fmt_shape(shape)}, "
                f"got shape {tuple(t.shape)}"
            )
        for got, want in zip(t.shape, shape):
            if want is not None and got != want:
                raise ValueError(f"{name}: expected shape {_fmt_shape(shape)}, got {tuple(t.shape)}")
    if finite and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains NaN or infinite values")
    return t


def check_spd(S, name: str = "Sigma", *, dtype=None, device=None) -> torch.Tensor:
    """Validate a symmetric positive definite matrix.

    Symmetry is checked to a relative tolerance of ``1e-6`` (float32:
    ``1e-4``); the result is exactly symmetrized. Positive definiteness is
    checked via the smallest eigenvalue.
    """
    S = check_matrix(S, name, (None, None), dtype=dtype, device=device)
    if S.shape[0] != S.shape[1]:
        raise ValueError(f"{name}: expected a square matrix, got shape {tuple(S.shape)}")
    if S.shape[0] == 0:
        raise ValueError(f"{name}: expected a non-empty matrix")
    tol = 1e-4 if S.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-6
    scale = S.abs().max().clamp_min(torch.finfo(S.dtype).tiny)
    if float((S - S.T).abs().max() / scale) > tol:
        raise ValueError(
            f"{name}: expected a symmetric matrix (max |S - S^T| / max |S| = "
            f"{float((S - S.T).abs().max() / scale):.2e})"
        )
    S = 0.5 * (S + S.T)
    lmin = float(torch.linalg.eigvalsh(S.to(torch.float64)).min())
    if not lmin > 0:
        raise ValueError(f"{name}: expected a positive definite matrix, smallest eigenvalue is {lmin:.3e}")
    return S


def check_samples(X, Y=None):
    """Validate a sample ``X`` (n, d) and optionally ``Y`` (n, k) on the same dtype/device; returns ``(X, Y)``."""
    X = check_matrix(X, "X", (None, None))
    if X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"X: expected a non-empty (n, d) array, got shape {tuple(X.shape)}")
    if Y is None:
        return X, None
    Y = check_matrix(Y, "Y", (X.shape[0], None), dtype=X.dtype, device=X.device)
    return X, Y


def check_positive_int(v, name: str, *, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {v!r}")
    return int(v)


def check_nonneg_float(v, name: str, *, positive: bool = False) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected a number, got {v!r}") from exc
    if not np.isfinite(f) or f < 0 or (positive and f == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{name}: expected a finite {kind} number, got {v!r}")
    return f


def _fmt_shape(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


# Every module that computes with torch imports this one: torch's thread count is set here, once
# per process, by the policy of attnlib.runtime (ATTNLIB_NUM_THREADS).
from .runtime import configure_threads as _configure_threads  # noqa: E402

_configure_threads()
