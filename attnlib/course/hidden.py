"""The hidden tests of the course assignments: a self-contained grader.

At release, :mod:`attnlib.course` pastes the source of this module (indented
into one function) into the hidden-test region of every graded cell (between
nbgrader's hidden-test delimiter comments), followed by the exercise's
test cases and expected values as Python literals, computed by the library
when the assignment is released. nbgrader stores that cell in its gradebook,
removes the region from the student version and puts it back when it
autogrades. So the grade of a submission does not depend on anything the
student's cells can rebind: not on :func:`attnlib.course.exercises.check`,
not on the library functions that computed the expected values, not on
numpy's or torch's comparison functions (the comparison below is pure
Python on ``tolist()`` values).

Policy for library functions (also stated on the book's instructors page):
an answer that *is* a function of ``attnlib`` (``my_to_factor = al.to_factor``,
a ``functools.partial`` of one, a grader's reference) or that calls, directly
or through a wrapper, one of the library functions the exercise asks the
student to write (found with ``sys.setprofile`` by the file and name of
the code that runs, so renaming does not hide it) earns nothing for that
exercise; the message names the function.

The module only imports the standard library at import time (torch and
numpy are imported when test inputs are built); every public name is used by
:mod:`attnlib.course.exercises` as well.
"""

import math
import sys


class ExerciseError(AssertionError):
    """A submitted function does not solve its exercise; the message says why, on one line."""


def encode(x):
    """A Python literal (dicts, lists, floats) for a tensor, an array, a number or a tuple of them."""
    if isinstance(x, (tuple, list)):
        return {"tuple": [encode(v) for v in x]}
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu()
        return {"torch": [int(s) for s in x.shape], "v": [float(v) for v in x.reshape(-1).tolist()]}
    if hasattr(x, "shape") and hasattr(x, "tolist"):  # numpy array or scalar
        flat = x.reshape(-1).tolist() if x.shape else [x.tolist()]
        return {"numpy": [int(s) for s in x.shape], "v": [float(v) for v in flat]}
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    raise TypeError(f"x: expected a tensor, an array, a number or a tuple of them, got {type(x).__name__}")


def decode(obj):
    """The object :func:`encode` describes (float64 tensors and arrays)."""
    if isinstance(obj, dict) and "tuple" in obj:
        return tuple(decode(v) for v in obj["tuple"])
    if isinstance(obj, dict) and "torch" in obj:
        import torch

        return torch.tensor(obj["v"], dtype=torch.float64).reshape(obj["torch"])
    if isinstance(obj, dict) and "numpy" in obj:
        import numpy

        return numpy.array(obj["v"], dtype=numpy.float64).reshape(obj["numpy"])
    return obj


