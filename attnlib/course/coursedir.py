"""An nbgrader course directory for the book's chapters: release, collect, autograde, export.

The layout is nbgrader's own, so an instructor can also use the plain
``nbgrader`` commands (and the formgrader, for the written answers) in it::

    course/
      nbgrader_config.py          written by init(); read by nbgrader and by this module
      gradebook.db                nbgrader's gradebook
      source/<chapter>/<chapter>.ipynb      the course version of the chapter (hidden tests included)
      release/<chapter>/<chapter>.ipynb     the student version (generate_assignment)
      submitted/<student>/<chapter>/<chapter>.ipynb   collected submissions
      autograded/<student>/<chapter>/...    nbgrader's autograde output
      feedback/<student>/<chapter>/...      HTML feedback (feedback())
      reports/<chapter>.csv, .json          points per exercise, messages, problems (grade())

Every function takes the course folder first. Errors in the arguments raise
``ValueError`` naming the argument; bad submitted files are reported (not
raised) by :func:`collect`.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from .handout import _nbgrader, book_notebooks, exercise_start, nbgrader_ids, read_notebook, source_notebook
from .submissions import SubmissionError, inspect_submission, suspicious_code

__all__ = [
    "CONFIG_FILE",
    "init",
    "release",
    "collect",
    "grade",
    "export",
    "feedback",
    "CollectResult",
    "StudentReport",
]

CONFIG_FILE = "nbgrader_config.py"
_CONFIG = '''"""nbgrader configuration of this course, written by `python -m attnlib.course init`.

Plain nbgrader commands run in this folder read it too (`nbgrader autograde ch1_model`,
`nbgrader export`, `nbgrader formgrader`); `python -m attnlib.course` reads it as well.
"""

import os

c = get_config()  # noqa: F821 - provided by traitlets when nbgrader loads this file

c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(c.CourseDirectory.root, "gradebook.db")

# Seconds one cell of a submission may run when it is autograded (an endless loop costs this much).
c.Execute.timeout = {timeout}
# The kernel's own start-up warnings (ipykernel) are not the student's: keep them out of the output.
c.Execute.extra_arguments = ["--HistoryManager.hist_file=:memory:", "--IPKernelApp.log_level=ERROR"]
'''
_STUDENT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-@+")


def _root(course, *, must_exist=True) -> Path:
    root = Path(course).resolve()
    if must_exist and not (root / CONFIG_FILE).is_file():
        raise ValueError(
            f"course: expected a course folder made by `python -m attnlib.course init` (with {CONFIG_FILE}), got {root}"
        )
    return root


def init(course, *, timeout: int = 120) -> Path:
    """Create the course folder (``nbgrader_config.py``, ``source/``) if needed; returns it."""
    if int(timeout) <= 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout}")
    root = _root(course, must_exist=False)
    if root.exists() and not root.is_dir():
        raise ValueError(f"course: expected a folder, {root} is a file")
    (root / "source").mkdir(parents=True, exist_ok=True)
    cfg = root / CONFIG_FILE
    if not cfg.exists():
        cfg.write_text(_CONFIG.format(timeout=int(timeout)), encoding="utf-8")
    return root


def _config(root: Path):
    from traitlets.config.loader import PyFileConfigLoader

    return PyFileConfigLoader(CONFIG_FILE, path=str(root)).load_config()


def _api(root: Path):
    # nbgrader runs the ``alembic`` executable of its environment: make it findable from an
    # un-activated virtual environment (``.venv/bin/python -m attnlib.course ...``)
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    # the kernels that run the submissions import the attnlib this process uses (a checkout, in
    # development, may not be the installed copy)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if str(checkout) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(checkout)] + [p for p in paths if p])
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    config = _config(root)
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    api.log.setLevel(logging.ERROR)
    return api


def _one_line(res: dict) -> str:
    """The most specific line of an nbgrader result's log and traceback: the last exception message."""
    import re

    text = (res.get("log") or "") + "\n" + (res.get("error") or "")
    found = re.findall(r"^\s*((?:\w+\.)*\w*(?:Error|Exception)\b: .+)$", text, re.M)
    found = [f for f in found if "Please see the" not in f]
    if found:
        return found[-1].strip()
    lines = [line for line in text.splitlines() if line.startswith("[ERROR]")]
    return lines[-1][len("[ERROR] ") :] if lines else "unknown error"


