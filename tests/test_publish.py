"""Publishing: tools/set_repository.py, the launch and repository buttons of the built book, and the
GitHub Pages workflow (.github/workflows/book.yml), linted offline."""

import os
import re
import shutil
import subprocess
import sys
import types
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
import yaml
from conftest import ROOT, TEST_REPOSITORY

sys.path.insert(0, str(ROOT / "tools"))
import set_repository as sr  # noqa: E402

SCRIPT = ROOT / "tools" / "set_repository.py"
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"
CHAPTERS = sorted(p.stem for p in (ROOT / "book").glob("ch*.ipynb"))
OWNED = {"repository", "html", "launch_buttons"}


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "_config.yml"
    shutil.copy2(ROOT / "_config.yml", path)
    return path


# ---------------------------------------------------------------------------------------------
# the committed configuration


def test_committed_config_is_the_unpublished_default():
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert cfg["repository"] == {"url": sr.PLACEHOLDER_URL, "branch": "main", "path_to_book": ""}
    assert not any(cfg["html"][k] for k in ("use_repository_button", "use_issues_button", "use_edit_page_button"))
    lb = cfg["launch_buttons"]
    assert not lb["thebe"] and not lb["binderhub_url"] and not lb["colab_url"]
    # html_theme_options would replace launch_buttons and repository wholesale (Jupyter Book 1.x)
    assert "html_theme_options" not in (cfg["sphinx"].get("config") or {})
    assert cfg["execute"]["execute_notebooks"] == "cache"
    assert "custom.css" in cfg["sphinx"]["config"]["html_css_files"]
    assert (ROOT / "book" / "static" / "custom.css").is_file()


# ---------------------------------------------------------------------------------------------
# tools/set_repository.py on a copy of the configuration


def test_substitutes_the_repository(config):
    before_text = config.read_text()
    before = yaml.safe_load(before_text)
    proc = _run("--url", TEST_REPOSITORY + ".git", "--branch", "main", "--config", str(config))
    assert proc.returncode == 0, proc.stderr
    after_text = config.read_text()
    after = yaml.safe_load(after_text)
    assert after["repository"] == {"url": TEST_REPOSITORY, "branch": "main", "path_to_book": ""}
    assert after["html"]["use_repository_button"] and after["html"]["use_issues_button"]
    assert after["html"]["use_edit_page_button"]
    assert after["launch_buttons"] == {
        "notebook_interface": "jupyterlab",
        "binderhub_url": "https://mybinder.org",
        "colab_url": "https://colab.research.google.com",
        "thebe": True,
    }
    # nothing else changes: the other keys, and every line (comments too) but the owned values
    assert {k: v for k, v in after.items() if k not in OWNED} == {k: v for k, v in before.items() if k not in OWNED}
    changed = [(a, b) for a, b in zip(before_text.splitlines(), after_text.splitlines()) if a != b]
    assert len(before_text.splitlines()) == len(after_text.splitlines())
    assert all(re.match(r"\s+(url|use_\w+_button|binderhub_url|colab_url|thebe):", b) for _, b in changed), changed


def test_is_idempotent_and_out_leaves_the_config_alone(config, tmp_path):
    original = config.read_text()
    out1, out2 = tmp_path / "one.yml", tmp_path / "two.yml"
    assert _run("--url", TEST_REPOSITORY, "--config", str(config), "--out", str(out1)).returncode == 0
    assert config.read_text() == original
    assert _run("--url", TEST_REPOSITORY + "/", "--config", str(out1), "--out", str(out2)).returncode == 0
    assert out1.read_text() == out2.read_text()
    # in place, twice: the second run changes nothing (not even the file's modification time)
    assert _run("--url", TEST_REPOSITORY, "--config", str(config)).returncode == 0
    assert config.read_text() == out1.read_text()
    mtime = config.stat().st_mtime_ns
    assert _run("--url", TEST_REPOSITORY, "--config", str(config)).returncode == 0
    assert config.stat().st_mtime_ns == mtime
    # another repository and branch replace the first
    sr.set_repository("https://github.com/other/book", "gh-pages", config)
    cfg = yaml.safe_load(config.read_text())
    assert cfg["repository"]["url"] == "https://github.com/other/book" and cfg["repository"]["branch"] == "gh-pages"


