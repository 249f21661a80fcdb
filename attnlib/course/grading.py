"""nbgrader preprocessors of the course: sanitize a submission, grade its cells in the guarded worker.

``python -m attnlib.course init`` writes them into ``nbgrader_config.py``, so
``python -m attnlib.course grade`` and a plain ``nbgrader autograde`` grade
the same way:

* :class:`SanitizeSubmission` (after nbgrader's own sanitizing: outputs
  cleared, locked cells restored, missing graded cells added back with
  ``OverwriteCells.add_missing_cells``): every Markdown cell that holds raw
  HTML, a link or image that is not ``http(s)``/``mailto``/relative, or
  anything a browser could read as a tag is replaced by its text in a code
  block; raw cells become text; attachments and foreign notebook metadata
  are dropped. The feedback HTML and the formgrader show the result.
* :class:`GradeInSandbox` (in place of nbgrader's ``Execute``: no kernel runs
  the submission): each graded check cell is decided by
  :func:`attnlib.course.exercises.judge` on what the guarded worker of
  :mod:`attnlib.course.hidden` reports; the cell gets an error output with the
  one-line message when it fails, which is what nbgrader scores.

What each did is written to ``reports/.grading/<chapter>/<student>.json``
for :func:`attnlib.course.coursedir.grade`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Float

__all__ = ["SanitizeSubmission", "GradeInSandbox", "safe_markdown", "course_root", "record_path"]

_TAGLIKE = re.compile(r"<\s*[A-Za-z/!?]")
_SCHEMES = ("http", "https", "mailto")
_CHECK = re.compile(r"""exercises\.check\(\s*["'](?P<key>[\d.]+)["']\s*,\s*(?P<fn>[A-Za-z_]\w*)\s*[,)]""")


def _unsafe_link(url: str) -> bool:
    u = "".join(ch for ch in url if ch > " ").lower()
    if u.startswith(("#", "/", "./", "../")) or ":" not in u.split("/")[0]:
        return False
    return u.split(":", 1)[0] not in _SCHEMES


def _reasons(text: str) -> list:
    """What makes Markdown unsafe to render in an instructor's browser (empty: safe)."""
    from markdown_it import MarkdownIt

    out = []
    squeezed = "".join(text.split()).lower()
    if _TAGLIKE.search(text):
        out.append("raw HTML")
    for word in ("javascript:", "vbscript:", "data:", "&#", "&colon;"):
        if word in squeezed:
            out.append(f"{word!r}")
    md = MarkdownIt("commonmark").enable("table")
    stack = list(md.parse(text))
    while stack:
        tok = stack.pop()
        stack += tok.children or []
        if tok.type in ("html_block", "html_inline"):
            out.append("raw HTML")
        for attr in ("href", "src"):
            url = tok.attrGet(attr) if tok.attrs else None
            if url and _unsafe_link(str(url)):
                out.append(f"a link to {str(url).split(':', 1)[0]}:")
            elif url and attr == "src" and ":" in str(url).split("/")[0]:
                out.append("an image from another site")  # it would be fetched when the page is shown
    return list(dict.fromkeys(out))


def safe_markdown(text: str):
    """``(markdown, reasons)``: ``text`` itself if it is safe, else its text in a code block and why."""
    reasons = _reasons(text)
    if not reasons:
        return text, []
    longest = max((len(m) for m in re.findall(r"`+|~+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    note = f"*This cell contained {', '.join(reasons)}; it is shown as text.*"
    return f"{note}\n\n{fence}text\n{text}\n{fence}", reasons


def course_root(resources) -> Path:
    """The course folder of an nbgrader run (from its ``sqlite:///.../gradebook.db`` URL)."""
    url = resources["nbgrader"]["db_url"]
    if not url.startswith("sqlite:///"):
        raise ValueError(f"db_url: expected the course's sqlite gradebook, got {url!r}")
    return Path(url[len("sqlite:///") :]).parent


def record_path(root: Path, chapter: str, student: str) -> Path:
    return Path(root) / "reports" / ".grading" / chapter / f"{student}.json"


def _update_record(resources, **fields):
    nbg = resources["nbgrader"]
    path = record_path(course_root(resources), nbg["assignment"], nbg["student"])
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(fields)
    path.write_text(json.dumps(old, indent=2))


class SanitizeSubmission(NbGraderPreprocessor):
    """Student content that a browser would run or fetch becomes text (see the module's docstring)."""

    def preprocess(self, nb, resources):
        """The notebook with its unsafe Markdown and raw cells shown as text; what changed goes to the record."""
        from nbformat.v4 import new_markdown_cell

        sanitized = []
        for i, cell in enumerate(nb.cells):
            cell.pop("attachments", None)
            name = cell.metadata.get("nbgrader", {}).get("grade_id") or f"cell {i + 1}"
            if cell.cell_type == "markdown":
                text, why = safe_markdown(cell.source)
                if why:
                    cell.source = text
                    sanitized.append(f"{name}: {', '.join(why)} shown as text")
            elif cell.cell_type == "raw":
                text, _ = safe_markdown("<raw>" + cell.source)
                new = new_markdown_cell(text.replace("<raw>", "", 1), metadata=cell.metadata)
                new.id = cell.get("id", new.id)
                nb.cells[i] = new
                sanitized.append(f"{name}: a raw cell shown as text")
        nb.metadata = {k: v for k, v in nb.metadata.items() if k in ("kernelspec", "language_info", "attnlib")}
        _update_record(resources, sanitized=sanitized)
        return nb, resources


_SANDBOXES: dict = {}


def sandbox(root: Path, timeout: float):
    """The zygote of this grading run (one per course and time limit, reused by every student)."""
    from . import BOOK_DIR
    from .hidden import Sandbox

    key = (str(root), float(timeout))
    box = _SANDBOXES.get(key)
    if box is None or box._proc.poll() is not None:
        box = _SANDBOXES[key] = Sandbox(timeout, sensitive=(root, BOOK_DIR))
    return box


def close_sandboxes():
    """Stop the zygotes started by this process."""
    while _SANDBOXES:
        _, box = _SANDBOXES.popitem()
        box.close()


def _strip_magics(src: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())


class GradeInSandbox(NbGraderPreprocessor):
    """Decide every autograded check cell outside the student's reach (see the module's docstring)."""

    timeout = Float(120.0, help="Seconds one graded cell's worker may run").tag(config=True)

    def preprocess(self, nb, resources):
        """The notebook with every check cell's output set from the guarded worker's verdict (see the class)."""
        from nbformat.v4 import new_output

        from .coursedir import release_record
        from .exercises import EXERCISES, judge
        from .handout import read_notebook
        from .hidden import encode

        root = course_root(resources)
        chapter = resources["nbgrader"]["assignment"]
        seed = release_record(root, chapter)["seed"]
        released = read_notebook(root / "release" / chapter / f"{chapter}.ipynb")
        setup = next(
            (c for c in released["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "setup"), None
        )
        setup_src = _strip_magics("".join(setup["source"]) if setup else "")
        box = sandbox(root, self.timeout)
        own, fatal, verdicts, cell_errors, since = [], set(), {}, {}, 0
        released_ids = {c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in released["cells"]}
        present = {c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells}
        for i, cell in enumerate(nb.cells):
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type != "code":
                continue
            if meta.get("grade") and not meta.get("solution"):
                cell.outputs = []
                gid = meta.get("grade_id", f"cell {i + 1}")
                m = _CHECK.search(cell.source)
                if m is None or m["key"] not in EXERCISES:
                    msg, passed, flags = f"{gid}: not a check cell of attnlib.course.exercises", False, []
                else:
                    from .exercises import hidden_cases

                    ex = EXERCISES[m["key"]]
                    cases = [[encode(a) for a in args] for _, args in hidden_cases(m["key"], seed)]
                    cells = [c for c in own if c[0] not in fatal]
                    answer = box.run(setup_src, cells, m["fn"], cases, ex.forbidden)
                    answer["recent"] = [c[0] for c in own[since:]]
                    if f"{gid}-solution" in released_ids and f"{gid}-solution" not in present:
                        answer["why"] = f" (the solution cell {gid}-solution is missing)"
                    v = judge(m["key"], answer, seed, self.timeout)
                    if v.fatal_cell:
                        fatal.add(v.fatal_cell)
                    msg, passed, flags = v.message, v.passed, v.flags
                    for name, err in v.cell_errors.items():
                        cell_errors.setdefault(name, err)
                clean = "".join(ch if ch >= " " else " " for ch in msg)
                if passed:
                    cell.outputs = [new_output("stream", name="stdout", text=clean + "\n")]
                else:
                    cell.outputs = [new_output("error", ename="ExerciseError", evalue=clean, traceback=[clean])]
                verdicts[gid] = {"passed": passed, "message": msg, "flags": flags}
                since = len(own)
            elif not meta.get("locked"):
                own.append((meta.get("grade_id") or str(i + 1), _strip_magics(cell.source)))
        _update_record(resources, verdicts=verdicts, skipped_cells=sorted(fatal), cell_errors=cell_errors)
        return nb, resources
