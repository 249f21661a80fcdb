"""The exercise graders: reference answers pass, typical mistakes fail with the right message.

Both uses of the one grader are tested: :func:`check` (the feedback in the book and the handouts) and
:func:`judge` on what the guarded worker of :mod:`attnlib.course.hidden` reports (what grades).
"""

import functools

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.course import hidden
from attnlib.course.exercises import EXERCISES, ExerciseError, check, hidden_cases, judge, solved

# Independent reference answers, written here with torch and numpy only (no attnlib function that
# the grader compares against), so that these tests fail if a grader's reference is wrong.


def _sqrtm(S, p=0.5):
    ev, Q = torch.linalg.eigh(S)
    return (Q * ev**p) @ Q.T


def _layer(A, B, X):
    scores = X @ B @ X.T
    W = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
    return (W / W.sum(dim=1, keepdim=True)) @ X @ A.T


def _excess_ref(A, B, S, M):
    E = A @ S @ B.T - M
    return 0.5 * torch.trace(E @ S @ E.T)


def _grad_ref(A, B, S, M):
    E = A @ S @ B.T - M
    return E @ S @ B @ S, S @ E.T @ A @ S


def _factor(A, B, S):
    H = _sqrtm(S)
    return A @ H, H @ B.T @ H


def _balanced(S, M):
    """Balanced factors (At, C) of T = M Sigma^(1/2)."""
    T = M @ _sqrtm(S)
    U, s, Vh = torch.linalg.svd(T, full_matrices=False)
    return (U * s.sqrt()) @ Vh, (Vh.T * s.sqrt()) @ Vh


def _unfactor(At, C, S):
    Hi = _sqrtm(S, -0.5)
    return At @ Hi, Hi @ C.T @ Hi


def _regularizer_ref(A, B, S, lam):
    At, C = _factor(A, B, S)
    D = At.T @ At - C @ C.T
    return lam / 4 * (D * D).sum()


def _p_norm_ref(dA, dB, S):
    a, c = _factor(dA, dB, S)
    return torch.sqrt((a * a).sum() + (c * c).sum())


def _rescale_ref(A, B, S):
    At, C = _factor(A, B, S)
    c = torch.sqrt(torch.linalg.norm(At) / torch.linalg.norm(C))
    return A / c, c * B


def _precond(A, B, S, M, lr):
    gA, gB = _grad_ref(A, B, S, M)
    Si = torch.linalg.inv(S)
    return A - lr * gA @ Si, B - lr * Si @ gB @ Si


ANSWERS = {
    "1.1": _layer,
    "1.2": lambda A, B, X, Y: 0.5 * ((_layer(A, B, X) - Y) ** 2).sum() / X.shape[0],
    "2.1": _excess_ref,
    "2.2": _grad_ref,
    "3.1": _factor,
    "3.2": lambda S, M: _unfactor(*_balanced(S, M), S),
    "4.1": _p_norm_ref,
    "4.2": _regularizer_ref,
    "5.1": _rescale_ref,
    "5.2": _precond,
    "6.1": lambda x, y: float(np.polyfit(np.log(x), np.log(y), 1)[0]),
    "6.2": lambda s, v: float(np.exp(np.polyfit(np.asarray(s, float), np.log(v), 1)[0])),
}


# chapter 7 (one block): Shampoo's direction L^-1/4 G R^-1/4 and Muon's exact orthogonalization U V^T
def _root4(S):
    ev, Q = torch.linalg.eigh(S)
    return Q @ torch.diag(ev**-0.25) @ Q.T


def _polar(G):
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    return U @ Vh


ANSWERS.update({"7.1": lambda G, L, R: _root4(L) @ G @ _root4(R), "7.2": _polar})


def test_every_exercise_has_an_answer_here():
    assert set(ANSWERS) == set(EXERCISES)


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_reference_answers_pass(key, capsys):
    check(key, ANSWERS[key])
    assert f"Exercise {key} passed" in capsys.readouterr().out
    assert solved(key, ANSWERS[key])


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_stub_fails_with_a_message_naming_the_stub(key):
    def stub(*args):
        raise NotImplementedError()

    with pytest.raises(ExerciseError, match=rf"Exercise {key}: .* still raises NotImplementedError"):
        check(key, stub)
    assert not solved(key, stub)


def test_wrong_value_gets_the_hint():
    # forgetting the factor 1/2 of the excess risk
    wrong = lambda A, B, S, M: 2 * _excess_ref(A, B, S, M)
    with pytest.raises(ExerciseError, match=r"largest difference .* Hint: .*a missing 1/2"):
        check("2.1", wrong)


