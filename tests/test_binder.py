"""Binder as readers get it: the environment of ``binder/`` alone, then ``binder/postBuild``, runs every chapter.

Built the way repo2docker builds it: a copy of the repository (repo2docker copies the repository into
the image), a fresh virtual environment of the interpreter ``binder/runtime.txt`` names (python3.11),
``pip install -r binder/requirements.txt`` and nothing else (the root requirements.txt is not read:
where ``binder/`` exists repo2docker reads that folder only), then ``bash binder/postBuild`` from the
repository root with the environment's ``bin`` first on ``PATH``. HOME, JUPYTER_CONFIG_DIR and
JUPYTER_DATA_DIR point into the test's temporary folder, so no configuration of the developer's is
read or written. Only pip's own settings are kept: its cache and its user configuration file (the
machine's package sources), passed as PIP_CACHE_DIR and PIP_CONFIG_FILE.

The tests then check that the reader's environment carries no test, lint, browser or book-build tools,
that nbgrader's instructor extensions (formgrader and the other server extensions, the JupyterLab
extension) are off as the server and JupyterLab read the configuration, and execute every chapter
(book/ch*.ipynb) with ``jupyter nbconvert --execute`` in that environment, one at a time, pinned to
one core (``taskset``; ATTNLIB/OMP/MKL/NUMBA threads 1) as on Binder (one CPU).

Memory, honestly: Binder (mybinder.org) enforces its 2 GB by the cgroup of the user's container,
which counts every page the container's processes use (anonymous memory and page cache), once each.
This test cannot create cgroups on an ordinary machine, so it measures, per chapter, (a) the peak of
the summed resident set size (RSS) of the whole process tree (nbconvert, the kernel and anything the
kernel starts), sampled every 0.2 s with psutil: it counts pages shared between processes more than
once (an overestimate on that account) and can miss a spike shorter than the sampling interval; and
(b) the kernel's own high-water mark (``ru_maxrss`` of the largest single process of the tree, exact,
from ``wait4``). It asserts both are below 2 GiB. Not measured: page cache and kernel memory that a
cgroup would charge, the browser session's load on the server, and several chapters open at once
(each a kernel of its own). The JupyterLab server a Binder reader also runs is started once (it must
start with JupyterLab's extension loaded and none of nbgrader's) and its RSS after start-up is
reported and added to each chapter's peak for a second check against 2 GiB.

Marked slow: on the 2-core development machine the build took 2 min (pip 104-107 s, postBuild 15 s)
and the seven chapters 3-4 min on one core, the whole file 5.5-6.5 min. Skipped (with the reason)
only where python3.11 is not installed.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
CHAPTERS = sorted((ROOT / "book").glob("ch*.ipynb"))
LIMIT = 2 * 1024**3  # Binder's memory limit, 2 GiB
CHAPTER_TIMEOUT = 1800  # s, one chapter, everything included (nbconvert's per-cell limit is 900 s)
# what a reader does not need; none of it may be installed in the reader's environment
DEVELOPER_MODULES = (
    "pytest",
    "_pytest",
    "nbval",
    "ruff",
    "jupyter_book",
    "myst_nb",
    "sphinx",
    "sphinx_book_theme",
    "pydata_sphinx_theme",
    "playwright",
    "selenium",
    "check_jsonschema",
    "zizmor",
)
DEVELOPER_DISTRIBUTIONS = (
    "pytest",
    "nbval",
    "ruff",
    "jupyter-book",
    "myst-nb",
    "sphinx",
    "sphinx-book-theme",
    "pydata-sphinx-theme",
    "playwright",
    "selenium",
    "check-jsonschema",
    "zizmor",
)
NBGRADER_SERVER_EXTENSIONS = ("formgrader", "course_list", "assignment_list", "validate_assignment")
# what the build must not inherit from the developer's shell
DROPPED_ENV = ("PYTHON", "JUPYTER", "IPYTHON", "VIRTUAL_ENV", "CONDA", "MPL", "ATTNLIB", "XDG_", "OMP_", "MKL_")
DROPPED_ENV += ("NUMBA_", "OPENBLAS_", "PYENV_VERSION")

pytestmark = pytest.mark.slow


def _interpreter():
    """The interpreter binder/runtime.txt names ("python-3.11" -> "python3.11") and its path, or None."""
    spec = (BINDER / "runtime.txt").read_text().strip()
    assert spec.startswith("python-"), f"binder/runtime.txt: expected python-X.Y, got {spec!r}"
    name = "python" + spec.removeprefix("python-")
    return name, shutil.which(name)


def _pip_settings():
    """pip's own settings on this machine, kept when HOME moves: its cache and its user configuration file
    (pip reads PIP_CONFIG_FILE in place of the user file); nothing of Jupyter's."""
    settings = {}
    if not os.environ.get("PIP_CACHE_DIR"):
        settings["PIP_CACHE_DIR"] = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip")
    if not os.environ.get("PIP_CONFIG_FILE"):
        config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        for path in (config_home / "pip" / "pip.conf", Path.home() / ".pip" / "pip.conf"):
            if path.is_file():
                settings["PIP_CONFIG_FILE"] = str(path)
                break
    return settings


