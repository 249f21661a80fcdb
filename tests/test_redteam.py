"""Red team: adversarial submissions of chapter 1 through collect and grade, next to honest and wrong ones.

Every adversarial submission attacks exercise 1.1 and answers exercise 1.2 honestly: the attack
must earn 0 for 1.1 and be flagged for review, and must not cost 1.2 its point (one graded cell's
failure costs that cell). Files that cannot be a student's handout of this release are rejected by
collect with one line naming the file and the cause. The honest submission earns full marks,
exactly, with no flag; the wrong one earns 0 for 1.1 with no flag.
"""

import copy
import json
import os

import pytest

from attnlib import course
from attnlib.course.handout import read_notebook

CH = "ch1_model"
#: another chapter (the notebook with chapter 2's exercises)
CH2 = next(c for c in course.chapters() if c.startswith("ch2_"))
TIMEOUT = 5  # seconds per graded cell in this course (a stuck cell costs this, once)


def _nbg(cell):
    return cell.get("metadata", {}).get("nbgrader", {})


def _solutions():
    master = read_notebook(course.BOOK_DIR / f"{CH}.ipynb")
    return {
        _nbg(c)["grade_id"]: "\n".join(line for line in "".join(c["source"]).splitlines() if "SOLUTION" not in line)
        for c in master["cells"]
        if _nbg(c).get("solution") and c["cell_type"] == "code"
    }


ZERO = "def my_attention(A, B, X):\n    return torch.zeros(X.shape[0], A.shape[0], dtype=X.dtype)\n"
VISIBLE = None  # filled in by the fixture: the visible cases' expected values of 1.1

#: Run the library's source (read by an attack) as the student's own code: relative imports made absolute.
SRC_EXEC = (
    "src = src.replace('from ..', 'from attnlib.').replace('from .', 'from attnlib.model.')\n"
    "exec(src.replace('def attention_reference', 'def my_attention'))\n"
)

