r"""The hidden tests: a student's functions run in a separate, guarded process; the grade is decided outside it.

Grading never runs a student's code in the process that knows the answers.
For every graded cell of a submission, :class:`Sandbox` forks a fresh worker
from a *zygote* process (which imported torch, numpy and the whole of
``attnlib`` once, and never runs student code itself). The worker

1. runs the handout's own import cell (trusted, from the release);
2. disables the library functions the exercise asks the student to write
   (``Exercise.forbidden``): their code objects are replaced, in place, by a
   trap that reports the call and raises, so every route to them (an alias,
   ``functools.partial``, a wrapper, a bound method, a lazy object whose
   ``__float__`` calls them, a call deferred to the result's conversion)
   ends in the trap, and the original code is not kept anywhere;
3. installs an audit hook (``sys.addaudithook``, which cannot be removed)
   that refuses, and reports, reading the library's, the book's or the course's
   files, writing any file, starting processes, ``ctypes``, sockets and
   ``gc``'s object lists, and, while the function runs, the interpreter's
   frames (``sys._getframe``, ``tb_frame``, ``gi_frame``; at the top level of a
   cell they are allowed and noted, for ``namedtuple`` or ``logging``);
4. runs the student's own code cells up to the graded cell in a fresh
   namespace, each in its own ``try``, then calls the function on the hidden
   cases, and turns each result into plain numbers (:func:`plain`: exact
   ``torch.Tensor``, ``numpy.ndarray``, numbers and tuples of them, nothing
   with a method of the student's own) before it writes them to its pipe.

The worker never sees an expected value: those are computed by the library in
the instructor's process, which compares (:mod:`attnlib.course.exercises`).
A stuck worker is killed after the time limit, a worker that dies
(``os._exit``, a crash) or exits (``SystemExit``) costs that graded cell
only, and each event is reported as what happened.

Standard library only at import time.
"""

from __future__ import annotations

import json
import os
import stat
import sys

__all__ = ["ExerciseError", "encode", "decode", "plain", "Sandbox", "VISIBLE_SEED"]

#: The seed of the cases every student sees (the book's and the handout's visible checks).
VISIBLE_SEED = 0
_MAX_OUTPUT = 1 << 22  # bytes a worker may report


class ExerciseError(AssertionError):
    """A submitted function does not solve its exercise; the message says why, on one line."""


# ----------------------------------------------------------------------------- plain data


def encode(x):
    """A JSON literal (dicts, lists, floats) for a tensor, an array, a number or a tuple of them (trusted input)."""
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
    """The object :func:`encode` (or :func:`plain`) describes: float64 tensors, arrays, floats, tuples."""
    if isinstance(obj, dict) and "tuple" in obj:
        return tuple(decode(v) for v in obj["tuple"])
    if isinstance(obj, dict) and "torch" in obj:
        import torch

        return torch.tensor(obj["v"], dtype=torch.float64).reshape(obj["torch"])
    if isinstance(obj, dict) and "numpy" in obj:
        import numpy

        return numpy.array(obj["v"], dtype=numpy.float64).reshape(obj["numpy"])
    if isinstance(obj, dict) and "shape" in obj:
        import torch

        return torch.tensor(obj["v"], dtype=torch.float64).reshape(obj["shape"])
    return obj


_REFS: dict = {}


def _refs() -> dict:
    """References to every builtin and method :func:`plain` uses, taken once (before any student code runs)."""
    if not _REFS:
        import builtins

        import numpy
        import torch

        _REFS.update(
            type=type,
            float=float,
            int=int,
            len=len,
            list=list,
            tuple=tuple,
            str=str,
            isinstance=isinstance,
            builtins_float=builtins.float,
            Tensor=torch.Tensor,
            t_detach=torch.Tensor.detach,
            t_cpu=torch.Tensor.cpu,
            t_size=torch._C.TensorBase.size,
            t_is_complex=torch._C.TensorBase.is_complex,
            t_reshape=torch._C.TensorBase.reshape,
            t_tolist=torch._C.TensorBase.tolist,
            ndarray=numpy.ndarray,
            a_reshape=numpy.ndarray.reshape,
            a_tolist=numpy.ndarray.tolist,
            scalars=(
                numpy.float64,
                numpy.float32,
                numpy.float16,
                numpy.int64,
                numpy.int32,
                numpy.int16,
                numpy.int8,
                numpy.uint8,
            ),
            np_dtype_kind=lambda a: a.dtype.kind,
        )
    return _REFS


