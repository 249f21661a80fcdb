"""The exercise graders: reference answers pass, typical mistakes fail with the right message."""
import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.exercises import EXERCISES, ExerciseError, check, solved

# library-based answers to every exercise (the book's worked solutions are checked by nbval)
ANSWERS = {
    "1.1": lambda X, A, B: al.attention(X, A, B),
    "1.2": lambda A, B, X, Y: al.empirical_loss(A, B, X, Y),
    "2.1": lambda S, M, A, B: al.Task(S, M).excess_risk(A, B),
    "2.2": lambda S, M, A, B: al.Task(S, M).population_grad(A, B),
    "3.1": lambda A, B, S: al.to_factor(A, B, S),
    "3.2": lambda S, M: al.from_factor(*_balanced(S, M), S),
    "4.1": lambda dA, dB, S: al.p_norm(dA, dB, S),
    "4.2": lambda A, B, S, lam: al.regularizer(A, B, S, lam),
    "5.1": lambda A, B, S: al.renormalize(A, B, S, mode="scale"),
    "5.2": lambda S, M, A, B, lr: _precond(S, M, A, B, lr),
    "6.1": lambda x, y: al.fit_power_law(x, y).slope,
    "6.2": lambda s, v: al.fit_geometric_rate(s, v),
}


def _balanced(S, M):
    T = M @ al.sym_sqrt(S)
    U, s, Vh = torch.linalg.svd(T, full_matrices=False)
    return (U * s.sqrt()) @ Vh, (Vh.T * s.sqrt()) @ Vh


def _precond(S, M, A, B, lr):
    gA, gB = al.Task(S, M).population_grad(A, B)
    Si = torch.linalg.inv(S)
    return A - lr * gA @ Si, B - lr * Si @ gB @ Si


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
    wrong = lambda S, M, A, B: 2 * al.Task(S, M).excess_risk(A, B)
    with pytest.raises(ExerciseError, match=r"largest difference .* Hint: L - L\* = 1/2"):
        check("2.1", wrong)


def test_overflowing_softmax_is_caught():
    def naive(X, A, B):
        W = torch.exp(X @ B @ X.T)
        return (W / W.sum(1, keepdim=True)) @ X @ A.T
    with pytest.raises(ExerciseError, match="test case 3 .*large scores.*NaN or infinite.*maximum score"):
        check("1.1", naive)


def test_wrong_shape_and_missing_return_and_exceptions():
    with pytest.raises(ExerciseError, match=r"component 0: returned shape \(3, 2\), expected \(2, 3\)"):
        check("3.1", lambda A, B, S: (al.to_factor(A, B, S)[0].T, al.to_factor(A, B, S)[1]))
    with pytest.raises(ExerciseError, match="returned None: did you forget `return`"):
        check("6.1", lambda x, y: None)
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check("6.2", lambda s, v: 1 / 0)
    with pytest.raises(ExerciseError, match="expected a function"):
        check("6.2", 0.9)


def test_in_place_modification_is_reported():
    def inplace(A, B, S):
        A.mul_(2.0)
        return al.renormalize(A / 2, B, S, mode="scale")
    with pytest.raises(ExerciseError, match="modified its input in place"):
        check("5.1", inplace)


def test_minimiser_check_is_property_based():
    # another point of the orbit, (At G, G^T C) with G orthogonal, is accepted ...
    def rotated(S, M):
        At, C = _balanced(S, M)
        G = torch.linalg.qr(torch.randn(At.shape[1], At.shape[1], generator=torch.Generator().manual_seed(1),
                                        dtype=At.dtype))[0]
        return al.from_factor(At @ G, G.T @ C, S)
    check("3.2", rotated)
    # ... an unbalanced minimiser is not, and neither is a balanced non-minimiser
    def unbalanced(S, M):
        At, C = _balanced(S, M)
        return al.from_factor(2 * At, C / 2, S)
    with pytest.raises(ExerciseError, match="not balanced"):
        check("3.2", unbalanced)
    with pytest.raises(ExerciseError, match="not a global minimiser"):
        check("3.2", lambda S, M: al.from_factor(*(0.9 * f for f in _balanced(S, M)), S))


def test_unknown_key_is_a_value_error():
    with pytest.raises(ValueError, match="key: expected one of"):
        check("9.9", lambda: None)