#: Attacks on exercise 1.1, by category of the issue: the source of the student's ex1-1 solution cell.
ATTACKS = {
    # namespace shadowing of the grader's helpers and of builtins, with a wrong answer
    "shadow_names": "float = lambda x: 0.0\nisinstance = lambda *a: True\nabs = lambda x: 0.0\n"
    "max = lambda *a, **k: 0.0\ndef grade(*a, **k):\n    return None\ndef _compare(*a, **k):\n    return None\n"
    "ExerciseError = Exception\n" + ZERO,
    "shadow_builtins": "import builtins\nbuiltins.abs = lambda x: 0.0\nbuiltins.max = lambda *a, **k: 0.0\n"
    "builtins.float = lambda x: 0.0\n" + ZERO,
    "rebind_library": "exercises.check = lambda *a, **k: None\nal.attention_reference = lambda A, B, X: "
    "torch.zeros(X.shape[0], A.shape[0], dtype=X.dtype)\ntorch.allclose = lambda *a, **k: True\n" + ZERO,
    # reaching the grader's objects / expected values from inside the function
    "frames": "import sys\ndef my_attention(A, B, X):\n    f = sys._getframe(1)\n    while f is not None:\n"
    "        for v in f.f_locals.values():\n            if isinstance(v, dict) and 'expected' in v:\n"
    "                return v['expected']\n        f = f.f_back\n    return A\n",
    "traceback_frames": "def my_attention(A, B, X):\n    try:\n        raise ValueError\n    except ValueError as e:\n"
    "        f = e.__traceback__.tb_frame.f_back\n    return f.f_locals.get('expected', A)\n",
    "gc_scan": "import gc\ndef my_attention(A, B, X):\n    for o in gc.get_objects():\n"
    "        if isinstance(o, dict) and 'expected' in o:\n            return o['expected']\n    return A\n",
    "inspect_stack": "import inspect\ndef my_attention(A, B, X):\n    return inspect.stack()[1].frame.f_locals['x']\n",
    "read_source": "import sys\nsrc = open(sys.modules['attnlib.model.layer'].__file__).read()\n"
    "exec(src.replace('def attention_reference', 'def my_attention'))\n",
    "read_course": "import json\nSRC = json.load(open({source!r}))\n" + ZERO,
    # ... by making the audit hook's own checks lie (builtins, posixpath's helpers) or with a path object
    "read_source_any": "import builtins, sys\n_any, calls = builtins.any, [0]\ndef fake(it):\n    calls[0] += 1\n"
    "    return _any(it) if calls[0] % 3 == 1 else calls[0] % 3 == 0\nbuiltins.any = fake\n"
    "src = open(sys.modules['attnlib.model.layer'].__file__).read()\nbuiltins.any = _any\n" + SRC_EXEC,
    "read_source_realpath": "import posixpath, sys\n_j = posixpath._joinrealpath\n"
    "posixpath._joinrealpath = lambda *a, **k: (sys.prefix, True)\n"
    "src = open(sys.modules['attnlib.model.layer'].__file__).read()\nposixpath._joinrealpath = _j\n" + SRC_EXEC,
    "read_source_fileio": "import io, pathlib, sys\n"
    "src = io.FileIO(pathlib.Path(sys.modules['attnlib.model.layer'].__file__)).read().decode()\n" + SRC_EXEC,
    "subprocess": "import subprocess, sys\ndef my_attention(A, B, X):\n    subprocess.run([sys.executable, '-c', "
    "'print(1)'])\n    return A\n",
    "kill_grader": "import os\nos.kill(os.getppid(), 9)\n" + ZERO,
    # results that run the student's methods after the check, or are not plain numbers
    "evil_float": "class Evil:\n    def __float__(self):\n        return 0.0\n"
    "    def __eq__(self, o):\n        return True\n"
    "    def __array__(self, *a, **k):\n        import numpy\n        return numpy.zeros(1)\n    def tolist(self):\n"
    "        return [[0.0]]\n    shape = (6, 2)\n    def detach(self):\n        return self\n"
    "def my_attention(A, B, X):\n    return Evil()\n",
    "evil_subclass": "class T(torch.Tensor):\n    def tolist(self):\n        return [[0.0]]\n"
    "def my_attention(A, B, X):\n    return torch.zeros(X.shape[0], A.shape[0], dtype=X.dtype).as_subclass(T)\n",
    "lazy_library": "class Lazy:\n    def __init__(self, *a):\n        self.a = a\n    def __float__(self):\n"
    "        return float(al.attention_reference(*self.a).sum())\n"
    "def my_attention(A, B, X):\n    return Lazy(A, B, X)\n",
    # the library's own answer, by every route
    "alias": "my_attention = al.attention_reference\n",
    "partial": "import functools\nmy_attention = functools.partial(al.attention)\n",
    "wrapper": "def my_attention(A, B, X):\n    return getattr(al, 'attention' + '_reference')(A, B, X)\n",
    "reference": "my_attention = exercises.EXERCISES['1.1'].reference\n",
    "callable_object": "class K:\n    def __call__(self, A, B, X):\n        return al.attention(A, B, X)\n"
    "my_attention = K()\n",
    "code_copy": "import types\nf = al.attention_reference\nmy_attention = types.FunctionType(f.__code__, "
    "f.__globals__, 'mine', f.__defaults__)\n",
    "thread": "import threading\ndef my_attention(A, B, X):\n    out = {}\n"
    "    t = threading.Thread(target=lambda: out.update(r=al.attention_reference(A, B, X)))\n"
    "    t.start()\n    t.join()\n    return out.get('r')\n",
    "profiler_off": "import sys\ndef my_attention(A, B, X):\n    p = sys.getprofile()\n    sys.setprofile(None)\n"
    "    r = al.attention_reference(A, B, X)\n    sys.setprofile(p)\n    return r\n",
    "pasted_visible": None,  # filled in by the fixture
    # the grading process itself
    "os_exit": "import os\ndef my_attention(A, B, X):\n    os._exit(0)\n",
    "os_exit_top": "import os\nos._exit(1)\n",
    "stuck": "def my_attention(A, B, X):\n    while True:\n        pass\n",
    "stuck_top": "while True:\n    pass\n",
    "system_exit": "import sys\ndef my_attention(A, B, X):\n    sys.exit(0)\n",
}

HTML = (
    'My derivation. <img src="x" onerror="document.title=\'pwned\'"> <script>alert(1)</script> '
    "[click](javascript:alert(2)) <a href='http://example.com'>x</a>"
)


