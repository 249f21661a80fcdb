"""Assignments with nbgrader: handouts, hidden tests, the course workflow, bad submissions.

Every chapter's handout and hidden tests are checked without nbgrader (the guarded worker of
attnlib.course.hidden on the worked solutions and the stubs); the nbgrader plumbing (release,
collect, autograde student by student, export) runs once, for chapter 1. The adversarial
submissions are in tests/test_redteam.py.
"""

import copy
import json
import re
import subprocess
import sys

import nbformat
import pytest

from attnlib import course
from attnlib.course import myst
from attnlib.course.handout import BOOK_ONLY_TAGS, exercise_start, read_notebook

CHAPTERS = course.chapters()
#: the notebook with chapter 2's exercises (the chapter's last page)
CH2 = next(c for c in CHAPTERS if c.startswith("ch2_"))
HIDDEN = "### BEGIN HIDDEN TESTS"


def _nbg(cell):
    return cell.get("metadata", {}).get("nbgrader", {})


def _master(chapter):
    return read_notebook(course.BOOK_DIR / f"{chapter}.ipynb")


def _src(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _solution_lines(nb):
    """Non-trivial lines of the solution regions and of the model answers of a master notebook."""
    lines = []
    for cell in nb["cells"]:
        meta = _nbg(cell)
        if not meta.get("solution"):
            continue
        inside = cell["cell_type"] == "markdown"
        for line in _src(cell).splitlines():
            if "BEGIN SOLUTION" in line:
                inside = True
            elif "END SOLUTION" in line:
                inside = False
            elif inside and len(line.strip()) > 12:
                lines.append(line.strip())
    return lines


def _dropdown_prose(nb):
    """Lines of the book-only cells: the solution dropdowns' prose and the cells tagged book-only."""
    lines, inside = [], False
    for cell in nb["cells"][exercise_start(nb) :]:
        src = _src(cell)
        inside = inside or "{solution-start}" in src
        book_only = set(cell.get("metadata", {}).get("tags", [])) & BOOK_ONLY_TAGS
        if (inside and not _nbg(cell)) or book_only:
            lines += [
                line.strip() for line in src.splitlines() if len(line.strip()) > 30 and not line.startswith("```")
            ]
        inside = inside and "{solution-end}" not in src
    return lines


def _student_version(source):
    """What nbgrader's generate_assignment makes of a source notebook (its preprocessors, no course)."""
    from nbgrader.preprocessors import ClearHiddenTests, ClearMarkScheme, ClearOutput, ClearSolutions, LockCells

    nb, res = nbformat.from_dict(copy.deepcopy(source)), {}
    for pre in (LockCells, ClearSolutions, ClearOutput, ClearHiddenTests, ClearMarkScheme):
        nb, res = pre().preprocess(nb, res)
    return nb


def _exercises_of(nb):
    """``{"ex2-1": [grade ids]}``: the graded cells of each exercise."""
    out = {}
    for gid in course.graded_cells(nb):
        out.setdefault(re.match(r"(ex\d+-\d+)", gid).group(1), []).append(gid)
    return out


# ----------------------------------------------------------------------------- every chapter, statically


def test_every_chapter_has_coding_and_derivation_exercises():
    assert len(CHAPTERS) >= 6
    for ch in CHAPTERS:
        nb = _master(ch)
        cells = {_nbg(c)["grade_id"]: c for c in nb["cells"] if _nbg(c).get("grade")}
        auto = [g for g, c in cells.items() if c["cell_type"] == "code"]
        assert 2 <= len(auto) <= 4, (ch, auto)
        assert all(_nbg(cells[g])["points"] > 0 for g in cells)
        # a derivation exercise: graded by hand only, worth at least 2 points
        derivations = [
            ex for ex, gids in _exercises_of(nb).items() if all(cells[g]["cell_type"] == "markdown" for g in gids)
        ]
        assert derivations and all(
            sum(_nbg(cells[g])["points"] for g in _exercises_of(nb)[d]) >= 2 for d in derivations
        )
        # every written question of a coding exercise has an answer cell
        for cell in nb["cells"][exercise_start(nb) :]:
            src = _src(cell)
            if src.startswith("```{exercise}") and re.search(r"\b(Explain|Then answer|Then show|Derive)\b", src):
                key = re.search(r"```\{exercise\} (\d+)\.(\d+)", src).groups()
                assert f"ex{key[0]}-{key[1]}-answer" in cells, (ch, key)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_handout_renders_and_gives_nothing_away(chapter):
    master = _master(chapter)
    source = course.source_notebook(chapter)
    student = _student_version(source)
    text = "\n".join(c.source for c in student.cells)
    markdown = "\n".join(c.source for c in student.cells if c.cell_type == "markdown")
    # MyST is converted: no directive fences, roles or directive options in the Markdown
    for raw in ("```{", "{doc}`", "{prf:", "{cite}", "{ref}`", ":label:", ":nonumber:", "{solution"):
        assert raw not in markdown, raw
    assert "### Exercise" in markdown and "$" in markdown
    # no solution, no model answer, no book-only prose, no hidden test
    leaked = [line for line in _solution_lines(master) + _dropdown_prose(master) if line in text]
    assert not leaked, leaked
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN" not in text and "in the book" not in text.lower()
    assert not any(set(c.metadata.get("tags", [])) & BOOK_ONLY_TAGS for c in student.cells)
    code_solutions = [c for c in master["cells"] if _nbg(c).get("solution") and c["cell_type"] == "code"]
    answers = [c for c in master["cells"] if _nbg(c).get("solution") and c["cell_type"] == "markdown"]
    code = "\n".join(c.source for c in student.cells if c.cell_type == "code")
    assert code.count("raise NotImplementedError()") == len(code_solutions)
    assert sum(c.source == "YOUR ANSWER HERE" for c in student.cells) == len(answers) > 0
    # the exercise section only, with the chapter's import cell (locked); the master's cell ids
    assert course.graded_cells(student) == course.graded_cells(master)
    ids = {c["id"] for c in master["cells"]}
    assert all(c.id in ids for c in student.cells[1:]) and student.cells[1].metadata["nbgrader"]["locked"]
    assert "from attnlib.course import exercises" in student.cells[1].source
    assert len(student.cells) <= len(master["cells"]) - exercise_start(master) + 2
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    # the source keeps a hidden test in every autograded cell
    graded = [c for c in source["cells"] if _nbg(c).get("grade") and c["cell_type"] == "code"]
    assert graded and all(HIDDEN in c["source"] for c in graded)


def test_a_section_page_takes_its_chapters_title():
    from attnlib.course.handout import chapter_title

    docs = {"ch5_algorithm": "The algorithm", "ch5_algorithm_exercises": "Summary and exercises", "ch1_model": "Model"}
    assert chapter_title(docs, "ch5_algorithm_exercises") == "The algorithm"
    assert chapter_title(docs, "ch1_model") == "Model"
    assert chapter_title(docs, "ch9_other") == "ch9_other"
    for ch in CHAPTERS:  # every handout names its chapter, not the page the exercises are on
        header = course.source_notebook(ch)["cells"][0]["source"]
        assert header.startswith("# Exercises: ") and "Summary and exercises" not in header, header[:80]


def test_no_hints_release_and_stubs_that_do_not_give_the_formula():
    source = course.source_notebook(CH2, hints=False)
    checks = [c["source"].split(HIDDEN)[0] for c in source["cells"] if _nbg(c).get("grade") and HIDDEN in c["source"]]
    assert checks and all("hints=False)" in c for c in checks)
    assert "gives no hints" in source["cells"][0]["source"]
    for ch in CHAPTERS:  # the stub docstrings say what to compute, not how
        for c in _student_version(course.source_notebook(ch)).cells:
            if _nbg(c).get("solution") and c.cell_type == "code":
                doc = re.search(r'"""(.*?)"""', c.source, re.S).group(1)
                assert not re.search(r"Sigma\^|tr\(|sqrt|sum_i|\|\|.*\|\|", doc), (ch, doc)


@pytest.fixture(scope="module")
def sandbox():
    from attnlib.course.hidden import Sandbox

    with Sandbox(timeout=60) as box:
        yield box


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_hidden_tests_accept_the_worked_solutions_and_reject_the_stubs(chapter, sandbox):
    from attnlib.course.exercises import EXERCISES, hidden_cases, judge
    from attnlib.course.grading import _CHECK, _strip_magics
    from attnlib.course.hidden import encode

    master = _master(chapter)
    source = course.source_notebook(chapter)
    setup = _strip_magics(source["cells"][1]["source"])
    graded = [c["source"] for c in source["cells"] if _nbg(c).get("grade") and HIDDEN in c["source"]]
    solutions = [_src(c) for c in master["cells"] if _nbg(c).get("solution") and c["cell_type"] == "code"]
    stubs = [c.source for c in _student_version(source).cells if _nbg(c).get("solution") and c.cell_type == "code"]
    for cells, passes in ((solutions, True), (stubs, False)):
        own = [(str(i), src) for i, src in enumerate(cells)]
        for src in graded:
            m = _CHECK.search(src)
            cases = [[encode(a) for a in args] for _, args in hidden_cases(m["key"], 99)]
            answer = sandbox.run(setup, own, m["fn"], cases, EXERCISES[m["key"]].forbidden)
            v = judge(m["key"], answer, 99, sandbox.timeout)
            assert v.passed == passes and not v.flags, v
            if not passes:
                assert "still raises NotImplementedError" in v.message


def test_myst_conversion():
    text = """(sec-x)=
## Heading

```{exercise} 1.1 · A title
:label: ex-1-1
:nonumber:

Show {prf:ref}`lem-tilt` as in {doc}`ch2_population`, see {cite}`goel2026training`.
```

````{prf:proposition} Named
:label: prop-a

Body with $x$ and a fence:
```python
x = 1
```
````

```{solution-start} ex-1-1
:class: dropdown
```

```{note}
Careful.
```

```{math}
:label: eq-a
a = b
```
"""
    out = myst.to_markdown(
        text,
        labels={"lem-tilt": "Lemma (Gaussian tilt)"},
        docs={"ch2_population": "The population loss"},
        bib={"goel2026training": "Goel et al. 2026"},
    )
    assert "### Exercise 1.1 · A title" in out
    assert "Show Lemma (Gaussian tilt) as in *The population loss*, see (Goel et al. 2026)." in out
    assert "**Proposition (Named).** Body with $x$ and a fence:\n```python\nx = 1\n```" in out
    assert "> **Note.** Careful." in out and "$$\na = b\n$$" in out
    for gone in ("(sec-x)=", ":label:", ":nonumber:", "solution-start", ":class:", "{"):
        assert gone not in out, gone
    assert myst.read_bib(course.BOOK_DIR / "references.bib")["goel2026training"] == "Goel et al. 2026"
    labels = myst.labels_of([_src(c) for c in _master("ch4_geometry")["cells"]])
    assert labels["prop-procrustes"] == "Proposition (Projection by orthogonal Procrustes)"
    with pytest.raises(ValueError, match="text: expected a string"):
        myst.to_markdown(None)


# ----------------------------------------------------------------------------- the course workflow, chapter 1

CH = "ch1_model"


def _submissions(folder, release):
    """Submissions of chapter 1: honest, untouched, exploits, damaged, broken, and bad files."""
    master = _master(CH)
    solution = {
        _nbg(c)["grade_id"]: "\n".join(line for line in _src(c).splitlines() if "SOLUTION" not in line)
        for c in master["cells"]
        if _nbg(c).get("solution") and c["cell_type"] == "code"
    }
    zero = "def my_attention(A, B, X):\n    return torch.zeros(X.shape[0], A.shape[0], dtype=X.dtype)\n"
    wrong_loss = "def my_empirical_loss(A, B, X, Y):\n    return torch.tensor(0.0, dtype=X.dtype)\n"

    def make(name, edit=None, drop=(), sources=None):
        nb = copy.deepcopy(release)
        for cell in nb["cells"]:
            gid = _nbg(cell).get("grade_id")
            if gid in solution:
                cell["source"] = (sources or {}).get(gid, solution[gid])
            elif gid and gid.endswith("-answer"):
                cell["source"] = "My derivation: differentiate the softmax."
            if edit and gid in edit:
                cell["source"] = edit[gid]
        nb["cells"] = [c for c in nb["cells"] if _nbg(c).get("grade_id") not in drop]
        (folder / f"{name}.ipynb").write_text(json.dumps(nb))

    make("honest")
    (folder / "stub.ipynb").write_text(json.dumps(release))
    make(
        "exploit",  # the one-liner, and rebinding the library, its reference and the comparisons
        sources={
            "ex1-1-solution": zero + "exercises.check = lambda *a, **k: None",
            "ex1-2-solution": wrong_loss
            + "import attnlib.model.layer\nal.empirical_loss = my_empirical_loss\n"
            + "attnlib.model.layer.empirical_loss = my_empirical_loss\ntorch.allclose = lambda *a, **k: True",
        },
    )
    make(
        "alias",
        sources={
            "ex1-1-solution": "my_attention = al.attention_reference",
            "ex1-2-solution": "my_empirical_loss = lambda A, B, X, Y: al.empirical_loss(A, B, X, Y)",
        },
    )
    make("damaged", drop={"ex1-1"}, edit={"ex1-2": "pass"}, sources={"ex1-2-solution": wrong_loss})
    make("broken", drop={"ex1-2-solution"}, sources={"ex1-1-solution": "def my_attention(A, B, X):\n    return (A"})
    bad = folder / "bad"
    bad.mkdir()
    (bad / "empty.ipynb").write_text("")
    (bad / "invalid.ipynb").write_text('{"cells": [ }')
    (bad / "list.ipynb").write_text("[1, 2]")
    (bad / "master.ipynb").write_text((course.BOOK_DIR / f"{CH2}.ipynb").read_text())
    other = copy.deepcopy(release)
    other["metadata"]["attnlib"]["chapter"] = CH2
    (bad / "other.ipynb").write_text(json.dumps(other))
    (bad / "no name.ipynb").write_text(json.dumps(release))
    return bad


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("course") / "course"
    course.init(root)
    released = course.release(root, [CH])[CH]
    subs = tmp_path_factory.mktemp("submissions")
    bad = _submissions(subs, read_notebook(released))
    collected = course.collect(root, CH, [p for p in subs.glob("*.ipynb")] + sorted(bad.glob("*.ipynb")))
    reports = {r.student: r for r in course.grade(root, CH)}
    return root, collected, reports


def test_release_is_nbgraders_layout_and_happens_once(graded):
    root, _, _ = graded
    for path in ("nbgrader_config.py", "gradebook.db", f"source/{CH}/{CH}.ipynb", f"release/{CH}/{CH}.ipynb"):
        assert (root / path).is_file(), path
    assert HIDDEN in (root / "source" / CH / f"{CH}.ipynb").read_text()
    released = (root / "release" / CH / f"{CH}.ipynb").read_text()
    assert "BEGIN HIDDEN" not in released
    # a fingerprint of this release in the handout; the hidden cases' seed in no notebook
    record = json.loads((root / "attnlib-releases.json").read_text())[CH]
    assert json.loads(released)["metadata"]["attnlib"] == {"chapter": CH, "release": record["fingerprint"]}
    for nb in root.glob("*/*/*.ipynb"):
        assert str(record["seed"]) not in nb.read_text()
    assert (root / ".gitignore").read_text().splitlines()[-1] == "*"
    with pytest.raises(ValueError, match="already released"):
        course.release(root, [CH])
    with pytest.raises(ValueError, match="chapters: expected names from"):
        course.release(root, ["ch9_nothing"])
    if CH2 != "ch2_population":  # a split chapter's name points at the page with its exercises
        with pytest.raises(ValueError, match=f"the exercises of ch2_population are in '{CH2}'"):
            course.release(root, ["ch2_population"])


def test_honest_submission_earns_full_marks(graded):
    r = graded[2]["honest"]
    assert r.scores == {"ex1-1": 1.0, "ex1-2": 1.0, "ex1-3-answer": 0.0}, r.lines()
    assert r.manual == ["ex1-3-answer"] and not r.messages and not r.problems and not r.flags


def test_untouched_stubs_earn_nothing_with_the_expected_messages(graded):
    r = graded[2]["stub"]
    assert r.total == 0 and r.max_total == 4
    for gid, fn in [("ex1-1", "my_attention"), ("ex1-2", "my_empirical_loss")]:
        assert re.search(rf"Exercise 1\.\d \(graded\): {fn} still raises NotImplementedError", r.messages[gid])


def test_switching_off_the_grader_or_rebinding_the_library_earns_nothing(graded):
    r = graded[2]["exploit"]
    assert r.scores["ex1-1"] == 0 and r.scores["ex1-2"] == 0, r.lines()
    assert "(graded)" in r.messages["ex1-1"] and "not right on hidden case 1" in r.messages["ex1-1"]
    flagged = " ".join(r.flags)
    for what in ("assigns to exercises.check", "assigns to al.empirical_loss", "assigns to torch.allclose"):
        assert what in flagged, r.flags


def test_aliasing_the_library_earns_nothing(graded):
    r = graded[2]["alias"]
    assert r.scores["ex1-1"] == 0 and r.scores["ex1-2"] == 0, r.lines()
    assert "calls attnlib.model.layer.attention_reference" in r.messages["ex1-1"]
    assert "calls attnlib.model.layer.empirical_loss" in r.messages["ex1-2"]


def test_deleted_and_edited_graded_cells_are_restored_and_reported(graded):
    r = graded[2]["damaged"]
    assert r.scores["ex1-1"] == 1 and r.scores["ex1-2"] == 0, r.lines()  # graded with the restored checks
    assert "the graded cell ex1-1 was deleted; it was put back from the handout" in r.problems
    assert "the graded cell ex1-2 was edited; it is graded with its original source" in r.problems
    assert not r.ok


def test_errors_in_the_students_cells_are_reported_with_their_cause(graded):
    r = graded[2]["broken"]
    assert r.scores["ex1-1"] == 0 and r.scores["ex1-2"] == 0
    assert re.match(
        r"Exercise 1\.1 \(graded\): my_attention is not defined \(cell ex1-1-solution raised SyntaxError: .*line 2",
        r.messages["ex1-1"],
    )
    assert r.messages["ex1-2"] == (
        "Exercise 1.2 (graded): my_empirical_loss is not defined (the solution cell ex1-2-solution is missing)"
    )
    assert "the solution cell ex1-2-solution was deleted; its exercise earns no points" in r.problems
    assert any(p.startswith("cell ex1-1-solution raised SyntaxError") for p in r.problems)


def test_bad_files_are_rejected_with_one_line_each(graded):
    _, collected, reports = graded
    assert sorted(collected.collected) == sorted(reports) == ["alias", "broken", "damaged", "exploit", "honest", "stub"]
    msgs = {k.rsplit("/", 1)[-1]: v for k, v in collected.rejected.items()}
    assert msgs["empty.ipynb"].endswith("the file is empty (expected a Jupyter notebook)")
    assert re.search(r"not a Jupyter notebook \(invalid JSON: .* at line 1, column \d+\)$", msgs["invalid.ipynb"])
    assert msgs["list.ipynb"].endswith("not a Jupyter notebook (the JSON has no list of cells)")
    assert msgs["other.ipynb"].endswith(f"this is the handout of {CH2}, not of ch1_model")
    assert "an instructor's notebook (the book's master" in msgs["master.ipynb"]
    assert "cannot take a student id from the file name" in msgs["no name.ipynb"]
    assert all("\n" not in m for m in msgs.values()) and not collected.ok


def test_reports_and_nbgrader_csv_export(graded, tmp_path):
    root, _, reports = graded
    rows = list(csv_rows(root / "reports" / f"{CH}.csv"))
    assert {r["student"]: float(r["autograded"]) for r in rows} == {s: reports[s].total for s in reports}
    out = course.export(root, tmp_path / "grades.csv")
    exported = {r["student_id"]: r for r in csv_rows(out)}
    assert set(exported) == set(reports)
    assert float(exported["honest"]["raw_score"]) == 2.0 and float(exported["honest"]["max_score"]) == 4.0
    assert float(exported["stub"]["raw_score"]) == 0.0


def csv_rows(path):
    import csv

    with open(path, newline="") as fh:
        yield from csv.DictReader(fh)


def test_command_line(graded, tmp_path, capsys):
    root, _, _ = graded
    assert course.main(["list"]) == 0 and CH in capsys.readouterr().out
    bad = tmp_path / "late.ipynb"
    bad.write_text("{")
    assert course.main(["collect", str(root), CH, str(bad)]) == 1
    out = capsys.readouterr().out
    assert "rejected: " in out and "invalid JSON" in out
    assert course.main(["grade", str(root), CH, "--student", "honest"]) == 0
    assert "honest: 2 / 2 autograded points, 1 written answer(s) to grade by hand" in capsys.readouterr().out
    assert course.main(["grade", str(root), CH, "--student", "nobody"]) == 2
    assert "error: students: no collected submission" in capsys.readouterr().err
    assert course.main(["grade", str(tmp_path), CH]) == 2
    assert "error: course: expected a course folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        course.main(["release"])


def test_course_is_outside_the_core_and_list_imports_little():
    code = (
        "import sys, attnlib; assert 'attnlib.course' not in sys.modules; "
        "from attnlib import course; course.main(['list']); "
        "heavy = [m for m in ('nbgrader', 'nbformat', 'sqlalchemy', 'nbconvert', 'jupyter_client') "
        "if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == CHAPTERS
