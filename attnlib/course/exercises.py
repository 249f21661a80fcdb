r"""Graders for the book's exercises.

Every chapter ends with exercises in which the reader writes functions (and
derivations, graded by hand). :func:`check` compares a function with the
library's own implementation (or, where many answers are right, checks the
defining properties) on a few fixed float64 test cases and raises
:class:`~attnlib.course.hidden.ExerciseError` with a message that says what went wrong, with a hint
unless ``hints=False``. The book calls ``check`` after each worked solution;
a student's notebook calls it in the graded cells for feedback.

The *grade* does not come from ``check``: at release, :func:`hidden_spec`
fixes the same test cases and their expected values as literals that
:mod:`attnlib.course` writes into nbgrader's hidden tests, graded by the
self-contained :func:`attnlib.course.hidden.grade`. Both apply the library
policy: an answer that is a library function, or calls the one the exercise
asks for (``Exercise.forbidden``), fails.

>>> import attnlib as al
>>> from attnlib.course import exercises
>>> exercises.check("6.2", lambda s, v: al.fit_geometric_rate(s, v))  # doctest: +ELLIPSIS
Exercise 6.2 passed ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from ..attention import attention_reference, empirical_loss
from ..fits import fit_geometric_rate, fit_power_law
from ..geometry import p_norm, regularizer, renormalize, to_factor
from ..linalg import sym_sqrt
from ..task import Task
from . import hidden
from .hidden import ExerciseError

__all__ = ["ExerciseError", "Exercise", "EXERCISES", "check", "solved", "hidden_spec"]

DTYPE = torch.float64


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function the reader writes and how it is graded.

    ``cases()`` returns a list of ``(description, args)``; ``reference(*args)``
    gives the expected value, or ``verify(result, *args)`` (if set) returns
    ``None`` for a correct result and an explanation otherwise (``kind`` is
    then ``"minimizer"``, the only property check the hidden tests know).
    ``forbidden`` names the library functions (``"attnlib.module.qualname"``,
    or ``"attnlib.module.*"``) that solve the exercise outright: an answer
    that calls one of them fails. ``hint`` says where to look, not the formula.
    """

    key: str
    signature: str
    cases: Callable[[], List[Tuple[str, tuple]]]
    hint: str
    reference: Callable[..., Any] = None
    verify: Callable[..., Any] = None
    rtol: float = 1e-8
    atol: float = 1e-10
    forbidden: Tuple[str, ...] = ()
    kind: str = "value"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g, scale=1.0):
    return scale * torch.randn(*shape, generator=g, dtype=DTYPE)


def _spd(d, g, cond=10.0):
    Q, _ = torch.linalg.qr(_randn(d, d, g=g))
    ev = torch.tensor(np.geomspace(1.0, cond, d), dtype=DTYPE)
    return (Q * ev) @ Q.T


def _params(k, d, g, scale=0.5):
    return _randn(k, d, g=g, scale=scale), _randn(d, d, g=g, scale=scale)


# ----------------------------------------------------------------------------- cases per chapter


def _cases_layer():
    out = []
    for i, (n, d, k, scale) in enumerate(((6, 3, 2, 0.5), (11, 4, 1, 1.0), (8, 3, 3, 1000.0))):
        g = _gen(100 + i)
        X = _randn(n, d, g=g)
        A, B = _params(k, d, g)
        desc = f"n = {n}, d = {d}, k = {k}" + (", large scores (|x_i^T B x_j| up to ~1e3)" if scale > 10 else "")
        out.append((desc, (A, B * scale, X)))
    return out


def _cases_loss():
    out = []
    for i, (n, d, k) in enumerate(((7, 3, 2), (12, 4, 3))):
        g = _gen(200 + i)
        X = _randn(n, d, g=g)
        A, B = _params(k, d, g)
        Y = _randn(n, k, g=g)
        out.append((f"n = {n}, d = {d}, k = {k}", (A, B, X, Y)))
    return out


def _cases_population(with_lr=False):
    out = []
    for i, (d, k, cond) in enumerate(((3, 2, 1.0), (4, 3, 30.0), (5, 1, 5.0))):
        g = _gen(300 + i)
        S = _spd(d, g, cond)
        M = _randn(k, d, g=g)
        A, B = _params(k, d, g)
        args = (A, B, S, M) + ((0.1,) if with_lr else ())
        out.append((f"d = {d}, k = {k}, cond(Sigma) = {cond:g}", args))
    return out


