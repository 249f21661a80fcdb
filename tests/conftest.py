import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

import attnlib as al

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def task():
    """A small, moderately conditioned, noisy task in float64."""
    return al.Task.random(5, 3, cond=10.0, signal=1.0, noise_std=0.3, seed=0)


def _jupyter_book():
    exe = Path(sys.executable).with_name("jupyter-book")
    return str(exe) if exe.exists() else shutil.which("jupyter-book")


@pytest.fixture(scope="session")
def built_book(tmp_path_factory):
    """Build the book once per test session (-W -n --keep-going); returns (html folder, log, returncode)."""
    jb = _jupyter_book()
    assert jb, "jupyter-book is not installed (pip install -r requirements.txt)"
    out = tmp_path_factory.mktemp("book")
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.pop("MPLBACKEND", None)  # the notebooks select the inline backend themselves
    proc = subprocess.run([jb, "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"],
                          capture_output=True, text=True, env=env, timeout=3000)
    return out / "_build" / "html", proc.stdout + proc.stderr, proc.returncode