def test_overflowing_softmax_is_caught():
    def naive(A, B, X):
        W = torch.exp(X @ B @ X.T)
        return (W / W.sum(1, keepdim=True)) @ X @ A.T

    with pytest.raises(ExerciseError, match="test case 3 .*large scores.*NaN or infinite.*subtracted from all"):
        check("1.1", naive)


def test_wrong_shape_and_missing_return_and_exceptions():
    with pytest.raises(ExerciseError, match=r"component 0: returned shape \(3, 2\), expected \(2, 3\)"):
        check("3.1", lambda A, B, S: (_factor(A, B, S)[0].T, _factor(A, B, S)[1]))
    with pytest.raises(ExerciseError, match="returned None: did you forget `return`"):
        check("6.1", lambda x, y: None)
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check("6.2", lambda s, v: 1 / 0)
    with pytest.raises(ExerciseError, match="expected a function"):
        check("6.2", 0.9)


def test_in_place_modification_is_reported():
    def inplace(A, B, S):
        A.mul_(2.0)
        return _rescale_ref(A / 2, B, S)

    with pytest.raises(ExerciseError, match="modified its input in place"):
        check("5.1", inplace)


def test_minimiser_check_is_property_based():
    # another point of the orbit, (At G, G^T C) with G orthogonal, is accepted ...
    def rotated(S, M):
        At, C = _balanced(S, M)
        G = torch.linalg.qr(
            torch.randn(At.shape[1], At.shape[1], generator=torch.Generator().manual_seed(1), dtype=At.dtype)
        )[0]
        return _unfactor(At @ G, G.T @ C, S)

    check("3.2", rotated)

    # ... an unbalanced minimizer is not, and neither is a balanced non-minimizer
    def unbalanced(S, M):
        At, C = _balanced(S, M)
        return _unfactor(2 * At, C / 2, S)

    with pytest.raises(ExerciseError, match="not balanced"):
        check("3.2", unbalanced)
    with pytest.raises(ExerciseError, match="not a global minimizer"):
        check("3.2", lambda S, M: _unfactor(*(0.9 * f for f in _balanced(S, M)), S))


def test_unknown_key_is_a_value_error():
    with pytest.raises(ValueError, match="key: expected one of"):
        check("9.9", lambda: None)


def test_no_hints_means_no_hint():
    wrong = lambda A, B, S, M: 2 * _excess_ref(A, B, S, M)
    with pytest.raises(ExerciseError) as err:
        check("2.1", wrong, hints=False)
    assert "largest difference" in str(err.value) and "Hint" not in str(err.value)


def test_hints_do_not_state_the_formulas():
    # the hints say where to look; the formulas of the answers are not in them
    for key, text in [("2.2", "E Sigma B Sigma"), ("3.1", "A Sigma^(1/2)"), ("5.2", "Sigma^(-1)"), ("1.2", "1/(2n)")]:
        assert text not in EXERCISES[key].hint, (key, EXERCISES[key].hint)


# ----------------------------------------------------------------------------- the library policy (visible check)


def test_an_alias_of_the_library_fails_the_check():
    for fn in (al.to_factor, functools.partial(al.to_factor), EXERCISES["3.1"].reference):
        with pytest.raises(ExerciseError, match=r"my_to_factor is the library function attnlib\.geometry\.to_factor"):
            check("3.1", fn)


def test_a_wrapper_of_the_asked_function_fails_an_allowed_call_passes():
    wrapper = lambda A, B, S: al.to_factor(A, B, S)
    with pytest.raises(ExerciseError, match=r"calls attnlib\.geometry\.to_factor, a library function that does"):
        check("3.1", wrapper)
    # 4.1 allows al.to_factor (the statement says so), not al.p_norm
    check("4.1", lambda dA, dB, S: torch.sqrt(sum((t**2).sum() for t in al.to_factor(dA, dB, S))))
    with pytest.raises(ExerciseError, match=r"calls attnlib\.geometry\.p_norm"):
        check("4.1", lambda dA, dB, S: 1.0 * al.p_norm(dA, dB, S))


def test_results_that_are_not_plain_numbers_fail():
    class Evil:
        def __float__(self):
            return 0.0

        def __eq__(self, other):
            return True

    with pytest.raises(ExerciseError, match="an object of its own class"):
        check("6.1", lambda x, y: Evil())
    sub = type("T", (torch.Tensor,), {})
    with pytest.raises(ExerciseError, match="an object of its own class"):
        check("2.1", lambda A, B, S, M: _excess_ref(A, B, S, M).as_subclass(sub))
    # numpy results and Python floats are read
    check("6.1", lambda x, y: np.float64(ANSWERS["6.1"](x, y)))
    check("2.1", lambda A, B, S, M: _excess_ref(A, B, S, M).numpy())