def _nested(values, shape):
    """A flat list as nested lists of the given shape."""
    if len(shape) <= 1:
        return list(values)
    step = len(values) // shape[0] if shape[0] else 0
    return [_nested(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def flatten(x, what="the result"):
    """``(shape, [floats])`` of a tensor, an array, a number or nested lists of numbers."""
    if hasattr(x, "detach"):
        x = x.detach()
    if hasattr(x, "cpu"):
        x = x.cpu()
    if hasattr(x, "shape") and hasattr(x, "tolist"):
        shape, x = tuple(int(s) for s in x.shape), x.tolist()
    elif isinstance(x, (list, tuple)):
        shape = None
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        return (), [float(x)]
    else:
        raise ExerciseError(f"{what} is a {type(x).__name__}, expected a tensor, an array or a number")
    flat, dims = [], []

    def walk(v, depth):
        if isinstance(v, (list, tuple)):
            if len(dims) <= depth:
                dims.append(len(v))
            elif dims[depth] != len(v):
                raise ExerciseError(f"{what} is a ragged list of numbers")
            for w in v:
                walk(w, depth + 1)
        else:
            try:
                flat.append(float(v))
            except (TypeError, ValueError):
                raise ExerciseError(f"{what} holds a {type(v).__name__}, expected numbers") from None

    walk(x, 0)
    return (shape if shape is not None else tuple(dims)), flat


def library_name(code):
    """``"attnlib.geometry.to_factor"`` for a code object of the attnlib package, else ``None``."""
    path = str(getattr(code, "co_filename", "")).replace("\\", "/")
    marker = "/attnlib/"
    if marker not in path or not path.endswith(".py"):
        return None
    module = "attnlib." + path.rsplit(marker, 1)[1][: -len(".py")].replace("/", ".")
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
    return module + "." + getattr(code, "co_qualname", code.co_name)


def library_origin(fn):
    """The attnlib name of ``fn`` if it is (a partial or bound method of) a library function, else ``None``."""
    for _ in range(10):
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    code = getattr(fn, "__code__", None)
    if code is None:  # an instance of a class with a __call__ method
        code = getattr(vars(type(fn)).get("__call__"), "__code__", None)
    return library_name(code) if code is not None else None


def _is_forbidden(name, forbidden):
    for f in forbidden:
        if name == f or (f.endswith(".*") and name.startswith(f[:-1])):
            return True
    return False


def watched_call(fn, args, forbidden):
    """Call ``fn(*args)``, recording the forbidden library functions it runs.

    Returns ``(result, calls, tampered)``: the names of the forbidden
    functions that ran, and whether the call removed or replaced the profiler.
    """
    calls = []

    def profiler(frame, event, arg):
        if event == "call":
            name = library_name(frame.f_code)
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


def policy_violation(fn, name, calls, tampered):
    """The message for an answer that the library policy gives no points, else ``None``."""
    origin = library_origin(fn)
    if origin is not None:
        return f"{name} is the library function {origin}; the exercise asks you to write it yourself"
    if calls:  # the first one is the outermost: the one the answer called
        return f"{name} calls {calls[0]}, a library function that does what the exercise asks you to write"
    if tampered:
        return f"{name} changed the interpreter's profiler (sys.setprofile) while it ran"
    return None


def _matmul(a, b):
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]


def _t(a):
    return [list(r) for r in zip(*a)]


def _fro(a):
    return math.sqrt(sum(v * v for row in a for v in row))


def _compare(got, want, rtol, atol, what="the result"):
    """``None`` if ``got`` matches the encoded ``want`` (numbers, arrays or tuples), else a message."""
    if isinstance(want, dict) and "tuple" in want:
        parts = want["tuple"]
        if not isinstance(got, (tuple, list)) or len(got) != len(parts):
            return f"expected a tuple of {len(parts)} results, got {type(got).__name__}"
        for i, (g, w) in enumerate(zip(got, parts)):
            msg = _compare(g, w, rtol, atol, f"component {i}")
            if msg is not None:
                return msg if msg.startswith("component") else f"component {i}: {msg}"
        return None
    wshape = tuple(want.get("torch", want.get("numpy", ()))) if isinstance(want, dict) else ()
    wv = want["v"] if isinstance(want, dict) else [float(want)]
    gshape, gv = flatten(got, what)
    if len(gv) == 1 and len(wv) == 1:
        gshape = wshape
    if tuple(gshape) != wshape:
        return f"returned shape {tuple(gshape)}, expected {wshape}"
    if not all(math.isfinite(v) for v in gv):
        return "returned NaN or infinite values"
    err = max((abs(g - w) for g, w in zip(gv, wv)), default=0.0)
    tol = atol + rtol * max((abs(w) for w in wv), default=0.0)
    if not err <= tol:
        return f"largest difference from the expected value {err:.3e} (tolerance {tol:.1e})"
    return None


def _verify_minimizer(got, case):
    """``None`` if ``got`` is a balanced global minimizer for the case's ``(Sigma, M)``, else a message."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"expected a pair (A, B), got {type(got).__name__}"
    S, M, H = (_nested(case[k]["v"], case[k]["torch"]) for k in ("Sigma", "M", "Sigma_half"))
    k, d = len(M), len(M[0])
    (sa, va), (sb, vb) = flatten(got[0], "A"), flatten(got[1], "B")
    if tuple(sa) != (k, d) or tuple(sb) != (d, d):
        return f"expected A of shape {(k, d)} and B of shape {(d, d)}, got {tuple(sa)} and {tuple(sb)}"
    if not all(math.isfinite(v) for v in va + vb):
        return "returned NaN or infinite values"
    A, B = _nested(va, (k, d)), _nested(vb, (d, d))
    E = [[x - m for x, m in zip(r, mr)] for r, mr in zip(_matmul(_matmul(A, S), _t(B)), M)]
    excess = 0.5 * _fro(_matmul(E, H)) ** 2
    if not excess <= 1e-20 * max(case["scale"], 1.0) + 1e-24:
        return f"the pair is not a global minimizer: its excess risk is {excess:.3e} (> 0)"
    At, C = _matmul(A, H), _matmul(_matmul(H, _t(B)), H)
    G = _matmul(_t(At), At)
    gap = _fro([[g - c for g, c in zip(r, cr)] for r, cr in zip(G, _matmul(C, _t(C)))])
    if not gap <= 1e-8 * (_fro(G) + 1e-300):
        return f"the pair minimizes the loss but is not balanced: ||At^T At - C C^T||_F = {gap:.3e}"
    return None


def grade(fn, spec):
    """Run the exercise's fixed test cases on ``fn``; raise :class:`ExerciseError` on the first failure (else ``None``).

    ``spec`` is the literal written at release by
    :func:`attnlib.course.exercises.hidden_spec`: the key, the function's
    name, the kind of check (``"value"`` or ``"minimizer"``), the forbidden
    library functions, tolerances, and the cases with their inputs and
    expected values.
    """
    key, name = spec["key"], spec["name"]
    head = f"Exercise {key} (graded test)"
    if not callable(fn):
        raise ExerciseError(f"{head}: expected a function {name}, got {type(fn).__name__}")
    cases = spec["cases"]
    for i, case in enumerate(cases, 1):
        where = f"case {i} of {len(cases)} ({case['desc']})"
        args = tuple(decode(a) for a in case["args"])
        try:
            got, calls, tampered = watched_call(fn, args, spec["forbidden"])
        except NotImplementedError:
            raise ExerciseError(f"{head}: {name} still raises NotImplementedError (the stub is in place)") from None
        except Exception as exc:  # noqa: BLE001 - reported to the student
            raise ExerciseError(f"{head}: {name} raised {type(exc).__name__}: {exc} on {where}") from None
        msg = policy_violation(fn, name, calls, tampered)
        if msg is not None:
            raise ExerciseError(f"{head}: {msg}; no points for this exercise")
        if got is None:
            raise ExerciseError(f"{head}: {name} returned None on {where}: a missing `return`?")
        for a, enc in zip(args, case["args"]):
            if isinstance(enc, dict) and "v" in enc and flatten(a)[1] != enc["v"]:
                raise ExerciseError(f"{head}: {name} modified its input in place on {where}")
        if spec["kind"] == "minimizer":
            msg = _verify_minimizer(got, case)
        else:
            msg = _compare(got, case["expected"], spec["rtol"], spec["atol"])
        if msg is not None:
            raise ExerciseError(f"{head}: {name} is not right on {where}: {msg}")
    # returns None: nbgrader would read a number shown by a graded cell as partial credit