def _book(book_dir) -> Path:
    from . import BOOK_DIR

    book = Path(book_dir) if book_dir is not None else BOOK_DIR
    if not book.is_dir():
        raise ValueError(f"book_dir: expected the folder of the chapter notebooks, {book} does not exist")
    return book


def release(course, chapters: Sequence[str], *, book_dir=None, hints: bool = True, force: bool = False):
    """Release ``chapters`` in the course: write ``source/<chapter>/`` and run nbgrader's ``generate_assignment``.

    Returns ``{chapter: path of the student version}``. A chapter that is
    already released is refused unless ``force`` (re-releasing after
    submissions were graded changes what they are graded against).
    """
    import nbformat

    from . import chapters as known

    root = init(course) if not (Path(course) / CONFIG_FILE).is_file() else _root(course)
    book = _book(book_dir)
    names = known(book)
    if isinstance(chapters, str):
        chapters = [chapters]
    if not chapters:
        raise ValueError(f"chapters: expected one or more of {names}, got none")
    for ch in chapters:
        if ch not in names:
            raise ValueError(f"chapters: expected names from {names}, got {ch!r}")
        if (root / "release" / ch).exists() and not force:
            raise ValueError(f"chapters: {ch} is already released in {root}; pass force=True (--force) to redo it")
    api = _api(root)
    out = {}
    for ch in chapters:
        nb = nbformat.from_dict(source_notebook(ch, book_dir=book, hints=hints))
        src = root / "source" / ch
        if src.exists():
            shutil.rmtree(src)
        src.mkdir(parents=True)
        nbformat.write(nb, str(src / f"{ch}.ipynb"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = api.generate_assignment(ch, force=True)
        if not res["success"]:
            raise RuntimeError(f"nbgrader generate_assignment failed for {ch}: {_one_line(res)}")
        out[ch] = root / "release" / ch / f"{ch}.ipynb"
    return out


@dataclass
class CollectResult:
    """What :func:`collect` did: the students collected, the files rejected, the problems repaired."""

    chapter: str
    collected: List[str] = field(default_factory=list)
    rejected: Dict[str, str] = field(default_factory=dict)
    problems: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.rejected and not any(self.problems.values())

    def lines(self) -> List[str]:
        out = [f"{self.chapter}: collected {len(self.collected)} submission(s), rejected {len(self.rejected)}"]
        out += [f"  rejected: {msg}" for msg in self.rejected.values()]
        for student, probs in self.problems.items():
            out += [f"  {student}: {p}" for p in probs]
        return out


def _student_id(path: Path, chapter: str) -> str:
    sid = path.parent.name if path.stem == chapter else path.stem
    if not sid or not set(sid) <= _STUDENT_CHARS:
        raise SubmissionError(
            f"{path}: cannot take a student id from the file name ({sid!r}); name it <student>.ipynb "
            f"or <student>/{chapter}.ipynb, with letters, digits and . _ - @ + only"
        )
    return sid


def _handouts(book: Path) -> Dict[str, tuple]:
    """``{chapter: (nbgrader ids, cell ids)}`` of every chapter's exercise section, from the masters."""
    out = {}
    for p, nb in book_notebooks(book):
        start = exercise_start(nb)
        if start is None:
            continue
        section = {"cells": nb["cells"][start:]}
        out[p.stem] = (set(nbgrader_ids(section)), {c.get("id") for c in section["cells"] if c.get("id")})
    return out


def _normalized(nb: dict) -> dict:
    """The fields nbformat 4 requires of every cell (front ends and hand edits sometimes drop some)."""
    import uuid

    seen = set()
    for cell in nb["cells"]:
        cell.setdefault("metadata", {})
        src = cell.get("source", "")
        cell["source"] = "".join(src) if isinstance(src, list) else str(src)
        if cell.get("id") in seen or not isinstance(cell.get("id"), str):
            cell["id"] = uuid.uuid4().hex[:8]
        seen.add(cell["id"])
        if cell["cell_type"] == "code":
            cell.setdefault("outputs", [])
            cell.setdefault("execution_count", None)
        else:
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
    nb["nbformat"], nb["nbformat_minor"] = 4, max(5, int(nb.get("nbformat_minor", 5) or 5))
    nb.setdefault("metadata", {})
    return nb


def _log_path(root: Path, chapter: str) -> Path:
    return root / "reports" / f"{chapter}-collect.json"


def collect(course, chapter: str, paths: Iterable, *, book_dir=None) -> CollectResult:
    """Collect submitted notebooks of ``chapter`` into ``submitted/<student>/<chapter>/``.

    ``paths`` are files (``alice.ipynb``, or ``alice/<chapter>.ipynb``) or
    folders holding such files. Each file is checked
    (:func:`attnlib.course.submissions.inspect_submission`): bad files are
    rejected with a one-line reason, repaired ones are collected with their
    problems listed. A student collected again replaces the earlier copy.
    """
    import nbformat

    root = _root(course)
    release_nb = root / "release" / chapter / f"{chapter}.ipynb"
    if not release_nb.is_file():
        raise ValueError(f"chapter: {chapter!r} is not released in {root}; run release first")
    handout = read_notebook(release_nb)
    handouts = _handouts(_book(book_dir))
    files: List[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        else:
            files.append(p)
    if not files:
        raise ValueError("paths: expected submitted notebooks (files or folders holding .ipynb files), got none")
    result = CollectResult(chapter)
    log_file = _log_path(root, chapter)
    log = json.loads(log_file.read_text()) if log_file.is_file() else {}
    for f in files:
        try:
            sid = _student_id(f, chapter)
            nb, problems = inspect_submission(f, chapter, handout, handouts)
            node = nbformat.from_dict(_normalized(nb))
        except SubmissionError as exc:
            result.rejected[str(f)] = str(exc)
            continue
        dest = root / "submitted" / sid / chapter
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        nbformat.write(node, str(dest / f"{chapter}.ipynb"))
        stamp = datetime.fromtimestamp(f.stat().st_mtime, tz=timezone.utc)
        (dest / "timestamp.txt").write_text(stamp.strftime("%Y-%m-%d %H:%M:%S.%f %Z"))
        result.collected.append(sid)
        result.problems[sid] = problems
        log[sid] = {"file": str(f), "problems": problems}
    log_file.parent.mkdir(exist_ok=True)
    log_file.write_text(json.dumps(log, indent=2))
    return result


@dataclass
class StudentReport:
    """The autograded result of one student's submission of one chapter."""

    student: str
    chapter: str
    scores: Dict[str, float]
    max_scores: Dict[str, float]
    manual: List[str] = field(default_factory=list)
    messages: Dict[str, str] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)
    flags: List[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return float(sum(self.scores.values()))

    @property
    def max_total(self) -> float:
        return float(sum(self.max_scores.values()))

    @property
    def ok(self) -> bool:
        """No problem with the submission itself (wrong answers are not problems)."""
        return not self.problems

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(total=self.total, max_total=self.max_total)
        return d

    def lines(self) -> List[str]:
        auto = [k for k in self.scores if k not in self.manual]
        pending = f", {len(self.manual)} written answer(s) to grade by hand" if self.manual else ""
        head = f"{self.student}: {sum(self.scores[k] for k in auto):g} / {sum(self.max_scores[k] for k in auto):g}"
        out = [f"{head} autograded points{pending}"]
        for k in auto:
            line = f"    {k:<16} {self.scores[k]:g} / {self.max_scores[k]:g}"
            if self.messages.get(k):
                line += f"  {self.messages[k]}"
            out.append(line)
        out += [f"    problem: {p}" for p in self.problems]
        out += [f"    review: {f}" for f in self.flags]
        return out


def _error(cell) -> Optional[tuple]:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out.get("ename", "Error"), str(out.get("evalue", "")).strip()
    return None


def _describe(ename: str, evalue: str) -> str:
    import re

    if ename in ("SyntaxError", "IndentationError", "TabError"):
        m = re.search(r"\((?:[^,()]*), line (\d+)\)$", evalue)
        if m:
            evalue = evalue[: m.start()].rstrip() + f" (line {m.group(1)})"
    if ename == "CellTimeoutError":
        return "the cell did not finish before the time limit (an endless loop?)"
    first = evalue.splitlines()[0] if evalue else ""
    if ename == "ExerciseError" and first:  # the graders' own one-line messages
        return first
    return f"{ename}: {first}" if first else ename


def _cell_name(cell, index: int) -> str:
    gid = _nbgrader(cell).get("grade_id")
    return f"cell {gid}" if gid else f"cell {index + 1}"


def _messages(nb: dict, release: dict) -> Dict[str, str]:
    """One line per failed graded cell, naming the real cause when an earlier cell of the student failed."""
    out = {}
    cells = nb["cells"]
    released = set(nbgrader_ids(release))
    last_graded = -1
    for i, cell in enumerate(cells):
        meta = _nbgrader(cell)
        if not (meta.get("grade") and cell.get("cell_type") == "code"):
            continue
        err = _error(cell)
        if err is not None:
            own = _describe(*err)

            def failed(cells_):
                for j, c in cells_:
                    if c.get("cell_type") == "code" and not _nbgrader(c).get("grade") and _error(c) is not None:
                        return f"{_cell_name(c, j)} raised {_describe(*_error(c))}"
                return None

            # the student's cells of this exercise first, then a deleted solution cell, then anything earlier
            cause = failed(list(enumerate(cells[last_graded + 1 : i], last_graded + 1)))
            if cause is None and err[0] == "NameError":
                present = set(nbgrader_ids(nb))
                missing = [g for g in released if g == meta["grade_id"] + "-solution" and g not in present]
                if missing:
                    cause = f"the solution cell {missing[0]} is missing"
                else:
                    cause = failed(list(enumerate(cells[: last_graded + 1])))
            out[meta["grade_id"]] = f"{cause}, so the check failed: {own}" if cause else own
        last_graded = i
    return out


def _write_reports(root: Path, chapter: str, reports: List[StudentReport]) -> None:
    folder = root / "reports"
    folder.mkdir(exist_ok=True)
    path = folder / f"{chapter}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update({r.student: r.as_dict() for r in reports})
    path.write_text(json.dumps(old, indent=2))
    rows = list(old.values())
    keys = []
    for r in rows:
        keys += [k for k in r["max_scores"] if k not in keys]
    with open(folder / f"{chapter}.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        head = ["student", "autograded", "autograded_max", "to_grade_by_hand"]
        w.writerow(head + keys + ["messages", "problems", "review"])
        for r in sorted(rows, key=lambda r: r["student"]):
            auto = [k for k in r["scores"] if k not in r["manual"]]
            got, top = sum(r["scores"][k] for k in auto), sum(r["max_scores"][k] for k in auto)
            messages = "; ".join(f"{k}: {m}" for k, m in r["messages"].items())
            w.writerow(
                [r["student"], got, top, len(r["manual"])]
                + [("" if k in r["manual"] else r["scores"].get(k, "")) for k in keys]
                + [messages, "; ".join(r["problems"]), "; ".join(r["flags"])]
            )


def grade(course, chapter: str, students: Optional[Sequence[str]] = None) -> List[StudentReport]:
    """Autograde the collected submissions of ``chapter`` (all, or ``students``) with nbgrader.

    One ``nbgrader autograde`` run over the students' folders; then a report
    per student: autograded points per exercise, the one-line reason for each
    failed check (the student's own failing cell when that is the cause), the
    written answers left to grade by hand, the problems found when the file
    was collected, and the suspicious lines for review. Reports are written
    to ``reports/<chapter>.json`` and ``.csv``.
    """
    from nbgrader.api import Gradebook, MissingEntry

    root = _root(course)
    sub = root / "submitted"
    available = sorted(p.parent.parent.name for p in sub.glob(f"*/{chapter}/{chapter}.ipynb")) if sub.is_dir() else []
    if not (root / "release" / chapter).is_dir():
        raise ValueError(f"chapter: {chapter!r} is not released in {root}; run release first")
    if students is None:
        students = available
    else:
        unknown = [s for s in students if s not in available]
        if unknown:
            raise ValueError(f"students: no collected submission of {chapter} for {unknown}; collected: {available}")
    if not students:
        raise ValueError(f"chapter: no collected submissions of {chapter!r} in {root}; run collect first")
    api = _api(root)
    failures = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if list(students) == available:
            res = api.autograde(chapter, "*", force=True)
            if not res["success"]:
                failures["*"] = _one_line(res)
        else:
            for s in students:
                res = api.autograde(chapter, s, force=True)
                if not res["success"]:
                    failures[s] = _one_line(res)
    release_nb = read_notebook(root / "release" / chapter / f"{chapter}.ipynb")
    log_file = _log_path(root, chapter)
    collected = json.loads(log_file.read_text()) if log_file.is_file() else {}
    reports = []
    with Gradebook(_config(root).CourseDirectory.db_url) as gb:
        for s in students:
            graded = root / "autograded" / s / chapter / f"{chapter}.ipynb"
            problems = list(collected.get(s, {}).get("problems", []))
            submitted = read_notebook(sub / s / chapter / f"{chapter}.ipynb")
            flags = suspicious_code(submitted)
            if not graded.is_file():
                why = failures.get(s) or failures.get("*") or "nbgrader autograde produced no output"
                problems.append(f"could not be autograded: {why}")
                scores = {g: 0.0 for g, p in _graded(release_nb).items()}
                reports.append(StudentReport(s, chapter, scores, _graded(release_nb), [], {}, problems, flags))
                continue
            nb = read_notebook(graded)
            try:
                sn = gb.find_submission_notebook(chapter, chapter, s)
            except MissingEntry:
                problems.append("not in the gradebook after autograding")
                continue
            scores, max_scores, manual = {}, {}, []
            for g in sn.grades:
                max_scores[g.name] = float(g.max_score)
                scores[g.name] = float(g.score)
                if g.cell.cell_type == "markdown" or g.needs_manual_grade and g.auto_score is None:
                    manual.append(g.name)
            order = list(_graded(release_nb))
            scores = {k: scores[k] for k in sorted(scores, key=lambda k: order.index(k) if k in order else 99)}
            max_scores = {k: max_scores[k] for k in scores}
            msgs = _messages(nb, release_nb)
            for j, c in enumerate(nb["cells"]):
                meta = _nbgrader(c)
                if c.get("cell_type") == "code" and not meta.get("grade") and _error(c) is not None:
                    problems.append(f"{_cell_name(c, j)} raised {_describe(*_error(c))}")
            reports.append(StudentReport(s, chapter, scores, max_scores, manual, msgs, problems, flags))
    _write_reports(root, chapter, reports)
    return reports


def _graded(nb: dict) -> Dict[str, float]:
    return {
        _nbgrader(c)["grade_id"]: float(_nbgrader(c).get("points", 0)) for c in nb["cells"] if _nbgrader(c).get("grade")
    }


def export(course, to) -> Path:
    """nbgrader's CSV export of the gradebook (one row per student and assignment) to the file ``to``."""
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    root = _root(course)
    to = Path(to).resolve()
    if to.is_dir():
        raise ValueError(f"to: expected a file name for the CSV, {to} is a folder")
    to.parent.mkdir(parents=True, exist_ok=True)
    plugin = CsvExportPlugin(config=_config(root))
    plugin.to = str(to)
    plugin.log.setLevel(logging.ERROR)
    with Gradebook(_config(root).CourseDirectory.db_url) as gb:
        plugin.export(gb)
    return to


def feedback(course, chapter: str) -> Path:
    """nbgrader's HTML feedback for every autograded submission of ``chapter``; returns ``feedback/``."""
    root = _root(course)
    if not (root / "autograded").is_dir():
        raise ValueError(f"chapter: nothing autograded in {root}; run grade first")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = _api(root).generate_feedback(chapter)
    if not res["success"]:
        raise RuntimeError(f"nbgrader generate_feedback failed for {chapter}: {_one_line(res)}")
    return root / "feedback"