@pytest.fixture(scope="module")
def redteam(tmp_path_factory):
    from attnlib.course.exercises import EXERCISES
    from attnlib.course.hidden import VISIBLE_SEED

    root = tmp_path_factory.mktemp("redteam") / "course"
    course.init(root, timeout=TIMEOUT)
    released = course.release(root, [CH])[CH]
    handout = read_notebook(released)
    sol = _solutions()
    visible = [EXERCISES["1.1"].reference(*args).tolist() for _, args in EXERCISES["1.1"].cases(VISIBLE_SEED)]
    attacks = dict(ATTACKS)
    attacks["read_course"] = ATTACKS["read_course"].replace(
        "{source!r}", repr(str(root / "source" / CH / f"{CH}.ipynb"))
    )
    attacks["pasted_visible"] = (
        f"VALUES = {visible!r}\ncalls = []\ndef my_attention(A, B, X):\n    calls.append(1)\n"
        "    return torch.tensor(VALUES[(len(calls) - 1) % len(VALUES)], dtype=torch.float64)\n"
    )
    subs = tmp_path_factory.mktemp("submitted")

    def make(name, ex11=None, answer="My derivation: differentiate the softmax.", edit=None, folder=subs):
        nb = copy.deepcopy(handout)
        for cell in nb["cells"]:
            gid = _nbg(cell).get("grade_id")
            if gid in sol:
                cell["source"] = sol[gid]
            if gid == "ex1-1-solution" and ex11 is not None:
                cell["source"] = ex11
            if gid == "ex1-3-answer":
                cell["source"] = answer
        if edit:
            edit(nb)
        path = folder / f"{name}.ipynb"
        path.write_text(json.dumps(nb))
        return path

    make("honest")
    make("wrong", ZERO)
    for name, src in attacks.items():
        make(name, src)
    make("html_answer", answer=HTML)

    def raw_cell(nb):
        nb["cells"].append({"cell_type": "raw", "id": "rawhtml", "metadata": {"format": "text/html"}, "source": HTML})

    make("raw_html", edit=raw_cell)
    # files that collect must reject
    bad = tmp_path_factory.mktemp("bad")
    os.symlink(root / "source" / CH / f"{CH}.ipynb", bad / "symlink.ipynb")
    (bad / "master.ipynb").write_text((course.BOOK_DIR / f"{CH}.ipynb").read_text())

    def duplicate(nb):
        cell = next(c for c in nb["cells"] if _nbg(c).get("grade_id") == "ex1-1")
        nb["cells"].append(copy.deepcopy(cell) | {"id": "dup"})

    make("duplicated", edit=duplicate, folder=bad)
    make("other_chapter", edit=lambda nb: nb["metadata"]["attnlib"].update(chapter=CH2), folder=bad)
    make("other_release", edit=lambda nb: nb["metadata"]["attnlib"].update(release="0" * 16), folder=bad)
    make("no_fingerprint", edit=lambda nb: nb["metadata"].pop("attnlib"), folder=bad)
    make("bad_schema", edit=lambda nb: nb["cells"][1].update(execution_count="one"), folder=bad)
    make(".hidden", folder=bad)
    make("-rf", folder=bad)
    (bad / "up").mkdir()
    make(CH, folder=bad / "up")
    paths = sorted(subs.glob("*.ipynb")) + sorted(bad.glob("*.ipynb")) + [bad / "up" / ".." / f"{CH}.ipynb"]
    (bad / f"{CH}.ipynb").write_text(released.read_text())  # the path above, seen from bad/
    collected = course.collect(root, CH, paths)
    reports = {r.student: r for r in course.grade(root, CH)}
    return root, collected, reports, attacks


def test_honest_submission_earns_full_marks_exactly(redteam):
    r = redteam[2]["honest"]
    assert r.scores == {"ex1-1": 1.0, "ex1-2": 1.0, "ex1-3-answer": 0.0} and r.manual == ["ex1-3-answer"]
    assert r.status == "graded" and not r.flags and not r.messages and not r.problems, r.lines()


