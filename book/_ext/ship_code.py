"""Ship the code with the site: the attnlib wheel and the chapters, installable with one command.

After an HTML build this writes, into the site's ``dist/`` folder:

- ``attnlib-<version>-py3-none-any.whl``, built by ``pip wheel --no-deps --no-build-isolation``
  from a copy of the library's sources (the checkout stays clean);
- ``book.pdf``, the whole book, when the LaTeX build ran first into the same ``_build``
  (``jupyter-book build . --builder pdflatex``, then the HTML build); the landing page's
  ``{{ pdf_download }}`` links it, or says how to make it;
- ``attnlib-book.zip``: a folder ``attnlib-book/`` with every chapter notebook, the committed
  results they read (``data/``), the wheel and ``requirements.txt`` (binder/requirements.txt, the
  reader's environment, plus the wheel), so that ``pip install -r requirements.txt`` in it is the
  one install command (the landing page's "Run it yourself" names it).

The sources are found next to the configuration (an in-place build) or, for a build of a copy of
the book (tests/conftest.py), where the installed ``attnlib`` lives. A failure is a warning, so a
build with ``-W`` fails: a site without its code is not published.
"""

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)

BUNDLE = "attnlib-book"


def project_root(confdir):
    """The folder with attnlib's ``pyproject.toml``: ``confdir`` or the installed package's checkout."""
    for cand in (Path(confdir),):
        if _is_root(cand):
            return cand
    import attnlib

    cand = Path(attnlib.__file__).resolve().parents[1]
    if _is_root(cand):
        return cand
    raise FileNotFoundError(f"no attnlib sources (pyproject.toml with name attnlib) at {confdir} or {cand}")


def _is_root(path):
    pyproject = path / "pyproject.toml"
    return pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"attnlib"', pyproject.read_text()) is not None


def build_wheel(root, out):
    """Build attnlib's wheel from a copy of ``root``'s sources into ``out``; returns the wheel's path."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(root / name, src / name)
        shutil.copytree(root / "attnlib", src / "attnlib", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        wheels = Path(tmp) / "wheels"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
        proc = subprocess.run([*cmd, str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip wheel failed: {proc.stderr[-2000:]}")
        (wheel,) = wheels.glob("attnlib-*.whl")
        target = out / wheel.name
        shutil.copy2(wheel, target)
    return target


def reader_requirements(root, wheel_name):
    """binder/requirements.txt (the reader's environment) with the shipped wheel as its last line."""
    text = (root / "binder" / "requirements.txt").read_text()
    if re.search(r"(?m)^\s*-r\s", text):
        raise ValueError("binder/requirements.txt: expected the reader's own pins, not an include (-r)")
    return text.rstrip("\n") + f"\n# the book's library, shipped with the site\n./{wheel_name}\n"


def build_bundle(root, book_dir, wheel, out):
    """``attnlib-book.zip``: the chapters, their data, the wheel and the reader's requirements."""
    target = out / f"{BUNDLE}.zip"
    notebooks = sorted(book_dir.glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no chapter notebooks in {book_dir}")
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
        for nb in notebooks:
            z.write(nb, f"{BUNDLE}/{nb.name}")
        for f in sorted((book_dir / "data").rglob("*")):
            if f.is_file():
                z.write(f, f"{BUNDLE}/data/{f.relative_to(book_dir / 'data')}")
        z.write(wheel, f"{BUNDLE}/{wheel.name}")
        z.writestr(f"{BUNDLE}/requirements.txt", reader_requirements(root, wheel.name))
    return target


def _pdf(app):
    return Path(app.outdir).parent / "latex" / "book.pdf"


def _pdf_substitution(app, config):
    subs = dict(config.myst_substitutions or {})
    if _pdf(app).is_file():
        subs["pdf_download"] = '<a href="../dist/book.pdf">the whole book as one PDF</a>'
    else:
        subs["pdf_download"] = "the whole book as one PDF (`jupyter-book build . --builder pdflatex`)"
    config.myst_substitutions = subs


def _ship(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    try:
        root = project_root(app.confdir)
        out = Path(app.outdir) / "dist"
        wheel = build_wheel(root, out)
        bundle = build_bundle(root, Path(app.srcdir) / "book", wheel, out)
        if _pdf(app).is_file():
            shutil.copy2(_pdf(app), out / "book.pdf")
        logger.info(f"ship_code: {wheel.name} and {bundle.name} in {out}")
    except Exception as exc:  # a warning: with -W the build fails
        logger.warning(f"ship_code: the site ships no code: {exc}")


def setup(app):
    app.connect("config-inited", _pdf_substitution)
    app.connect("build-finished", _ship)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