def plain(x, what="the result", _depth=0):
    """``x`` as plain data: ``{"shape": [...], "v": [floats]}`` or ``{"tuple": [...]}``; else :class:`ExerciseError`.

    Accepts exactly ``torch.Tensor`` (no subclass), ``numpy.ndarray`` of
    numbers, numpy and Python numbers, tuples of those, and nested lists of
    numbers. Everything is read with references taken before student code ran,
    so no method of an object of the student's own runs here.
    """
    r = _refs()
    t = r["type"](x)
    if _depth > 8:
        raise ExerciseError(f"{what} is nested too deeply")
    if t is r["Tensor"]:
        if r["t_is_complex"](x):
            raise ExerciseError(f"{what} is a complex tensor, expected real numbers")
        x = r["t_cpu"](r["t_detach"](x))
        shape = [r["int"](s) for s in r["t_size"](x)]
        return {"shape": shape, "v": [r["float"](v) for v in r["t_tolist"](r["t_reshape"](x, (-1,)))]}
    if t is r["ndarray"]:
        if r["np_dtype_kind"](x) not in ("f", "i", "u"):
            raise ExerciseError(f"{what} is an array of {x.dtype}, expected numbers")
        return {
            "shape": [r["int"](s) for s in x.shape],
            "v": [r["float"](v) for v in r["a_tolist"](r["a_reshape"](x, -1))],
        }
    if t is r["float"] or t is r["int"] or t in r["scalars"]:
        return {"shape": [], "v": [r["float"](x)]}
    if t is r["tuple"] or t is r["list"]:
        items = r["list"](x)
        if items and all(r["type"](v) in (r["float"], r["int"], r["list"]) for v in items) and t is r["list"]:
            flat, dims = [], []

            def walk(v, depth):
                tv = r["type"](v)
                if tv is r["list"]:
                    if r["len"](dims) <= depth:
                        dims.append(r["len"](v))
                    elif dims[depth] != r["len"](v):
                        raise ExerciseError(f"{what} is a ragged list of numbers")
                    for w in v:
                        walk(w, depth + 1)
                elif tv is r["float"] or tv is r["int"]:
                    flat.append(r["float"](v))
                else:
                    raise ExerciseError(f"{what} holds a {tv.__name__}, expected numbers")

            walk(items, 0)
            return {"shape": dims, "v": flat}
        return {"tuple": [plain(v, f"component {i} of {what}", _depth + 1) for i, v in enumerate(items)]}
    name = f"a {t.__qualname__}" if t.__module__ == "builtins" else "an object of its own class"
    raise ExerciseError(f"{what} is {name}, expected a tensor, an array or a number")


def is_own_object(x) -> bool:
    """``True`` for a result of a type the student defined (or a subclass of a tensor, an array, a number)."""
    r = _refs()
    t = r["type"](x)
    if t is r["tuple"] or t is r["list"]:
        return any(is_own_object(v) for v in r["list"](x)[:64])
    if t in (r["Tensor"], r["ndarray"], r["float"], r["int"], r["str"], type(None)):
        return False
    if t in r["scalars"] or t is bool:
        return False
    return True


# ----------------------------------------------------------------------------- the worker (a forked child)


def _qualname_functions(pattern: str):
    """Function objects of attnlib named by ``pattern`` (``"attnlib.mod.qualname"`` or ``"attnlib.mod.*"``)."""
    import inspect
    import types

    out = []

    def unwrap(obj):
        seen = 0
        while obj is not None and seen < 10:
            if isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
            elif isinstance(obj, property):
                for f in (obj.fget, obj.fset, obj.fdel):
                    unwrap(f)
                return
            elif callable(getattr(obj, "func", None)) and not isinstance(obj, types.FunctionType):
                obj = obj.func  # functools.cached_property, partial
            elif isinstance(obj, types.FunctionType):
                out.append(obj)
                obj = getattr(obj, "__wrapped__", None)
            else:
                return
            seen += 1

    if pattern.endswith(".*"):
        modname = pattern[:-2]
        mod = sys.modules.get(modname)
        if mod is None:
            return out
        for value in list(vars(mod).values()):
            if isinstance(value, types.FunctionType) and value.__module__ == modname:
                unwrap(value)
            elif inspect.isclass(value) and value.__module__ == modname:
                for attr in vars(value).values():
                    unwrap(attr)
        return out
    parts = pattern.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is None:
            continue
        obj = mod
        try:
            for name in parts[i:-1]:
                obj = vars(obj)[name]
            unwrap(vars(obj)[parts[-1]])
        except (KeyError, TypeError):
            pass
        break
    return out