def test_adds_missing_blocks(tmp_path):
    path = tmp_path / "_config.yml"
    path.write_text('title: "x"\nhtml:\n  favicon: ""\n')
    sr.set_repository(TEST_REPOSITORY, "main", path)
    cfg = yaml.safe_load(path.read_text())
    assert cfg["title"] == "x" and cfg["html"]["favicon"] == "" and cfg["html"]["use_repository_button"]
    assert cfg["repository"]["url"] == TEST_REPOSITORY and cfg["launch_buttons"]["thebe"] is True


def test_refuses_html_theme_options(tmp_path):
    path = tmp_path / "_config.yml"
    path.write_text('sphinx:\n  config:\n    html_theme_options:\n      search_bar_text: "x"\n')
    with pytest.raises(ValueError, match="html_theme_options"):
        sr.set_repository(TEST_REPOSITORY, "main", path)


@pytest.mark.parametrize(
    "url",
    [
        "http://github.com/example-org/attnlib-book",
        "https://gitlab.com/a/b",
        "https://github.com/example-org",
        "https://github.com/a/b/tree/main",
        "github.com/a/b",
        "https://github.com/a/b?x=1",
        "https://github.com/a b/c",
        "javascript:alert(1)//github.com/a/b",
        "",
        sr.PLACEHOLDER_URL,
    ],
)
def test_rejects_a_bad_url(url, config):
    original = config.read_text()
    proc = _run("--url", url, "--config", str(config))
    assert proc.returncode == 2 and "--url" in proc.stderr, proc.stderr
    assert config.read_text() == original
    with pytest.raises(ValueError, match="--url"):
        sr.normalize_url(url)


@pytest.mark.parametrize("branch", ["", "a b", "../x", "-x", "main;rm -rf /", "x.lock"])
def test_rejects_a_bad_branch(branch, config):
    proc = _run("--url", TEST_REPOSITORY, "--branch", branch, "--config", str(config))
    assert proc.returncode == 2 and "--branch" in proc.stderr, proc.stderr


def test_missing_config_is_named(tmp_path):
    proc = _run("--url", TEST_REPOSITORY, "--config", str(tmp_path / "nope.yml"))
    assert proc.returncode == 2 and "--config" in proc.stderr


# ---------------------------------------------------------------------------------------------
# the colab-install cell, on a copy of a chapter


def _run_cell(source, in_colab):
    """Run the cell's source as IPython would, with a recording get_ipython; returns the magics run."""
    from IPython.core.inputtransformer2 import TransformerManager

    calls = []
    shell = types.SimpleNamespace(run_line_magic=lambda name, line: calls.append((name, line)))
    saved = sys.modules.pop("google.colab", None)
    try:
        if in_colab:
            sys.modules["google.colab"] = types.ModuleType("google.colab")
        exec(
            compile(TransformerManager().transform_cell(source), "<colab-install>", "exec"),
            {"get_ipython": lambda: shell},
        )
    finally:
        sys.modules.pop("google.colab", None)
        if saved is not None:
            sys.modules["google.colab"] = saved
    return calls