def _unreachable_indexes(requirements):
    """The --index-url / --extra-index-url lines of a requirements file whose host does not resolve."""
    urls = re.findall(r"(?m)^\s*--(?:extra-)?index-url[=\s]+(\S+)", requirements.read_text())
    bad = []
    for url in urls:
        host = urllib.parse.urlsplit(url).hostname
        try:
            socket.getaddrinfo(host, 443)
        except OSError:
            bad.append(url)
    return bad


def _core():
    """One core this process may run on (the lowest of its affinity mask)."""
    return min(os.sched_getaffinity(0))


class Reader:
    """The reader's environment: the repository copy, the venv and the environment variables."""

    def __init__(self, base):
        self.base = base
        self.repo = base / "repo"
        self.venv = base / "venv"
        self.home = base / "home"
        self.config_dir = self.home / ".jupyter"
        self.data_dir = self.home / ".local" / "share" / "jupyter"
        self.bin = self.venv / "bin"
        self.python = self.bin / "python"
        env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_ENV)}
        env.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            HOME=str(self.home),
            JUPYTER_CONFIG_DIR=str(self.config_dir),
            JUPYTER_DATA_DIR=str(self.data_dir),
            PYTHONNOUSERSITE="1",
        )
        env.update(_pip_settings())
        self.env = env

    def run(self, *args, cwd=None, timeout=600, check=True, **env):
        proc = subprocess.run(
            [str(a) for a in args],
            cwd=cwd or self.repo,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    def probe(self, code, cwd=None):
        """Run Python code in the reader's environment; its stdout parsed as JSON."""
        return json.loads(self.run(self.python, "-c", code, cwd=cwd).stdout)


# not copied: git's folder, environments, build outputs and caches anywhere; experiment scratch and course
# folders at the top only (.gitignore); attnlib/course is the library's and is copied
SKIP_ANYWHERE = {".git", ".venv", "venv", "_build", "__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
SKIP_ANYWHERE |= {".jupyter_cache", "jupyter_execute", ".attnlib_kernels", "build", "dist"}
SKIP_AT_TOP = {"runs", "course", "courses", "submissions"}


def _copy_repository(dest):
    def ignore(folder, names):
        top = Path(folder) == ROOT
        return {n for n in names if n in SKIP_ANYWHERE or n.endswith(".egg-info") or (top and n in SKIP_AT_TOP)}

    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """Build the reader's environment once: binder/requirements.txt alone, then binder/postBuild."""
    name, exe = _interpreter()
    if exe is None:
        pytest.skip(f"{name} (binder/runtime.txt) is not installed: cannot build the Binder environment")
    base = tmp_path_factory.mktemp("binder")
    r = Reader(base)
    r.home.mkdir()
    _copy_repository(r.repo)
    t0 = time.monotonic()
    # the interpreter with the developer's environment (a pyenv shim needs its HOME); the venv is fresh
    subprocess.run([exe, "-m", "venv", str(r.venv)], check=True, capture_output=True, timeout=300)
    # only binder/requirements.txt: its own --extra-index-url line gives pip the CPU torch index. Where
    # that index does not resolve (a machine without general network access), pip would retry it for
    # every package (about 8 s each): it skips it at once instead, and torch comes from the machine's
    # other sources (test_reader_environment_has_no_developer_tools checks that it is 2.13.0+cpu)
    requirements = r.repo / "binder" / "requirements.txt"
    unreachable = _unreachable_indexes(requirements)
    retries = ["--retries", "0"] if unreachable else []
    if unreachable:
        print(f"\nindex not reachable from this machine, not retried: {', '.join(unreachable)}")
    r.run(r.python, "-m", "pip", "install", "-q", *retries, "-r", requirements, timeout=1800)
    t1 = time.monotonic()
    # repo2docker: postBuild from the repository root, after requirements.txt
    r.run("bash", r.repo / "binder" / "postBuild", timeout=600)
    t2 = time.monotonic()
    print(f"\nBinder environment: pip install -r binder/requirements.txt {t1 - t0:.0f} s, postBuild {t2 - t1:.0f} s")
    yield r
    # the environment is 1.6 GB: removed; the logs, the executed chapters and the table stay
    shutil.rmtree(r.venv, ignore_errors=True)
    shutil.rmtree(r.home, ignore_errors=True)


def test_runtime_is_the_python_of_the_root_environment():
    name, _ = _interpreter()
    assert name == "python3.11", "binder/runtime.txt and the root environment (README, .ci/run) use Python 3.11"


def test_reader_environment_has_no_developer_tools(reader):
    found = reader.probe(
        "import importlib.util, json; "
        f"print(json.dumps([m for m in {list(DEVELOPER_MODULES)!r} if importlib.util.find_spec(m)]))"
    )
    assert found == [], f"developer tools importable in the reader's environment: {found}"
    installed = {
        d["name"].lower().replace("_", "-"): d["version"]
        for d in json.loads(reader.run(reader.python, "-m", "pip", "list", "--format=json").stdout)
    }
    assert not set(DEVELOPER_DISTRIBUTIONS) & set(installed), set(DEVELOPER_DISTRIBUTIONS) & set(installed)
    for tool in ("pytest", "ruff", "jupyter-book", "playwright", "nbval"):
        assert not (reader.bin / tool).exists(), tool
    # the CPU build of torch, the pinned one, and no CUDA libraries
    assert installed["torch"] == "2.13.0+cpu", installed["torch"]
    assert not [n for n in installed if n.startswith("nvidia-")]
    # exactly the pinned versions (tests/test_site_code.py checks that they are the test environment's)
    for name, version in installed.items():
        pinned = [
            ln.split("==")[1].strip()
            for ln in (BINDER / "requirements.txt").read_text().splitlines()
            if ln.split("==")[0].strip().lower() == name
        ]
        if pinned:
            assert version.split("+")[0] == pinned[0], (name, version, pinned[0])
    # attnlib: the checkout's, installed by postBuild (editable), as the chapters import it from book/
    where = reader.probe("import json, attnlib; print(json.dumps(attnlib.__file__))", cwd=reader.repo / "book")
    assert Path(where).is_relative_to(reader.repo / "attnlib"), where


def test_nbgrader_instructor_extensions_are_off(reader):
    # what postBuild wrote, in the reader's own configuration folder
    server_cfg = json.loads((reader.config_dir / "jupyter_server_config.json").read_text())
    exts = server_cfg["ServerApp"]["jpserver_extensions"]
    for name in NBGRADER_SERVER_EXTENSIONS:
        assert exts[f"nbgrader.server_extensions.{name}"] is False, name
    page_cfg = json.loads((reader.config_dir / "labconfig" / "page_config.json").read_text())
    assert page_cfg["disabledExtensions"].get("@jupyter/nbgrader") is True, page_cfg
    assert page_cfg["lockedExtensions"].get("@jupyter/nbgrader") is True, page_cfg
    # without it they would be on: nbgrader's package enables them in the environment's own config
    installed = json.loads((reader.venv / "etc" / "jupyter" / "jupyter_server_config.d" / "nbgrader.json").read_text())[
        "ServerApp"
    ]["jpserver_extensions"]
    assert any(installed.values()), installed
    assert (reader.venv / "share" / "jupyter" / "labextensions" / "@jupyter" / "nbgrader").is_dir()
    # as the server reads the whole configuration path: nbgrader's off, JupyterLab on
    # (ServerApp's own steps: its config files, then the extensions' .d files for what those leave unset)
    effective = reader.probe(
        "import json; from jupyter_server.serverapp import ServerApp; app = ServerApp(); "
        "app.parse_command_line([]); app.load_config_file(); app.find_server_extensions(); "
        "print(json.dumps(dict(app.jpserver_extensions)))"
    )
    for name in NBGRADER_SERVER_EXTENSIONS:
        assert effective.get(f"nbgrader.server_extensions.{name}") is False, (name, effective)
    assert effective.get("jupyterlab") is True, effective
    # and as JupyterLab lists it
    listing = reader.run("jupyter", "labextension", "list")
    status = [ln for ln in (listing.stdout + listing.stderr).splitlines() if re.search(r"@jupyter/nbgrader v\d", ln)]
    assert status and all("disabled" in ln for ln in status), status


def _tree_rss(root):
    """Summed RSS of a process and its descendants, in bytes."""
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, []
    total = 0
    for p in tree:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total, tree


SERVER = {}  # the JupyterLab server's RSS after start-up, for the chapters' second memory check


def test_jupyterlab_server_starts_without_nbgrader(reader):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = reader.base / "server.log"
    cmd = [reader.bin / "jupyter", "lab", "--no-browser", f"--ServerApp.port={port}", "--ServerApp.ip=127.0.0.1"]
    cmd += ["--IdentityProvider.token=binder-test"]
    if os.geteuid() == 0:  # Binder's user is not root; a CI container's often is
        cmd += ["--allow-root"]
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=reader.repo, env=reader.env, stdout=fh, stderr=fh)
    try:
        deadline = time.monotonic() + 180
        while "is running at" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)  # settled
        text = log.read_text()
        assert "is running at" in text, text[-3000:]
        SERVER["rss"], _ = _tree_rss(psutil.Process(proc.pid))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    loaded = [ln for ln in text.splitlines() if "extension was successfully loaded" in ln]
    assert any("jupyterlab |" in ln for ln in loaded), text[-3000:]
    assert not [ln for ln in loaded if "nbgrader" in ln], loaded
    print(f"\nJupyterLab server after start-up: RSS {SERVER['rss'] / 2**20:.0f} MiB")