def _trap_code(name: str, freevars):
    """A code object that raises (the forbidden call reported first), with the free variables of the original."""
    lines = ["def _outer():"]
    lines += [f"    {v} = None" for v in freevars]
    lines += ["    def _trap(*args, **kwargs):"]
    if freevars:
        lines += ["        " + ", ".join(freevars)]
    lines += [f"        raise _attnlib_forbidden_call({name!r})", "    return _trap"]
    ns: dict = {}
    exec("\n".join(lines), ns)  # noqa: S102 - our own fixed source
    return ns["_outer"]().__code__


def _install_traps(forbidden, report, state):
    """Replace the code of every forbidden library function by a trap; the originals are dropped."""

    def forbidden_call(name):
        report({"forbidden": name, "phase": state["phase"]})
        return ExerciseError(f"{name} is not available while this exercise is graded (it is the exercise's answer)")

    for pattern in forbidden:
        for fn in _qualname_functions(pattern):
            fn.__globals__["_attnlib_forbidden_call"] = forbidden_call
            mod = fn.__module__ or "attnlib"
            full = f"{mod}.{fn.__qualname__}"
            try:
                fn.__code__ = _trap_code(full, fn.__code__.co_freevars)
            except ValueError:  # pragma: no cover - a closure layout the trap cannot copy
                pass


#: Audit events a worker refuses in every phase: processes, signals, the garbage collector's object lists,
#: profilers and tracers, sockets, ctypes, mmap, and changing the working folder.
_REFUSED_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "pty.spawn",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sys.setprofile",
        "sys.settrace",
        "socket.connect",
        "socket.bind",
        "socket.__new__",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.addressof",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "ctypes.call_function",
        "mmap.__new__",
        "os.chdir",
    }
)
#: The attributes (``object.__getattr__`` events) and the ``sys`` functions that reach the interpreter's frames.
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_FRAME_EVENTS = frozenset({"sys._getframe", "sys._current_frames"})


def _bound_realpath():
    """``realpath(str) -> str`` from ``os.lstat``/``os.readlink`` bound now.

    ``os.path.realpath`` is Python code that looks up its helpers (``posixpath._joinrealpath``) when
    it runs, so a student's cell could make it lie; this one uses only what it binds here and the
    methods of ``str`` and ``list`` (immutable types).
    """
    lstat, readlink, getcwd, is_link = os.lstat, os.readlink, os.getcwd, stat.S_ISLNK
    split, join, startswith = str.split, str.join, str.startswith
    OSErr = OSError

    def realpath(path):
        if not startswith(path, "/"):
            path = getcwd() + "/" + path
        todo, done, links = [p for p in split(path, "/") if p][::-1], [], 0
        while todo:
            part = todo.pop()
            if part == "." or (part == ".." and not done):
                continue
            if part == "..":
                done.pop()
                continue
            here = "/" + join("/", done + [part])
            try:
                link = is_link(lstat(here).st_mode)
            except OSErr:  # does not exist (yet): keep the name
                link = False
            links += 1 if link else 0
            if not link or links > 40:
                done.append(part)
                continue
            target = readlink(here)
            if startswith(target, "/"):
                done = []
            todo.extend([p for p in split(target, "/") if p][::-1])
        return "/" + join("/", done)

    return realpath