def _cases_factor():
    out = []
    for i, (d, k, cond) in enumerate(((3, 2, 1.0), (4, 3, 50.0))):
        g = _gen(400 + i)
        A, B = _params(k, d, g)
        out.append((f"d = {d}, k = {k}, cond(Sigma) = {cond:g}", (A, B, _spd(d, g, cond))))
    return out


def _cases_minimizer():
    out = []
    for i, (d, k, cond) in enumerate(((3, 2, 1.0), (4, 2, 20.0), (4, 4, 100.0))):
        g = _gen(500 + i)
        out.append((f"d = {d}, k = {k}, cond(Sigma) = {cond:g}", (_spd(d, g, cond), _randn(k, d, g=g))))
    return out


def _cases_p_norm():
    """The factor cases, plus case 1 with Sigma -> c Sigma and the P-norm-preserving rescaled direction.

    Under Sigma -> c Sigma, dA Sigma^(1/2) gains c^(1/2) and Sigma^(1/2) dB^T Sigma^(1/2) gains c, so
    (c^(-1/2) dA, c^(-1) dB) has the same P-norm: the last case's expected value equals case 1's.
    """
    out = _cases_factor()
    c = 4.0
    dA, dB, S = out[0][1]
    out.append((f"case 1 with Sigma -> {c:g} Sigma and (dA, dB) -> (c^-1/2 dA, c^-1 dB)", (dA / c**0.5, dB / c, c * S)))
    return out


def _cases_regularizer():
    return [(desc, args + (lam,)) for (desc, args), lam in zip(_cases_factor(), (1.0, 0.3))]


def _cases_power_law():
    out = []
    for i, (slope, noise) in enumerate(((-1.0, 0.0), (-0.5, 0.1), (-2.0, 0.3))):
        g = np.random.default_rng(600 + i)
        x = np.geomspace(10, 1e4, 12)
        y = 3.0 * x**slope * np.exp(noise * g.standard_normal(x.size))
        out.append((f"12 points, slope {slope:g}, log-noise {noise:g}", (x, y)))
    return out


def _cases_geometric():
    out = []
    for i, (mu, noise) in enumerate(((0.5, 0.0), (0.9, 0.05), (0.99, 0.01))):
        g = np.random.default_rng(700 + i)
        s = np.arange(0, 30, 2)
        v = 2.0 * mu**s * np.exp(noise * g.standard_normal(s.size))
        out.append((f"{s.size} points, mu = {mu:g}, log-noise {noise:g}", (s, v)))
    return out


# ----------------------------------------------------------------------------- references / verifiers


def _excess(A, B, S, M):
    return Task(S, M).excess_risk(A, B)


def _grad(A, B, S, M):
    return Task(S, M).population_grad(A, B)


def _precond_step(A, B, S, M, lr):
    gA, gB = Task(S, M).population_grad(A, B)
    Si = torch.linalg.inv(S)
    return A - lr * gA @ Si, B - lr * Si @ gB @ Si


def _verify_minimizer(result, S, M):
    A, B = _as_pair(result, "(A, B)")
    k, d = M.shape
    if tuple(A.shape) != (k, d) or tuple(B.shape) != (d, d):
        return f"expected A of shape {(k, d)} and B of shape {(d, d)}, got {tuple(A.shape)} and {tuple(B.shape)}"
    task = Task(S, M)
    ex = float(task.excess_risk(A, B))
    scale = float(task.excess_risk(torch.zeros_like(A), torch.zeros_like(B)))
    if not ex <= 1e-20 * max(scale, 1.0) + 1e-24:
        return f"the pair is not a global minimizer: its excess risk is {ex:.3e} (> 0), so A Sigma B^T differs from M"
    At, C = to_factor(A, B, S)
    gap = float(torch.linalg.norm(At.T @ At - C @ C.T))
    size = float(torch.linalg.norm(At.T @ At)) + 1e-300
    if gap > 1e-8 * size:
        return (
            f"the pair minimizes the loss but is not balanced: ||At^T At - C C^T||_F = {gap:.3e} "
            f"(relative {gap / size:.1e})"
        )
    return None