def test_colab_install_cell(tmp_path):
    nb_path = tmp_path / "ch1_model.ipynb"
    shutil.copy2(ROOT / "book" / "ch1_model.ipynb", nb_path)
    before = nbformat.read(nb_path, as_version=4)
    before_cells = [c for c in before.cells if sr.COLAB_TAG not in c.metadata.get("tags", [])]

    proc = _run("--url", TEST_REPOSITORY, "--no-config", "--notebook", str(nb_path))
    assert proc.returncode == 0, proc.stderr
    nb = nbformat.read(nb_path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    cell = code[0]
    assert sr.COLAB_TAG in cell.metadata["tags"] and "remove-cell" in cell.metadata["tags"]
    assert sum(sr.COLAB_TAG in c.metadata.get("tags", []) for c in nb.cells) == 1
    assert f'"attnlib @ git+{TEST_REPOSITORY}@main"' in cell.source and cell.outputs == []
    # every other cell is as it was, in the same order
    assert [c for c in nb.cells if c is not cell] == before_cells

    # harmless outside Colab (nbval, the book build, Binder): nothing runs; in Colab: one pip install
    assert _run_cell(cell.source, in_colab=False) == []
    assert _run_cell(cell.source, in_colab=True) == [("pip", f'install -q "attnlib @ git+{TEST_REPOSITORY}@main"')]

    # idempotent, and an update replaces the cell instead of adding one
    text = nb_path.read_text()
    assert sr.add_colab_install_cell(nb_path, TEST_REPOSITORY) is False and nb_path.read_text() == text
    assert sr.add_colab_install_cell(nb_path, "https://github.com/other/book", "dev") is True
    nb = nbformat.read(nb_path, as_version=4)
    tagged = [c for c in nb.cells if sr.COLAB_TAG in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0].id == cell.id
    assert "git+https://github.com/other/book@dev" in tagged[0].source
    assert [c for c in nb.cells if c.cell_type == "code"][0] is tagged[0]
    # a bad URL touches nothing
    assert _run("--url", "https://example.com/x/y", "--no-config", "--notebook", str(nb_path)).returncode == 2
    assert "other/book@dev" in nb_path.read_text()
    # several notebooks after one --notebook (the workflow passes book/ch*.ipynb)
    second = tmp_path / "ch2_population.ipynb"
    shutil.copy2(ROOT / "book" / "ch2_population.ipynb", second)
    proc = _run("--url", TEST_REPOSITORY, "--no-config", "--notebook", str(nb_path), str(second))
    assert proc.returncode == 0, proc.stderr
    for path in (nb_path, second):
        first = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"][0]
        assert f"git+{TEST_REPOSITORY}@main" in first.source


# ---------------------------------------------------------------------------------------------
# the built book (tests/conftest.py builds it for TEST_REPOSITORY)


class _Buttons(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.onclick = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if a.get("onclick"):
            self.onclick.append(a["onclick"])


@pytest.fixture(scope="module")
def html(built_book):
    html, log, returncode = built_book
    assert (html / "book" / "ch1_model.html").is_file(), log[-3000:]
    return html


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_has_launch_and_repository_buttons(chapter, html):
    page = (html / "book" / f"{chapter}.html").read_text()
    parser = _Buttons()
    parser.feed(page)
    org_repo = TEST_REPOSITORY.removeprefix("https://github.com/")
    source = f"book/{chapter}.ipynb"
    assert (ROOT / source).is_file()
    assert f"https://mybinder.org/v2/gh/{org_repo}/main?urlpath=lab/tree/{source}" in parser.links
    assert f"https://colab.research.google.com/github/{org_repo}/blob/main/{source}" in parser.links
    assert TEST_REPOSITORY in parser.links
    assert f"{TEST_REPOSITORY}/edit/main/{source}" in parser.links
    assert any(link.startswith(f"{TEST_REPOSITORY}/issues/new") for link in parser.links)
    # the Live Code button, and thebe asking Binder for this repository's branch, in book/
    assert "initThebeSBT()" in parser.onclick
    config = re.search(r'<script type="text/x-thebe-config">(.*?)</script>', page, re.S)
    assert config, "no thebe configuration on the page"
    assert f'repo: "{org_repo}"' in config[1] and 'ref: "main"' in config[1]
    assert 'path: "./book"' in config[1]


@pytest.mark.slow
def test_no_placeholder_repository_is_left(html):
    pages = sorted(html.rglob("*.html"))
    assert len(pages) > 10
    for page in pages:
        text = page.read_text(errors="replace")
        for placeholder in ("binder-examples", "executablebooks/jupyter-book", "OWNER/REPO"):
            assert placeholder not in text, (page.name, placeholder)


# ---------------------------------------------------------------------------------------------
# the GitHub Pages workflow


def test_workflow_builds_and_deploys_the_book():
    wf = yaml.safe_load(WORKFLOW.read_text())
    on = wf[True] if True in wf else wf["on"]  # PyYAML reads the key `on` as a boolean
    assert on["push"]["branches"] == ["main"] and "workflow_dispatch" in on
    assert wf["concurrency"]["group"]
    build, deploy = wf["jobs"]["build"], wf["jobs"]["deploy"]
    steps = build["steps"]
    uses = [s["uses"] for job in wf["jobs"].values() for s in job["steps"] if "uses" in s]
    assert all(re.fullmatch(r"actions/[\w-]+@v\d+", u) for u in uses), uses  # pinned by major tag
    names = [u.split("@")[0] for u in uses]
    for action in (
        "actions/checkout",
        "actions/setup-python",
        "actions/configure-pages",
        "actions/upload-pages-artifact",
        "actions/deploy-pages",
    ):
        assert action in names
    setup = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python"))
    assert str(setup["with"]["python-version"]) == "3.11"
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "pip install -r requirements.txt -e ." in runs
    assert "python tools/set_repository.py --url" in runs
    fill = next(s for s in steps if "set_repository.py" in s.get("run", ""))
    assert fill["env"]["REPO_URL"] == "https://github.com/${{ github.repository }}"
    assert fill["env"]["BRANCH"] == "${{ github.ref_name }}"
    assert "--notebook book/ch*.ipynb" in fill["run"]  # every chapter gets its colab-install cell
    assert "jupyter-book build . -W -n --keep-going" in runs
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-pages-artifact"))
    assert upload["with"]["path"] == "_build/html"
    assert deploy["needs"] == "build" and deploy["environment"]["name"] == "github-pages"
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    # the steps run in this order: fill in the repository before building, build before uploading
    order = [
        i for i, s in enumerate(steps) for key in ("set_repository.py", "jupyter-book build") if key in s.get("run", "")
    ]
    assert order == sorted(order) and order[-1] < steps.index(upload)


def _tool(name):
    exe = Path(sys.executable).with_name(name)
    path = str(exe) if exe.exists() else shutil.which(name)
    assert path, f"{name} is not installed (pip install -r requirements.txt)"
    return path


def _offline_env():
    """No network: any request would go to a closed local port; no GitHub token for zizmor."""
    env = {k: v for k, v in os.environ.items() if k not in ("GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN")}
    dead = "http://127.0.0.1:9"
    env.update(HTTP_PROXY=dead, HTTPS_PROXY=dead, http_proxy=dead, https_proxy=dead, NO_PROXY="", no_proxy="")
    return env


def _check_schema(workflows):
    """check-jsonschema against GitHub's workflow schema (vendored in the package)."""
    return subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *map(str, workflows)],
        capture_output=True,
        text=True,
        env=_offline_env(),
        timeout=300,
    )


