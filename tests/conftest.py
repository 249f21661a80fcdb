import os
import re
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


# the repository the test build's links point at (tools/set_repository.py fills it in)
TEST_REPOSITORY = "https://github.com/example-org/attnlib-book"
# what the build reads: the configuration, the table of contents and book/ (chapters, bibliography,
# static files, the local extension); attnlib is imported from the environment
BOOK_SOURCES = ("_config.yml", "_toc.yml", "book")


@pytest.fixture(scope="session")
def built_book(tmp_path_factory):
    """Build the book once per test session (-W -n --keep-going); returns (html folder, log, returncode).

    Builds a copy of the book's sources in a temporary folder, published as it would be from
    TEST_REPOSITORY (tools/set_repository.py: launch and repository buttons on) and with notebook
    execution off: the notebooks are committed executed, and nbval re-executes each of them in the
    same test run. The README's in-place build executes them (execute_notebooks: "cache").
    """
    jb = _jupyter_book()
    assert jb, "jupyter-book is not installed (pip install -r requirements.txt)"
    src = tmp_path_factory.mktemp("book")
    skip = shutil.ignore_patterns(
        "_build", ".ipynb_checkpoints", "__pycache__", ".jupyter_cache", "jupyter_execute", ".pytest_cache"
    )
    for name in BOOK_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "set_repository.py"),
            "--url",
            TEST_REPOSITORY,
            "--config",
            str(src / "_config.yml"),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    config = src / "_config.yml"
    text, n = re.subn(r'(?m)^(\s+execute_notebooks\s*:\s*)\S+', r'\g<1>"off"', config.read_text())
    assert n == 1, "_config.yml has no execute.execute_notebooks to switch off"
    config.write_text(text)
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.pop("MPLBACKEND", None)  # the notebooks select the inline backend themselves
    proc = subprocess.run(
        [jb, "build", str(src), "-W", "-n", "--keep-going"], capture_output=True, text=True, env=env, timeout=3000
    )
    return src / "_build" / "html", proc.stdout + proc.stderr, proc.returncode
