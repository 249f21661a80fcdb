"""Assignments with nbgrader: student versions and autograding of the chapter notebooks."""

import json
import re

import nbformat
import pytest

from attnlib import course

CHAPTERS = course.chapters()
# chapters fast enough to autograde in the suite (chapter 5 takes minutes; its reference
# solutions are graded by the same check cells when nbval re-runs the notebook)
FAST = ["ch1_model"]  # one chapter tests the grading plumbing; nbval runs every chapter's check cells


def _solution_lines(nb):
    """Non-trivial lines of the solution regions of the master notebook."""
    lines = []
    for cell in nb.cells:
        if not cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            continue
        inside = False
        for line in cell.source.splitlines():
            if "BEGIN SOLUTION" in line:
                inside = True
            elif "END SOLUTION" in line:
                inside = False
            elif inside and len(line.strip()) > 12:
                lines.append(line.strip())
    return lines


def test_every_chapter_has_two_to_four_graded_exercises():
    assert len(CHAPTERS) >= 6
    for ch in CHAPTERS:
        nb = nbformat.read(str(course.BOOK_DIR / f"{ch}.ipynb"), 4)
        graded = course.graded_cells(nb)
        assert 2 <= len(graded) <= 4, (ch, graded)
        assert all(p > 0 for p in graded.values())


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    return {ch: course.release(ch, out) / f"{ch}.ipynb" for ch in CHAPTERS}


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_solution_survives_in_the_student_version(chapter, releases):
    master = nbformat.read(str(course.BOOK_DIR / f"{chapter}.ipynb"), 4)
    student = nbformat.read(str(releases[chapter]), 4)
    text = "\n".join(c.source for c in student.cells)
    solution = _solution_lines(master)
    assert solution, "the master has solution regions"
    leaked = [line for line in solution if line in text]
    assert not leaked, leaked
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    assert "{solution-start}" not in text and "{solution-end}" not in text
    assert text.count("raise NotImplementedError()") == len(course.graded_cells(master))
    # graded cells are kept (and locked), outputs are cleared, the chapter's prose is kept
    assert course.graded_cells(student) == course.graded_cells(master)
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    assert sum(c.cell_type == "markdown" for c in student.cells) > 5


@pytest.mark.parametrize("chapter", FAST)
def test_reference_solutions_earn_full_marks(chapter):
    report = course.grade(chapter, course.BOOK_DIR / f"{chapter}.ipynb")
    assert report.max_total > 0
    assert report.total == report.max_total, str(report)
    assert not report.messages


def test_untouched_stubs_earn_nothing_with_the_expected_messages(releases):
    report = course.grade("ch1_model", releases["ch1_model"])
    assert report.total == 0 and report.max_total == 2
    for gid, msg in [("ex1-1", "my_attention"), ("ex1-2", "my_empirical_loss")]:
        assert re.search(
            rf"ExerciseError: Exercise 1\.\d: {msg} still raises NotImplementedError", report.messages[gid]
        ), report.messages


def test_one_solved_exercise_earns_exactly_its_points(releases, tmp_path):
    master = nbformat.read(str(course.BOOK_DIR / "ch2_population.ipynb"), 4)
    student = nbformat.read(str(releases["ch2_population"]), 4)
    solution = {
        c.metadata["nbgrader"]["grade_id"]: c.source
        for c in master.cells
        if c.get("metadata", {}).get("nbgrader", {}).get("solution")
    }
    for cell in student.cells:  # the student solves exercise 2.2 only (2 points)
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "ex2-2-solution":
            cell.source = "\n".join(line for line in solution["ex2-2-solution"].splitlines() if "SOLUTION" not in line)
    sub = tmp_path / "submission.ipynb"
    nbformat.write(student, str(sub))
    report = course.grade("ch2_population", sub)
    assert report.scores == {"ex2-1": 0.0, "ex2-2": 2.0}, str(report)
    assert "my_excess_risk still raises NotImplementedError" in report.messages["ex2-1"]
    assert "ex2-2" not in report.messages


def test_editing_a_graded_cell_earns_nothing(releases, tmp_path):
    student = nbformat.read(str(releases["ch1_model"]), 4)
    for cell in student.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
            cell.source = "pass"
    sub = tmp_path / "cheat.ipynb"
    nbformat.write(student, str(sub))
    assert course.grade("ch1_model", sub).total == 0


def test_cli_release_and_grade(tmp_path, capsys):
    assert course.main(["release", "ch1_model", "--out", str(tmp_path)]) == 0
    released = tmp_path / "ch1_model" / "ch1_model.ipynb"
    assert released.is_file()
    assert course.main(["grade", "ch1_model", str(released), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "ch1_model: 0 / 2 points" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["total"] == 0 and data["exercises"]["ex1-1"]["max_score"] == 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="chapter: expected one of"):
        course.release("ch9_nothing", "/tmp")
    with pytest.raises(ValueError, match="chapter: 'intro' has no graded exercises|chapter: expected one of"):
        course.release("intro", "/tmp")
    with pytest.raises(ValueError, match="submission: expected a notebook file"):
        course.grade("ch1_model", "/nonexistent.ipynb")
