"""The exercise graders: reference answers pass, typical mistakes fail with the right message."""

import numpy as np
import pytest
import torch

from attnlib.course.exercises import EXERCISES, ExerciseError, check, solved

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
    with pytest.raises(ExerciseError, match=r"largest difference .* Hint: L - L\* = 1/2"):
        check("2.1", wrong)


def test_overflowing_softmax_is_caught():
    def naive(A, B, X):
        W = torch.exp(X @ B @ X.T)
        return (W / W.sum(1, keepdim=True)) @ X @ A.T

    with pytest.raises(ExerciseError, match="test case 3 .*large scores.*NaN or infinite.*maximum score"):
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

    # ... an unbalanced minimiser is not, and neither is a balanced non-minimiser
    def unbalanced(S, M):
        At, C = _balanced(S, M)
        return _unfactor(2 * At, C / 2, S)

    with pytest.raises(ExerciseError, match="not balanced"):
        check("3.2", unbalanced)
    with pytest.raises(ExerciseError, match="not a global minimiser"):
        check("3.2", lambda S, M: _unfactor(*(0.9 * f for f in _balanced(S, M)), S))


def test_unknown_key_is_a_value_error():
    with pytest.raises(ValueError, match="key: expected one of"):
        check("9.9", lambda: None)
