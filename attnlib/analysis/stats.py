r"""The book's analysis: every fit and estimator, with confidence intervals whose coverage is checked by simulation.

Plain fits on log scales: :func:`fit_power_law` (least squares through ``(log x, log y)``, optional
bootstrap interval), :func:`fit_geometric_rate` (the rate ``mu`` of ``c mu^m``) and
:func:`fit_error_exponent` (a power law through per-``n`` means with a bootstrap over the
sequences). :func:`excess_ustat`: the U-statistic over independent chains, an unbiased estimate of
``1/2 ||E[R] Sigma^{1/2}||_F^2`` with its jackknife standard error (regime (ii)).

The scaling experiments estimate, at each ``n`` of a grid, a positive quantity (the mean or the
median over independent seeds of an excess; or a U-statistic over independent chains) with a
standard error, and fit ``log value = a + b log n``. :func:`wls_exponent` is that fit, weighted
by the inverse variances of the per-``n`` log-estimates; its interval is

.. math:: b \pm q_{\mathrm{level}}\;\mathrm{se}(b)\,\max\!\big(1, \sqrt{\chi^2 / (m - 2)}\big),

the Birge ratio ``sqrt(chi^2 / dof)`` inflating the interval when the points scatter around the
line more than their standard errors allow (a curved log-log plot, or underestimated errors).
Per-``n`` summaries: :func:`summarize` (mean: delta method on the log; median: the
distribution-free quantile interval). :func:`local_slopes` gives the slope between
neighbouring ``n`` with its standard error. :func:`coverage` runs a simulation of a design and
reports how often the interval contains the true exponent; :func:`gamma_design` (independent
seeds per ``n``) and :func:`chain_design` (independent chains per ``n``, U-statistics) build such
simulations from a sweep's measured design, and the tests and the last chapter call them.
:func:`scaled_constant` (the constant ``c`` of ``value ~ c n^-p``), :func:`paired_ratio` (two
estimators on the same seeds) and :func:`steps_per_decade` are the chapter's other summaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from .._validate import check_positive_int
from ..model.task import as_covariance

__all__ = [
    "PowerLawFit",
    "fit_power_law",
    "fit_geometric_rate",
    "fit_error_exponent",
    "excess_ustat",
    "ExponentFit",
    "summarize",
    "wls_exponent",
    "fit_exponent",
    "ustat_exponent",
    "local_slopes",
    "t_quantile",
    "coverage",
    "scaled_constant",
    "paired_ratio",
    "steps_per_decade",
    "gamma_design",
    "chain_design",
    "paired_ratio_design",
]


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


def _check_lengths(ns) -> list:
    try:
        vals = list(ns)
    except TypeError as exc:
        raise ValueError(f"ns: expected a sequence of integers >= 1, got {ns!r}") from exc
    if not vals:
        raise ValueError("ns: expected at least one sequence length")
    return [check_positive_int(v, "ns") for v in vals]


def fit_error_exponent(
    ns: Sequence[int], errors, *, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> PowerLawFit:
    r"""Power law ``mean error ~ c n^slope`` through the per-``n`` means, with a bootstrap over sequences.

    ``errors`` has shape ``(len(ns), n_seeds)``: one value per independent
    sequence (as returned by :func:`attnlib.model.finite_n.query_averaged_error`). The slope is the
    least-squares slope of ``log(mean over sequences)`` against ``log n``;
    the interval resamples the sequences at each ``n`` independently
    (``n_boot`` times, seeded) and refits: a percentile interval at ``level``.
    """
    ns = _check_lengths(ns)
    E = np.asarray(errors.cpu().numpy() if hasattr(errors, "cpu") else errors, dtype=float)
    if E.ndim != 2 or E.shape[0] != len(ns):
        raise ValueError(f"errors: expected shape ({len(ns)}, n_seeds), got {E.shape}")
    if E.shape[1] < 2:
        raise ValueError(f"errors: need at least two sequences per n for the bootstrap, got {E.shape[1]}")
    if not np.all(np.isfinite(E)) or np.any(E <= 0):
        raise ValueError("errors: expected finite positive values")
    n_boot = check_positive_int(n_boot, "n_boot")
    level = _check_level(level)
    fit = fit_power_law(ns, E.mean(1))
    lx = np.log(np.asarray(ns, dtype=float))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, E.shape[1], size=(n_boot,) + E.shape)  # independent resampling at each n
    means = np.take_along_axis(np.broadcast_to(E, idx.shape), idx, axis=2).mean(2)  # (n_boot, len(ns))
    slopes = np.polyfit(lx, np.log(means).T, 1)[0]
    lo, hi = np.quantile(slopes, [(1 - level) / 2, (1 + level) / 2])
    fit.ci = (float(lo), float(hi))
    return fit


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


def t_quantile(p: float, dof: float) -> float:
    """Quantile ``p`` of Student's t with ``dof`` degrees of freedom (Cornish-Fisher expansion).

    Exact for ``dof = inf`` (the normal quantile); relative error below 1e-3 for ``dof >= 3``
    and central ``p`` (0.8 .. 0.995).
    """
    if not 0 < p < 1:
        raise ValueError(f"p: expected a probability in (0, 1), got {p!r}")
    if not dof > 0:
        raise ValueError(f"dof: expected a positive number, got {dof!r}")
    z = NormalDist().inv_cdf(p)
    if math.isinf(dof):
        return z
    v = float(dof)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


@dataclass
class ExponentFit:
    """``value ~ exp(intercept) n^slope``: the slope, its standard error (already inflated by
    ``inflation``), the interval ``ci`` at ``level``, the fit's ``chi2`` on ``dof`` degrees of
    freedom, and the points it was fitted to (``ns``, ``values``, ``se_log``)."""

    slope: float
    intercept: float
    se: float
    ci: tuple
    level: float
    chi2: float
    dof: int
    inflation: float
    ns: np.ndarray = field(repr=False)
    values: np.ndarray = field(repr=False)
    se_log: np.ndarray = field(repr=False)

    def __call__(self, n):
        return np.exp(self.intercept) * np.asarray(n, dtype=float) ** self.slope

    def covers(self, b: float) -> bool:
        """Whether the interval contains ``b``."""
        return self.ci[0] <= b <= self.ci[1]


def _check_level(level) -> float:
    level = float(level)
    if not 0 < level < 1:
        raise ValueError(f"level: expected a number in (0, 1), got {level!r}")
    return level


def summarize(values, stat: str = "mean") -> tuple:
    """Per-``n`` estimate and standard error of its natural log from independent positive draws.

    ``stat="mean"``: the sample mean, ``se_log = sd / (sqrt(S) mean)`` (delta method).
    ``stat="median"``: the sample median, ``se_log`` = half the log-width of the
    distribution-free interval of the median at 95% (the sample quantiles at
    ``1/2 -+ 1.96 / (2 sqrt(S))``, interpolated), divided by 1.96.
    Returns ``(estimate, se_log)``; needs ``S >= 3`` values.
    """
    v = np.asarray(values, dtype=float).ravel()
    if v.size < 3:
        raise ValueError(f"values: need at least 3 independent values, got {v.size}")
    if not np.all(np.isfinite(v)) or np.any(v <= 0):
        raise ValueError("values: expected positive finite numbers")
    S = v.size
    if stat == "mean":
        m = float(v.mean())
        return m, float(v.std(ddof=1) / (math.sqrt(S) * m))
    if stat == "median":
        z = NormalDist().inv_cdf(0.975)
        h = min(0.5, z / (2 * math.sqrt(S)))
        lo, hi = np.quantile(v, [0.5 - h, 0.5 + h])
        med = float(np.median(v))
        return med, float((math.log(hi) - math.log(lo)) / (2 * z))
    raise ValueError(f"stat: expected 'mean' or 'median', got {stat!r}")


def wls_exponent(
    ns, values, se_log, *, level: float = 0.95, inflate: bool = True, pool_se: bool = False, dof_t=None
) -> ExponentFit:
    """Weighted least squares of ``log values`` on ``log ns`` with weights ``1 / se_log^2``.

    The interval uses the normal quantile (or Student's t with ``dof_t`` degrees of freedom)
    times the slope's standard error, inflated by the Birge ratio when ``inflate`` and
    ``chi2 > dof``. ``pool_se`` replaces every ``se_log`` by their root-mean-square first
    (equal weights): per-point errors estimated from few independent units (a median's
    quantiles, a jackknife over a handful of chains) are noisy, and noisy weights make a
    weighted fit overconfident (the coverage tests show it); ``dof_t`` then accounts for the
    uncertainty of the pooled error. Needs at least three points.
    """
    level = _check_level(level)
    x = np.log(np.asarray(ns, dtype=float).ravel())
    y = np.asarray(values, dtype=float).ravel()
    s = np.asarray(se_log, dtype=float).ravel()
    if not (x.size == y.size == s.size) or x.size < 3:
        raise ValueError("ns, values, se_log: expected three sequences of the same length >= 3")
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ValueError("values: a fit on log scales needs positive finite values")
    if np.any(s <= 0) or not np.all(np.isfinite(s)):
        raise ValueError("se_log: expected positive finite standard errors")
    if pool_se:
        s = np.full_like(s, math.sqrt(np.mean(s**2)))
    ly = np.log(y)
    w = 1.0 / s**2
    xm = np.sum(w * x) / np.sum(w)
    ym = np.sum(w * ly) / np.sum(w)
    sxx = np.sum(w * (x - xm) ** 2)
    slope = float(np.sum(w * (x - xm) * (ly - ym)) / sxx)
    icpt = float(ym - slope * xm)
    chi2 = float(np.sum(w * (ly - icpt - slope * x) ** 2))
    dof = x.size - 2
    infl = max(1.0, math.sqrt(chi2 / dof)) if inflate else 1.0
    se = infl / math.sqrt(sxx)
    q = t_quantile(0.5 + level / 2, dof_t) if dof_t is not None else NormalDist().inv_cdf(0.5 + level / 2)
    return ExponentFit(
        slope,
        icpt,
        float(se),
        (slope - q * se, slope + q * se),
        level,
        chi2,
        dof,
        infl,
        np.exp(x),
        y,
        s,
    )


def fit_exponent(
    values_by_n: Dict[float, Sequence[float]],
    *,
    stat: str = "mean",
    level: float = 0.95,
    n_min=None,
    n_max=None,
    pool_se=None,
) -> ExponentFit:
    """:func:`summarize` each ``n``'s independent values, then :func:`wls_exponent` over ``n_min <= n <= n_max``.

    ``pool_se`` (default: on for the median) replaces every point's ``se_log`` by their
    root-mean-square: the quantile-interval errors are noisy, and noisy weights make a weighted
    fit overconfident; when the values at different ``n`` differ by a scale factor (the model
    being fitted) their log-spread is the same, so pooling loses nothing.
    """
    keys = sorted(float(k) for k in values_by_n)
    keys = [k for k in keys if (n_min is None or k >= n_min) and (n_max is None or k <= n_max)]
    if len(keys) < 3:
        raise ValueError(f"values_by_n: need at least three values of n in range, got {len(keys)}")
    lookup = {float(k): v for k, v in values_by_n.items()}
    est = [summarize(lookup[k], stat) for k in keys]
    if pool_se is None:
        pool_se = stat == "median"
    return wls_exponent(keys, [e[0] for e in est], [e[1] for e in est], level=level, pool_se=pool_se)


def ustat_exponent(ns, estimates: Sequence[dict], *, level: float = 0.95) -> ExponentFit:
    """Exponent from per-``n`` U-statistics over independent chains (dicts of
    :func:`excess_ustat`: ``excess``, ``se``, ``K``).

    Weighted log-log fit with the jackknife relative errors pooled over ``n``
    (``pool_se=True``) and Student's t with ``m (K - 1)`` degrees of freedom for the pooled
    error (``m`` points, ``K`` chains each), as the coverage tests require.
    """
    est = list(estimates)
    if len(est) != len(list(ns)):
        raise ValueError("estimates: expected one estimate per n")
    if any(e["excess"] <= 0 for e in est):
        raise ValueError("estimates: a U-statistic is not positive; more chains are needed")
    K = min(int(e["K"]) for e in est)
    return wls_exponent(
        ns,
        [e["excess"] for e in est],
        [e["se"] / e["excess"] for e in est],
        level=level,
        pool_se=True,
        dof_t=len(est) * (K - 1),
    )


def local_slopes(ns, values, se_log) -> np.ndarray:
    """Slopes between neighbouring points on log-log scales with their standard errors.

    Returns an array of rows ``(n_geometric_mean, slope, se)`` (independent estimates at
    different ``n``).
    """
    x = np.log(np.asarray(ns, dtype=float).ravel())
    y = np.log(np.asarray(values, dtype=float).ravel())
    s = np.asarray(se_log, dtype=float).ravel()
    if not (x.size == y.size == s.size) or x.size < 2:
        raise ValueError("ns, values, se_log: expected three sequences of the same length >= 2")
    dx = np.diff(x)
    return np.column_stack([np.exp(x[:-1] + dx / 2), np.diff(y) / dx, np.sqrt(s[1:] ** 2 + s[:-1] ** 2) / dx])


def coverage(
    simulate: Callable[[np.random.Generator], ExponentFit], truth: float, reps: int = 400, seed: int = 0
) -> Dict[str, float]:
    """Fraction of ``reps`` simulated fits whose interval contains ``truth``.

    ``simulate(rng)`` draws one data set of the design from ``rng`` and returns its fit.
    Returns ``{"coverage", "reps", "mean_slope", "mean_halfwidth"}``.
    """
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps: expected a positive integer, got {reps!r}")
    rng = np.random.default_rng(seed)
    hits, slopes, widths = 0, [], []
    for _ in range(reps):
        f = simulate(rng)
        hits += f.covers(truth)
        slopes.append(f.slope)
        widths.append(0.5 * (f.ci[1] - f.ci[0]))
    return {
        "coverage": hits / reps,
        "reps": reps,
        "mean_slope": float(np.mean(slopes)),
        "mean_halfwidth": float(np.mean(widths)),
    }


def _check_values_by_n(values_by_n, name: str = "values_by_n", min_n: int = 1, min_size: int = 2) -> dict:
    if not isinstance(values_by_n, dict) or len(values_by_n) < min_n:
        raise ValueError(f"{name}: expected a dict {{n: values}} with at least {min_n} entries")
    out = {}
    for n, v in values_by_n.items():
        a = np.asarray(v, dtype=float).ravel()
        if not float(n) > 0:
            raise ValueError(f"{name}: expected positive n, got {n!r}")
        if a.size < min_size or not np.all(np.isfinite(a)) or np.any(a <= 0):
            raise ValueError(f"{name}: at n = {n}, expected at least {min_size} positive finite values")
        out[n] = a
    return out


def scaled_constant(values_by_n: Dict[float, Sequence[float]], *, power: float = 1.0, n_min=None) -> tuple:
    """The constant ``c`` of ``E value ~ c n^-power``, pooled over ``n >= n_min``.

    At each ``n`` the independent values give ``n^power mean`` with standard error
    ``n^power sd / sqrt(S)``; the estimates are averaged with inverse-variance weights.
    Returns ``(c, se)`` (a 95% interval is ``c +- 1.96 se``). Meaningful where ``n^power x value``
    is flat, which the chapter checks on a plot and with the fitted exponent.
    """
    vals = _check_values_by_n(values_by_n)
    if not math.isfinite(float(power)):
        raise ValueError(f"power: expected a finite number, got {power!r}")
    keys = [n for n in vals if n_min is None or float(n) >= float(n_min)]
    if not keys:
        raise ValueError(f"n_min: no n >= {n_min} in values_by_n (largest {max(float(n) for n in vals)})")
    est = np.array([float(n) ** power * vals[n].mean() for n in keys])
    se = np.array([float(n) ** power * vals[n].std(ddof=1) / math.sqrt(vals[n].size) for n in keys])
    if np.any(se <= 0):
        raise ValueError("values_by_n: the values at some n do not vary; no standard error")
    w = 1.0 / se**2
    return float(np.sum(w * est) / w.sum()), float(1.0 / math.sqrt(w.sum()))


def paired_ratio(numerator_by_n, denominator_by_n, *, n_min=None, level: float = 0.95) -> tuple:
    """Geometric mean of ``numerator / denominator`` over paired values (the same seeds), with its interval.

    Both arguments are ``{n: values}`` with the values of each ``n`` in the same seed order; the
    log-ratios of all ``n >= n_min`` are pooled and the interval is the normal interval of their
    mean, exponentiated. Returns ``(ratio, low, high)``.
    """
    level = _check_level(level)
    num = _check_values_by_n(numerator_by_n, "numerator_by_n")
    den = _check_values_by_n(denominator_by_n, "denominator_by_n")
    keys = [n for n in num if n_min is None or float(n) >= float(n_min)]
    if not keys:
        raise ValueError(f"n_min: no n >= {n_min} in numerator_by_n")
    for n in keys:
        if n not in den or den[n].size != num[n].size:
            raise ValueError(f"denominator_by_n: expected {num[n].size} paired values at n = {n}")
    lr = np.concatenate([np.log(num[n] / den[n]) for n in keys])
    if lr.size < 2:
        raise ValueError("numerator_by_n: need at least two paired values")
    m, se = float(lr.mean()), float(lr.std(ddof=1) / math.sqrt(lr.size))
    q = NormalDist().inv_cdf(0.5 + level / 2)
    return math.exp(m), math.exp(m - q * se), math.exp(m + q * se)


def steps_per_decade(mu: float) -> float:
    """Steps a geometric sequence ``c mu^m`` needs to shrink by a factor 10: ``log 10 / -log mu``."""
    mu = float(mu)
    if not 0 < mu < 1:
        raise ValueError(f"mu: expected a contraction factor in (0, 1), got {mu!r}")
    return math.log(10) / -math.log(mu)


def gamma_design(
    values_by_n: Dict[float, Sequence[float]], *, stat: str = "mean", truth: float = -1.0, amplitude: float = 2.0
) -> Callable[[np.random.Generator], ExponentFit]:
    """A simulation of a sweep with independent seeds per ``n``, for :func:`coverage`.

    The design is read off the measured ``values_by_n``: the same ``n`` grid, ``S`` = the smallest
    number of seeds at any ``n``, and the per-seed dispersion as a Gamma law whose shape is
    ``1 / median_n(var / mean^2)``. One simulated sweep draws, at each ``n``, ``S`` values
    ``amplitude n^truth G`` with ``G ~ Gamma(shape, 1/shape)`` (mean 1) and returns
    :func:`fit_exponent` of them with ``stat``; the true exponent is ``truth``.
    """
    vals = _check_values_by_n(values_by_n, min_n=3, min_size=3)
    if stat not in ("mean", "median"):
        raise ValueError(f"stat: expected 'mean' or 'median', got {stat!r}")
    if not (math.isfinite(float(truth)) and float(amplitude) > 0):
        raise ValueError(
            f"truth, amplitude: expected a finite exponent and a positive amplitude, got {truth!r}, {amplitude!r}"
        )
    ns = np.array(list(vals))
    S = min(v.size for v in vals.values())
    cv2 = float(np.median([v.var() / v.mean() ** 2 for v in vals.values()]))
    if not cv2 > 0:
        raise ValueError("values_by_n: the values do not vary; no dispersion to simulate")
    shape = 1.0 / cv2

    def simulate(rng: np.random.Generator) -> ExponentFit:
        return fit_exponent({n: amplitude * float(n) ** truth * rng.gamma(shape, 1 / shape, S) for n in ns}, stat=stat)

    simulate.design = {"ns": ns, "seeds": S, "shape": shape, "truth": float(truth)}
    return simulate


def chain_design(
    residuals_by_n: Dict[float, np.ndarray], Sigma, *, truth: float = -2.0, n_min=None
) -> Callable[[np.random.Generator], ExponentFit]:
    r"""A simulation of a sweep with ``K`` independent chains per ``n``, for :func:`coverage`.

    ``residuals_by_n`` maps ``n`` to the chains' averaged residuals, an array ``(K, k, d)``
    (``attnlib.experiments.prompt_residuals``). The design: the ``n >= n_min`` of the grid, ``K``
    chains, and at each ``n`` the measured relative chain noise ``q_n`` (the entries' standard
    deviation across chains, averaged, over the norm of the mean residual). One simulated
    sweep takes the mean residual ``R_0`` at the largest ``n``, sets the true residual
    ``R_n = R_0 (n_max/n)^{-truth/2}`` (so the excess ``1/2 ||R_n Sigma^{1/2}||^2`` scales as
    ``n^truth``), draws ``K`` chains ``R_n + q_n ||R_n|| N(0, I)`` and returns
    :func:`ustat_exponent` of their U-statistics (:func:`excess_ustat`; a negative
    U-statistic is replaced by its absolute value, as a fit on logs needs positive values).
    """
    if not isinstance(residuals_by_n, dict) or not residuals_by_n:
        raise ValueError("residuals_by_n: expected a dict {n: array of shape (K, k, d)}")
    R = {float(n): np.asarray(v, dtype=float) for n, v in sorted(residuals_by_n.items())}
    shapes = {r.shape for r in R.values()}
    if any(r.ndim != 3 or r.shape[0] < 3 for r in R.values()) or len({s[1:] for s in shapes}) != 1:
        raise ValueError("residuals_by_n: expected arrays (K, k, d) of one (k, d) with K >= 3 chains each")
    if not math.isfinite(float(truth)):
        raise ValueError(f"truth: expected a finite exponent, got {truth!r}")
    ns = [n for n in R if n_min is None or n >= float(n_min)]
    if len(ns) < 3:
        raise ValueError(f"n_min: need at least three n >= {n_min}, got {len(ns)}")
    n0 = max(R)
    R0 = R[n0].mean(axis=0)
    rel = {n: R[n].std(axis=0, ddof=1).mean() / np.linalg.norm(R[n].mean(axis=0)) for n in ns}
    K = min(R[n].shape[0] for n in ns)
    S = np.asarray(Sigma.cpu().numpy() if hasattr(Sigma, "cpu") else Sigma, dtype=float)

    def simulate(rng: np.random.Generator) -> ExponentFit:
        U = []
        for n in ns:
            Rt = R0 * (n0 / n) ** (-truth / 2)
            u = excess_ustat(Rt + rel[n] * np.linalg.norm(Rt) * rng.standard_normal((K,) + Rt.shape), S)
            U.append(dict(u, excess=abs(u["excess"])))
        return ustat_exponent(ns, U)

    simulate.design = {"ns": np.array(ns), "chains": K, "rel_noise": rel, "truth": float(truth)}
    return simulate


@dataclass
class _RatioFit:
    """A paired ratio on the log scale, in the shape :func:`coverage` reads (``slope``, ``ci``, ``covers``)."""

    slope: float
    ci: tuple

    def covers(self, b: float) -> bool:
        return self.ci[0] <= b <= self.ci[1]


def paired_ratio_design(
    numerator: Sequence[float], denominator: Sequence[float], *, truth: float = 1.0, level: float = 0.95
) -> Callable[[np.random.Generator], _RatioFit]:
    """A simulation of :func:`paired_ratio` at one ``n``, for :func:`coverage`: the measured design.

    The ``S`` paired log-ratios ``log(numerator / denominator)`` are centered and resampled with
    replacement (their measured spread and skew), shifted to the true log-ratio ``log(truth)``; one
    simulated sweep returns the interval of :func:`paired_ratio` on the log scale, so
    ``coverage(sim, math.log(truth))`` is the coverage of its nominal ``level`` interval.
    """
    num, den = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if num.shape != den.shape or num.ndim != 1 or num.size < 3:
        raise ValueError("numerator, denominator: expected two paired sequences of the same length >= 3")
    if np.any(num <= 0) or np.any(den <= 0) or not float(truth) > 0:
        raise ValueError("numerator, denominator, truth: expected positive values")
    lr = np.log(num / den)
    centered = lr - lr.mean()
    level = _check_level(level)

    def simulate(rng: np.random.Generator) -> _RatioFit:
        x = math.log(truth) + rng.choice(centered, size=centered.size, replace=True)
        r, lo, hi = paired_ratio({1: np.exp(x)}, {1: np.ones_like(x)}, level=level)
        return _RatioFit(math.log(r), (math.log(lo), math.log(hi)))

    simulate.design = {"seeds": int(lr.size), "sd_log": float(lr.std(ddof=1)), "truth": float(truth)}
    return simulate