# ----------------------------------------------------------------------------- hidden cases


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_hidden_cases_differ_from_the_visible_ones_and_from_release_to_release(key):
    visible = EXERCISES[key].cases(hidden.VISIBLE_SEED)
    a, b = hidden_cases(key, 11), hidden_cases(key, 12)
    assert [d for d, _ in a] == [d for d, _ in visible]  # the same kinds of case
    for other in (a, b):
        assert hidden.encode([x for _, x in other]) != hidden.encode([x for _, x in visible])
    assert hidden.encode([x for _, x in a]) != hidden.encode([x for _, x in b])
    assert hidden.encode([x for _, x in a]) == hidden.encode([x for _, x in hidden_cases(key, 11)])
    with pytest.raises(ValueError, match="seed"):
        hidden_cases(key, hidden.VISIBLE_SEED)


@pytest.fixture(scope="module")
def sandbox():
    with hidden.Sandbox(timeout=20) as box:
        yield box


SETUP = "import numpy as np\nimport torch\nimport attnlib as al\nfrom attnlib.course import exercises\n"


def _grade(box, key, src, seed=7):
    fn = EXERCISES[key].signature.split("(")[0]
    cases = [[hidden.encode(a) for a in args] for _, args in hidden_cases(key, seed)]
    answer = box.run(SETUP, [("solution", src)], fn, cases, EXERCISES[key].forbidden)
    return judge(key, answer, seed, box.timeout)


def test_hidden_grading_passes_honest_answers_and_fails_the_rest(sandbox):
    honest = (
        "def my_to_factor(A, B, Sigma):\n    w, Q = torch.linalg.eigh(Sigma)\n    R = (Q * w.sqrt()) @ Q.T\n"
        "    return A @ R, R @ B.T @ R\n"
    )
    v = _grade(sandbox, "3.1", honest)
    assert v.passed and not v.flags, v
    v = _grade(sandbox, "3.1", "def my_to_factor(A, B, Sigma):\n    return A @ Sigma, Sigma @ B.T @ Sigma\n")
    assert not v.passed and "not right on hidden case" in v.message and not v.flags
    v = _grade(sandbox, "3.1", "def my_to_factor(A, B, Sigma):\n    raise NotImplementedError()\n")
    assert not v.passed and "still raises NotImplementedError" in v.message
    v = _grade(sandbox, "3.1", "x = 1\n")
    assert not v.passed and "my_to_factor is not defined" in v.message
    # the allowed library call of 4.1 passes, the forbidden one does not
    allowed = "def my_p_norm(dA, dB, S):\n    return torch.sqrt(sum((t**2).sum() for t in al.to_factor(dA, dB, S)))\n"
    assert _grade(sandbox, "4.1", allowed).passed
    v = _grade(sandbox, "4.1", "def my_p_norm(dA, dB, S):\n    return al.p_norm(dA, dB, S)\n")
    assert not v.passed and "calls attnlib.geometry.p_norm" in v.message and v.flags


@pytest.mark.parametrize(
    "src, message",
    [
        ("my_to_factor = al.to_factor", "calls attnlib.geometry.to_factor"),
        (
            "import functools\nmy_to_factor = functools.partial(al.geometry.to_factor)",
            "calls attnlib.geometry.to_factor",
        ),
        ("my_to_factor = exercises.EXERCISES['3.1'].reference", "calls attnlib.geometry.to_factor"),
        (
            "class Lazy:\n    def __init__(s, *a): s.a = a\n"
            "    def __array__(s, *k): return al.to_factor(*s.a)[0].numpy()\n"
            "def my_to_factor(A, B, S):\n    return Lazy(A, B, S), Lazy(A, B, S)\n",
            "an object of its own class",
        ),
        ("import sys\ndef my_to_factor(A, B, S):\n    sys._getframe(1)\n", "frames (sys._getframe)"),
        (
            "def my_to_factor(A, B, S):\n    try:\n        raise ValueError\n    except ValueError as e:\n"
            "        e.__traceback__.tb_frame\n",
            "the interpreter's frames",
        ),
        ("import gc\ndef my_to_factor(A, B, S):\n    gc.get_objects()\n", "tried gc.get_objects"),
        ("src = open(al.geometry.__file__).read()\n", "tried reading"),
        ("import subprocess\ndef my_to_factor(A, B, S):\n    subprocess.run(['true'])\n", "subprocess.Popen"),
        ("import sys\ndef my_to_factor(A, B, S):\n    sys.exit(0)\n", "called exit() or sys.exit()"),
        ("import os\ndef my_to_factor(A, B, S):\n    os._exit(3)\n", "ended the grading process"),
    ],
)
def test_hidden_grading_refuses_and_flags_attacks(sandbox, src, message):
    v = _grade(sandbox, "3.1", src)
    assert not v.passed and message in v.message and v.flags, v


