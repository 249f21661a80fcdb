r"""Course assignments from the book's chapters, with nbgrader.

This subpackage is not loaded by ``import attnlib`` (the maths core). The
chapter notebooks in ``book/`` are the single master of the book, the tests
and the assignments; the course version of a chapter is its exercise section
(:mod:`attnlib.course.handout`), graded on hidden cases drawn at release from
a secret seed, each graded cell in a guarded worker process that never sees
an expected value (:mod:`attnlib.course.hidden`, :mod:`attnlib.course.grading`).
The one grader behind the book's checks and the grade is
:mod:`attnlib.course.exercises`.

The commands wrap nbgrader's own workflow in an nbgrader course directory
(:mod:`attnlib.course.coursedir`): release the chosen chapters once, collect
many submissions, autograde them all, export the gradebook::

    python -m attnlib.course list
    python -m attnlib.course init course/
    python -m attnlib.course release course/ ch1_model ch2_population_exercises [--no-hints]
    python -m attnlib.course collect course/ ch1_model submissions/
    python -m attnlib.course grade course/ ch1_model
    python -m attnlib.course export course/ --to grades.csv
    python -m attnlib.course feedback course/ ch1_model

``collect`` rejects files that cannot be graded with a one-line reason (not a
notebook, a symbolic link, a bad student id, a duplicated grade id, an
instructor's notebook, not a handout of this release); ``grade`` grades one
student at a time and gives each a status (``graded`` or ``not graded: cause``);
``collect`` and ``grade`` exit with status 1 when a submission was rejected
or had problems (a deleted or edited graded cell, an error in the student's
own cells, a timeout), 2 on an error in the command itself, 0 otherwise.

Importing this package is cheap (the standard library only); nbgrader, nbformat
and torch are imported by the commands that need them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

#: The book's folder (the master notebooks), next to the package in a checkout.
BOOK_DIR = Path(__file__).resolve().parents[2] / "book"


def chapters(book_dir=None) -> List[str]:
    """Names of the notebooks that have an exercise section with graded cells.

    A chapter that is split into section pages has its exercises on its last page
    (``ch2_population_exercises``); ``ch1_model`` is one page.
    """
    from .handout import exercise_start, graded_ids, read_notebook

    book = Path(book_dir) if book_dir is not None else BOOK_DIR
    if not book.is_dir():
        raise ValueError(f"book_dir: expected the folder of the chapter notebooks, {book} does not exist")
    out = []
    for p in sorted(book.glob("*.ipynb")):
        try:
            nb = read_notebook(p)
        except ValueError:
            continue
        if exercise_start(nb) is not None and graded_ids(nb):
            out.append(p.stem)
    return out


#: The commands, from the modules that implement them (imported on first use: ``import attnlib.course`` stays cheap).
_LAZY = {
    "graded_cells": "handout.graded_ids",  # {grade_id: points} of a notebook's graded cells
    "init": "coursedir",
    "release": "coursedir",
    "collect": "coursedir",
    "grade": "coursedir",
    "export": "coursedir",
    "feedback": "coursedir",
    "source_notebook": "handout",
}

__all__ = ["BOOK_DIR", "chapters", *_LAZY, "main"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, _, attr = _LAZY[name].partition(".")
        value = getattr(importlib.import_module(f".{module}", __name__), attr or name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attnlib.course' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnlib.course", description=__doc__.split("\n\n")[0])
    p.add_argument("--book", default=None, help="folder of the master notebooks (default: the checkout's book/)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="chapters with graded exercises")
    s = sub.add_parser("init", help="create an nbgrader course folder")
    s.add_argument("course")
    s.add_argument("--timeout", type=int, default=120, help="seconds the hidden test of one graded cell may run")
    s = sub.add_parser("release", help="release chapters: source/ and the student versions in release/")
    s.add_argument("course")
    s.add_argument("chapters", nargs="+")
    s.add_argument("--no-hints", action="store_true", help="checks in the student version give no hints")
    s.add_argument("--force", action="store_true", help="release again a chapter already released")
    s = sub.add_parser("collect", help="collect submitted notebooks into submitted/<student>/<chapter>/")
    s.add_argument("course")
    s.add_argument("chapter")
    s.add_argument("paths", nargs="+", help="<student>.ipynb files, <student>/<chapter>.ipynb files, or folders")
    s = sub.add_parser("grade", help="autograde the collected submissions; points per exercise")
    s.add_argument("course")
    s.add_argument("chapter")
    s.add_argument("--student", action="append", default=None, help="only this student (repeatable)")
    s = sub.add_parser("export", help="the gradebook as CSV (nbgrader export)")
    s.add_argument("course")
    s.add_argument("--to", default="grades.csv", help="CSV file to write")
    s = sub.add_parser("feedback", help="HTML feedback for the autograded submissions (nbgrader)")
    s.add_argument("course")
    s.add_argument("chapter")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status (0 clean, 1 submissions with problems, 2 error)."""
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "list":
            print("\n".join(chapters(args.book)))
            return 0
        from . import coursedir as cd

        if args.cmd == "init":
            print(f"course folder: {cd.init(args.course, timeout=args.timeout)}")
            return 0
        if args.cmd == "release":
            out = cd.release(args.course, args.chapters, book_dir=args.book, hints=not args.no_hints, force=args.force)
            for ch, path in out.items():
                print(f"{ch}: student version {path}")
            return 0
        if args.cmd == "collect":
            res = cd.collect(args.course, args.chapter, args.paths, book_dir=args.book)
            print("\n".join(res.lines()))
            return 0 if res.ok else 1
        if args.cmd == "grade":
            reports = cd.grade(args.course, args.chapter, args.student)
            for r in reports:
                print("\n".join(r.lines()))
            bad = [r.student for r in reports if not r.ok]
            print(f"{args.chapter}: graded {len(reports)} submission(s); reports in {Path(args.course) / 'reports'}")
            if bad:
                print(f"{args.chapter}: submissions with problems: {', '.join(bad)}")
            return 1 if bad else 0
        if args.cmd == "export":
            print(f"gradebook: {cd.export(args.course, args.to)}")
            return 0
        if args.cmd == "feedback":
            print(f"feedback: {cd.feedback(args.course, args.chapter)}")
            return 0
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
