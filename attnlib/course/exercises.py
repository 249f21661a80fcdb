r"""Graders for the book's exercises: one grader behind the visible checks and the hidden tests.

Every chapter ends with exercises in which the reader writes functions (and
derivations, graded by hand). Each coding exercise is one :class:`Exercise`
in :data:`EXERCISES`. **To add one** (for example for a new chapter), add an
entry and put a graded cell ``exercises.check("7.1", my_function)`` under its
solution cell in the chapter::

    Exercise(
        "7.1",                                   # the key the chapter's check cell uses
        "my_function(A, Sigma) -> scalar",       # the function the reader writes
        _cases_something,                        # cases(seed) -> [(description, args)]
        "where to look (not the formula)",      # the hint of the visible check
        reference=library_function,              # expected value = reference(*args) ...
        forbidden=("attnlib.module.library_function",),  # ... which the answer may not call
    )

``cases(seed)`` draws its inputs from ``seed`` only (through ``_gen``, a
``torch.Generator``, or ``np.random.default_rng(_mix(seed, base))``):
``seed = 0`` gives the visible cases that the book and the handouts check; a
release draws its own secret seed for the hidden cases
(:mod:`attnlib.course.coursedir`), so the hidden cases differ from the
visible ones, and from release to release.

:func:`check` (the book's and the students' feedback) and :func:`judge` (the
grade, from the guarded worker of :mod:`attnlib.course.hidden`) share the
same steps: the result is read as plain numbers by
:func:`attnlib.course.hidden.plain` and compared by :func:`compare` (or
checked by ``verify`` for exercises with many right answers). The policy for
library functions: an answer that is, wraps or calls one of
``Exercise.forbidden`` earns nothing for that exercise (when grading, those
functions are disabled in the worker; the visible check watches for them with
``sys.setprofile``).

>>> import numpy as np
>>> from attnlib.course import exercises
>>> exercises.check("6.2", lambda s, v: float(np.exp(np.polyfit(np.asarray(s, float), np.log(v), 1)[0])))
Exercise 6.2 passed (3 test cases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from ..analysis.stats import fit_geometric_rate, fit_power_law
from ..geometry import p_norm, regularizer, renormalize, to_factor
from ..model.layer import attention_reference, empirical_loss
from ..model.task import Task
from . import hidden
from .hidden import ExerciseError

__all__ = ["ExerciseError", "Exercise", "EXERCISES", "check", "solved", "compare", "judge", "hidden_cases"]

DTYPE = torch.float64
#: The training code, forbidden in every exercise that asks for a piece of it (its step rules, loop and presets).
_TRAINING = ("attnlib.optim.api.*", "attnlib.optim.loop.*", "attnlib.optim.steps.*", "attnlib.optim.objectives.*")


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function the reader writes and how it is graded.

    ``cases(seed)`` returns a list of ``(description, args)`` drawn from ``seed``; ``reference(*args)``
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


def _mix(seed: int, base: int) -> int:
    """The generator seed of one case: ``base`` for the visible cases (seed 0), else a mix of both."""
    if seed == hidden.VISIBLE_SEED:
        return base
    return int(np.random.SeedSequence([int(seed) % 2**63, base]).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


def _gen(seed: int, base: int) -> torch.Generator:
    return torch.Generator().manual_seed(_mix(seed, base))


def _randn(*shape, g, scale=1.0):
    return scale * torch.randn(*shape, generator=g, dtype=DTYPE)


def _spd(d, g, cond=10.0):
    Q, _ = torch.linalg.qr(_randn(d, d, g=g))
    ev = torch.tensor(np.geomspace(1.0, cond, d), dtype=DTYPE)
    return (Q * ev) @ Q.T


def _params(k, d, g, scale=0.5):
    return _randn(k, d, g=g, scale=scale), _randn(d, d, g=g, scale=scale)


# ----------------------------------------------------------------------------- cases per chapter


def _cases_layer(seed=0):
    out = []
    for i, (n, d, k, scale) in enumerate(((6, 3, 2, 0.5), (11, 4, 1, 1.0), (8, 3, 3, 1000.0))):
        g = _gen(seed, 100 + i)
        X = _randn(n, d, g=g)
        A, B = _params(k, d, g)
        desc = f"n = {n}, d = {d}, k = {k}" + (", large scores (|x_i^T B x_j| up to ~1e3)" if scale > 10 else "")
        out.append((desc, (A, B * scale, X)))
    return out


def _cases_loss(seed=0):
    out = []
    for i, (n, d, k) in enumerate(((7, 3, 2), (12, 4, 3))):
        g = _gen(seed, 200 + i)
        X = _randn(n, d, g=g)
        A, B = _params(k, d, g)
        Y = _randn(n, k, g=g)
        out.append((f"n = {n}, d = {d}, k = {k}", (A, B, X, Y)))
    return out


def _cases_population(seed=0, with_lr=False):
    out = []
    for i, (d, k, cond) in enumerate(((3, 2, 1.0), (4, 3, 30.0), (5, 1, 5.0))):
        g = _gen(seed, 300 + i)
        S = _spd(d, g, cond)
        M = _randn(k, d, g=g)
        A, B = _params(k, d, g)
        args = (A, B, S, M) + ((0.1,) if with_lr else ())
        out.append((f"d = {d}, k = {k}, cond(Sigma) = {cond:g}", args))
    return out


def _cases_factor(seed=0):
    out = []
    for i, (d, k, cond) in enumerate(((3, 2, 1.0), (4, 3, 50.0))):
        g = _gen(seed, 400 + i)
        A, B = _params(k, d, g)
        out.append((f"d = {d}, k = {k}, cond(Sigma) = {cond:g}", (A, B, _spd(d, g, cond))))
    return out


def _cases_minimizer(seed=0):
    out = []
    for i, (d, k, cond) in enumerate(((3, 2, 1.0), (4, 2, 20.0), (4, 4, 100.0))):
        g = _gen(seed, 500 + i)
        out.append((f"d = {d}, k = {k}, cond(Sigma) = {cond:g}", (_spd(d, g, cond), _randn(k, d, g=g))))
    return out


def _cases_p_norm(seed=0):
    """The factor cases, plus case 1 with Sigma -> c Sigma and the P-norm-preserving rescaled direction.

    Under Sigma -> c Sigma, dA Sigma^(1/2) gains c^(1/2) and Sigma^(1/2) dB^T Sigma^(1/2) gains c, so
    (c^(-1/2) dA, c^(-1) dB) has the same P-norm: the last case's expected value equals case 1's.
    """
    out = _cases_factor(seed)
    c = 4.0
    dA, dB, S = out[0][1]
    out.append((f"case 1 with Sigma -> {c:g} Sigma and (dA, dB) -> (c^-1/2 dA, c^-1 dB)", (dA / c**0.5, dB / c, c * S)))
    return out


def _cases_regularizer(seed=0):
    return [(desc, args + (lam,)) for (desc, args), lam in zip(_cases_factor(seed), (1.0, 0.3))]


def _cases_power_law(seed=0):
    out = []
    for i, (slope, noise) in enumerate(((-1.0, 0.0), (-0.5, 0.1), (-2.0, 0.3))):
        g = np.random.default_rng(_mix(seed, 600 + i))
        x = np.geomspace(10, 1e4, 12)
        y = 3.0 * x**slope * np.exp(noise * g.standard_normal(x.size))
        out.append((f"12 points, slope {slope:g}, log-noise {noise:g}", (x, y)))
    return out


def _cases_geometric(seed=0):
    out = []
    for i, (mu, noise) in enumerate(((0.5, 0.0), (0.9, 0.05), (0.99, 0.01))):
        g = np.random.default_rng(_mix(seed, 700 + i))
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
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"expected a pair (A, B), got {type(result).__name__}"
    A, B = (torch.as_tensor(r, dtype=DTYPE) for r in result)
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


#: Every coding exercise of the book, by key (``"2.1"``): what the reader writes and how it is graded.
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
                "attnlib.model.layer.attention",
                "attnlib.model.layer.attention_reference",
                "attnlib.model.layer.attention_weights",
                "attnlib.model.finite_n.*",
                "attnlib.analysis.landscape.*",
                "attnlib.model.prompts.*",
            ),
        ),
        Exercise(
            "1.2",
            "my_empirical_loss(A, B, X, Y) -> scalar",
            _cases_loss,
            "check the normalization: a factor 1/2, a mean over the n queries, and a squared norm of "
            "each k-dimensional residual (do not divide by n k)",
            reference=lambda A, B, X, Y: empirical_loss(A, B, X, Y, fused=False),
            forbidden=(
                "attnlib.model.layer.empirical_loss",
                "attnlib.model.finite_n.*",
                "attnlib.analysis.landscape.*",
                "attnlib.model.prompts.*",
                *_TRAINING,
            ),
        ),
        Exercise(
            "2.1",
            "my_excess_risk(A, B, Sigma, M) -> scalar",
            _cases_population,
            "start from the closed-form population loss of this chapter and subtract the Bayes risk; "
            "a value off by a constant factor usually means a missing 1/2",
            reference=_excess,
            forbidden=(
                "attnlib.model.task.Task.excess_risk",
                "attnlib.model.task.Task.population_loss",
                "attnlib.model.task.Task.residual",
                "attnlib.analysis.landscape.*",
                *_TRAINING,
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
                "attnlib.model.task.Task.population_grad",
                "attnlib.model.task.Task.excess_risk",
                "attnlib.model.task.Task.population_loss",
                *_TRAINING,
                "attnlib.analysis.landscape.*",
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
                "attnlib.model.task.Task.Sigma_sqrt",
                "attnlib.model.task.Task.Sigma_inv_sqrt",
                "attnlib.model.task.Task.T",
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
                "attnlib.analysis.landscape.stationary_point",
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
            reference=lambda A, B, S: renormalize(A, B, S, mode="equalize"),
            forbidden=(
                "attnlib.geometry.renormalize",
                "attnlib.geometry.Renormalization.__call__",
                "attnlib.geometry._equalize",
                *_TRAINING,
            ),
        ),
        Exercise(
            "5.2",
            "my_preconditioned_step(A, B, Sigma, M, lr) -> (A, B)",
            lambda seed=0: _cases_population(seed, with_lr=True),
            "write a plain gradient step in factor coordinates and carry it back to (A, B) with the chain rule",
            reference=_precond_step,
            forbidden=_TRAINING,
        ),
        Exercise(
            "6.1",
            "my_loglog_slope(x, y) -> float",
            _cases_power_law,
            "fit a straight line by least squares to the logarithms of both coordinates and return its "
            "slope, not its intercept",
            reference=lambda x, y: fit_power_law(x, y).slope,
            rtol=1e-7,
            forbidden=("attnlib.analysis.stats.*", "attnlib.experiments.*", "attnlib.model.finite_n.*"),
        ),
        Exercise(
            "6.2",
            "my_geometric_rate(steps, values) -> float",
            _cases_geometric,
            "take logarithms of the values: what is then linear in the steps, and how is its slope related to mu?",
            reference=fit_geometric_rate,
            rtol=1e-7,
            forbidden=("attnlib.analysis.stats.*", "attnlib.experiments.*", "attnlib.model.finite_n.*"),
        ),
    )
}


# ----------------------------------------------------------------------------- chapter 7 (optimizers)
# One block, added with chapter 7: the two coding exercises of book/ch7_optimizers_exercises.ipynb.


def _cases_shampoo(seed=0):
    out = []
    for i, (m, n, cl, cr) in enumerate(((2, 4, 1.0, 10.0), (4, 4, 30.0, 100.0), (3, 5, 1e3, 1.0))):
        g = _gen(seed, 800 + i)
        out.append(
            (f"G {m} x {n}, cond(L) = {cl:g}, cond(R) = {cr:g}", (_randn(m, n, g=g), _spd(m, g, cl), _spd(n, g, cr)))
        )
    return out


def _cases_orthogonalize(seed=0):
    out = []
    for i, (m, n, scale) in enumerate(((4, 4, 1.0), (2, 4, 1e-3), (5, 3, 1e3))):
        g = _gen(seed, 900 + i)
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
                forbidden=("attnlib.optim.optimizers.*", "attnlib.linalg.*"),
            ),
            Exercise(
                "7.2",
                "my_orthogonalize(G) -> (m, n) tensor",
                _cases_orthogonalize,
                "a singular value decomposition G = U S V^T: keep the singular vectors and replace every "
                "singular value by 1; the result must not depend on the size of G",
                reference=_orthogonalize,
                rtol=1e-7,
                forbidden=("attnlib.optim.optimizers.*", "attnlib.linalg.*"),
            ),
        )
    }
)


# ----------------------------------------------------------------------------- comparison (plain numbers)


def _values(enc):
    """``(shape, flat values)`` of a :func:`~attnlib.course.hidden.plain` literal that is not a tuple."""
    return tuple(enc.get("shape", enc.get("torch", enc.get("numpy", ())))), enc["v"]


def compare(got, want, ex: Exercise) -> str | None:
    """``None`` if the plain result ``got`` matches the plain expected value ``want``, else a message (pure Python)."""
    if "tuple" in want:
        parts = want["tuple"]
        if "tuple" not in got or len(got["tuple"]) != len(parts):
            n = len(got["tuple"]) if "tuple" in got else 1
            return f"expected a tuple of {len(parts)} results, got {n}"
        for i, (g, w) in enumerate(zip(got["tuple"], parts)):
            msg = compare(g, w, ex)
            if msg is not None:
                return f"component {i}: {msg}"
        return None
    if "tuple" in got:
        return f"expected one result, got a tuple of {len(got['tuple'])}"
    (gshape, gv), (wshape, wv) = _values(got), _values(want)
    if len(gv) == 1 and len(wv) == 1:
        gshape = wshape
    if tuple(gshape) != tuple(wshape):
        return f"returned shape {tuple(gshape)}, expected {tuple(wshape)}"
    if not all(math.isfinite(v) for v in gv):
        return "returned NaN or infinite values"
    err = max((abs(g - w) for g, w in zip(gv, wv)), default=0.0)
    tol = ex.atol + ex.rtol * max((abs(w) for w in wv), default=0.0)
    if not err <= tol:
        return f"largest difference from the expected value {err:.3e} (tolerance {tol:.1e})"
    return None


def _verdict(ex: Exercise, got, args) -> str | None:
    """The one check of a plain result on one case: ``verify`` or ``compare`` with the reference."""
    if ex.verify is not None:
        try:
            return ex.verify(hidden.decode(got), *args)
        except ExerciseError as err:
            return str(err)
    return compare(got, hidden.plain(ex.reference(*args), "the reference"), ex)


def _exercise(key: str) -> Exercise:
    if key not in EXERCISES:
        raise ValueError(f"key: expected one of {sorted(EXERCISES)}, got {key!r}")
    return EXERCISES[key]


def check(key: str, fn: Callable, *, quiet: bool = False, hints: bool = True) -> None:
    """Check ``fn`` as the answer to exercise ``key`` (for example ``"2.1"``) on its visible cases.

    Runs ``fn`` on each visible case and raises :class:`~attnlib.course.hidden.ExerciseError` with a
    one-line message on the first failure: the stub still in place, an
    exception, a result that is not plain numbers, a wrong shape, non-finite
    values, a wrong value (with a hint unless ``hints=False``), or an answer
    that the library policy rules out. Prints one line on success unless
    ``quiet``. Feedback only: the grade comes from :func:`judge`.
    """
    ex = _exercise(key)
    name = ex.signature.split("(")[0]
    if not callable(fn):
        raise ExerciseError(f"Exercise {key}: expected a function {ex.signature}, got {type(fn).__name__}")
    hint = f" Hint: {ex.hint}." if hints else ""
    cases = ex.cases(hidden.VISIBLE_SEED)
    for i, (desc, args) in enumerate(cases, 1):
        inputs = tuple(
            a.clone() if isinstance(a, torch.Tensor) else np.array(a, copy=True) if isinstance(a, np.ndarray) else a
            for a in args
        )
        try:
            got, calls, tampered = _watched_call(fn, inputs, ex.forbidden)
        except NotImplementedError:
            raise ExerciseError(
                f"Exercise {key}: {name} still raises NotImplementedError. Replace the stub "
                f"(`raise NotImplementedError()`) in the solution cell with your code."
            ) from None
        except Exception as exc:  # noqa: BLE001 - reported to the student
            raise ExerciseError(
                f"Exercise {key}: {name} raised {type(exc).__name__}: {exc} (test case {i}: {desc})"
            ) from None
        msg = _policy_violation(fn, name, calls, tampered)
        if msg is not None:
            raise ExerciseError(f"Exercise {key}: {msg}; such an answer earns no points.")
        if got is None:
            raise ExerciseError(
                f"Exercise {key}: {name} returned None: did you forget `return`? (test case {i}: {desc})"
            )
        try:
            value = hidden.plain(got)
        except ExerciseError as err:
            raise ExerciseError(f"Exercise {key}: {name} on test case {i} ({desc}): {err}") from None
        for a, b in zip(args, inputs):
            if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                raise ExerciseError(
                    f"Exercise {key}: {name} modified its input in place (test case {i}: {desc}); work on copies"
                )
        msg = _verdict(ex, value, args)
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


# ----------------------------------------------------------------------------- the visible check's library watch


def _library_name(code):
    """``"attnlib.geometry.to_factor"`` for a code object of the attnlib package, else ``None``."""
    path = str(getattr(code, "co_filename", "")).replace("\\", "/")
    marker = "/attnlib/"
    if marker not in path or not path.endswith(".py"):
        return None
    module = "attnlib." + path.rsplit(marker, 1)[1][: -len(".py")].replace("/", ".")
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
    return module + "." + getattr(code, "co_qualname", code.co_name)


def _is_forbidden(name, forbidden):
    return any(name == f or (f.endswith(".*") and name.startswith(f[:-1])) for f in forbidden)


def _library_origin(fn):
    for _ in range(10):
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    code = getattr(fn, "__code__", None)
    if code is None:
        code = getattr(vars(type(fn)).get("__call__"), "__code__", None)
    return _library_name(code) if code is not None else None


def _watched_call(fn, args, forbidden):
    """``(result, forbidden calls, profiler replaced)`` of ``fn(*args)``, watched with ``sys.setprofile``."""
    import sys

    calls = []

    def profiler(frame, event, arg):
        if event == "call":
            name = _library_name(frame.f_code)
            if name is not None and _is_forbidden(name, forbidden) and name not in calls:
                calls.append(name)

    previous = sys.getprofile()
    sys.setprofile(profiler)
    try:
        result = fn(*args)
    finally:
        tampered = sys.getprofile() is not profiler
        sys.setprofile(previous)
    return result, calls, tampered


def _policy_violation(fn, name, calls, tampered):
    origin = _library_origin(fn)
    if origin is not None:
        return f"{name} is the library function {origin}; the exercise asks you to write it yourself"
    if calls:
        return f"{name} calls {calls[0]}, a library function that does what the exercise asks you to write"
    if tampered:
        return f"{name} changed the interpreter's profiler (sys.setprofile) while it ran"
    return None


# ----------------------------------------------------------------------------- the grade


def hidden_cases(key: str, seed: int) -> List[Tuple[str, tuple]]:
    """The hidden cases of exercise ``key`` for the release seed ``seed`` (not the visible seed)."""
    if int(seed) == hidden.VISIBLE_SEED:
        raise ValueError("seed: the hidden cases need a release seed, not the visible cases' seed 0")
    return _exercise(key).cases(int(seed))


@dataclass
class Verdict:
    """The grade of one graded cell: passed or not, the one-line message, flags for review, a cell to skip later."""

    passed: bool
    message: str
    flags: List[str]
    fatal_cell: str | None = None
    cell_errors: Dict[str, str] | None = None

    def __post_init__(self):
        self.flags = list(dict.fromkeys(self.flags))  # each flag once


def _last(events, key):
    out = [e for e in events if key in e]
    return out[-1] if out else None


def judge(key: str, answer: dict, seed: int, timeout: float) -> Verdict:
    """``_judge``, with the errors of the student's own cells (``cell_errors``) attached."""
    v = _judge(key, answer, seed, timeout)
    v.cell_errors = {e["cell"]: e["error"] for e in answer["events"] if "cell" in e and "error" in e}
    return v