def test_frames_at_the_top_level_are_allowed_and_noted(sandbox):
    """A namedtuple (which reads its caller's frame) in a student's cell works, and is noted for review."""
    honest = (
        "from collections import namedtuple\nPair = namedtuple('Pair', 'At C')\n"
        "def my_to_factor(A, B, Sigma):\n    w, Q = torch.linalg.eigh(Sigma)\n    R = (Q * w.sqrt()) @ Q.T\n"
        "    return tuple(Pair(A @ R, R @ B.T @ R))\n"
    )
    v = _grade(sandbox, "3.1", honest)
    assert v.passed and v.flags == [
        "exercise 3.1: the student's code tried the interpreter's frames (sys._getframe) in cell solution; "
        "allowed at the top level"
    ], v


def test_hidden_grading_times_out_and_names_the_limit():
    with hidden.Sandbox(timeout=2) as box:
        v = _grade(box, "6.1", "def my_loglog_slope(x, y):\n    while True:\n        pass\n")
    assert not v.passed and "timed out after 2 s in my_loglog_slope on hidden case 1" in v.message
    assert "KeyboardInterrupt" not in v.message and v.flags


def test_hidden_minimiser_check_is_property_based(sandbox):
    rotated = (
        "def my_balanced_minimizer(S, M):\n    w, Q = torch.linalg.eigh(S)\n"
        "    R, Ri = (Q * w.sqrt()) @ Q.T, (Q / w.sqrt()) @ Q.T\n"
        "    U, s, Vh = torch.linalg.svd(M @ R, full_matrices=False)\n"
        "    At, C = (U * s.sqrt()) @ Vh, (Vh.T * s.sqrt()) @ Vh\n"
        "    return At @ Ri, Ri @ C.T @ Ri\n"
    )
    assert _grade(sandbox, "3.2", rotated).passed
    v = _grade(
        sandbox,
        "3.2",
        rotated.replace("return At @ Ri", "return 2 * At @ Ri").replace("Ri @ C.T @ Ri", "Ri @ C.T @ Ri / 2"),
    )
    assert not v.passed and "not balanced" in v.message


def test_pasted_visible_values_fail_and_are_flagged(sandbox):
    visible = [float(EXERCISES["6.1"].reference(*args)) for _, args in EXERCISES["6.1"].cases(hidden.VISIBLE_SEED)]
    src = f"VALUES = {visible!r}\ncalls = []\n"
    src += "def my_loglog_slope(x, y):\n    calls.append(1)\n    return VALUES[len(calls) - 1]\n"
    v = _grade(sandbox, "6.1", src)
    assert not v.passed and any("visible case's expected value" in f for f in v.flags), v


def test_the_p_norm_rescaling_of_exercise_4_1():
    """Sigma -> c Sigma is compensated by (c^-1/2 dA, c^-1 dB), not by c^-3/2 on dB; the check tests it."""
    g = torch.Generator().manual_seed(0)
    G = torch.randn(4, 4, generator=g, dtype=torch.float64)
    S = G @ G.T + torch.eye(4, dtype=torch.float64)
    dA, dB = torch.randn(2, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    for c in (0.1, 4.0, 25.0):
        assert torch.allclose(_p_norm_ref(dA / c**0.5, dB / c, c * S), _p_norm_ref(dA, dB, S), rtol=1e-12)
        zero = torch.zeros_like(dA)
        assert torch.allclose(_p_norm_ref(zero, dB / c**1.5, c * S), _p_norm_ref(zero, dB, S) / c**0.5, rtol=1e-12)
    # the check's last case is that rescaling of its first case: the same expected value
    (_, first), (_, last) = EXERCISES["4.1"].cases()[0], EXERCISES["4.1"].cases()[-1]
    assert torch.allclose(_p_norm_ref(*last), _p_norm_ref(*first), rtol=1e-12)
    assert not torch.allclose(last[2], first[2])
    # an answer with Sigma^(1/2) on one side of dB^T only (a C that scales like dA) fails
    one_sided = lambda dA, dB, S: torch.sqrt((dA @ _sqrtm(S)).square().sum() + (dB.T @ _sqrtm(S)).square().sum())
    with pytest.raises(ExerciseError):
        check("4.1", one_sided)


def test_a_failed_import_cell_is_named_as_such():
    """A worker whose handout import cell failed ends early, without an ``end`` report: the verdict says the
    import cell failed (not that the student's code ended the process)."""
    from attnlib.course.exercises import judge

    answer = {"events": [{"setup_error": "ImportError: cannot import name 'x'"}], "exit": 0}
    v = judge("1.1", answer, 0, 10.0)
    assert not v.passed and "the handout's import cell failed when graded (ImportError" in v.message, v
    crashed = judge("1.1", {"events": [{"start": True, "case": 0}], "exit": 0}, 0, 10.0)
    assert "ended the grading process" in crashed.message, crashed
