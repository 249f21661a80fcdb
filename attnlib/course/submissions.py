"""Checks of submitted notebooks: one-line errors for bad files, problems that are repaired and reported.

:func:`inspect_submission` reads one submitted file against the released
handout of its assignment. A file that cannot be graded raises
:class:`SubmissionError` with a one-line message (a symbolic link, empty, not
JSON, not a notebook, a duplicated ``grade_id``, an instructor's notebook,
another chapter's handout, not a handout of this release). A notebook
that can be graded but was damaged is repaired from the handout and its
problems are listed: a deleted graded cell is put back where it was, an
edited graded or locked cell gets its original source (nbgrader would
restore it anyway; the message tells the instructor it happened), a deleted
solution cell is reported. :func:`suspicious_code` lists lines of the
student's own cells that tamper with modules or the interpreter, for review.

Standard library only.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .handout import _nbgrader, _source, nbgrader_ids

__all__ = ["SubmissionError", "inspect_submission", "suspicious_code", "chapter_of"]


class SubmissionError(ValueError):
    """A submitted file cannot be graded; the message says why, on one line."""


def _load(path: Path) -> dict:
    if not path.is_file():
        raise SubmissionError(f"{path}: no such file")
    raw = path.read_bytes()
    if not raw.strip():
        raise SubmissionError(f"{path}: the file is empty (expected a Jupyter notebook)")
    try:
        nb = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise SubmissionError(f"{path}: not a Jupyter notebook (the file is not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise SubmissionError(
            f"{path}: not a Jupyter notebook (invalid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise SubmissionError(f"{path}: not a Jupyter notebook (the JSON has no list of cells)")
    if int(nb.get("nbformat", 0) or 0) < 4:
        raise SubmissionError(
            f"{path}: a notebook of format {nb.get('nbformat')}; open it in Jupyter and save it (format 4)"
        )
    for i, cell in enumerate(nb["cells"], 1):
        if not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown", "raw"):
            raise SubmissionError(f"{path}: not a valid notebook (cell {i} has no known cell type)")
    return nb


def chapter_of(nb: dict, handouts: Dict[str, set]) -> Optional[str]:
    """The chapter whose handout shares most nbgrader ids (then cell ids) with ``nb``, or ``None``."""
    ids = set(nbgrader_ids(nb))
    cell_ids = {c.get("id") for c in nb["cells"] if c.get("id")}
    best, score = None, (0, 0)
    for chapter, (grade_ids, handout_cell_ids) in handouts.items():
        s = (len(ids & grade_ids), len(cell_ids & handout_cell_ids))
        if s > score:
            best, score = chapter, s
    return best


_INSTRUCTOR_MARKERS = ("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS", "{solution-start}", "### BEGIN MARK SCHEME")


def _check_identity(path: Path, nb: dict, chapter: str, fingerprint: Optional[str], handouts) -> None:
    """Reject duplicated grade ids, instructors' notebooks and notebooks that are not this release's handout."""
    seen: Dict[str, int] = {}
    for i, cell in enumerate(nb["cells"], 1):
        gid = _nbgrader(cell).get("grade_id")
        if gid in seen:
            raise SubmissionError(
                f"{path}: the grade_id {gid!r} is on two cells ({seen[gid]} and {i}), a duplicated cell; "
                f"keep one (copy the code into it) and submit again"
            )
        if gid:
            seen[gid] = i
    for cell in nb["cells"]:
        if any(m in _source(cell) for m in _INSTRUCTOR_MARKERS):
            raise SubmissionError(
                f"{path}: holds worked solutions or hidden tests, so it is an instructor's notebook (the book's "
                f"master or the course's source), not a student's copy of the {chapter} handout"
            )
    meta = nb.get("metadata") if isinstance(nb.get("metadata"), dict) else {}
    mark = meta.get("attnlib") if isinstance(meta.get("attnlib"), dict) else {}
    if mark.get("chapter") not in (None, chapter):
        raise SubmissionError(f"{path}: this is the handout of {mark.get('chapter')}, not of {chapter}")
    if fingerprint is not None and mark.get("release") != fingerprint:
        other = chapter_of(nb, {k: v for k, v in handouts.items() if k != chapter})
        if not mark and other is not None and not set(nbgrader_ids(nb)) & handouts.get(chapter, (set(), set()))[0]:
            raise SubmissionError(f"{path}: this is the notebook of {other}, not of {chapter} (by its cell ids)")
        why = "has no release fingerprint" if not mark.get("release") else "has the fingerprint of another release"
        raise SubmissionError(
            f"{path}: not a copy of this release's {chapter} handout (its metadata {why}); "
            f"make it from the released {chapter}.ipynb"
        )


def _check_chapter(path: Path, nb: dict, chapter: str, release: dict, handouts) -> None:
    """Reject a notebook that has none of the handout's graded cells (naming its chapter when it is another's)."""
    mine = set(nbgrader_ids(release))
    present = set(nbgrader_ids(nb))
    if not present & mine:
        other = chapter_of(nb, {k: v for k, v in handouts.items() if k != chapter})
        if other is not None:
            raise SubmissionError(f"{path}: this is the notebook of {other}, not of {chapter} (by its cell ids)")
        raise SubmissionError(
            f"{path}: none of the cells of the {chapter} handout is in this notebook; "
            f"was it made from the released {chapter}.ipynb?"
        )


def _put_back(release_cells: List[dict], pos: int, cells: List[dict], by_id: Dict[str, dict]) -> None:
    """Insert a copy of the handout's cell ``pos`` after the closest preceding handout cell still present."""
    at = 0
    for prev in reversed(release_cells[:pos]):
        pid = _nbgrader(prev).get("grade_id")
        if pid in by_id:
            at = next(i for i, c in enumerate(cells) if c is by_id[pid]) + 1
            break
    rcell = release_cells[pos]
    restored = json.loads(json.dumps(rcell))
    cells.insert(at, restored)
    by_id[_nbgrader(rcell)["grade_id"]] = restored