def _earlier(recent, phase) -> bool:
    """A cell of an earlier exercise: its own graded cell paid for it."""
    return recent is not None and str(phase).startswith("cell ") and str(phase)[5:] not in recent


def _review(key: str, name: str, events, recent):
    """``(flags, fail)``: the worker's forbidden calls, refused operations and exits, and the first that fails."""
    flags: List[str] = []
    fail = None
    for e in events:
        if "forbidden" in e and str(e.get("phase", "")).startswith("hidden case"):
            msg = f"{name} calls {e['forbidden']}, a library function that does what the exercise asks you to write"
            fail = fail or msg
            flags.append(f"exercise {key}: {msg}")
        if "blocked" in e:
            where = e.get("phase", "")
            shown = f"while {name} ran" if str(where).startswith("hidden case") else f"in {where}"
            verdict = "allowed at the top level" if e.get("allowed") else "refused"
            flags.append(f"exercise {key}: the student's code tried {e['blocked']} {shown}; {verdict}")
            if e.get("serious") and not _earlier(recent, where):
                fail = fail or f"the student's code tried {e['blocked']} ({where}), which grading refuses"
    for e in events:
        if e.get("exit") and not ("cell" in e and _earlier(recent, f"cell {e['cell']}")):
            where = f"cell {e['cell']}" if "cell" in e else f"{name} on hidden case {e['case'] + 1}"
            msg = f"the student's code called exit() or sys.exit() (SystemExit in {where})"
            flags.append(f"exercise {key}: {msg}")
            fail = fail or msg
    return flags, fail