EXERCISES: Dict[str, Exercise] = {
    e.key: e
    for e in (
        Exercise(
            "1.1",
            "my_attention(A, B, X) -> (n, k) tensor",
            _cases_layer,
            "each row of the weight matrix is a softmax over the tokens j; a softmax does not change when "
            "the same constant is subtracted from all the scores of a row",
            reference=attention_reference,
            forbidden=(
                "attnlib.attention.attention",
                "attnlib.attention.attention_reference",
                "attnlib.attention.attention_weights",
            ),
        ),
        Exercise(
            "1.2",
            "my_empirical_loss(A, B, X, Y) -> scalar",
            _cases_loss,
            "check the normalization: a factor 1/2, a mean over the n queries, and a squared norm of "
            "each k-dimensional residual (do not divide by n k)",
            reference=lambda A, B, X, Y: empirical_loss(A, B, X, Y, fused=False),
            forbidden=("attnlib.attention.empirical_loss", "attnlib.finite_n.*"),
        ),
        Exercise(
            "2.1",
            "my_excess_risk(A, B, Sigma, M) -> scalar",
            _cases_population,
            "start from the closed-form population loss of this chapter and subtract the Bayes risk; "
            "a value off by a constant factor usually means a missing 1/2",
            reference=_excess,
            forbidden=(
                "attnlib.task.Task.excess_risk",
                "attnlib.task.Task.population_loss",
                "attnlib.task.Task.residual",
            ),
        ),
        Exercise(
            "2.2",
            "my_population_grad(A, B, Sigma, M) -> (grad_A, grad_B)",
            _cases_population,
            "compare your formulas with torch.autograd.grad applied to your my_excess_risk; a transposed "
            "factor is the usual mistake",
            reference=_grad,
            forbidden=(
                "attnlib.task.Task.population_grad",
                "attnlib.task.Task.excess_risk",
                "attnlib.task.Task.population_loss",
                "attnlib.train.*",
            ),
        ),
        Exercise(
            "3.1",
            "my_to_factor(A, B, Sigma) -> (At, C)",
            _cases_factor,
            "the square root must be the symmetric one (an eigendecomposition), not a Cholesky factor; "
            "check on which sides of B^T it appears",
            reference=to_factor,
            forbidden=(
                "attnlib.geometry.*",
                "attnlib.linalg.*",
                "attnlib.task.Task.Sigma_sqrt",
                "attnlib.task.Task.Sigma_inv_sqrt",
                "attnlib.task.Task.T",
            ),
        ),
        Exercise(
            "3.2",
            "my_balanced_minimizer(Sigma, M) -> (A, B)",
            _cases_minimizer,
            "work in factor coordinates, where the global minimizers are the factorizations of T, and "
            "use a singular value decomposition of T",
            verify=_verify_minimizer,
            kind="minimizer",
            forbidden=(
                "attnlib.geometry.manifold_point",
                "attnlib.geometry.random_manifold_point",
                "attnlib.geometry.project_to_manifold",
                "attnlib.geometry._procrustes",
                "attnlib.landscape.stationary_point",
            ),
        ),
        Exercise(
            "4.1",
            "my_p_norm(dA, dB, Sigma) -> scalar",
            _cases_p_norm,
            "the P-norm is the Frobenius norm of the direction written in factor coordinates; the last "
            "test case rescales Sigma and the direction together and expects the P-norm of case 1",
            reference=p_norm,
            forbidden=("attnlib.geometry.p_norm", "attnlib.geometry.p_inner"),
        ),
        Exercise(
            "4.2",
            "my_regularizer(A, B, Sigma, lam) -> scalar",
            _cases_regularizer,
            "write (A, B) in factor coordinates first, and check the factor in front of the norm",
            reference=regularizer,
            forbidden=("attnlib.geometry.regularizer",),
        ),
        Exercise(
            "5.1",
            "my_renormalize(A, B, Sigma) -> (A, B)",
            _cases_factor,
            "find the one scalar c for which At / c and c C have equal Frobenius norms, and carry the "
            "rescaling back to (A, B)",
            reference=lambda A, B, S: renormalize(A, B, S, mode="scale"),
            forbidden=("attnlib.geometry.renormalize", "attnlib.train.*"),
        ),
        Exercise(
            "5.2",
            "my_preconditioned_step(A, B, Sigma, M, lr) -> (A, B)",
            lambda: _cases_population(with_lr=True),
            "write a plain gradient step in factor coordinates and carry it back to (A, B) with the chain rule",
            reference=_precond_step,
            forbidden=("attnlib.train.*",),
        ),
        Exercise(
            "6.1",
            "my_loglog_slope(x, y) -> float",
            _cases_power_law,
            "fit a straight line by least squares to the logarithms of both coordinates and return its "
            "slope, not its intercept",
            reference=lambda x, y: fit_power_law(x, y).slope,
            rtol=1e-7,
            forbidden=("attnlib.fits.*", "attnlib.experiments.*"),
        ),
        Exercise(
            "6.2",
            "my_geometric_rate(steps, values) -> float",
            _cases_geometric,
            "take logarithms of the values: what is then linear in the steps, and how is its slope related to mu?",
            reference=fit_geometric_rate,
            rtol=1e-7,
            forbidden=("attnlib.fits.*", "attnlib.experiments.*"),
        ),
    )
}


