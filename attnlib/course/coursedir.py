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
`nbgrader export`; the formgrader is the "Formgrader" entry of JupyterLab's Nbgrader menu, with
`jupyter lab` started in this folder); `python -m attnlib.course` reads it as well.
"""

import os

c = get_config()  # noqa: F821 - provided by traitlets when nbgrader loads this file

c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(c.CourseDirectory.root, "gradebook.db")

# Grading: no kernel runs a submission. The hidden tests run in a guarded worker process
# (attnlib.course.grading.GradeInSandbox in place of nbgrader's Execute); student Markdown that a
# browser would run is shown as text (SanitizeSubmission); deleted graded cells are put back.
from nbconvert.preprocessors import ClearMetadataPreprocessor  # noqa: E402
from nbgrader.preprocessors import (  # noqa: E402
    AssignLatePenalties,
    CheckCellMetadata,
    ClearOutput,
    DeduplicateIds,
    IgnorePattern,
    LimitOutput,
    OverwriteCells,
    OverwriteKernelspec,
    SaveAutoGrades,
)

from attnlib.course.grading import GradeInSandbox, SanitizeSubmission  # noqa: E402

c.Autograde.sanitize_preprocessors = [
    ClearOutput, DeduplicateIds, OverwriteKernelspec, OverwriteCells, CheckCellMetadata, SanitizeSubmission
]
c.Autograde.autograde_preprocessors = [
    GradeInSandbox, IgnorePattern, ClearMetadataPreprocessor, LimitOutput, SaveAutoGrades, AssignLatePenalties,
    CheckCellMetadata,
]
c.OverwriteCells.add_missing_cells = True
# Seconds the hidden test of one graded cell may run (an endless loop costs this much, once).
c.GradeInSandbox.timeout = {timeout}
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
    ignore = root / ".gitignore"
    if not ignore.exists():  # solutions, submissions and grades are not for a public repository
        ignore.write_text("# a course folder holds solutions, submissions and grades: never commit it\n*\n")
    return root


RELEASES_FILE = "attnlib-releases.json"


def release_record(root: Path, chapter: str) -> dict:
    """``{"seed", "fingerprint", "released"}`` of ``chapter``'s release in the course (the seed is secret)."""
    path = Path(root) / RELEASES_FILE
    records = json.loads(path.read_text()) if path.is_file() else {}
    if chapter not in records:
        raise ValueError(f"chapter: {chapter!r} has no release record in {root}; release it again (--force)")
    return records[chapter]