def _cut_short(key: str, name: str, head: str, answer: dict, timeout: float, flags) -> Verdict | None:
    """The verdict on a worker that timed out or ended before its last report (``None`` if it did not)."""
    events = answer["events"]
    ended_early = not any("end" in e for e in events) and _last(events, "missing") is None
    if not (answer.get("timed_out") or ended_early and _last(events, "setup_error") is None):
        return None  # (a failed import cell also ends the worker early: _not_run says so)
    started = [e for e in events if e.get("start")]
    last = started[-1] if started else None
    fatal = None
    if (
        last is not None
        and "cell" in last
        and not any(e.get("cell") == last["cell"] and not e.get("start") for e in events)
    ):
        where, fatal = f"cell {last['cell']}", last["cell"]
    elif last is not None and "case" in last:
        where = f"{name} on hidden case {last['case'] + 1}"
    else:
        where = "the setup"
    if answer.get("timed_out"):
        msg = f"timed out after {timeout:g} s in {where} (an endless loop?)"
    elif answer.get("signal"):
        msg = f"the grading process was killed by signal {answer['signal']} in {where} (a crash?)"
    else:
        status = answer.get("exit")
        msg = f"the student's code ended the grading process in {where} (os._exit or a crash; status {status})"
    flags.append(f"exercise {key}: {msg}")
    return Verdict(False, f"{head}: {msg}", flags, fatal)


