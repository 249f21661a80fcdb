"""ruff (configured in pyproject.toml) over the library, the tests, the scripts and the notebooks' code."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["attnlib", "tests", "benchmarks", "tools", "book"]


def _ruff():
    exe = Path(sys.executable).with_name("ruff")
    return str(exe) if exe.exists() else shutil.which("ruff")


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(args):
    ruff = _ruff()
    assert ruff, "ruff is not installed (pip install -r requirements.txt)"
    out = subprocess.run([ruff, *args, *TARGETS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