# ----------------------------------------------------------------------------- chapter 7 (optimizers)
# One block, added with chapter 7: the two coding exercises of book/ch7_optimizers.ipynb.


def _cases_shampoo():
    out = []
    for i, (m, n, cl, cr) in enumerate(((2, 4, 1.0, 10.0), (4, 4, 30.0, 100.0), (3, 5, 1e3, 1.0))):
        g = _gen(800 + i)
        out.append(
            (f"G {m} x {n}, cond(L) = {cl:g}, cond(R) = {cr:g}", (_randn(m, n, g=g), _spd(m, g, cl), _spd(n, g, cr)))
        )
    return out


def _cases_orthogonalize():
    out = []
    for i, (m, n, scale) in enumerate(((4, 4, 1.0), (2, 4, 1e-3), (5, 3, 1e3))):
        g = _gen(900 + i)
        out.append((f"G {m} x {n}, entries of size {scale:g}", (_randn(m, n, g=g, scale=scale),)))
    return out


def _inv_fourth_root(S):
    ev, Q = torch.linalg.eigh(S)
    return (Q * ev ** (-0.25)) @ Q.T


def _shampoo_direction(G, L, R):
    return _inv_fourth_root(L) @ G @ _inv_fourth_root(R)


def _orthogonalize(G):
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    return U @ Vh


EXERCISES.update(
    {
        e.key: e
        for e in (
            Exercise(
                "7.1",
                "my_shampoo_direction(G, L, R) -> (m, n) tensor",
                _cases_shampoo,
                "an inverse fourth root of a symmetric positive definite matrix comes from its eigendecomposition "
                "(raise the eigenvalues to the power -1/4); L acts on the left of G, R on the right",
                reference=_shampoo_direction,
                rtol=1e-7,
                forbidden=("attnlib.optimizers.*", "attnlib.linalg.*"),
            ),
            Exercise(
                "7.2",
                "my_orthogonalize(G) -> (m, n) tensor",
                _cases_orthogonalize,
                "a singular value decomposition G = U S V^T: keep the singular vectors and replace every "
                "singular value by 1; the result must not depend on the size of G",
                reference=_orthogonalize,
                rtol=1e-7,
                forbidden=("attnlib.optimizers.*", "attnlib.linalg.*"),
            ),
        )
    }
)


# ----------------------------------------------------------------------------- comparison


def _to_tensor(x, what):
    try:
        return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x, dtype=DTYPE)
    except Exception as exc:  # noqa: BLE001 - turned into a readable message
        raise ExerciseError(f"{what}: could not read the returned value as numbers ({exc})") from None


def _as_pair(result, what):
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ExerciseError(f"expected a pair {what}, got {type(result).__name__}")
    return _to_tensor(result[0], what), _to_tensor(result[1], what)


