"""The experiment runner (quick mode, resume) and the fits on synthetic data with known answers."""

import csv
import math

import numpy as np
import pytest

import attnlib as al
from attnlib import experiments as ex


def test_quick_scaling_run_writes_tidy_csv_and_resumes(tmp_path, capsys):
    out = tmp_path / "quick.csv"
    assert ex.main(["scaling", "--quick", "--out", str(out), "--no-progress"]) == 0
    assert "8 runs written, 0 already present" in capsys.readouterr().out
    rows = ex.read_rows(str(out))
    cfg = ex.QUICK
    assert len(rows) == len(cfg.ns) * len(cfg.noise_stds) * len(cfg.seeds) * (cfg.steps + 1)
    assert set(rows[0]) == set(ex.COLUMNS)
    for r in rows:
        assert r["excess"] >= 0 and r["dist"] >= 0 and r["diverged"] == 0
        if r["step"] in (0, cfg.steps):
            assert r["test_loss"] > 0
        else:
            assert math.isnan(r["test_loss"])
    # step 0 is the spectral initialisation
    task = cfg.task(0.1)
    X, Y = task.sample(64, seed=10_000 + 1)
    r0 = [r for r in rows if r["n"] == 64 and r["noise_std"] == 0.1 and r["seed"] == 1 and r["step"] == 0][0]
    assert r0["excess"] == pytest.approx(float(task.excess_risk(*al.spectral_init(X, Y))), rel=1e-12)
    # resume: nothing new to do, nothing appended
    assert ex.main(["scaling", "--quick", "--out", str(out), "--no-progress"]) == 0
    assert "0 runs written, 8 already present" in capsys.readouterr().out
    assert len(ex.read_rows(str(out))) == len(rows)


def test_resume_after_interruption(tmp_path):
    out = tmp_path / "part.csv"
    cfg = ex.ScalingConfig(ns=(64,), noise_stds=(0.0,), seeds=(0, 1, 2), steps=3)
    part = ex.ScalingConfig(**{**cfg.__dict__, "seeds": (0,)})
    ex.run_scaling(part, str(out), progress=False)
    info = ex.run_scaling(cfg, str(out), progress=False)
    assert info == {**info, "runs": 2, "skipped": 1}
    seeds = sorted({r["seed"] for r in ex.read_rows(str(out))})
    assert seeds == [0, 1, 2]


def _synthetic_rows(exponent, ns=(100, 300, 1000, 3000, 10000), seeds=5, noise=0.0, mu=0.8, steps=30, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for n in ns:
        for s in range(seeds):
            floor = 3.0 * n**exponent * math.exp(0.1 * rng.standard_normal())
            for m in range(steps + 1):
                rows.append(
                    {
                        "n": n,
                        "noise_std": noise,
                        "seed": s,
                        "step": m,
                        "excess": floor + mu**m,
                        "dist": 0.0,
                        "objective": 1.0 + 0.5 * mu**m,
                        "time_s": 0.0,
                        "test_loss": float("nan"),
                        "diverged": 0,
                    }
                )
    return rows


@pytest.mark.parametrize("exponent", [-1.0, -2.0])
def test_fit_floor_recovers_the_exponent(exponent):
    rows = _synthetic_rows(exponent, steps=150)
    fit = ex.fit_floor(rows, 0.0, n_boot=300)
    assert fit.slope == pytest.approx(exponent, abs=0.05)
    assert fit.ci[0] < exponent < fit.ci[1]
    with pytest.raises(ValueError, match="noise_std"):
        ex.fit_floor(rows, 0.5)


def test_fit_optimisation_rate_recovers_mu():
    rows = _synthetic_rows(-1.0, mu=0.8, steps=150)
    assert ex.fit_optimisation_rate(rows, 1000, 0.0) == pytest.approx(0.8, rel=1e-3)
    with pytest.raises(ValueError, match="n, noise_std"):
        ex.fit_optimisation_rate(rows, 7, 0.0)


def test_read_rows_rejects_other_csv(tmp_path):
    p = tmp_path / "other.csv"
    with open(p, "w", newline="") as fh:
        csv.writer(fh).writerows([["a", "b"], [1, 2]])
    with pytest.raises(ValueError, match="not a scaling CSV"):
        ex.read_rows(str(p))


def test_cuda_flag_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the flag is valid here")
    with pytest.raises(SystemExit):
        ex.main(["scaling", "--quick", "--out", str(tmp_path / "x.csv"), "--device", "cuda"])
