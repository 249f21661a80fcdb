"""Time the class-sized nbgrader workflow: release one chapter, collect N submissions, grade all, export.

    python benchmarks/grading.py --chapter ch1_model --students 30 --out benchmarks/grading.md

The submissions are made from the released handout and the book's worked solutions: student i
solves exercise j when bit j of i is set (so the class has full, partial and empty submissions),
and writes something in every answer cell. Each phase runs through the same functions as
``python -m attnlib.course`` in a fresh course folder (deleted afterwards unless ``--keep``).
The machine's load average is reported with the times: on a shared machine they are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnlib import course  # noqa: E402
from attnlib.course.handout import _nbgrader, _source, read_notebook  # noqa: E402

GRADE = "grade {n} submissions (nbgrader autograde per student, hidden tests in the guarded worker)"


def make_submissions(chapter: str, released: Path, folder: Path, n: int) -> None:
    """``n`` submissions of ``chapter`` in ``folder`` (``student01.ipynb``, ...)."""
    master = read_notebook(course.BOOK_DIR / f"{chapter}.ipynb")
    solutions = {
        _nbgrader(c)["grade_id"]: "\n".join(line for line in _source(c).splitlines() if "SOLUTION" not in line)
        for c in master["cells"]
        if _nbgrader(c).get("solution") and c["cell_type"] == "code"
    }
    order = sorted(solutions)
    handout = read_notebook(released)
    for i in range(n):
        nb = json.loads(json.dumps(handout))
        for cell in nb["cells"]:
            gid = _nbgrader(cell).get("grade_id")
            if gid in solutions and (i >> order.index(gid)) & 1:
                cell["source"] = solutions[gid]
            elif gid and gid.endswith("-answer"):
                cell["source"] = f"Answer of student {i + 1}."
        (folder / f"student{i + 1:02d}.ipynb").write_text(json.dumps(nb))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chapter", default="ch1_model")
    p.add_argument("--students", type=int, default=30)
    p.add_argument("--out", default=None, help="also write the table (Markdown) to this file")
    p.add_argument("--keep", default=None, help="keep the course folder here instead of deleting it")
    args = p.parse_args(argv)
    if args.students < 1:
        p.error("--students: expected a positive number")
    tmp = Path(tempfile.mkdtemp(prefix="attnlib-grading-"))
    root = Path(args.keep) if args.keep else tmp / "course"
    times = {}
    try:
        t = time.perf_counter()
        course.init(root)
        released = course.release(root, [args.chapter], hints=False)[args.chapter]
        times["release (generate_assignment, hidden tests)"] = time.perf_counter() - t
        subs = tmp / "submitted-files"
        subs.mkdir()
        make_submissions(args.chapter, released, subs, args.students)
        t = time.perf_counter()
        collected = course.collect(root, args.chapter, [subs])
        times[f"collect {args.students} files"] = time.perf_counter() - t
        t = time.perf_counter()
        reports = course.grade(root, args.chapter)
        times[GRADE.format(n=args.students)] = time.perf_counter() - t
        t = time.perf_counter()
        course.export(root, tmp / "grades.csv")
        times["export the gradebook as CSV"] = time.perf_counter() - t
        t = time.perf_counter()
        course.feedback(root, args.chapter)
        times[f"feedback for {args.students} submissions (HTML)"] = time.perf_counter() - t
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    assert len(collected.collected) == args.students and len(reports) == args.students
    graded = times[GRADE.format(n=args.students)]
    load = os.getloadavg()
    lines = [
        f"Grading {args.students} submissions of {args.chapter}: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        f"(1 / 5 / 15 min) at the end; the machine was shared with other jobs, so the times are upper bounds.",
        "",
        "| phase | seconds |",
        "|:---|---:|",
        *[f"| {k} | {v:.1f} |" for k, v in times.items()],
        f"| per submission, grading | {graded / args.students:.1f} |",
        "",
        "Points: "
        + ", ".join(f"{r.total:g}" for r in sorted(reports, key=lambda r: r.student))
        + f" (of {reports[0].max_total - sum(reports[0].max_scores[k] for k in reports[0].manual):g} autograded).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