def _audit(workflows):
    """zizmor's offline audits (template injection, credentials, permissions, pinning, ...)."""
    config = ROOT / ".github" / "zizmor.yml"
    return subprocess.run(
        [_tool("zizmor"), "--offline", "--no-progress", "--config", str(config), *map(str, workflows)],
        capture_output=True,
        text=True,
        env=_offline_env(),
        timeout=300,
    )


def test_workflows_lint_clean():
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert WORKFLOW in workflows
    schema, audit = _check_schema(workflows), _audit(workflows)
    assert schema.returncode == 0, schema.stdout + schema.stderr
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_linters_catch_broken_workflows(tmp_path):
    """The two linters do find what they are for (so a clean run above means something)."""
    bad_schema = tmp_path / "schema.yml"
    bad_schema.write_text(
        "on: push\njobs:\n  build:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - uses: actions/checkout@v4\n        wiht:\n          fetch-depth: 0\n"
    )
    injection = tmp_path / "injection.yml"
    injection.write_text(
        "on: issues\npermissions: {}\njobs:\n  greet:\n    runs-on: ubuntu-latest\n"
        "    steps:\n      - run: echo \"${{ github.event.issue.title }}\"\n"
    )
    schema = _check_schema([bad_schema])
    assert schema.returncode != 0, schema.stdout
    audit = _audit([injection])
    assert audit.returncode != 0 and "template-injection" in audit.stdout + audit.stderr, audit.stdout