def _not_run(name: str, head: str, answer: dict, fail, flags) -> Verdict | None:
    """The verdict when the setup failed, the review failed the exercise, or the function is missing (else ``None``)."""
    events, recent = answer["events"], answer.get("recent")
    setup = _last(events, "setup_error")
    if setup is not None:
        return Verdict(False, f"{head}: the handout's import cell failed when graded ({setup['setup_error']})", flags)
    if fail is not None:
        return Verdict(False, f"{head}: {fail}; no points for this exercise", flags)
    missing = _last(events, "missing")
    if missing is not None:
        errors = [e for e in events if "cell" in e and "error" in e and (recent is None or e["cell"] in recent)]
        cause = f" (cell {errors[-1]['cell']} raised {errors[-1]['error']})" if errors else answer.get("why", "")
        what = "is not defined" if missing["missing"] is None else f"is a {missing['missing']}, not a function"
        return Verdict(False, f"{head}: {name} {what}{cause}", flags)
    return None


def _on_cases(key: str, ex: Exercise, name: str, head: str, events, seed: int, flags) -> Verdict:
    """The verdict on the function's results on the hidden cases of the release ``seed``."""
    cases = hidden_cases(key, seed)
    visible = None
    results = {e["case"]: e for e in events if "case" in e and not e.get("start")}
    for i, (desc, args) in enumerate(cases):
        where = f"hidden case {i + 1} of {len(cases)} ({desc})"
        e = results.get(i)
        if e is None:
            return Verdict(False, f"{head}: no result on {where}", flags)
        if e.get("stub"):
            return Verdict(False, f"{head}: {name} still raises NotImplementedError (the stub is in place)", flags)
        if "raised" in e:
            return Verdict(False, f"{head}: {name} raised {e['raised']} on {where}", flags)
        if e.get("own_type"):
            flags.append(f"exercise {key}: {name} returned an object of its own class on {where}")
        if e.get("error"):
            return Verdict(False, f"{head}: {name} on {where}: {e['error']}", flags)
        if e.get("changed"):
            return Verdict(False, f"{head}: {name} modified its input in place on {where}", flags)
        got = e["value"]
        msg = _verdict(ex, got, args)
        if msg is not None and ex.verify is None:
            if visible is None:
                visible = [hidden.plain(ex.reference(*a)) for _, a in ex.cases(hidden.VISIBLE_SEED)]
            if any(compare(got, w, ex) is None for w in visible):
                flags.append(f"exercise {key}: {name} returned a visible case's expected value on {where} (pasted?)")
        if msg is not None:
            return Verdict(False, f"{head}: {name} is not right on {where}: {msg}", flags)
    return Verdict(True, f"{head}: passed ({len(cases)} hidden cases)", flags)


def _judge(key: str, answer: dict, seed: int, timeout: float) -> Verdict:
    """The verdict on the worker's ``answer`` (``Sandbox.run``) for exercise ``key``.

    Expected values are computed here, in the instructor's process, from
    the release ``seed``; the worker never had them. Forbidden library calls
    during the function's run, refused operations, results of the student's
    own classes, a result equal to a visible case's expected value, timeouts,
    process deaths and ``SystemExit`` are flagged for review.
    """
    ex = _exercise(key)
    name = ex.signature.split("(")[0]
    head = f"Exercise {key} (graded)"
    flags, fail = _review(key, name, answer["events"], answer.get("recent"))
    verdict = _cut_short(key, name, head, answer, timeout, flags) or _not_run(name, head, answer, fail, flags)
    if verdict is not None:
        return verdict
    return _on_cases(key, ex, name, head, answer["events"], seed, flags)