def test_wrong_submission_earns_nothing_for_the_wrong_exercise_and_is_not_flagged(redteam):
    r = redteam[2]["wrong"]
    assert r.scores["ex1-1"] == 0.0 and r.scores["ex1-2"] == 1.0 and not r.flags, r.lines()
    assert "not right on hidden case 1" in r.messages["ex1-1"]


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_attack_earns_nothing_for_its_exercise_and_is_flagged(redteam, name):
    r = redteam[2][name]
    assert r.status == "graded", r.lines()
    assert r.scores["ex1-1"] == 0.0 and r.scores["ex1-2"] == 1.0, r.lines()
    assert r.flags, r.lines()


def test_messages_say_what_happened(redteam):
    reports = redteam[2]
    assert f"timed out after {TIMEOUT} s in my_attention on hidden case 1" in reports["stuck"].messages["ex1-1"]
    assert f"timed out after {TIMEOUT} s in cell ex1-1-solution" in reports["stuck_top"].messages["ex1-1"]
    assert "called exit() or sys.exit()" in reports["system_exit"].messages["ex1-1"]
    assert "ended the grading process" in reports["os_exit"].messages["ex1-1"]
    assert "calls attnlib.model.layer.attention_reference" in reports["alias"].messages["ex1-1"]
    for r in reports.values():
        assert all("KeyboardInterrupt" not in m for m in r.messages.values())
    assert any("visible case's expected value" in f for f in reports["pasted_visible"].flags)


def test_student_html_is_shown_as_text_and_flagged(redteam):
    root, _, reports, _ = redteam
    for name in ("html_answer", "raw_html"):
        r = reports[name]
        assert r.scores == {"ex1-1": 1.0, "ex1-2": 1.0, "ex1-3-answer": 0.0}, r.lines()
        assert any("shown as text" in f for f in r.flags), r.flags
        graded = read_notebook(root / "autograded" / name / CH / f"{CH}.ipynb")
        for cell in graded["cells"]:
            if cell["cell_type"] == "markdown" and "onerror" in "".join(cell["source"]):
                assert "".join(cell["source"]).count("```") >= 2  # inside a code block
        assert not any(c["cell_type"] == "raw" for c in graded["cells"])


def test_collect_rejects_what_is_not_a_handout_of_this_release(redteam):
    _, collected, reports, _ = redteam
    msgs = {os.path.relpath(k, os.path.dirname(os.path.dirname(k))): v for k, v in collected.rejected.items()}
    by_name = {k.rsplit("/", 1)[-1]: v for k, v in collected.rejected.items()}
    assert "is a symbolic link" in by_name["symlink.ipynb"]
    assert "an instructor's notebook (the book's master" in by_name["master.ipynb"]
    assert "the grade_id 'ex1-1' is on two cells" in by_name["duplicated.ipynb"]
    assert by_name["other_chapter.ipynb"].endswith(f"this is the handout of {CH2}, not of ch1_model")
    assert "has the fingerprint of another release" in by_name["other_release.ipynb"]
    assert "has no release fingerprint" in by_name["no_fingerprint.ipynb"]
    assert "not a valid notebook (nbformat: " in by_name["bad_schema.ipynb"]
    for name in (".hidden.ipynb", "-rf.ipynb"):
        assert "cannot take a student id from the file name" in by_name[name]
    assert any(
        k.endswith(f"up/../{CH}.ipynb") and "cannot take a student id" in v for k, v in collected.rejected.items()
    )
    assert all("\n" not in m for m in msgs.values())
    for v, k in ((v, k) for k, v in collected.rejected.items()):
        assert v.startswith(k)  # names the file
    # nothing rejected was graded, nothing was written outside submitted/
    assert not {"symlink", "master", "duplicated", "bad_schema", "..", ".hidden", "-rf", "up"} & set(reports)
    assert sorted(p.name for p in (redteam[0] / "submitted").iterdir()) == sorted(reports)


def test_export_has_a_status_column(redteam, tmp_path):
    import csv

    root, _, reports, _ = redteam
    with open(course.export(root, tmp_path / "grades.csv"), newline="") as fh:
        rows = {r["student_id"]: r for r in csv.DictReader(fh)}
    assert {s: r["status"] for s, r in rows.items()} == {s: "graded" for s in reports}
    assert float(rows["honest"]["raw_score"]) == 2.0
