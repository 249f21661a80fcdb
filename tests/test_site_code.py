"""The built site ships what a reader needs to run a downloaded chapter (book/_ext/ship_code.py).

From the built site alone: the attnlib wheel installs into a fresh virtual environment, the
bundle's one install command names the reader's pinned environment and the wheel, and the first
code cells of chapter 1 from the bundle run there. Offline: the fresh environment sees the test
environment's third-party packages (torch, numpy, ...) through a path file, but not its attnlib
(an editable install of this checkout), so the attnlib it imports is the shipped wheel's.
"""

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(request):
    prebuilt = os.environ.get("ATTNLIB_BUILT_HTML")  # a build made beforehand (see test_browser.py)
    if prebuilt:
        return Path(prebuilt)
    html, log, returncode = request.getfixturevalue("built_book")
    assert returncode == 0, log[-3000:]
    return html


def _version():
    return re.search(r'(?m)^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


@pytest.mark.slow
def test_site_ships_wheel_and_bundle_linked_from_the_landing_page(site):
    wheel = site / "dist" / f"attnlib-{_version()}-py3-none-any.whl"
    bundle = site / "dist" / "attnlib-book.zip"
    assert wheel.is_file() and bundle.is_file()
    page = (site / "book" / "intro.html").read_text()
    assert 'href="../dist/attnlib-book.zip"' in page and f'href="../dist/{wheel.name}"' in page
    # the PDF: linked where the site ships it, else the page says how to make it
    if (site / "dist" / "book.pdf").is_file():
        assert 'href="../dist/book.pdf"' in page
    else:
        assert "pdflatex" in page and "dist/book.pdf" not in page
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "attnlib/__init__.py" in names and "attnlib/course/__init__.py" in names
    with zipfile.ZipFile(bundle) as z:
        names = set(z.namelist())
        reqs = z.read("attnlib-book/requirements.txt").decode()
    chapters = {p.name for p in (ROOT / "book").glob("*.ipynb")}
    assert {f"attnlib-book/{c}" for c in chapters} <= names
    assert {f"attnlib-book/data/{p.name}" for p in (ROOT / "book" / "data").iterdir() if p.is_file()} <= names
    assert f"attnlib-book/{wheel.name}" in names
    # the one install command: the reader's pins (binder/requirements.txt) and the wheel
    lines = [ln.strip() for ln in reqs.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[-1] == f"./{wheel.name}"
    pins = dict(ln.split("==") for ln in lines if "==" in ln)
    assert {"torch", "numpy", "matplotlib", "ipykernel", "jupyterlab"} <= set(pins)
    for banned in ("pytest", "nbval", "ruff", "playwright", "jupyter-book", "check-jsonschema", "zizmor"):
        assert banned not in pins, f"requirements.txt: {banned} is not a reader's tool"
    # the pins are the versions the book was tested with
    for name, version in pins.items():
        assert metadata.version(name).split("+")[0] == version.split("+")[0], (name, version)


@pytest.mark.slow
def test_wheel_from_the_site_runs_chapter_one_in_a_fresh_venv(site, tmp_path):
    bundle = site / "dist" / "attnlib-book.zip"
    with zipfile.ZipFile(bundle) as z:
        z.extractall(tmp_path)
    work = tmp_path / "attnlib-book"
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    py = venv / "bin" / "python"
    site_dir = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # third-party packages of this environment, as plain paths (its .pth files, among them the
    # editable attnlib of this checkout, are not processed)
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site_dir / "zz_test_environment.pth").write_text("\n".join(deps) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["MPLBACKEND"] = "Agg"
    probe = subprocess.run([str(py), "-c", "import attnlib"], cwd=work, capture_output=True, text=True, env=env)
    assert probe.returncode != 0, "the fresh environment must not see this checkout's attnlib"

    (wheel,) = work.glob("attnlib-*.whl")
    subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        cwd=work,
        check=True,
        capture_output=True,
        env=env,
        timeout=300,
    )
    where = subprocess.run(
        [str(py), "-c", "import attnlib; print(attnlib.__file__)"],
        cwd=work,
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), where

    # the first code cells of chapter 1, as the reader downloaded it (IPython magics dropped)
    nb = json.loads((work / "ch1_model.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"][:4]
    code = "\n\n".join(
        "\n".join(ln for ln in "".join(c["source"]).splitlines() if not ln.lstrip().startswith(("%", "!")))
        for c in cells
    )
    (work / "first_cells.py").write_text(code + "\nprint('FIRST CELLS OK')\n")
    run = subprocess.run([str(py), "first_cells.py"], cwd=work, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "FIRST CELLS OK" in run.stdout
