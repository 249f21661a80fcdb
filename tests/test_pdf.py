"""The whole book as one PDF (Jupyter Book's LaTeX builder with Debian's TeX Live, xelatex).

Needs ``xelatex`` and ``latexmk`` (``.ci/run`` installs them); elsewhere the test is skipped with
the reason. Builds a copy of the book's sources with execution off (the committed outputs), like
the HTML build of tests/conftest.py, and checks the result: a PDF with a plausible page count,
every figure included, no unresolved reference or citation, no missing glyph.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HAVE_TEX = shutil.which("xelatex") and shutil.which("latexmk")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not HAVE_TEX,
        reason="TeX Live is not installed (Debian: apt-get install texlive-xetex latexmk ...; .ci/run installs it)",
    ),
]


@pytest.fixture(scope="module")
def pdf_build(tmp_path_factory):
    src = tmp_path_factory.mktemp("pdfbook")
    skip = shutil.ignore_patterns("_build", ".ipynb_checkpoints", "__pycache__", ".jupyter_cache", "jupyter_execute")
    shutil.copytree(ROOT / "book", src / "book", ignore=skip)
    for name in ("_config.yml", "_toc.yml"):
        shutil.copy2(ROOT / name, src / name)
    config = src / "_config.yml"
    text, n = re.subn(r'(?m)^(\s+execute_notebooks\s*:\s*)\S+', r'\g<1>"off"', config.read_text())
    assert n == 1
    config.write_text(text)
    jb = Path(sys.executable).with_name("jupyter-book")
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.pop("MPLBACKEND", None)
    proc = subprocess.run(
        [str(jb), "build", str(src), "--builder", "pdflatex"], capture_output=True, text=True, env=env, timeout=3000
    )
    latex = src / "_build" / "latex"
    return latex, proc.stdout + proc.stderr, proc.returncode


def test_pdf_builds_with_every_figure_and_reference(pdf_build):
    latex, log, returncode = pdf_build
    assert returncode == 0, log[-4000:]
    pdf, tex, texlog = latex / "book.pdf", latex / "book.tex", latex / "book.log"
    assert pdf.is_file() and pdf.read_bytes()[:5] == b"%PDF-"
    text = texlog.read_text(errors="replace")
    pages = int(re.search(r"Output written on book\.pdf \((\d+) pages?", text).group(1))
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())  # the chapters, not their section pages
    chapters = [e for part in toc["parts"] for e in part["chapters"] if Path(e["file"]).name.startswith("ch")]
    assert pages >= 10 * len(chapters), f"{pages} pages for {len(chapters)} chapters"
    # references and citations resolved, figures found, every glyph in the fonts
    assert not re.findall(r"LaTeX Warning: (Reference|Citation|Hyper reference) .* undefined", text), text[-3000:]
    assert "There were undefined references" not in text
    assert not re.findall(r"File `[^']+' not found", text)
    missing = sorted(set(re.findall(r"Missing character: There is no (.) ", text)))
    assert not missing, f"characters the PDF's fonts lack: {missing}"
    # every notebook figure and the landing page's overview are in it
    source = tex.read_text()
    included = re.findall(r"\\sphinxincludegraphics(?:\[[^\]]*\])?\{\{?([^}]+?)\}?\}", source)
    figures = sum(
        "image/png" in out.get("data", {})
        for nb in (ROOT / "book").glob("*.ipynb")
        for cell in json.loads(nb.read_text())["cells"]
        for out in cell.get("outputs", [])
    )
    assert figures > 0 and len(included) >= figures + 1, (len(included), figures)
    assert any("argument" in name for name in included)
    for name in included:
        assert list(latex.glob(name + "*")) or (latex / name).exists(), name
    # theorems and proofs (sphinx-proof) and the exercises made it in
    assert source.count("Proposition") >= 5 and "Proof" in source


def test_pdf_is_shipped_and_linked_by_a_later_html_build(pdf_build):
    """Built first, the PDF goes into the HTML site's dist/ and the landing page links it
    (book/_ext/ship_code.py); the Pages workflow can publish it so."""
    latex, _, returncode = pdf_build
    assert returncode == 0
    src = latex.parents[1]
    jb = Path(sys.executable).with_name("jupyter-book")
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.pop("MPLBACKEND", None)
    proc = subprocess.run(
        [str(jb), "build", str(src), "-W", "-n", "--keep-going"], capture_output=True, text=True, env=env, timeout=3000
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    html = src / "_build" / "html"
    assert (html / "dist" / "book.pdf").read_bytes() == (latex / "book.pdf").read_bytes()
    assert 'href="../dist/book.pdf"' in (html / "book" / "intro.html").read_text()