def _new_release(root: Path, chapter: str) -> dict:
    import secrets

    path = root / RELEASES_FILE
    records = json.loads(path.read_text()) if path.is_file() else {}
    records[chapter] = {
        "seed": secrets.randbits(62) + 1,
        "fingerprint": secrets.token_hex(8),
        "released": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path.write_text(json.dumps(records, indent=2))
    os.chmod(path, 0o600)
    return records[chapter]


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
        pages = [n for n in names if n.startswith(f"{ch}_")]
        if ch not in names and len(pages) == 1:  # a chapter whose exercises are on its last section page
            raise ValueError(f"chapters: the exercises of {ch} are in {pages[0]!r}; expected names from {names}")
        if ch not in names:
            raise ValueError(f"chapters: expected names from {names}, got {ch!r}")
        if (root / "release" / ch).exists() and not force:
            raise ValueError(f"chapters: {ch} is already released in {root}; pass force=True (--force) to redo it")
    api = _api(root)
    out = {}
    for ch in chapters:
        rec = _new_release(root, ch)  # a new seed for the hidden cases, a new fingerprint, per release
        nb = nbformat.from_dict(source_notebook(ch, book_dir=book, hints=hints, fingerprint=rec["fingerprint"]))
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
    if not sid or not set(sid) <= _STUDENT_CHARS or sid[0] in ".-" or sid in (".", ".."):
        raise SubmissionError(
            f"{path}: cannot take a student id from the file name ({sid!r}); name it <student>.ipynb "
            f"or <student>/{chapter}.ipynb, with letters, digits and . _ - @ + only, not starting with . or -"
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


def _submitted_files(paths: Iterable) -> List[Path]:
    """The files in ``paths``: files as given, and folders' ``.ipynb`` files and symbolic links to folders."""
    files: List[Path] = []
    for p in map(Path, paths):
        if p.is_dir() and not p.is_symlink():
            for folder, dirs, names in os.walk(p, followlinks=False):
                if ".ipynb_checkpoints" in Path(folder).parts:
                    continue
                files += sorted(Path(folder) / d for d in dirs if (Path(folder) / d).is_symlink())
                files += sorted(Path(folder) / n for n in names if n.endswith(".ipynb"))
        else:
            files.append(p)
    if not files:
        raise ValueError("paths: expected submitted notebooks (files or folders holding .ipynb files), got none")
    return files


def _checked(f: Path, chapter: str, handout: dict, handouts, fingerprint):
    """``(student id, notebook node, problems)`` of the submitted file ``f``, or :class:`SubmissionError`."""
    import nbformat

    if f.is_symlink():
        raise SubmissionError(f"{f}: is a symbolic link; submit the notebook file itself")
    sid = _student_id(f, chapter)
    nb, problems = inspect_submission(f, chapter, handout, handouts, fingerprint)
    node = nbformat.from_dict(_normalized(nb))
    try:
        nbformat.validate(node)
    except nbformat.ValidationError as exc:
        first = str(exc).strip().splitlines()[0][:200]
        raise SubmissionError(f"{f}: not a valid notebook (nbformat: {first})") from None
    return sid, node, problems


def _store(root: Path, chapter: str, f: Path, sid: str, node) -> Optional[str]:
    """Write the checked ``node`` to ``submitted/<sid>/<chapter>/``; the rejection if ``sid`` leads elsewhere."""
    import nbformat

    dest = root / "submitted" / sid / chapter
    if dest.resolve().parent.parent != (root / "submitted").resolve():  # pragma: no cover - ids are checked
        return f"{f}: the student id {sid!r} points outside the submission folder"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    nbformat.write(node, str(dest / f"{chapter}.ipynb"))
    stamp = datetime.fromtimestamp(f.stat().st_mtime, tz=timezone.utc)
    (dest / "timestamp.txt").write_text(stamp.strftime("%Y-%m-%d %H:%M:%S.%f %Z"))
    return None


def collect(course, chapter: str, paths: Iterable, *, book_dir=None) -> CollectResult:
    """Collect submitted notebooks of ``chapter`` into ``submitted/<student>/<chapter>/``.

    ``paths`` are files (``alice.ipynb``, or ``alice/<chapter>.ipynb``) or
    folders holding such files. Each file is checked
    (:func:`attnlib.course.submissions.inspect_submission`): bad files are
    rejected with a one-line reason, repaired ones are collected with their
    problems listed. A student collected again replaces the earlier copy.
    """
    root = _root(course)
    release_nb = root / "release" / chapter / f"{chapter}.ipynb"
    if not release_nb.is_file():
        raise ValueError(f"chapter: {chapter!r} is not released in {root}; run release first")
    handout = read_notebook(release_nb)
    handouts = _handouts(_book(book_dir))
    fingerprint = release_record(root, chapter)["fingerprint"]
    files = _submitted_files(paths)
    result = CollectResult(chapter)
    log_file = _log_path(root, chapter)
    log = json.loads(log_file.read_text()) if log_file.is_file() else {}
    for f in files:
        try:
            sid, node, problems = _checked(f, chapter, handout, handouts, fingerprint)
        except SubmissionError as exc:
            result.rejected[str(f)] = str(exc)
            continue
        rejected = _store(root, chapter, f, sid, node)
        if rejected is not None:  # pragma: no cover - ids are checked
            result.rejected[str(f)] = rejected
            continue
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
    status: str = "graded"

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
        out = [f"{head} autograded points{pending}" + ("" if self.status == "graded" else f" ({self.status})")]
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
        head = ["student", "status", "autograded", "autograded_max", "to_grade_by_hand"]
        w.writerow(head + keys + ["messages", "problems", "review"])
        for r in sorted(rows, key=lambda r: r["student"]):
            auto = [k for k in r["scores"] if k not in r["manual"]]
            got, top = sum(r["scores"][k] for k in auto), sum(r["max_scores"][k] for k in auto)
            messages = "; ".join(f"{k}: {m}" for k, m in r["messages"].items())
            w.writerow(
                [r["student"], r.get("status", "graded"), got, top, len(r["manual"])]
                + [("" if k in r["manual"] else r["scores"].get(k, "")) for k in keys]
                + [messages, "; ".join(r["problems"]), "; ".join(r["flags"])]
            )


def grade(course, chapter: str, students: Optional[Sequence[str]] = None) -> List[StudentReport]:
    """Autograde the collected submissions of ``chapter`` (all, or ``students``) with nbgrader.

    One ``nbgrader autograde`` run per student (a submission that breaks
    nbgrader costs that student only, with status ``not graded: <cause>``),
    each graded cell decided in the guarded worker; then a report
    per student: autograded points per exercise, the one-line reason for each
    failed check (the student's own failing cell when that is the cause), the
    written answers left to grade by hand, the problems found when the file
    was collected, and the suspicious lines for review. Reports are written
    to ``reports/<chapter>.json`` and ``.csv``.
    """

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
    from .grading import close_sandboxes, record_path

    api = _api(root)
    release_nb = read_notebook(root / "release" / chapter / f"{chapter}.ipynb")
    log_file = _log_path(root, chapter)
    collected = json.loads(log_file.read_text()) if log_file.is_file() else {}
    reports = []
    try:
        for s in students:  # one student at a time: a submission cannot change another's grade
            record = record_path(root, chapter, s)
            if record.exists():
                record.unlink()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    res = api.autograde(chapter, s, force=True)
                    failure = None if res["success"] else _one_line(res)
                except Exception as exc:  # noqa: BLE001 - one student's failure, reported as such
                    failure = f"{type(exc).__name__}: {exc}"
            reports.append(_report(root, chapter, s, release_nb, collected, failure))
    finally:
        close_sandboxes()
    _write_reports(root, chapter, reports)
    return reports


def _report(root: Path, chapter: str, s: str, release_nb: dict, collected: dict, failure) -> StudentReport:
    """The report of one student after nbgrader's autograde (with :mod:`attnlib.course.grading`'s record)."""
    from nbgrader.api import Gradebook, MissingEntry

    from .grading import record_path

    sub = root / "submitted"
    graded = root / "autograded" / s / chapter / f"{chapter}.ipynb"
    problems = list(collected.get(s, {}).get("problems", []))
    flags = suspicious_code(read_notebook(sub / s / chapter / f"{chapter}.ipynb"))
    path = record_path(root, chapter, s)
    record = json.loads(path.read_text()) if path.is_file() else {}
    for line in record.get("sanitized", []):
        flags.append(f"{line} (raw HTML or a script link in the student's Markdown)")
    msgs = {}
    for name, err in record.get("cell_errors", {}).items():
        problems.append(f"cell {name} raised {err}")
    for gid, v in record.get("verdicts", {}).items():
        flags += v["flags"]
        if not v["passed"]:
            msgs[gid] = v["message"]
    zero = {g: 0.0 for g in _graded(release_nb)}
    if failure is not None or not graded.is_file():
        why = failure or "nbgrader autograde produced no output"
        return StudentReport(s, chapter, zero, _graded(release_nb), [], msgs, problems, flags, f"not graded: {why}")
    with Gradebook(_config(root).CourseDirectory.db_url) as gb:
        try:
            sn = gb.find_submission_notebook(chapter, chapter, s)
        except MissingEntry:
            status = "not graded: not in the gradebook after autograding"
            return StudentReport(s, chapter, zero, _graded(release_nb), [], msgs, problems, flags, status)
        scores, max_scores, manual = {}, {}, []
        for g in sn.grades:
            max_scores[g.name] = float(g.max_score)
            scores[g.name] = float(g.score)
            if g.cell.cell_type == "markdown" or g.needs_manual_grade and g.auto_score is None:
                manual.append(g.name)
    order = list(_graded(release_nb))
    scores = {k: scores[k] for k in sorted(scores, key=lambda k: order.index(k) if k in order else 99)}
    max_scores = {k: max_scores[k] for k in scores}
    nb = read_notebook(graded)
    for gid, m in _messages(nb, release_nb).items():
        msgs.setdefault(gid, m)
    for j, c in enumerate(nb["cells"]):
        meta = _nbgrader(c)
        if c.get("cell_type") == "code" and not meta.get("grade") and _error(c) is not None:
            problems.append(f"{_cell_name(c, j)} raised {_describe(*_error(c))}")
    return StudentReport(s, chapter, scores, max_scores, manual, msgs, problems, list(dict.fromkeys(flags)))


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
    # a status column: a failed grading is never a silent 0
    status = {}
    for rep in sorted((root / "reports").glob("*.json")) if (root / "reports").is_dir() else []:
        if rep.stem.endswith("-collect"):
            continue
        for r in json.loads(rep.read_text()).values():
            status[(r["chapter"], r["student"])] = r.get("status", "graded")
    with open(to, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    if rows:
        a, sid = rows[0].index("assignment"), rows[0].index("student_id")
        rows[0].append("status")
        for row in rows[1:]:
            row.append(status.get((row[a], row[sid]), "not submitted" if row[a] else ""))
        with open(to, "w", newline="", encoding="utf-8") as fh:
            csv.writer(fh).writerows(rows)
    return to


def feedback(course, chapter: str) -> Path:
    """nbgrader's HTML feedback for every autograded submission of ``chapter``; returns ``feedback/``.

    Every page gets a Content-Security-Policy that allows no script and no
    fetch (``CSP``), and loses nbgrader's scripts and external style
    sheets: formulas show as TeX source. The students' Markdown was made
    safe when it was graded (:class:`attnlib.course.grading.SanitizeSubmission`).
    """
    root = _root(course)
    if not (root / "autograded").is_dir():
        raise ValueError(f"chapter: nothing autograded in {root}; run grade first")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = _api(root).generate_feedback(chapter)
    if not res["success"]:
        raise RuntimeError(f"nbgrader generate_feedback failed for {chapter}: {_one_line(res)}")
    for page in (root / "feedback").glob(f"*/{chapter}/*.html"):
        page.write_text(_locked_down(page.read_text(encoding="utf-8")), encoding="utf-8")
    return root / "feedback"


#: The feedback pages run no script and fetch nothing (the student's content is sanitized as well).
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


def _locked_down(html: str) -> str:
    """A feedback page with a Content-Security-Policy first in its head and without scripts or external loads."""
    import re

    html = re.sub(r"<script\b.*?</script\s*>", "", html, flags=re.S | re.I)
    html = re.sub(r"<link\b[^>]*>", "", html, flags=re.I)
    meta = f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
    head = re.search(r"<head[^>]*>", html, flags=re.I)
    return html[: head.end()] + meta + html[head.end() :] if head else meta + html
