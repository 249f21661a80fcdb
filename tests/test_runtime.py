"""Thread policy and seed streams: one place each."""

import os
from pathlib import Path

import pytest
import torch

import attnlib as al
from attnlib import runtime


def _cgroup(tmp_path, v2=None, v1=None):
    tmp_path.mkdir(exist_ok=True)
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(str(v1[0]))
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(str(v1[1]))
    return str(tmp_path)


def test_granted_cpus_reads_the_cgroup_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert runtime.granted_cpus(_cgroup(tmp_path / "a", v2="max 100000")) == 16
    assert runtime.granted_cpus(_cgroup(tmp_path / "b", v2="150000 100000")) == 2  # 1.5 CPUs -> 2
    assert runtime.granted_cpus(_cgroup(tmp_path / "c", v2="50000 100000")) == 1
    assert runtime.granted_cpus(_cgroup(tmp_path / "d", v1=(100000, 100000))) == 1
    assert runtime.granted_cpus(_cgroup(tmp_path / "e", v1=(-1, 100000))) == 16  # v1 unlimited
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert runtime.granted_cpus(_cgroup(tmp_path / "b")) == 1  # affinity wins


def test_thread_policy_from_the_environment():
    assert runtime.threads_from_env(None, granted=8) >= 1
    assert runtime.threads_from_env("", granted=8) == 1  # default: one thread
    assert runtime.threads_from_env("auto", granted=8) == 8
    assert runtime.threads_from_env("3", granted=8) == 3
    assert runtime.threads_from_env("32", granted=2) == 2  # capped at what is granted
    for bad in ("0", "-1", "many", "1.5"):
        with pytest.raises(ValueError, match="ATTNLIB_NUM_THREADS"):
            runtime.threads_from_env(bad, granted=8)


def test_configure_threads_sets_torch(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert al.configure_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("ATTNLIB_NUM_THREADS", "auto")
        n = al.configure_threads()
        assert n == al.granted_cpus() and torch.get_num_threads() == n
        assert al.thread_info()["env"] == "auto"
    finally:
        torch.set_num_threads(before)


def test_import_applies_the_policy_in_a_fresh_process():
    import subprocess
    import sys

    code = "import attnlib, torch; attnlib.Task; print(torch.get_num_threads())"
    env = dict(os.environ, ATTNLIB_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "1"
    env["ATTNLIB_NUM_THREADS"] = "nonsense"
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "ATTNLIB_NUM_THREADS" in bad.stderr


def test_import_is_lazy_and_light():
    """`import attnlib` loads neither torch nor the course tools; the first use of a name does."""
    import subprocess
    import sys

    code = (
        "import sys, attnlib; light = 'torch' not in sys.modules and 'attnlib.course' not in sys.modules; "
        "attnlib.train; print(light, 'torch' in sys.modules, 'attnlib.course' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "False"]
    # no submodule is named like a function: importing every module leaves al.train the function
    code = "import attnlib as al, attnlib.experiments; print(callable(al.train), al.train.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "attnlib.optim.api"]
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        al.nonexistent  # noqa: B018
    assert set(al.__all__) <= set(dir(al))


def test_derive_seed_streams_are_distinct_and_validated():
    # the held-out sequences of different seeds never reuse each other's (or a training sequence's) seed
    held = [al.derive_seed(s, "heldout", i) for s in range(50) for i in range(8)]
    train = [al.derive_seed(s, "sequence") for s in range(50)]
    assert len(set(held)) == len(held) and not set(held) & set(train)
    assert al.derive_seed(3, "sequence") == 10_003  # the committed sweep's layout
    assert al.derive_seed(3, "my-new-experiment") == al.derive_seed(3, "my-new-experiment")
    assert al.derive_seed(3, "my-new-experiment") != al.derive_seed(4, "my-new-experiment")
    with pytest.raises(ValueError, match="seed"):
        al.derive_seed(-1, "sequence")
    with pytest.raises(ValueError, match="index"):
        al.derive_seed(1, "sequence", -2)


def test_version_is_the_package_metadata():
    """One version number: attnlib.__version__ is what pyproject.toml declares (via the metadata)."""
    import tomllib

    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert al.__version__ == declared