def _compare(got, want, ex: Exercise) -> str | None:
    """``None`` if ``got`` matches ``want`` (tensor, scalar or pair), else a message."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"expected a tuple of {len(want)} results, got {type(got).__name__}"
        for i, (g, w) in enumerate(zip(got, want)):
            msg = _compare(g, w, ex)
            if msg is not None:
                return f"component {i}: {msg}"
        return None
    w = _to_tensor(want.detach() if isinstance(want, torch.Tensor) else want, "reference")
    g = _to_tensor(got.detach() if isinstance(got, torch.Tensor) else got, "your result")
    if g.numel() == 1 and w.numel() == 1:
        g, w = g.reshape(()), w.reshape(())
    if tuple(g.shape) != tuple(w.shape):
        return f"returned shape {tuple(g.shape)}, expected {tuple(w.shape)}"
    if not torch.isfinite(g).all():
        return "returned NaN or infinite values"
    err = float(torch.max(torch.abs(g - w)))
    tol = ex.atol + ex.rtol * float(torch.max(torch.abs(w)))
    if err > tol:
        return f"largest difference from the expected value {err:.3e} (tolerance {tol:.1e})"
    return None


def check(key: str, fn: Callable, *, quiet: bool = False, hints: bool = True) -> None:
    """Grade ``fn`` as the answer to exercise ``key`` (for example ``"2.1"``).

    Runs ``fn`` on each test case and raises :class:`~attnlib.course.hidden.ExerciseError` with a
    one-line message on the first failure: the stub still in place, an
    exception, a wrong shape, non-finite values, a wrong value (with a hint
    unless ``hints=False``), or an answer that the library policy rules out
    (``fn`` is a library function, or calls one in ``Exercise.forbidden``).
    Prints one line on success unless ``quiet``.
    """
    if key not in EXERCISES:
        raise ValueError(f"key: expected one of {sorted(EXERCISES)}, got {key!r}")
    ex = EXERCISES[key]
    name = ex.signature.split("(")[0]
    if not callable(fn):
        raise ExerciseError(f"Exercise {key}: expected a function {ex.signature}, got {type(fn).__name__}")
    hint = f" Hint: {ex.hint}." if hints else ""
    cases = ex.cases()
    for i, (desc, args) in enumerate(cases, 1):
        inputs = tuple(
            a.clone() if isinstance(a, torch.Tensor) else np.array(a, copy=True) if isinstance(a, np.ndarray) else a
            for a in args
        )
        try:
            got, calls, tampered = hidden.watched_call(fn, inputs, ex.forbidden)
        except NotImplementedError:
            raise ExerciseError(
                f"Exercise {key}: {name} still raises NotImplementedError. Replace the stub "
                f"(`raise NotImplementedError()`) in the solution cell with your code."
            ) from None
        except Exception as exc:  # noqa: BLE001 - reported to the student
            raise ExerciseError(
                f"Exercise {key}: {name} raised {type(exc).__name__}: {exc} (test case {i}: {desc})"
            ) from None
        msg = hidden.policy_violation(fn, name, calls, tampered)
        if msg is not None:
            raise ExerciseError(f"Exercise {key}: {msg}; such an answer earns no points.")
        if got is None:
            raise ExerciseError(
                f"Exercise {key}: {name} returned None: did you forget `return`? (test case {i}: {desc})"
            )
        for a, b in zip(args, inputs):
            if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                raise ExerciseError(
                    f"Exercise {key}: {name} modified its input in place (test case {i}: {desc}); work on copies"
                )
        if ex.verify is not None:
            try:
                msg = ex.verify(got, *args)
            except ExerciseError as err:
                msg = str(err)
        else:
            msg = _compare(got, ex.reference(*args), ex)
        if msg is not None:
            raise ExerciseError(f"Exercise {key}: {name} is not right yet on test case {i} ({desc}): {msg}.{hint}")
    if not quiet:
        print(f"Exercise {key} passed ({len(cases)} test cases).")


def solved(key: str, fn: Callable) -> bool:
    """``True`` if ``fn`` passes :func:`check` for exercise ``key`` (no output)."""
    try:
        check(key, fn, quiet=True)
    except ExerciseError:
        return False
    return True


def hidden_spec(key: str) -> dict:
    """The hidden test of exercise ``key`` as a Python literal (for :func:`attnlib.course.hidden.grade`).

    Inputs and expected values are computed here, by the library, once (at
    release); the literal holds plain floats, so the grade does not depend on
    any function a student's notebook can rebind.
    """
    if key not in EXERCISES:
        raise ValueError(f"key: expected one of {sorted(EXERCISES)}, got {key!r}")
    ex = EXERCISES[key]
    cases = []
    for desc, args in ex.cases():
        case = {"desc": desc, "args": [hidden.encode(a) for a in args]}
        if ex.kind == "minimizer":
            S, M = args
            case.update(
                Sigma=hidden.encode(S),
                M=hidden.encode(M),
                Sigma_half=hidden.encode(sym_sqrt(S)),
                scale=float(Task(S, M).excess_risk(torch.zeros_like(M), torch.zeros_like(S))),
            )
        else:
            case["expected"] = hidden.encode(ex.reference(*args))
        cases.append(case)
    return {
        "key": key,
        "name": ex.signature.split("(")[0],
        "kind": ex.kind,
        "forbidden": list(ex.forbidden),
        "rtol": ex.rtol,
        "atol": ex.atol,
        "cases": cases,
    }