def _deleted(meta: dict, gid: str) -> str:
    """The problem line of the handout's cell ``gid`` (nbgrader metadata ``meta``) deleted from a submission."""
    if meta.get("solution") and not meta.get("grade"):
        return f"the solution cell {gid} was deleted; its exercise earns no points"
    if meta.get("solution"):  # a written answer
        return f"the answer cell {gid} was deleted; it was put back empty"
    kind = "graded cell" if meta.get("grade") else "locked cell"
    return f"the {kind} {gid} was deleted; it was put back from the handout"


def _repair(nb: dict, release: dict) -> List[str]:
    """Put deleted graded cells of ``nb`` back and restore its edited locked cells from ``release``; the problems."""
    problems: List[str] = []
    by_id = {}
    for cell in nb["cells"]:
        gid = _nbgrader(cell).get("grade_id")
        if gid and gid not in by_id:
            by_id[gid] = cell
    cells = list(nb["cells"])
    for pos, rcell in enumerate(release["cells"]):
        meta = _nbgrader(rcell)
        gid = meta.get("grade_id")
        if not gid:
            continue
        cell = by_id.get(gid)
        if cell is None:
            if not (meta.get("solution") and not meta.get("grade")):  # a deleted solution cell is not put back
                _put_back(release["cells"], pos, cells, by_id)
            problems.append(_deleted(meta, gid))
            continue
        if meta.get("locked") and (
            _source(cell).strip() != _source(rcell).strip() or cell.get("cell_type") != rcell.get("cell_type")
        ):
            kind = "graded cell" if meta.get("grade") else "locked cell"
            problems.append(f"the {kind} {gid} was edited; it is graded with its original source")
            cell.clear()
            cell.update(json.loads(json.dumps(rcell)))
    nb["cells"] = cells
    return problems


def inspect_submission(
    path, chapter: str, release: dict, handouts: Dict[str, Tuple[set, set]], fingerprint: Optional[str] = None
):
    """Check one submitted notebook of ``chapter`` against its ``release`` (the handout as a dict).

    ``handouts`` maps every chapter to ``(nbgrader ids, cell ids)`` of its
    exercise section, to name the chapter a wrong notebook belongs to.
    Returns ``(notebook, problems)``: the notebook with deleted graded cells
    put back and edited locked cells restored, and one line per problem.
    Raises :class:`SubmissionError` if the file cannot be graded: a symbolic
    link, not a notebook, a duplicated ``grade_id``, an instructor's notebook
    (worked solutions or hidden tests in it), or not a handout of this
    release (its ``fingerprint`` in the metadata, when given).
    """
    path = Path(path)
    if path.is_symlink():
        raise SubmissionError(f"{path}: is a symbolic link; submit the notebook file itself")
    nb = _load(path)
    _check_identity(path, nb, chapter, fingerprint, handouts)
    _check_chapter(path, nb, chapter, release, handouts)
    problems = _repair(nb, release)
    return nb, problems


