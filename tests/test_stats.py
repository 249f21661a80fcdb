"""Exponent fits and the coverage of their intervals, simulated with the committed sweeps' designs."""

import math
from pathlib import Path

import numpy as np
import pytest

from attnlib import experiments as ex
from attnlib.analysis import stats as st
from attnlib.analysis.stats import excess_ustat

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


def _trained_values():
    rows = ex.read_sweep(str(DATA / "regime1_trained.csv"))
    return ex.trained_values(rows, "balance", 0.1)


@pytest.mark.parametrize("design", ["spectral", "trained"])
@pytest.mark.parametrize("stat", ["mean", "median"])
def test_regime_i_intervals_cover_at_the_stated_rate(design, stat):
    """400 simulated sweeps with the committed design (same ns, seeds, per-seed dispersion), exponent -1."""
    path = DATA / ("regime1_spectral.csv" if design == "spectral" else "regime1_trained.csv")
    if not path.exists():
        pytest.skip(f"{path.name} not generated yet")
    if design == "spectral":
        values = ex.values_by_n(ex.read_sweep(str(path)), "excess", noise_std=0.0)
    else:
        values = _trained_values()
    simulate = st.gamma_design(values, stat=stat, truth=-1.0)
    assert simulate.design["seeds"] >= (400 if design == "spectral" else 40)
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
    residuals = ex.prompt_residuals(ex.read_sweep(str(path)), label)
    simulate = st.chain_design(residuals, ex.make_task().Sigma, truth=-2.0, n_min=n_min)
    assert simulate.design["chains"] >= 6
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


def test_scaled_constant_recovers_c_and_pools_by_inverse_variance():
    rng = np.random.default_rng(0)
    vals = {n: 1.5 / n * rng.gamma(4.0, 0.25, 2000) for n in (64, 256, 1024)}
    c, se = st.scaled_constant(vals, n_min=128)
    assert abs(c - 1.5) < 3 * se and se < 0.03
    # exact pooling on a two-point case: equal errors give the plain average of n x mean
    two = {10: np.array([1.0, 3.0]), 20: np.array([0.5, 1.5])}
    assert st.scaled_constant(two) == pytest.approx((20.0, 10 / math.sqrt(2)))
    assert st.scaled_constant(vals, power=2.0)[0] > 100  # n^2 x value is not flat: no constant, large number
    with pytest.raises(ValueError, match="n_min"):
        st.scaled_constant(vals, n_min=4096)
    with pytest.raises(ValueError, match="values_by_n"):
        st.scaled_constant({8: [1.0, -1.0]})


def test_paired_ratio_uses_the_pairing():
    rng = np.random.default_rng(1)
    base = {n: rng.lognormal(0.0, 1.0, 50) / n for n in (32, 64, 128)}
    num = {n: 0.5 * v * rng.lognormal(0.0, 0.05, v.size) for n, v in base.items()}
    r, lo, hi = st.paired_ratio(num, base)
    assert lo < 0.5 < hi and hi / lo < 1.05  # paired: the seed-to-seed spread cancels
    shuffled = {n: rng.permutation(v) for n, v in base.items()}
    _, lo_s, hi_s = st.paired_ratio(num, shuffled)
    assert hi_s / lo_s > 1.3  # unpaired values give a much wider interval
    with pytest.raises(ValueError, match="denominator_by_n"):
        st.paired_ratio(num, {n: v[:-1] for n, v in base.items()})


def test_steps_per_decade():
    assert st.steps_per_decade(0.1) == pytest.approx(1.0)
    assert st.steps_per_decade(0.9) == pytest.approx(21.854, abs=1e-3)
    with pytest.raises(ValueError, match="mu"):
        st.steps_per_decade(1.0)


def test_gamma_design_reads_the_design_and_simulates_the_truth():
    rng = np.random.default_rng(2)
    ns = (32, 64, 128, 256)
    measured = {n: 3.0 / n * rng.gamma(2.0, 0.5, 80) for n in ns}  # shape 2, 80 seeds
    sim = st.gamma_design(measured, truth=-1.5)
    assert list(sim.design["ns"]) == list(ns) and sim.design["seeds"] == 80
    assert sim.design["shape"] == pytest.approx(2.0, rel=0.3)
    fits = [sim(np.random.default_rng(s)) for s in range(40)]
    assert abs(np.mean([f.slope for f in fits]) + 1.5) < 0.05
    assert st.coverage(sim, -1.5, reps=200, seed=3)["coverage"] >= 0.9
    assert st.coverage(sim, -1.0, reps=50, seed=3)["coverage"] < 0.1  # a wrong truth is not covered
    with pytest.raises(ValueError, match="stat"):
        st.gamma_design(measured, stat="mode")
    with pytest.raises(ValueError, match="values_by_n"):
        st.gamma_design({32: [1.0, 2.0, 3.0]})


def test_chain_design_simulates_the_truth_with_the_measured_chain_noise():
    rng = np.random.default_rng(4)
    R0 = np.array([[1.0, 0.5, 0.0], [0.2, -0.3, 0.1]])
    ns = (16, 32, 64, 128)
    measured = {n: R0 * 128 / n + 0.2 * np.linalg.norm(R0 * 128 / n) * rng.standard_normal((6, 2, 3)) for n in ns}
    sim = st.chain_design(measured, np.eye(3), truth=-2.0)
    assert sim.design["chains"] == 6
    assert all(0.1 < q < 0.3 for q in sim.design["rel_noise"].values())
    assert st.coverage(sim, -2.0, reps=200, seed=5)["coverage"] >= 0.9
    shallow = st.chain_design(measured, np.eye(3), truth=-1.0, n_min=32)
    assert list(shallow.design["ns"]) == [32.0, 64.0, 128.0]
    assert abs(np.mean([shallow(np.random.default_rng(s)).slope for s in range(30)]) + 1.0) < 0.1
    with pytest.raises(ValueError, match="residuals_by_n"):
        st.chain_design({16: np.zeros((2, 2, 3))}, np.eye(3))
    with pytest.raises(ValueError, match="n_min"):
        st.chain_design(measured, np.eye(3), n_min=100)


def test_paired_ratio_design_has_its_coverage():
    from attnlib.analysis import stats as st_

    rng = np.random.default_rng(0)
    num, den = rng.gamma(3.0, 1.0, 40), rng.gamma(3.0, 1.0, 40)
    sim = st_.paired_ratio_design(num, den, truth=2.0)
    cov = st_.coverage(sim, math.log(2.0), reps=400, seed=1)["coverage"]
    assert 0.9 <= cov <= 0.99
    with pytest.raises(ValueError, match="paired"):
        st_.paired_ratio_design(num, den[:5])
