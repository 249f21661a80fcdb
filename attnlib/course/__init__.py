r"""Course assignments from the book's chapters, with nbgrader.

This subpackage is not loaded by ``import attnlib`` (the maths core); the
graders live in :mod:`attnlib.course.exercises`.

The chapter notebooks in ``book/`` are the single master: their exercise
cells carry nbgrader's cell metadata (solution cells with ``### BEGIN
SOLUTION`` / ``### END SOLUTION`` regions, graded cells with points that call
:func:`attnlib.course.exercises.check`). The markdown cells that only exist for the
book's solution dropdowns are tagged ``solution-markup`` and dropped from the
student version by nbconvert's ``TagRemovePreprocessor``, run by nbgrader.

This module wraps nbgrader's own ``generate_assignment`` and ``autograde``
in a throw-away course directory, so an instructor needs neither a course
set-up nor Docker::

    python -m attnlib.course list
    python -m attnlib.course release ch2_population --out release/
    python -m attnlib.course grade ch2_population submitted.ipynb [--json report.json]

``grade`` prints the points per exercise and the message of every failed
check, and exits with status 0 whether or not the student earned points.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["BOOK_DIR", "SOLUTION_MARKUP_TAG", "chapters", "graded_cells", "release", "grade", "GradeReport", "main"]

#: The book's folder (the master notebooks), next to the package in a checkout.
BOOK_DIR = Path(__file__).resolve().parents[2] / "book"
#: Cells with this tag exist only for the book (solution dropdown markup) and are dropped on release.
SOLUTION_MARKUP_TAG = "solution-markup"
_STUDENT = "student"


def _book(book_dir) -> Path:
    book = Path(book_dir) if book_dir is not None else BOOK_DIR
    if not book.is_dir():
        raise ValueError(f"book_dir: expected the folder of the chapter notebooks, {book} does not exist")
    return book


def _read(path: Path):
    import nbformat

    return nbformat.read(str(path), as_version=4)


def graded_cells(nb) -> Dict[str, int]:
    """``{grade_id: points}`` of the graded cells of a notebook (nbgrader metadata)."""
    out = {}
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade"):
            out[meta["grade_id"]] = int(meta.get("points", 0))
    return out


def chapters(book_dir=None) -> List[str]:
    """Names of the chapter notebooks that carry graded exercises."""
    book = _book(book_dir)
    return sorted(p.stem for p in book.glob("*.ipynb") if graded_cells(_read(p)))


def _check_chapter(chapter: str, book: Path) -> Path:
    src = book / f"{chapter}.ipynb"
    if not src.is_file():
        raise ValueError(f"chapter: expected one of {chapters(book)}, got {chapter!r}")
    if not graded_cells(_read(src)):
        raise ValueError(f"chapter: {chapter!r} has no graded exercises; expected one of {chapters(book)}")
    return src


def _config(root: Path, timeout: int):
    from nbconvert.preprocessors import TagRemovePreprocessor
    from nbgrader.converters import GenerateAssignment
    from traitlets.config import Config

    c = Config()
    c.CourseDirectory.root = str(root)
    c.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
    c.TagRemovePreprocessor.enabled = True
    c.TagRemovePreprocessor.remove_cell_tags = {SOLUTION_MARKUP_TAG}
    c.GenerateAssignment.preprocessors = [TagRemovePreprocessor] + list(
        GenerateAssignment.class_traits()["preprocessors"].default()
    )
    c.Execute.timeout = int(timeout)
    c.ExecutePreprocessor.timeout = int(timeout)
    c.Execute.kernel_name = "python3"
    return c


def _setup(chapter: str, book: Path, root: Path, timeout: int):
    """A course directory with ``source/<chapter>/``; generates the release; returns the API."""
    import logging
    import os

    # nbgrader runs the ``alembic`` executable of its environment: make it findable from an
    # un-activated virtual environment (``.venv/bin/python -m attnlib.course ...``)
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

    from nbgrader.apps import NbGraderAPI

    src_dir = root / "source" / chapter
    src_dir.mkdir(parents=True)
    shutil.copy(book / f"{chapter}.ipynb", src_dir / f"{chapter}.ipynb")
    if (book / "data").is_dir():  # chapters read their committed data relative to the notebook
        shutil.copytree(book / "data", src_dir / "data")
    api = NbGraderAPI(config=_config(root, timeout))
    api.log.setLevel(logging.ERROR)
    res = api.generate_assignment(chapter, force=True)
    if not res["success"]:
        raise RuntimeError(f"nbgrader generate_assignment failed for {chapter}:\n{res['log']}\n{res['error']}")
    return api


def release(chapter: str, out, *, book_dir=None) -> Path:
    """Write the student version of ``chapter`` (nbgrader ``generate_assignment``) into folder ``out``.

    Solution regions become ``raise NotImplementedError()`` stubs, outputs are
    cleared, the book's solution markup is removed, graded cells are locked.
    Returns the folder holding ``<chapter>.ipynb`` (and the chapter's data).
    """
    book = _book(book_dir)
    _check_chapter(chapter, book)
    out = Path(out) / chapter
    with tempfile.TemporaryDirectory(prefix="attnlib-course-") as tmp:
        _setup(chapter, book, Path(tmp), timeout=600)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(Path(tmp) / "release" / chapter, out)
    return out


@dataclass
class GradeReport:
    """Points per graded cell of one graded submission."""

    chapter: str
    scores: Dict[str, float]
    max_scores: Dict[str, float]
    messages: Dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.scores.values()))

    @property
    def max_total(self) -> float:
        return float(sum(self.max_scores.values()))

    def as_dict(self) -> dict:
        return {
            "chapter": self.chapter,
            "total": self.total,
            "max_total": self.max_total,
            "exercises": {
                k: {"score": self.scores[k], "max_score": self.max_scores[k], "message": self.messages.get(k, "")}
                for k in self.scores
            },
        }

    def __str__(self) -> str:
        lines = [f"{self.chapter}: {self.total:g} / {self.max_total:g} points"]
        for k in self.scores:
            lines.append(f"  {k:<24} {self.scores[k]:g} / {self.max_scores[k]:g}")
            if self.messages.get(k):
                lines.append(f"      {self.messages[k]}")
        return "\n".join(lines)


def _error_message(cell) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename')}: {out.get('evalue')}"
    return ""


def grade(chapter: str, submission, *, book_dir=None, timeout: int = 600) -> GradeReport:
    """Autograde ``submission`` (a filled-in student notebook of ``chapter``) with nbgrader.

    The graded cells are restored from the master before running (nbgrader's
    ``OverwriteCells``), so editing them earns nothing. Returns the points of
    every graded cell and the error message of each failed one.
    """
    from nbgrader.api import Gradebook

    book = _book(book_dir)
    _check_chapter(chapter, book)
    submission = Path(submission)
    if not submission.is_file():
        raise ValueError(f"submission: expected a notebook file, {submission} does not exist")
    with tempfile.TemporaryDirectory(prefix="attnlib-course-") as tmp:
        root = Path(tmp)
        api = _setup(chapter, book, root, timeout)
        sub_dir = root / "submitted" / _STUDENT / chapter
        shutil.copytree(root / "release" / chapter, sub_dir)
        shutil.copy(submission, sub_dir / f"{chapter}.ipynb")
        with warnings.catch_warnings():  # nbgrader's own SQLAlchemy session warnings are not ours
            warnings.simplefilter("ignore")
            res = api.autograde(chapter, _STUDENT, force=True)
        if not res["success"]:
            raise RuntimeError(f"nbgrader autograde failed for {submission}:\n{res['log']}\n{res['error']}")
        graded = _read(root / "autograded" / _STUDENT / chapter / f"{chapter}.ipynb")
        messages = {}
        for cell in graded.cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if meta.get("grade"):
                messages[meta["grade_id"]] = _error_message(cell)
        with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
            nb = gb.find_submission_notebook(chapter, chapter, _STUDENT)
            scores = {g.name: float(g.score) for g in nb.grades}
            max_scores = {g.name: float(g.max_score) for g in nb.grades}
    order = list(graded_cells(_read(book / f"{chapter}.ipynb")))
    key = {k: i for i, k in enumerate(order)}
    scores = dict(sorted(scores.items(), key=lambda kv: key.get(kv[0], len(key))))
    return GradeReport(chapter, scores, {k: max_scores[k] for k in scores}, {k: v for k, v in messages.items() if v})


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnlib.course", description=__doc__.split("\n\n")[0])
    p.add_argument("--book", default=None, help="folder of the master notebooks (default: the checkout's book/)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="chapters with graded exercises")
    r = sub.add_parser("release", help="write the student version of a chapter")
    r.add_argument("chapter")
    r.add_argument("--out", required=True, help="folder to write <chapter>/<chapter>.ipynb into")
    g = sub.add_parser("grade", help="autograde a submitted notebook, points per exercise")
    g.add_argument("chapter")
    g.add_argument("submission")
    g.add_argument("--json", default=None, help="also write the report as JSON to this file")
    g.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = p.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(chapters(args.book)))
    elif args.cmd == "release":
        out = release(args.chapter, args.out, book_dir=args.book)
        print(f"student version: {out / (args.chapter + '.ipynb')}")
    else:
        report = grade(args.chapter, args.submission, book_dir=args.book, timeout=args.timeout)
        print(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