_MODULE_IMPORTS = (ast.Import, ast.ImportFrom)
_CALLS = {"setattr", "delattr", "exec", "eval", "compile", "__import__", "get_ipython", "globals", "vars"}
_MODULES = {
    "builtins",
    "gc",
    "ctypes",
    "inspect",
    "importlib",
    "sys",
    "IPython",
    "ipykernel",
    "subprocess",
    "multiprocessing",
    "threading",
    "_thread",
    "signal",
    "socket",
}
_SYS_ATTRS = {"setprofile", "settrace", "modules", "excepthook", "_getframe"}


def _root(node) -> Optional[str]:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001
        return "?"


def _parse_cells(nb: dict):
    """``(trees, modules, handout_names)`` of the notebook's code cells that parse.

    ``trees`` are ``(name, tree)`` of the student's own cells, ``modules`` the
    names bound by ``import`` in any cell, ``handout_names`` the names the
    locked cells assign at their top level.
    """
    trees = []
    modules, handout_names = set(), set()
    for i, cell in enumerate(nb["cells"], 1):
        if cell.get("cell_type") != "code":
            continue
        meta = _nbgrader(cell)
        src = "\n".join(line for line in _source(cell).splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                modules.update(a.asname or a.name for a in node.names)
        if not meta.get("locked"):
            trees.append((meta.get("grade_id") or f"cell {i}", tree))
        else:
            for node in tree.body:
                if isinstance(node, ast.Assign):
                    handout_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return trees, modules, handout_names


def _rebindings(name: str, tree, handout_names) -> List[str]:
    """Lines of the cell ``name`` that rebind, at its top level, a name the handout (or Python) defines."""
    out = []
    for node in tree.body:
        bound = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = [t.id for t in targets if isinstance(t, ast.Name)]
        for b in bound:
            if b in handout_names and not b.startswith("__"):
                out.append(f"{name}, line {node.lineno}: rebinds {b}, a name of the handout or of Python")
    return out


def _tampering(node, modules) -> Optional[str]:
    """What the AST ``node`` does to modules or the interpreter (``"assigns to al.x"``, ...), or ``None``."""
    what = None
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = list(node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target])
        while any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):
            targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        for t in targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) in modules:
                verb = "deletes" if isinstance(node, ast.Delete) else "assigns to"
                what = f"{verb} {_dotted(t)}"
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
        what = f"calls {node.func.id}()"
    elif isinstance(node, _MODULE_IMPORTS):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        bad = [n for n in names if n.split(".")[0] in _MODULES]
        if bad:
            what = f"imports {', '.join(bad)}"
    elif isinstance(node, ast.Attribute) and _root(node) == "sys" and node.attr in _SYS_ATTRS:
        what = f"uses sys.{node.attr}"
    return what


def suspicious_code(nb: dict) -> List[str]:
    """Lines of the student's own code cells that change modules or the interpreter, for review.

    Module names are the names bound by ``import`` anywhere in the notebook.
    Reported: assignments to (or deletion of) attributes of modules
    (``exercises.check = ...``, ``al.to_factor = ...``, ``torch.allclose = ...``),
    calls of ``setattr``, ``exec``, ``eval``, ``get_ipython`` and the like,
    imports of ``builtins``, ``gc``, ``ctypes``, ``sys``, ``inspect``,
    ``importlib``, IPython, ``subprocess``, threads, signals or sockets,
    ``sys.setprofile``/``settrace``/``modules``, and top-level rebinding of a
    name that the handout's locked cells or Python's builtins define
    (``np = ...``, ``def float(x): ...``).
    Locked cells (the handout's own) are skipped; cells that do not parse
    are skipped (their error is reported by grading).
    """
    import builtins

    trees, modules, handout_names = _parse_cells(nb)
    handout_names |= modules | set(dir(builtins))
    out = []
    for name, tree in trees:
        out += _rebindings(name, tree, handout_names)  # the names the handout (or Python) defines, rebound
        for node in ast.walk(tree):
            what = _tampering(node, modules)
            if what is not None:
                entry = f"{name}, line {getattr(node, 'lineno', '?')}: {what}"
                if entry not in out:
                    out.append(entry)
    return out
