"""Exponent fits and the coverage of their intervals, simulated with the committed sweeps' designs."""

import math
from pathlib import Path

import numpy as np
import pytest

from attnlib import experiments as ex
from attnlib import stats as st
from attnlib.prompts import excess_ustat

DATA = Path(__file__).resolve().parents[1] / "book" / "data"


def test_t_quantile():
    assert st.t_quantile(0.975, math.inf) == pytest.approx(1.959964, abs=1e-6)
    assert st.t_quantile(0.975, 10) == pytest.approx(2.228139, rel=1e-3)
    assert st.t_quantile(0.975, 5) == pytest.approx(2.570582, rel=2e-3)
    with pytest.raises(ValueError, match="p"):
        st.t_quantile(1.0, 3)


def test_summarize():
    v = np.arange(1.0, 102.0)
    m, se = st.summarize(v, "mean")
    assert m == pytest.approx(51.0) and se == pytest.approx(v.std(ddof=1) / (10.05 * 51.0), rel=1e-2)
    med, se_m = st.summarize(v, "median")
    assert med == 51.0 and 0 < se_m < 0.2
    with pytest.raises(ValueError, match="stat"):
        st.summarize(v, "mode")
    with pytest.raises(ValueError, match="positive"):
        st.summarize([1.0, 0.0, 2.0])


def test_wls_recovers_a_power_law_and_inflates_for_curvature():
    ns = 2.0 ** np.arange(4, 12)
    f = st.wls_exponent(ns, 3 * ns**-1.5, np.full(ns.size, 0.01))
    assert f.slope == pytest.approx(-1.5, abs=1e-12) and f.inflation == 1.0 and f.covers(-1.5)
    assert f(100.0) == pytest.approx(3 * 100**-1.5)
    curved = 3 * ns**-2.0 * np.log(ns) ** 6
    g = st.wls_exponent(ns, curved, np.full(ns.size, 0.01))
    assert g.inflation > 10  # chi^2 >> dof: the interval widens instead of pretending
    ls = st.local_slopes(ns, curved, np.full(ns.size, 0.01))
    assert np.allclose(ls[:, 1], -2 + 6 * np.log(np.log(ns[1:]) / np.log(ns[:-1])) / np.log(2))
    with pytest.raises(ValueError, match="se_log"):
        st.wls_exponent(ns, curved, np.zeros(ns.size))


def _spectral_design():
    """ns, seeds per n and the per-seed dispersion (Gamma shape) of the committed regime-(i) sweeps."""
    path = DATA / "regime1_spectral.csv"
    rows = ex.load(str(path))
    v = ex.values_by_n(rows, "excess", noise_std=0.0)
    ns = np.array(sorted(v))
    S = min(len(a) for a in v.values())
    cv2 = np.median([a.var() / a.mean() ** 2 for a in v.values()])
    return ns, S, 1.0 / cv2


def _trained_design():
    rows = ex.load(str(DATA / "regime1_trained.csv"))
    last = max(int(r["step"]) for r in rows)
    v = ex.values_by_n(
        [r for r in rows if int(r["step"]) == last and r["renorm"] == "balance"], "excess", noise_std=0.1
    )
    ns = np.array(sorted(v))
    S = min(len(a) for a in v.values())
    cv2 = np.median([a.var() / a.mean() ** 2 for a in v.values()])
    return ns, S, 1.0 / cv2


@pytest.mark.parametrize("design", ["spectral", "trained"])
@pytest.mark.parametrize("stat", ["mean", "median"])
def test_regime_i_intervals_cover_at_the_stated_rate(design, stat):
    """400 simulated sweeps with the committed design (same ns, seeds, per-seed dispersion), exponent -1."""
    path = DATA / ("regime1_spectral.csv" if design == "spectral" else "regime1_trained.csv")
    if not path.exists():
        pytest.skip(f"{path.name} not generated yet")
    ns, S, shape = _spectral_design() if design == "spectral" else _trained_design()
    assert S >= (400 if design == "spectral" else 40)

    def simulate(rng):
        vals = {n: 2.0 / n * rng.gamma(shape, 1.0 / shape, S) for n in ns}
        return st.fit_exponent(vals, stat=stat, level=0.95)

    res = st.coverage(simulate, -1.0, reps=400, seed=1)
    assert 0.90 <= res["coverage"] <= 0.99, res
    assert abs(res["mean_slope"] + 1.0) < 0.2 * res["mean_halfwidth"] + 0.01


@pytest.mark.parametrize("label", ["cap0.25", "balance"])
@pytest.mark.parametrize("n_min", [16, 128, 256])
def test_regime_ii_intervals_cover_at_the_stated_rate(label, n_min):
    """Simulated chains with the committed regime-(ii) design (ns, chains per n, relative noise), exponent -2."""
    path = DATA / "regime2_prompts.csv"
    if not path.exists():
        pytest.skip("regime2_prompts.csv not generated yet")
    rows = ex.load(str(path))
    task = ex.make_task()
    est = ex.prompt_excess(rows, label)
    ns = np.array(sorted(est))
    K = min(e["K"] for e in est.values())
    assert K >= 6
    # per-n chain noise: spread of the residual entries across chains, relative to the mean residual
    kd = task.k * task.d
    rel = []
    for n in ns:
        R = np.array([[r[f"r{i}"] for i in range(kd)] for r in rows if r["label"] == label and int(r["n"]) == n])
        rel.append(R.std(axis=0, ddof=1).mean() / np.linalg.norm(R.mean(axis=0)))
    rel = np.array(rel)
    S = task.Sigma.numpy()
    R0 = np.array([[r[f"r{i}"] for i in range(kd)] for r in rows if r["label"] == label and int(r["n"]) == ns[-1]])
    R0 = R0.mean(axis=0).reshape(task.k, task.d)

    keep = ns >= n_min

    def simulate(rng):
        U = []
        for n, q in zip(ns[keep], rel[keep]):
            Rt = R0 * (ns[-1] / n)  # excess ~ n^-2
            Rs = Rt + q * np.linalg.norm(Rt) * rng.standard_normal((K,) + Rt.shape)
            U.append(excess_ustat(Rs, S))
        for u in U:
            u["excess"] = abs(u["excess"])
        return st.ustat_exponent(ns[keep], U)

    res = st.coverage(simulate, -2.0, reps=400, seed=2)
    assert 0.90 <= res["coverage"] <= 0.99, res


def test_pooling_is_what_makes_few_chain_intervals_honest():
    """Without pooling, noisy jackknife weights from 6 chains make the interval too short (measured here)."""
    ns = 2.0 ** np.arange(4, 11)
    R0 = np.array([[1.0, 0.5, 0.0], [0.2, -0.3, 0.1]])

    def sim(pool):
        def simulate(rng):
            U, se = [], []
            for n in ns:
                Rt = R0 * 30 / n
                e = excess_ustat(Rt + 0.1 * np.linalg.norm(Rt) * rng.standard_normal((6, 2, 3)), np.eye(3))
                U.append(abs(e["excess"]))
                se.append(e["se"] / abs(e["excess"]))
            return st.wls_exponent(ns, U, se, pool_se=pool)

        return st.coverage(simulate, -2.0, reps=400, seed=3)["coverage"]

    assert sim(True) >= 0.92 and sim(False) < sim(True)
