"""Size limits of attnlib's functions (issue 19): at most 60 lines and at most 8 parameters each.

Measured with ``ast`` on every function and method of every module of ``attnlib`` (nested
functions too): its length is ``end_lineno - lineno + 1`` (decorators not counted, the docstring
counted), its parameters are every named one (positional-only, positional, keyword-only) except
``self`` and ``cls``, plus one for ``*args`` and one for ``**kwargs`` when present. A config object
(a dataclass) counts as one parameter, which is the way to pass a larger design.

``KNOWN`` lists functions over a limit that are still to be split (none now); a function that is
not listed may not grow over a limit, and a listed one that is fixed must be removed from the list
(the test says so), so the list only shrinks.
"""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60
MAX_PARAMS = 8

#: No module is excluded (the training modules were rewritten around one training API, issue 19).
EXCLUDED_MODULES: set = set()

#: Functions over a limit still to be split ("module:qualified name").
KNOWN: set = set()  # every function is within the limits now


def parameter_count(node: ast.AST) -> int:
    """Named parameters except ``self``/``cls``, plus one each for ``*args`` and ``**kwargs``."""
    a = node.args
    named = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def functions(tree: ast.AST):
    """``(qualified name, node)`` of every function and method, nested ones included."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


@functools.lru_cache(maxsize=None)
def over_the_limits(root: Path = ROOT):
    """``{"module:name": (lines, parameters)}`` of the functions of attnlib over a limit."""
    out = {}
    for path in sorted((root / "attnlib").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for name, node in functions(ast.parse(path.read_text(), filename=rel)):
            lines, params = node.end_lineno - node.lineno + 1, parameter_count(node)
            if lines > MAX_LINES or params > MAX_PARAMS:
                out[f"{rel}:{name}"] = (lines, params)
    return out


def test_the_measure_counts_lines_and_parameters():
    src = "class C:\n    def m(self, a, /, b, *args, c, **kw):\n        x = 1\n        return x\n"
    (name, node), *_ = [f for f in functions(ast.parse(src)) if f[0] == "C.m"]
    assert name == "C.m" and parameter_count(node) == 5 and node.end_lineno - node.lineno + 1 == 3


def test_no_function_over_60_lines_or_8_parameters():
    found = over_the_limits()
    new = {k: v for k, v in found.items() if k.split(":")[0] not in EXCLUDED_MODULES and k not in KNOWN}
    assert not new, "over the limits (lines, parameters): " + ", ".join(f"{k} {v}" for k, v in sorted(new.items()))


def test_known_exceptions_are_still_over_a_limit():
    """A listed function that now fits the limits must leave the list (which only shrinks)."""
    fixed = sorted(name for name in KNOWN if name not in over_the_limits())
    assert not fixed, f"{fixed} fit the limits now: remove them from KNOWN"


#: The packages by concept, lowest first; a module may import only from its own layer and the ones below.
LAYERS = (
    {"_validate", "rng", "linalg", "runtime"},
    {"model"},
    {"geometry"},
    {"optim"},
    {"analysis"},
    {"experiments"},
    {"plotting"},
    {"course"},
)


def _layer(dotted: str) -> int:
    """Layer of a module given by its dotted name under attnlib (``model.task`` -> 1)."""
    head = dotted.split(".")[0]
    for i, names in enumerate(LAYERS):
        if head in names:
            return i
    raise AssertionError(f"attnlib.{dotted}: in no layer of LAYERS")


def _internal_imports(path: Path):
    """``(line, dotted target under attnlib)`` of every import of attnlib inside ``path``."""
    mod = path.relative_to(ROOT / "attnlib").with_suffix("").parts
    package = list(mod if mod[-1] == "__init__" else mod[:-1])
    if package and package[-1] == "__init__":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            targets = (
                [".".join(base + node.module.split("."))]
                if node.module
                else [".".join(base + [a.name]) for a in node.names]
            )
            for t in targets:
                if t:
                    yield node.lineno, t
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for n in names:
                if n and n.startswith("attnlib."):
                    yield node.lineno, n[len("attnlib.") :]


def test_packages_import_only_those_below_them():
    """model < geometry < optim < analysis < experiments < plotting < course, over the foundation modules."""
    bad = []
    for path in sorted((ROOT / "attnlib").rglob("*.py")):
        if path == ROOT / "attnlib" / "__init__.py":
            continue  # the lazy top-level namespace
        rel = path.relative_to(ROOT / "attnlib").with_suffix("").as_posix().replace("/", ".")
        own = _layer(rel)
        for line, target in _internal_imports(path):
            if _layer(target) > own:
                bad.append(f"attnlib/{path.relative_to(ROOT / 'attnlib')}:{line} imports attnlib.{target}")
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_no_module_is_named_like_a_function():
    """No submodule shares its name with a public name of the package it is in (``train``, ``attention``)."""
    import importlib
    import pkgutil

    import attnlib

    clashes = []
    for info in pkgutil.walk_packages(attnlib.__path__, "attnlib."):
        parent, _, leaf = info.name.rpartition(".")
        pkg = importlib.import_module(parent)
        public = set(getattr(pkg, "__all__", ())) | set(getattr(pkg, "_EXPORTS", {}))
        if leaf in public:
            clashes.append(info.name)
    assert not clashes, clashes
