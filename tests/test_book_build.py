"""The book builds to HTML with warnings as errors (-W -n --keep-going)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _jupyter_book():
    exe = Path(sys.executable).with_name("jupyter-book")
    return str(exe) if exe.exists() else shutil.which("jupyter-book")


@pytest.mark.slow
def test_book_builds_without_warnings(tmp_path):
    jb = _jupyter_book()
    assert jb, "jupyter-book is not installed (pip install -r requirements.txt)"
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.pop("MPLBACKEND", None)  # the notebooks select the inline backend themselves
    proc = subprocess.run([jb, "build", str(ROOT), "--path-output", str(tmp_path), "-W", "-n", "--keep-going"],
                          capture_output=True, text=True, env=env, timeout=3000)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    html = tmp_path / "_build" / "html"
    assert (html / "book" / "intro.html").exists()
    assert "build succeeded" in log and "WARNING:" not in log, log[-4000:]
