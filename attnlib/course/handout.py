r"""The course version of a chapter: its exercise section as an nbgrader source notebook.

The chapter notebooks in ``book/`` are the single master. :func:`source_notebook`
turns the section from the ``## Exercises`` heading to the end of a chapter
into the notebook an nbgrader course keeps in ``source/<chapter>/``:

* a title cell (new) and the chapter's import cell, locked (nbgrader
  restores both when it grades), so the handout runs in seconds and grading
  does not re-run the chapter's experiments;
* the exercise statements and prose, with the MyST directives and roles
  converted to plain Markdown (:mod:`attnlib.course.myst`), so they render
  in JupyterLab and in the classic notebook without an extension;
* without the book-only cells: those tagged ``solution-markup`` (the
  solution dropdown's markup), ``remove-cell`` (the book's hidden assert
  cells) or ``book-only``, and everything between ``{solution-start}`` and
  ``{solution-end}`` that is not an nbgrader solution cell (the worked
  solution's explanation);
* the solution cells as they are (nbgrader's ``generate_assignment``
  replaces the ``### BEGIN SOLUTION`` regions by stubs and the written
  answer cells by ``YOUR ANSWER HERE``);
* every graded cell with a hidden-test region that only names the exercise
  (:func:`hidden_test`; the grade is decided outside the student's kernel, on
  hidden cases drawn from the release's secret seed, see
  :mod:`attnlib.course.grading`), and with ``hints=False`` in the visible
  check for a release without hints;
* the release's fingerprint in the notebook metadata (``attnlib``), by which
  ``collect`` tells a handout of this release from any other notebook.

Cell ids of the kept cells are the master's, so a submission can be traced
to its chapter by its cell ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional

__all__ = [
    "EXERCISES_HEADING",
    "BOOK_ONLY_TAGS",
    "read_notebook",
    "exercise_start",
    "source_notebook",
    "chapter_title",
    "hidden_test",
    "graded_ids",
    "nbgrader_ids",
]

EXERCISES_HEADING = "## Exercises"
#: Cells with one of these tags exist only for the book and are not in a student's version.
BOOK_ONLY_TAGS = frozenset({"solution-markup", "remove-cell", "book-only"})
_CHECK = re.compile(r"""exercises\.check\(\s*["'](?P<key>[\d.]+)["']\s*,\s*(?P<fn>[A-Za-z_]\w*)\s*\)""")


def read_notebook(path) -> dict:
    """A notebook file as a dict (JSON), with a ``ValueError`` naming the file if it is not one."""
    path = Path(path)
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: expected a notebook file ({exc})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path}: expected a notebook file (JSON with a list of cells)")
    return nb


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def _meta(cell) -> dict:
    meta = cell.get("metadata") or {}
    return meta if isinstance(meta, dict) else {}


def _nbgrader(cell) -> dict:
    meta = _meta(cell).get("nbgrader") or {}
    return meta if isinstance(meta, dict) else {}


def exercise_start(nb: dict) -> Optional[int]:
    """Index of the markdown cell that starts with the ``## Exercises`` heading (``None`` if there is none)."""
    for i, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") == "markdown" and _source(cell).lstrip().startswith(EXERCISES_HEADING):
            return i
    return None


def graded_ids(nb: dict) -> Dict[str, int]:
    """``{grade_id: points}`` of the graded cells (autograded and manually graded)."""
    return {
        _nbgrader(c)["grade_id"]: float(_nbgrader(c).get("points", 0))
        for c in nb["cells"]
        if _nbgrader(c).get("grade") and _nbgrader(c).get("grade_id")
    }


def nbgrader_ids(nb: dict) -> List[str]:
    """The nbgrader ``grade_id`` of every cell that has one, in order."""
    return [_nbgrader(c)["grade_id"] for c in nb["cells"] if _nbgrader(c).get("grade_id")]


def _setup_cell(nb: dict, start: int, chapter: str) -> dict:
    code = [c for c in nb["cells"][:start] if c.get("cell_type") == "code"]
    for needle in ("from attnlib.course import exercises", "import attnlib"):
        for cell in code:
            if needle in _source(cell):
                return cell
    raise ValueError(
        f"chapter: {chapter!r} has no import cell (`from attnlib.course import exercises`) before its exercises"
    )


def hidden_test(key: str, fn: str) -> str:
    """The hidden-test region of the graded cell of exercise ``key`` whose function is ``fn``.

    The region only names the exercise: the grade is decided outside the
    student's kernel (:class:`attnlib.course.grading.GradeInSandbox`) on
    hidden cases drawn from the release's seed, which is not in any notebook.
    """
    return (
        "### BEGIN HIDDEN TESTS\n"
        f"# graded by attnlib.course: {fn} on the hidden cases of exercise {key}, outside this notebook\n"
        "### END HIDDEN TESTS"
    )


def _code_cell(cell, source: str):
    """An nbformat code cell with the master's id and cleaned metadata."""
    from nbformat.v4 import new_code_cell

    return new_code_cell(source, id=cell["id"], metadata=_clean_meta(cell))


def _clean_meta(cell) -> dict:
    meta = {}
    if _nbgrader(cell):
        meta["nbgrader"] = dict(_nbgrader(cell))
    tags = [t for t in _meta(cell).get("tags", []) if t not in BOOK_ONLY_TAGS]
    if tags:
        meta["tags"] = tags
    return meta


def _book_only_removed(cells: List[dict]) -> List[dict]:
    """The cells without the book's: tagged ``BOOK_ONLY_TAGS``, or inside a solution dropdown (nbconvert's TagRemove).

    Cells between ``{solution-start}`` and ``{solution-end}`` that are not
    nbgrader solution cells (the worked solution's explanation) are tagged
    ``book-only`` first, then nbconvert's ``TagRemovePreprocessor`` drops every
    tagged cell.
    """
    import copy

    import nbformat
    from nbconvert.preprocessors import TagRemovePreprocessor

    marked, inside = [], False
    for cell in copy.deepcopy(cells):
        src = _source(cell)
        inside = inside or "{solution-start}" in src
        if inside and not _nbgrader(cell).get("solution"):
            meta = cell.setdefault("metadata", {})
            meta["tags"] = list(meta.get("tags", [])) + ["book-only"]
        inside = inside and "{solution-end}" not in src
        marked.append(cell)
    node = nbformat.from_dict({"cells": marked, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    pre = TagRemovePreprocessor(remove_cell_tags=set(BOOK_ONLY_TAGS), enabled=True)
    node, _ = pre.preprocess(node, {})
    return node.cells


def book_notebooks(book: Path):
    """Yield ``(path, notebook)`` for every readable ``*.ipynb`` in ``book``, sorted; unreadable ones are skipped."""
    for p in sorted(Path(book).glob("*.ipynb")):
        try:
            yield p, read_notebook(p)
        except ValueError:
            continue


def _chapter_titles(book: Path) -> Dict[str, str]:
    from .myst import title_of

    out = {}
    for p, nb in book_notebooks(book):
        for c in nb["cells"]:
            if c.get("cell_type") == "markdown" and title_of(_source(c)):
                out[p.stem] = title_of(_source(c))
                break
    for p in sorted(book.glob("*.md")):
        t = title_of(p.read_text(encoding="utf-8"))
        if t:
            out[p.stem] = t
    return out


def _header(chapter: str, title: str, hints: bool) -> str:
    number = re.match(r"ch(\d+)", chapter)
    which = f"chapter {number.group(1)}, *{title}*" if number else f"the chapter *{title}*"
    checks = (
        "it runs your function on fixed test cases and says what is wrong, with a hint"
        if hints
        else "it runs your function on fixed test cases and says what is wrong (this version gives no hints)"
    )
    return f"""# Exercises: {title}

These are the exercises of {which}, of the book *Softmax self-attention, trained to its global
optimum*. Read the chapter first; the exercises build on its results and notation.

* **Functions.** Write each function in the code cell under its exercise, in place of
  `raise NotImplementedError()`, and keep its name. Then run the check cell after it: {checks}.
  Your grade comes from hidden tests on other cases of the same kind, drawn when the assignment
  was released and run outside your notebook when it is graded.
* **Library functions.** You may call the library (`al`, from `attnlib`) where an exercise says so.
  An answer that *is* a library function, or that calls the library function the exercise asks
  you to write, earns no points.
* **Derivations and explanations** go in the answer cells (`YOUR ANSWER HERE`), in Markdown with
  `$...$` for formulas; they are graded by hand.
* This cell, the import cell below and the check cells are read-only (JupyterLab does not let
  you edit or delete them); if one is changed anyway, the original is used for grading. Put your
  own imports in your solution cells, and keep your code in functions: grading runs your code
  cells without the check cells, with a time limit, and without access to files.
* Before you hand in: *Kernel, Restart Kernel and Run All Cells*, and check that every cell ran."""


def _converter(book: Path, nb: dict):
    """``(convert, docs)``: MyST to plain Markdown with the chapter's labels, the book's titles and references."""
    from .myst import labels_of, read_bib, to_markdown

    md = [_source(c) for c in nb["cells"] if c.get("cell_type") == "markdown"]
    docs = _chapter_titles(book)
    bib_file = book / "references.bib"
    bib = read_bib(bib_file) if bib_file.is_file() else {}
    labels = labels_of(md)

    def convert(text):
        return to_markdown(text, labels=labels, docs=docs, bib=bib)

    return convert, docs


def chapter_title(docs: Dict[str, str], name: str) -> str:
    """The title of the chapter that notebook ``name`` belongs to.

    A chapter's section pages are named after it (``ch5_algorithm_exercises`` is a page of
    ``ch5_algorithm``), so a section takes the title of the longest notebook name it extends; a
    chapter's own page keeps its title, and an unknown name is returned as it is.
    """
    owners = [doc for doc in docs if name.startswith(doc + "_")]
    return docs[max(owners, key=len)] if owners else docs.get(name, name)


def _opening_cells(chapter: str, title: str, setup: dict, hints: bool) -> List[dict]:
    """The handout's title cell and the chapter's import cell, both locked."""
    from nbformat.v4 import new_markdown_cell

    lock = {"grade": False, "locked": True, "schema_version": 3, "solution": False, "task": False}
    header = {"nbgrader": dict(lock, grade_id="handout-header")}
    cells = [new_markdown_cell(_header(chapter, title, hints), id=f"handout-{chapter}"[:64], metadata=header)]
    cells.append(_code_cell(setup, _source(setup)))
    cells[-1]["metadata"]["nbgrader"] = dict(lock, grade_id="setup")
    return cells


def _graded_source(chapter: str, cell: dict, src: str, hints: bool) -> str:
    """A graded cell's source: its visible check (without hints if ``hints=False``) and its hidden-test region."""
    from .exercises import EXERCISES

    grader = _nbgrader(cell)
    m = _CHECK.search(src)
    if not m or m["key"] not in EXERCISES:
        raise ValueError(
            f"chapter: the graded cell {grader.get('grade_id')!r} of {chapter!r} must call "
            f'exercises.check("<key>", <function>) with a key of attnlib.course.exercises'
        )
    visible = src if hints else _CHECK.sub(lambda m: m[0][:-1].rstrip() + ", hints=False)", src)
    return visible.rstrip() + "\n" + hidden_test(m["key"], m["fn"])


def _exercise_cells(chapter: str, cells: List[dict], convert, hints: bool) -> List[dict]:
    """The handout's cells of the exercise section ``cells``: book-only cells removed, MyST converted."""
    from nbformat.v4 import new_markdown_cell

    out = []
    for cell in _book_only_removed(cells):
        src = _source(cell)
        grader = _nbgrader(cell)
        if cell.get("cell_type") == "markdown":
            text = convert(src)
            if not text.strip() and not grader:
                continue
            out.append(new_markdown_cell(text, id=cell["id"], metadata=_clean_meta(cell)))
        elif cell.get("cell_type") == "code":
            if grader.get("grade"):
                src = _graded_source(chapter, cell, src, hints)
            out.append(_code_cell(cell, src))
    return out


def source_notebook(chapter: str, *, book_dir=None, hints: bool = True, fingerprint: Optional[str] = None) -> dict:
    """The nbgrader source notebook (an nbformat 4 ``NotebookNode``, validated) of ``chapter``'s exercise section.

    ``hints=False`` makes the visible checks give no hints (for graded use).
    ``fingerprint`` (a release's, see :func:`attnlib.course.coursedir.release`)
    goes into the notebook metadata as ``{"attnlib": {"chapter", "release"}}``,
    so that ``collect`` can tell a handout of this release from anything else.
    Raises ``ValueError`` naming the argument if the chapter does not exist or
    has no exercise section, and for a graded cell that does not call
    ``exercises.check("<key>", <function>)``.
    """
    import nbformat
    from nbformat.v4 import new_notebook

    from . import BOOK_DIR

    book = Path(book_dir) if book_dir is not None else BOOK_DIR
    path = book / f"{chapter}.ipynb"
    if not path.is_file():
        raise ValueError(f"chapter: expected the name of a notebook in {book}, got {chapter!r}")
    nb = read_notebook(path)
    start = exercise_start(nb)
    if start is None:
        raise ValueError(f"chapter: {chapter!r} has no {EXERCISES_HEADING!r} section")
    convert, docs = _converter(book, nb)
    cells = _opening_cells(chapter, chapter_title(docs, chapter), _setup_cell(nb, start, chapter), hints)
    cells += _exercise_cells(chapter, nb["cells"][start:], convert, hints)
    meta = {k: v for k, v in nb.get("metadata", {}).items() if k in ("kernelspec", "language_info")}
    meta["attnlib"] = {"chapter": chapter, "release": fingerprint}
    out = new_notebook(cells=cells, metadata=meta)
    nbformat.validate(out)
    return out
