"""The exercise graders: reference answers pass, typical mistakes fail with the right message.

Both graders are tested: :func:`check` (the feedback in the book and the handouts) and the hidden
tests (:mod:`attnlib.course.hidden` with the literal specs of :func:`hidden_spec`, what grades).
"""

import ast
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.course import hidden
from attnlib.course.exercises import EXERCISES, ExerciseError, check, hidden_spec, solved

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


# ----------------------------------------------------------------------------- the library policy


def test_an_alias_of_the_library_fails_both_graders():
    for fn in (al.to_factor, functools.partial(al.to_factor), EXERCISES["3.1"].reference):
        with pytest.raises(ExerciseError, match=r"my_to_factor is the library function attnlib\.geometry\.to_factor"):
            check("3.1", fn)
        with pytest.raises(ExerciseError, match="is the library function attnlib.geometry.to_factor"):
            hidden.grade(fn, hidden_spec("3.1"))
    # the reference of 1.2 is a lambda of the course package: also the library's
    with pytest.raises(ExerciseError, match=r"is the library function attnlib\.course\.exercises\.<lambda>"):
        hidden.grade(EXERCISES["1.2"].reference, hidden_spec("1.2"))


def test_a_wrapper_of_the_asked_function_fails_an_allowed_call_passes():
    wrapper = lambda A, B, S: al.to_factor(A, B, S)
    with pytest.raises(ExerciseError, match=r"calls attnlib\.geometry\.to_factor, a library function that does"):
        check("3.1", wrapper)
    with pytest.raises(ExerciseError, match=r"calls attnlib\.geometry\.to_factor"):
        hidden.grade(wrapper, hidden_spec("3.1"))
    # 4.1 allows al.to_factor (the statement says so), not al.p_norm
    allowed = lambda dA, dB, S: torch.sqrt(sum((t**2).sum() for t in al.to_factor(dA, dB, S)))
    check("4.1", allowed)
    hidden.grade(allowed, hidden_spec("4.1"))
    with pytest.raises(ExerciseError, match=r"calls attnlib\.geometry\.p_norm"):
        hidden.grade(lambda dA, dB, S: 1.0 * al.p_norm(dA, dB, S), hidden_spec("4.1"))
    # a method of a library class: Task.population_grad answers 2.2 outright
    with pytest.raises(ExerciseError, match=r"calls attnlib\.task\.Task\.population_grad"):
        hidden.grade(lambda A, B, S, M: al.Task(S, M).population_grad(A, B), hidden_spec("2.2"))


def test_switching_off_the_profiler_fails():
    import sys

    def sneaky(A, B, S):
        sys.setprofile(None)
        return _factor(A, B, S)

    with pytest.raises(ExerciseError, match="changed the interpreter's profiler"):
        hidden.grade(sneaky, hidden_spec("3.1"))


# ----------------------------------------------------------------------------- the hidden tests


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_hidden_tests_pass_the_answers_and_fail_the_stub(key):
    spec = hidden_spec(key)
    assert ast.literal_eval(repr(spec)) == spec  # a plain literal: floats, strings, lists, dicts
    hidden.grade(ANSWERS[key], spec)

    def stub(*args):
        raise NotImplementedError()

    with pytest.raises(ExerciseError, match=rf"Exercise {key} \(graded test\): .* still raises NotImplementedError"):
        hidden.grade(stub, spec)


def test_hidden_tests_do_not_depend_on_what_a_notebook_can_rebind(monkeypatch):
    spec = hidden_spec("3.1")  # fixed at release
    wrong = lambda A, B, S: (A @ S, S @ B.T @ S)  # Sigma in place of its square root
    # a student's cell rebinds the grader, the reference, the library and the comparisons
    import attnlib.course.exercises as exercises_module
    import attnlib.geometry

    monkeypatch.setattr(exercises_module, "check", lambda *a, **k: None)
    monkeypatch.setattr(attnlib.geometry, "to_factor", wrong)
    monkeypatch.setattr(al, "to_factor", wrong)
    monkeypatch.setattr(torch, "allclose", lambda *a, **k: True)
    monkeypatch.setattr(np, "allclose", lambda *a, **k: True)
    monkeypatch.setattr(np.testing, "assert_allclose", lambda *a, **k: None)
    exercises_module.check("3.1", wrong)  # the visible check is switched off ...
    # ... the hidden test is not (case 1 has Sigma = I, where Sigma and its root agree)
    with pytest.raises(ExerciseError, match="not right on case 2"):
        hidden.grade(wrong, spec)


def test_hidden_checks_shape_nan_return_and_inputs():
    spec = hidden_spec("3.1")
    with pytest.raises(ExerciseError, match=r"component 0: returned shape \(3, 2\), expected \(2, 3\)"):
        hidden.grade(lambda A, B, S: (_factor(A, B, S)[0].T, _factor(A, B, S)[1]), spec)
    with pytest.raises(ExerciseError, match="returned None"):
        hidden.grade(lambda A, B, S: None, spec)
    with pytest.raises(ExerciseError, match="NaN or infinite"):
        hidden.grade(lambda A, B, S: tuple(t * float("nan") for t in _factor(A, B, S)), spec)

    def inplace(A, B, S):
        out = _factor(A, B, S)
        A.zero_()
        return out

    with pytest.raises(ExerciseError, match="modified its input in place"):
        hidden.grade(inplace, spec)
    with pytest.raises(ExerciseError, match="expected a function"):
        hidden.grade(0.5, spec)
    # numpy results and Python floats are read too
    hidden.grade(lambda x, y: np.float64(ANSWERS["6.1"](x, y)), hidden_spec("6.1"))
    hidden.grade(lambda A, B, S, M: _excess_ref(A, B, S, M).numpy(), hidden_spec("2.1"))


def test_hidden_minimiser_check_is_property_based():
    spec = hidden_spec("3.2")
    hidden.grade(ANSWERS["3.2"], spec)

    def unbalanced(S, M):
        At, C = _balanced(S, M)
        return _unfactor(2 * At, C / 2, S)

    with pytest.raises(ExerciseError, match="not balanced"):
        hidden.grade(unbalanced, spec)
    with pytest.raises(ExerciseError, match="not a global minimizer"):
        hidden.grade(lambda S, M: _unfactor(*(0.9 * f for f in _balanced(S, M)), S), spec)


def test_hidden_grader_is_self_contained():
    """Its source is pasted into the hidden tests: standard library only, no nbgrader delimiters."""
    src = Path(hidden.__file__).read_text()
    tree = ast.parse(src)
    top = {a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names}
    top |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert top <= {"math", "sys"}, top
    for word in ("BEGIN HIDDEN", "END HIDDEN", "BEGIN SOLUTION", "END SOLUTION", "BEGIN MARK", "END MARK"):
        assert word not in src


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