def _open_check(sensitive, allowed):
    """``check(args) -> (what, serious)`` for an ``open`` event; ``what`` is ``None`` for an open that is allowed.

    Everything it uses is bound here, before any student code runs, so that rebinding a builtin or a
    module attribute later (``builtins.any``, ``os.O_WRONLY``, ``posixpath``'s helpers, ``os.fsdecode``)
    does not change it. A path that is neither ``str``, ``bytes`` nor a file descriptor (a path-like
    object handed to ``io.FileIO``, whose ``__fspath__`` could answer differently the second time) is refused.
    """
    startswith = str.startswith
    realpath = _bound_realpath()
    isinstance_, any_, len_, bool_, type_ = isinstance, any, len, bool, type
    strtype, bytestype, inttype = str, bytes, int
    decode = bytes.decode
    encoding = sys.getfilesystemencoding()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def check(args):
        path, mode = args[0], args[1]
        if isinstance_(path, inttype):
            return None, True
        if isinstance_(path, bytestype):
            path = decode(path, encoding, "surrogateescape")
        if not isinstance_(path, strtype):
            return f"opening a {type_(path).__name__} object (not a path string)", True
        p = realpath(path)
        writing = isinstance_(mode, strtype) and any_(c in mode for c in "wax+")
        flags = args[2] if len_(args) > 2 and isinstance_(args[2], inttype) else 0
        writing = writing or bool_(flags & write_flags)
        if any_(startswith(p, s) for s in sensitive):
            return f"reading {p}", True
        if writing:
            return f"writing {p}", False
        if not any_(startswith(p, s) for s in allowed):
            return f"reading {p}", False
        return None, True

    return check


def _install_guard(report, state, sensitive, allowed):
    """An audit hook that refuses what grading does not need (it cannot be removed), and reports it."""
    refuse, frames, frame_events = _REFUSED_EVENTS, _FRAME_ATTRS, _FRAME_EVENTS
    sensitive, allowed = tuple(sensitive), tuple(allowed)  # nothing the student's code can change
    opened = _open_check(sensitive, allowed)
    startswith = str.startswith
    RuntimeErr, len_ = RuntimeError, len

    def hook(event, args):
        what = None
        serious = True
        if event in refuse:
            what = event
        elif event in frame_events or event == "object.__getattr__" and len_(args) > 1 and args[1] in frames:
            what = f"the interpreter's frames ({event if event in frame_events else args[1]})"
            if not startswith(state["phase"], "hidden case"):  # a namedtuple, logging, a traceback at top level
                report({"blocked": what, "serious": False, "allowed": True, "phase": state["phase"]})
                return
        elif event == "open":
            what, serious = opened(args)
        if what is None:
            return
        report({"blocked": what, "serious": serious, "phase": state["phase"]})
        raise RuntimeErr(f"{what} is not allowed while a submission is graded")

    sys.addaudithook(hook)


def _describe(exc) -> str:
    """``"ValueError: message"`` on one line, whatever the exception's methods do."""
    try:
        name = type(exc).__name__
        if not isinstance(name, str):
            name = "an exception"
    except BaseException:  # noqa: BLE001
        name = "an exception"
    try:
        msg = str(exc)
        if not isinstance(msg, str):
            msg = ""
    except BaseException:  # noqa: BLE001
        msg = ""
    msg = " ".join(msg.split())[:300]
    return f"{name}: {msg}" if msg else name


def _reporter(fd):
    """``report(obj)``: one JSON line to the pipe ``fd``, with the functions it needs bound now."""
    write = os.write
    dumps = json.dumps

    def report(obj):
        try:
            write(fd, (dumps(obj) + "\n").encode())
        except BaseException:  # noqa: BLE001
            pass

    return report


def _run_setup(setup, ns, report) -> bool:
    """Run the handout's own import cell in ``ns``; ``False`` (and the error reported) if it failed."""
    try:
        exec(compile(setup, "<setup cell>", "exec"), ns)  # noqa: S102 - the handout's own cell
    except BaseException as exc:  # noqa: BLE001
        report({"setup_error": _describe(exc)})
        return False
    return True


def _silence_checks():
    """The visible checks do not run when grading (they would call the references)."""
    try:
        from attnlib.course import exercises

        exercises.check = lambda *a, **k: None
        exercises.solved = lambda *a, **k: False
    except Exception:  # noqa: BLE001
        pass


def _run_cells(cells, ns, report, state):
    """Run the student's cells ``[(name, source)]`` in ``ns``, each in its own ``try``, reporting each."""
    for name, src in cells:
        state["phase"] = f"cell {name}"
        report({"cell": name, "start": True})
        try:
            exec(compile(src, f"<cell {name}>", "exec"), ns)  # noqa: S102 - the student's cell, in the guarded worker
            report({"cell": name, "ok": True})
        except SystemExit:
            report({"cell": name, "error": "SystemExit", "exit": True})
        except BaseException as exc:  # noqa: BLE001
            report({"cell": name, "error": _describe(exc)})


