"""The chapters' shape, read from the committed notebooks (no execution): what a reader relies on.

Every chapter opens with an "In this chapter" admonition that names what it assumes and links the
previous page, ends its body with a summary of what it measured before the exercises, shows every
figure as a numbered, captioned figure that the text refers to, keeps tool markers out of the code,
and is spelled one way (American -ize/-ization).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
PAGES = [p for p in BOOK.glob("*.md")]


def _toc_chapters():
    """``{chapter notebook: [its section notebooks, in reading order]}`` from ``_toc.yml``."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    out = {}
    for part in toc["parts"]:
        for entry in part["chapters"]:
            name = Path(entry["file"]).name
            if name.startswith("ch"):
                out[name + ".ipynb"] = [Path(s["file"]).name + ".ipynb" for s in entry.get("sections", [])]
    return out


#: the chapters (their first pages) and their section pages, each its own notebook
TOC = _toc_chapters()
CHAPTERS = list(TOC)
#: every chapter and section notebook
NOTEBOOKS = sorted(p.name for p in BOOK.glob("ch*.ipynb"))

#: British -is- forms of the words the book uses (initialisation, minimiser, normalised, ...)
BRITISH = re.compile(
    r"\b\w*(initiali|normali|minimi|maximi|optimi|lineari|parameteri|parametri|symmetri|equali|summari|"
    r"materiali|standardi|generali|characteri|recogni|stabili|visuali|regulari|factori|speciali|organi|"
    r"discreti|vectori|randomi|emphasi|utili|categori|diagonali|orthogonali)s(ation|ations|er|ers|e|ed|es|ing)\b",
    re.IGNORECASE,
)


def _cells(name):
    return json.loads((BOOK / name).read_text())["cells"]


def _text(cell):
    return "".join(cell["source"])


def _markdown(name):
    return "\n".join(_text(c) for c in _cells(name) if c["cell_type"] == "markdown")


def test_chapters_are_found():
    assert len(CHAPTERS) == 7, CHAPTERS
    listed = CHAPTERS + [s for sections in TOC.values() for s in sections]
    differ = set(listed) ^ set(NOTEBOOKS)
    assert sorted(listed) == NOTEBOOKS, f"notebooks in book/ and pages in _toc.yml differ: {differ}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_sections_belong_to_their_chapter(chapter):
    """A section's notebook is named after its chapter (``ch5_algorithm_geometric.ipynb``) and opens
    with its title; only a chapter's first page carries the opening box."""
    for section in TOC[chapter]:
        assert section.startswith(chapter.removesuffix(".ipynb") + "_"), f"{section}: not named after {chapter}"
        first = _text(_cells(section)[0])
        assert first.startswith("# "), f"{section}: the first cell should be the page title"
        assert "{admonition} In this chapter" not in _markdown(section), f"{section}: a second opening box"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_opening_admonition(chapter):
    i = CHAPTERS.index(chapter)
    previous = "intro" if i == 0 else CHAPTERS[i - 1].removesuffix(".ipynb")
    head = "\n".join(_text(c) for c in _cells(chapter)[:4] if c["cell_type"] == "markdown")
    m = re.search(r"```\{admonition\} In this chapter\n(.*?)\n```", head, re.S)
    assert m, f"{chapter}: no 'In this chapter' admonition among the first cells"
    body = m.group(1)
    for part in ("**What it shows.**", "**What it assumes.**"):
        assert part in body, f"{chapter}: the opening lacks {part}"
        after = body.split(part, 1)[1].lstrip()
        assert after[:1].isupper() or after[:1] in "{$", f"{chapter}: {part} should start a sentence: {after[:30]!r}"
    assert f"{{doc}}`{previous}`" in body, f"{chapter}: the opening does not link the previous page {previous}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_summary_before_exercises(chapter):
    """The chapter's last page ends its body with the summary, then the exercises; no other page of
    the chapter has either."""
    last, *others = ([chapter] + TOC[chapter])[::-1]
    headings = [line for line in _markdown(last).splitlines() if line.startswith("## ")]
    assert "## Summary: what this chapter measured" in headings, f"{last}: no summary section"
    assert "## Exercises" in headings, f"{last}: no exercises"
    assert headings.index("## Summary: what this chapter measured") < headings.index("## Exercises")
    for page in others:
        text = _markdown(page)
        early = "## Exercises" in text or "## Summary: what" in text
        assert not early, f"{page}: summary or exercises before the chapter's last page"


@pytest.mark.parametrize("chapter", NOTEBOOKS)
def test_figures_are_numbered_captioned_and_referenced(chapter):
    prefix = "fig-" + chapter.split("_")[0] + "-"
    book_text = "\n".join(_markdown(c) for c in NOTEBOOKS) + "\n".join(p.read_text() for p in PAGES)
    names = []
    for cell in _cells(chapter):
        if cell["cell_type"] != "code":
            continue
        images = sum("image/png" in o.get("data", {}) for o in cell["outputs"])
        if not images:
            continue
        fig = cell["metadata"].get("mystnb", {}).get("figure", {})
        where = f"{chapter}, cell {cell['id']}"
        assert images == 1, f"{where}: {images} images in one figure cell"
        assert fig.get("name", "").startswith(prefix), f"{where}: figure name should start with {prefix}"
        assert len(fig.get("caption", "").split()) >= 8, f"{where}: the figure needs a caption"
        assert "ap.check_labelled(fig)" in _text(cell), f"{where}: axes labels are not checked"
        assert f"{{numref}}`{fig['name']}`" in book_text, f"{where}: no {{numref}} to {fig['name']}"
        names.append(fig["name"])
    assert len(set(names)) == len(names), f"{chapter}: repeated figure names {names}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_has_figures(chapter):
    pages = [chapter] + TOC[chapter]
    assert any(
        "image/png" in o.get("data", {})
        for p in pages
        for c in _cells(p)
        if c["cell_type"] == "code"
        for o in c["outputs"]
    ), f"no figure on the pages of {chapter}"


@pytest.mark.parametrize("chapter", NOTEBOOKS)
def test_markers_are_tags_and_counts_are_consecutive(chapter):
    code = [c for c in _cells(chapter) if c["cell_type"] == "code"]
    for cell in code:
        assert "NBVAL_CHECK_OUTPUT" not in _text(cell), f"{chapter}, cell {cell['id']}: use the nbval-check-output tag"
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{chapter}: execution counts are not 1..{len(code)}"


@pytest.mark.parametrize("source", NOTEBOOKS + [p.name for p in PAGES])
def test_one_spelling(source):
    text = _markdown(source) if source.endswith(".ipynb") else (BOOK / source).read_text()
    found = sorted({m.group(0) for m in BRITISH.finditer(text)})
    assert not found, f"{source}: British spelling {found} (the book writes -ize, -ization)"


def test_spelling_check_can_fail():
    assert BRITISH.search("the spectral initialisation") and BRITISH.search("a minimiser")
    assert not BRITISH.search("the spectral initialization, the exercises, the noise")