def _measure(cmd, cwd, env, log, timeout):
    """Run cmd; return (exit code, peak summed RSS of its process tree, largest single ru_maxrss), in bytes."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    peak, deadline = 0, time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        total, tree = _tree_rss(root)
        peak = max(peak, total)
        if time.monotonic() > deadline:
            for p in reversed(tree):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, peak, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def test_every_chapter_runs_on_one_core_within_binders_memory(reader):
    assert CHAPTERS, "no chapters in book/"
    out = reader.base / "executed"
    out.mkdir()
    book = reader.repo / "book"
    taskset = shutil.which("taskset")
    pin = [taskset, "-c", str(_core())] if taskset else []
    threads = {k: "1" for k in ("ATTNLIB_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}
    env = {**reader.env, **threads}
    # the kernel is the reader's: its python, one core, one thread (a notebook of one cell, run the same way)
    probe = reader.base / "probe.ipynb"
    code = (
        "import json, os, sys, torch, attnlib\n"
        "print(json.dumps(dict(exe=sys.executable, cores=len(os.sched_getaffinity(0)), "
        "threads=torch.get_num_threads(), attnlib=attnlib.__file__)))"
    )
    cell = {"cell_type": "code", "metadata": {}, "source": code, "outputs": [], "execution_count": None}
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    probe_nb = {"cells": [cell], "metadata": {"kernelspec": kernelspec}, "nbformat": 4, "nbformat_minor": 5}
    probe.write_text(json.dumps(probe_nb))
    subprocess.run(
        [*pin, reader.bin / "jupyter", "nbconvert", "--to", "notebook", "--execute", "--output-dir", out, probe],
        cwd=book,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    outputs = json.loads((out / "probe.ipynb").read_text())["cells"][0]["outputs"]
    text = "".join("".join(o["text"]) for o in outputs if o.get("name") == "stdout")
    seen = json.loads(text)
    assert Path(seen["exe"]).parent == reader.bin, seen
    assert Path(seen["attnlib"]).is_relative_to(reader.repo), seen
    assert seen["threads"] == 1 and (seen["cores"] == 1 or not taskset), seen

    rows, failures = [], []
    for chapter in CHAPTERS:
        nb = book / chapter.name
        log = reader.base / f"{chapter.stem}.log"
        cmd = [*pin, reader.bin / "jupyter", "nbconvert", "--to", "notebook", "--execute"]
        cmd += ["--output-dir", out, "--ExecutePreprocessor.timeout=900", nb]
        t0 = time.monotonic()
        code, tree_peak, single_peak = _measure([str(c) for c in cmd], book, env, log, CHAPTER_TIMEOUT)
        wall = time.monotonic() - t0
        errors = []
        if code == 0:
            executed = json.loads((out / chapter.name).read_text())
            errors = [
                o.get("ename", "") + ": " + o.get("evalue", "")
                for c in executed["cells"]
                for o in c.get("outputs", [])
                if o.get("output_type") == "error"
            ]
        else:
            errors = [f"nbconvert exit {code}: " + log.read_text()[-2000:]]
        rows.append((chapter.stem, wall, tree_peak, single_peak, "ok" if not errors else "FAILED"))
        print(f"{chapter.stem}: {wall:.0f} s, tree RSS peak {tree_peak / 2**20:.0f} MiB, ", end="")
        print(f"largest process {single_peak / 2**20:.0f} MiB, {rows[-1][-1]}", flush=True)
        if errors:
            failures.append((chapter.stem, errors))
        checks = [("process-tree RSS", tree_peak), ("process RSS", single_peak)]
        if "rss" in SERVER:
            checks.append(("process-tree RSS plus the JupyterLab server's", tree_peak + SERVER["rss"]))
        for what, value in checks:
            if value >= LIMIT:
                failures.append((chapter.stem, [f"{what} peak {value / 2**30:.2f} GiB >= 2 GiB"]))

    cpu = f"`taskset -c {_core()}`" if taskset else "no taskset (all cores of this process)"
    table = [
        "# Chapters in the Binder environment (binder/ alone, then postBuild)",
        "",
        f"One core ({cpu}, ATTNLIB/OMP/MKL/NUMBA threads 1), Python {sys.version_info.major}.{sys.version_info.minor}"
        f" test runner, {psutil.cpu_count()} CPUs on the machine. Peak RSS: summed over the process tree"
        " (sampled every 0.2 s) and of the largest single process (ru_maxrss).",
        "",
        "| chapter | wall time (s) | peak RSS, process tree (MiB) | peak RSS, largest process (MiB) | result |",
        "|---|---:|---:|---:|---|",
    ]
    table += [f"| {c} | {w:.0f} | {t / 2**20:.0f} | {s / 2**20:.0f} | {res} |" for c, w, t, s, res in rows]
    table += [f"| total | {sum(r[1] for r in rows):.0f} | | | |"]
    if "rss" in SERVER:
        table += ["", f"JupyterLab server after start-up (no notebook open): RSS {SERVER['rss'] / 2**20:.0f} MiB."]
    report = reader.base / "binder_chapters.md"
    report.write_text("\n".join(table) + "\n")
    print("\n" + "\n".join(table) + f"\n(written to {report})")
    assert not failures, failures