def _run_cases(fn, cases, report, state, is_own):
    """Call ``fn`` on every encoded case and report its result as plain data (or what it raised)."""
    for i, enc in enumerate(cases):
        args = tuple(decode(a) for a in enc)
        state["phase"] = f"hidden case {i + 1}"
        report({"case": i, "start": True})
        try:
            result = fn(*args)
            own_type = is_own(result)
            try:
                value = plain(result)
                err = None
            except ExerciseError as exc:
                value, err = None, str(exc)
            changed = [j for j, (a, e) in enumerate(zip(args, enc)) if isinstance(e, dict) and plain(a)["v"] != e["v"]]
            report({"case": i, "value": value, "error": err, "own_type": own_type, "changed": changed})
        except NotImplementedError:
            report({"case": i, "raised": "NotImplementedError", "stub": True})
        except SystemExit:
            report({"case": i, "raised": "SystemExit", "exit": True})
        except BaseException as exc:  # noqa: BLE001
            report({"case": i, "raised": _describe(exc)})


def _worker(job, fd):
    """The forked child: run the setup and the student's cells, call the function on the cases, report, exit.

    The traps and the audit hook are installed after the handout's setup cell
    and before the student's first cell; everything used after the student's
    cells ran (``own``, ``is_own``, ``run_cases``) is bound before they run.
    """
    import builtins

    exit_ = os._exit
    state = {"phase": "setup"}
    report = _reporter(fd)
    ns = {"__name__": "__main__", "__builtins__": builtins}
    if not _run_setup(job["setup"], ns, report):
        exit_(0)
    _silence_checks()
    _install_traps(job["forbidden"], report, state)
    _install_guard(report, state, job["sensitive"], job["allowed"])
    own = _refs()
    is_own = is_own_object
    run_cases = _run_cases
    _run_cells(job["cells"], ns, report, state)
    fn = ns.get(job["fn"])
    if fn is None or not callable(fn):
        report({"missing": own["type"](fn).__name__ if fn is not None else None})
        exit_(0)
    run_cases(fn, job["cases"], report, state, is_own)
    state["phase"] = "end"
    report({"end": True})
    exit_(0)


def _preimport():
    """Import torch, numpy, matplotlib (Agg) and every module of attnlib, so no library file is read later."""
    import importlib
    import pkgutil

    os.environ.setdefault("MPLBACKEND", "Agg")
    import numpy  # noqa: F401
    import torch  # noqa: F401

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
        import matplotlib.ticker  # noqa: F401
    except Exception:  # noqa: BLE001 - matplotlib is optional for grading
        pass
    import attnlib

    for info in pkgutil.walk_packages(attnlib.__path__, "attnlib."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - an optional module that does not import here
            pass
    _refs()


def _limit_memory(extra: int) -> None:
    """Address space: what the worker has now (torch and the library) plus ``extra`` bytes."""
    import resource

    try:
        with open("/proc/self/statm") as fh:
            now = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (now + extra, now + extra))
    except (OSError, ValueError):  # pragma: no cover - not Linux
        pass


def _start_worker(job, r, w):
    """In the forked child: its own process group, no terminal, the job's folder, the memory cap; never returns."""
    try:
        os.close(r)
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.chdir(job["cwd"])
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
        _limit_memory(job.get("memory", 4 << 30))
        _worker(job, w)
    finally:
        os._exit(0)


def _read_reports(r, deadline):
    """What the worker writes to the pipe ``r`` until it closes it or ``deadline`` passes: ``(bytes, timed_out)``."""
    import select
    import time

    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return buf, True
        ready, _, _ = select.select([r], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                return buf, False
            if len(buf) < _MAX_OUTPUT:
                buf += chunk


def _reap(pid, timed_out):
    """Kill a worker that ran out of time, wait for it and kill what else it started; its wait status."""
    import signal

    if timed_out:
        for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                kill()
            except OSError:
                pass
    _, status = os.waitpid(pid, 0)
    try:  # anything else the worker started in its group
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    return status


def _run_job(line):
    """Fork a worker for the job on ``line`` (JSON), collect its reports, reap it; the zygote's answer."""
    import time

    job = json.loads(line)
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the worker
        _start_worker(job, r, w)
    os.close(w)
    del job
    buf, timed_out = _read_reports(r, t0 + float(json.loads(line)["timeout"]))
    status = _reap(pid, timed_out)
    os.close(r)
    return {
        "lines": buf.decode("utf-8", "replace").splitlines(),
        "timed_out": timed_out,
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "seconds": time.monotonic() - t0,
    }


def _serve():
    """The zygote: read one job per line on stdin, fork a worker for it, answer one line on stdout."""
    import select  # noqa: F401 - imported before the first fork: every worker starts with the same modules
    import signal  # noqa: F401
    import time  # noqa: F401

    _preimport()
    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(_run_job(line)), file=out, flush=True)


