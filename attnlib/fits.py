"""Fits on log scales: power laws and geometric rates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

__all__ = ["PowerLawFit", "fit_power_law", "fit_geometric_rate"]


@dataclass
class PowerLawFit:
    """``y ~ C x^slope``: ``slope``, ``log_c`` (natural log of ``C``), the standard error of the
    slope and, with ``ci``, a confidence interval for it."""

    slope: float
    log_c: float
    stderr: float
    ci: Optional[tuple] = None

    def __call__(self, x):
        return np.exp(self.log_c) * np.asarray(x, dtype=float) ** self.slope


def _clean(x, y, name_x="x", name_y="y"):
    x = np.asarray(x, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    if x.shape != y.shape:
        raise ValueError(f"{name_y}: expected the same number of values as {name_x}, got {y.size} and {x.size}")
    if x.size < 2:
        raise ValueError(f"{name_x}: need at least two points to fit, got {x.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x, y: contain NaN or infinite values")
    if np.any(x <= 0) or np.any(y <= 0):
        raise ValueError("x, y: a fit on log scales needs positive values")
    return x, y


def fit_power_law(
    x: Sequence[float], y: Sequence[float], *, n_boot: int = 0, seed: int = 0, level: float = 0.95
) -> PowerLawFit:
    """Least-squares line through ``(log x, log y)``.

    ``stderr`` is the ordinary least-squares standard error of the slope. With
    ``n_boot > 0`` the points are resampled with replacement ``n_boot`` times
    (seeded) and ``ci`` is the percentile interval of the slope at ``level``.
    """
    x, y = _clean(x, y)
    lx, ly = np.log(x), np.log(y)
    slope, icpt = np.polyfit(lx, ly, 1)
    resid = ly - (slope * lx + icpt)
    dof = max(len(lx) - 2, 1)
    sxx = np.sum((lx - lx.mean()) ** 2)
    stderr = float(np.sqrt(np.sum(resid**2) / dof / sxx)) if sxx > 0 else float("inf")
    ci = None
    if n_boot > 0:
        rng = np.random.default_rng(seed)
        slopes = []
        for _ in range(n_boot):
            idx = rng.integers(0, len(lx), len(lx))
            if np.ptp(lx[idx]) == 0:
                continue
            slopes.append(np.polyfit(lx[idx], ly[idx], 1)[0])
        lo, hi = np.quantile(slopes, [(1 - level) / 2, (1 + level) / 2])
        ci = (float(lo), float(hi))
    return PowerLawFit(float(slope), float(icpt), stderr, ci)


def fit_geometric_rate(steps: Sequence[float], values: Sequence[float]) -> float:
    """Rate ``mu`` of ``values ~ c mu^steps``: ``exp`` of the slope of ``log values`` against ``steps``."""
    s = np.asarray(steps, dtype=float).ravel()
    v = np.asarray(values, dtype=float).ravel()
    if s.shape != v.shape or s.size < 2:
        raise ValueError("steps, values: expected two sequences of the same length >= 2")
    if np.any(v <= 0) or not np.all(np.isfinite(v)):
        raise ValueError("values: a geometric fit needs positive finite values")
    return float(np.exp(np.polyfit(s, np.log(v), 1)[0]))
