"""The regime-(ii) sweeps beyond n = 1024 added for issue 21: nu = 0.375 with the design of prompts_large, and
float64 attention on chains of prompts_large (same seeds, hence the same prompts)."""

import numpy as np

from attnlib import experiments as ex
from attnlib.analysis import theory as th


def _design(specs):
    return sorted((s["n"], s["chain"], s["steps"], s["burn_in"], s["prompts"], s["lr"]) for s in specs)


def test_fix_sweep_has_the_design_of_prompts_large():
    fix, large = ex.sweep("prompts_large_fix").specs, ex.sweep("prompts_large").specs
    assert _design(fix) == _design(large)
    assert {(s["label"], s["renormalize"], s["nu_cap"], s["attention_dtype"]) for s in fix} == {
        ("fix0.375", "fix", 0.375, "float32")
    }


def test_float64_sweep_reruns_chains_of_prompts_large():
    f64, large = ex.sweep("prompts_float64").specs, ex.sweep("prompts_large").specs
    by_run = {s["run"]: s for s in large}
    assert {s["attention_dtype"] for s in f64} == {"float64"} and {s["n"] for s in f64} == {2048, 4096}
    for s in f64:  # the same run name means the same label, n and chain, hence the same seed and prompts
        twin = dict(by_run[s["run"]], attention_dtype="float64")
        assert twin == s


def test_quick_float64_and_float32_chains_pair_up():
    a = ex.sweep("prompts_float64", quick=True)
    b = ex.sweep("prompts_large", quick=True)
    assert [s["run"] for s in a.specs] == [s["run"] for s in b.specs]
    Ra = np.array([[a.func(s)[0][f"r{i}"] for i in range(8)] for s in a.specs]).reshape(-1, 2, 4)
    Rb = np.array([[b.func(s)[0][f"r{i}"] for i in range(8)] for s in b.specs]).reshape(-1, 2, 4)
    p = th.paired_precision(Rb, Ra, ex.make_task(0.0).Sigma)
    assert 0 < p["max_rel_change"] < 1e-3  # float32 rounding moves each chain, by far less than its noise
    assert abs(p["diff"]) < 1e-3 * p["se_b"]