# ----------------------------------------------------------------------------- the instructor's side


_EVENT_TYPES = {
    "case": int,
    "cell": str,
    "phase": str,
    "blocked": str,
    "forbidden": str,
    "raised": str,
    "error": (str, type(None)),
    "setup_error": str,
    "missing": (str, type(None)),
    "changed": list,
    "value": (dict, type(None)),
}


def _well_formed(ev) -> bool:
    """A worker's report as the worker writes it (a student's code could write other lines to the pipe)."""
    if not isinstance(ev, dict):
        return False
    for key, kind in _EVENT_TYPES.items():
        if key in ev and not isinstance(ev[key], kind) or key == "case" and key in ev and isinstance(ev[key], bool):
            return False
    value = ev.get("value")
    return value is None or _plain_literal(value)


def _plain_literal(v, depth=0) -> bool:
    if depth > 8 or not isinstance(v, dict):
        return False
    if "tuple" in v:
        return isinstance(v["tuple"], list) and all(_plain_literal(w, depth + 1) for w in v["tuple"])
    shape, vals = v.get("shape"), v.get("v")
    if not isinstance(shape, list) or not isinstance(vals, list):
        return False
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return False
    size = 1
    for n in shape:
        size *= n
    return size == len(vals) and all(isinstance(x, float) for x in vals)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Sandbox:
    """A zygote process that forks one guarded worker per graded cell (see the module's docstring).

    ``timeout`` is the limit, in seconds, of one worker; ``sensitive`` are
    folders whose files a worker may not read (the course folder, the book;
    the library's own folder is always one). Use as a context manager, or call
    ``close()``.
    """

    def __init__(self, timeout: float = 120.0, sensitive=()):
        import subprocess
        import tempfile

        if not timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        pkg = os.path.realpath(os.path.join(_package_root(), "attnlib"))
        self.sensitive = sorted({pkg + os.sep, *(os.path.realpath(str(s)) + os.sep for s in sensitive)})
        import site
        import sysconfig

        allowed = {sys.prefix, sys.base_prefix, sys.exec_prefix, sysconfig.get_paths()["stdlib"], os.devnull}
        allowed |= set(site.getsitepackages()) | {site.getusersitepackages()}
        self.allowed = sorted(os.path.realpath(a) for a in allowed if a)
        self._cwd = tempfile.mkdtemp(prefix="attnlib-grading-")
        env = dict(os.environ)
        env["PYTHONPATH"] = _package_root() + os.pathsep + env.get("PYTHONPATH", "")
        env["MPLBACKEND"] = "Agg"
        env.setdefault("OMP_NUM_THREADS", "1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "attnlib.course.hidden"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=self._cwd,
            env=env,
            text=True,
        )
        first = self._proc.stdout.readline()
        if not first.strip():
            raise RuntimeError("the grading process did not start (python -m attnlib.course.hidden)")

    def run(self, setup: str, cells, fn: str, cases, forbidden) -> dict:
        """Run one job: the setup source, ``[(name, source)]`` of student cells, the function's name, encoded cases.

        Returns the zygote's answer: ``lines`` (the worker's reports, parsed;
        unreadable ones dropped), ``timed_out``, ``exit``, ``signal``, ``seconds``.
        """
        job = {
            "setup": setup,
            "cells": [list(c) for c in cells],
            "fn": fn,
            "cases": cases,
            "forbidden": list(forbidden),
            "timeout": self.timeout,
            "sensitive": self.sensitive,
            "allowed": self.allowed,
            "cwd": self._cwd,
        }
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        answer = json.loads(self._proc.stdout.readline())
        events = []
        for line in answer.pop("lines"):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if _well_formed(ev):
                events.append(ev)
        answer["events"] = events
        return answer

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except Exception:  # noqa: BLE001
                self._proc.kill()
        import shutil

        shutil.rmtree(self._cwd, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    _serve()
