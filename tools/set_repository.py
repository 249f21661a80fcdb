#!/usr/bin/env python3
"""Point the book at the repository it is published from.

    python tools/set_repository.py --url https://github.com/OWNER/REPO [--branch main]
                                   [--config _config.yml] [--out PATH]
    python tools/set_repository.py --url https://github.com/OWNER/REPO --no-config --notebook book/ch1_model.ipynb

Sets, in ``_config.yml`` (in place, or a substituted copy with ``--out``):

* ``repository``: ``url``, ``branch`` and ``path_to_book: ""`` (the book's root is the repository
  root, so a chapter's source is ``book/<chapter>.ipynb`` in the repository, which is what the
  Binder, Colab and edit links need);
* ``html``: the repository, issues and edit-page buttons;
* ``launch_buttons``: Binder (``https://mybinder.org``, which builds ``binder/``), Colab, the
  JupyterLab interface and ``thebe: true`` (the "Live Code" button: sphinx-book-theme then gives
  thebe this repository and branch instead of sphinx-thebe's own example repository).

Only these keys change; the rest of the file (comments included) is kept as it is, and running the
script again with the same arguments changes nothing. The GitHub Pages workflow
(``.github/workflows/book.yml``) runs it with the repository it builds.

``--notebook PATH`` (repeatable) adds to each notebook, or updates, a first code cell tagged
``colab-install`` that installs attnlib from the repository when, and only when, the notebook runs
in Google Colab (elsewhere the library is installed and the cell does nothing).

Everything the script needs is in the standard library, PyYAML and nbformat (both come with
jupyter-book).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLACEHOLDER_URL = "https://github.com/OWNER/REPO"
BINDERHUB_URL = "https://mybinder.org"
COLAB_URL = "https://colab.research.google.com"
NOTEBOOK_INTERFACE = "jupyterlab"
COLAB_TAG = "colab-install"

_URL = re.compile(r"https://github\.com/(?P<owner>[A-Za-z0-9](?:[A-Za-z0-9-]{0,38}))/(?P<repo>[A-Za-z0-9._-]{1,100})")
_BRANCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
_TOP_KEY = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_-]*)\s*:(?P<rest>.*)$")


class UsageError(ValueError):
    """A bad argument; the message starts with the argument's name."""


def normalize_url(url: str) -> str:
    """``https://github.com/OWNER/REPO`` (a trailing ``/`` or ``.git`` is dropped); UsageError otherwise."""
    if not isinstance(url, str):
        raise UsageError(f"--url: expected a string, got {type(url).__name__}")
    candidate = url.strip()
    candidate = candidate[:-1] if candidate.endswith("/") else candidate
    candidate = candidate[:-4] if candidate.endswith(".git") else candidate
    m = _URL.fullmatch(candidate)
    if not m or m["repo"] in {".", ".."} or m["owner"].endswith("-"):
        raise UsageError(
            f"--url: expected a GitHub repository as https://github.com/OWNER/REPO "
            f"(Binder's and Colab's launch links need one), got {url!r}"
        )
    if candidate == PLACEHOLDER_URL:
        raise UsageError(f"--url: {url!r} is the placeholder; give the real repository")
    return candidate


def validate_branch(branch: str) -> str:
    """A plain git branch name (letters, digits, ``._/-``); UsageError otherwise."""
    if (
        not isinstance(branch, str)
        or not _BRANCH.fullmatch(branch)
        or ".." in branch
        or branch.endswith((".", "/", ".lock"))
        or "//" in branch
    ):
        raise UsageError(f"--branch: expected a git branch name such as 'main', got {branch!r}")
    return branch


def settings(url: str, branch: str = "main") -> dict[str, dict[str, object]]:
    """The keys this script owns in ``_config.yml``, by top-level block."""
    url, branch = normalize_url(url), validate_branch(branch)
    return {
        "repository": {"url": url, "branch": branch, "path_to_book": ""},
        "html": {"use_repository_button": True, "use_issues_button": True, "use_edit_page_button": True},
        "launch_buttons": {
            "notebook_interface": NOTEBOOK_INTERFACE,
            "binderhub_url": BINDERHUB_URL,
            "colab_url": COLAB_URL,
            "thebe": True,
        },
    }


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(str(value))  # a YAML double-quoted string (the values here are plain ASCII)


def _block(lines: list[str], key: str) -> tuple[int, int] | None:
    """(index of ``key:``, index after its last indented line) of a top-level block, or None."""
    start = next((i for i, line in enumerate(lines) if (m := _TOP_KEY.match(line)) and m["key"] == key), None)
    if start is None:
        return None
    end = start + 1
    for i in range(start + 1, len(lines)):
        if lines[i][:1] in (" ", "\t"):
            end = i + 1
        elif lines[i].strip() and not lines[i].lstrip().startswith("#"):
            break
    return start, end


def _set_block_keys(lines: list[str], key: str, values: dict[str, object]) -> list[str]:
    span = _block(lines, key)
    if span is None:
        if lines and lines[-1].strip():
            lines = lines + [""]
        return lines + [f"{key}:"] + [f"  {k}: {_scalar(v)}" for k, v in values.items()]
    start, end = span
    if _TOP_KEY.match(lines[start])["rest"].split("#")[0].strip():
        raise ValueError(
            f"_config.yml: '{key}' is not a block mapping ({lines[start]!r}); write it as "
            f"'{key}:' followed by indented keys"
        )
    body = lines[start + 1 : end]
    indents = [len(l) - len(l.lstrip()) for l in body if l.strip() and not l.lstrip().startswith("#")]
    indent = " " * (min(indents) if indents else 2)
    for k, v in values.items():
        pattern = re.compile(rf"^{indent}{re.escape(k)}\s*:")
        new = f"{indent}{k}: {_scalar(v)}"
        hits = [i for i, l in enumerate(body) if pattern.match(l)]
        if hits:
            body[hits[0]] = new
        else:
            last = max((i for i, l in enumerate(body) if l.strip()), default=-1)
            body.insert(last + 1, new)
    return lines[: start + 1] + body + lines[end:]


def substitute(text: str, url: str, branch: str = "main") -> str:
    """``_config.yml``'s text with the repository keys set; the rest of the text is kept."""
    import yaml

    wanted = settings(url, branch)
    before = yaml.safe_load(text) or {}
    if "html_theme_options" in (((before.get("sphinx") or {}).get("config")) or {}):
        # Jupyter Book 1.x: sphinx.config.html_theme_options replaces the theme options it derives
        # from launch_buttons and repository, so the buttons set here would silently vanish
        raise ValueError(
            "_config.yml sets sphinx.config.html_theme_options, which replaces launch_buttons and "
            "repository wholesale; move those settings to the top-level keys"
        )
    lines = text.splitlines()
    for key, values in wanted.items():
        lines = _set_block_keys(lines, key, values)
    out = "\n".join(lines) + "\n"
    # the result must parse, carry the values, and leave every other key as it was
    after = yaml.safe_load(out)
    expected = dict(before)
    for key, values in wanted.items():
        expected[key] = {**(before.get(key) or {}), **values}
    if after != expected:
        raise RuntimeError(
            "set_repository: the substituted _config.yml does not read back as intended; "
            "edit the repository/html/launch_buttons blocks by hand"
        )
    return out


def set_repository(
    url: str, branch: str = "main", config: Path | str = ROOT / "_config.yml", out: Path | str | None = None
) -> Path:
    """Substitute ``config`` in place, or write the substituted copy to ``out``; returns the file written."""
    config = Path(config)
    if not config.is_file():
        raise UsageError(f"--config: no such file: {config}")
    text = config.read_text(encoding="utf-8")
    new = substitute(text, url, branch)
    target = Path(out) if out is not None else config
    if target != config or new != text:
        target.write_text(new, encoding="utf-8")
    return target


def colab_install_source(url: str, branch: str = "main") -> str:
    """The source of the ``colab-install`` cell."""
    url, branch = normalize_url(url), validate_branch(branch)
    return (
        "# Google Colab only: install the book's library from its repository. Elsewhere (Binder, a\n"
        "# local environment, the book's build and tests) attnlib is installed and this does nothing.\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        f'    %pip install -q "attnlib @ git+{url}@{branch}"'
    )


def add_colab_install_cell(notebook: Path | str, url: str, branch: str = "main") -> bool:
    """Add (or update) the ``colab-install`` cell as the notebook's first code cell; True when the file changed.

    The cell is tagged ``colab-install`` and ``remove-cell`` (the book's pages do not show it). An
    existing ``colab-install`` cell keeps its id and other metadata and is moved before the first
    other code cell.
    """
    import nbformat

    notebook = Path(notebook)
    if not notebook.is_file():
        raise UsageError(f"--notebook: no such file: {notebook}")
    source = colab_install_source(url, branch)
    original = notebook.read_text(encoding="utf-8")
    nb = nbformat.reads(original, as_version=4)
    tagged = [c for c in nb.cells if c.cell_type == "code" and COLAB_TAG in c.metadata.get("tags", [])]
    cell = tagged[0] if tagged else nbformat.v4.new_code_cell()
    nb.cells = [c for c in nb.cells if not any(c is t for t in tagged)]
    cell.source = source
    cell.outputs, cell.execution_count = [], None
    tags = list(cell.metadata.get("tags", []))
    cell.metadata["tags"] = tags + [t for t in (COLAB_TAG, "remove-cell") if t not in tags]
    first_code = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), len(nb.cells))
    nb.cells.insert(first_code, cell)
    nbformat.validate(nb)
    new = nbformat.writes(nb) + "\n"
    if new == original:
        return False
    notebook.write_text(new, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True, help="the repository, https://github.com/OWNER/REPO")
    parser.add_argument("--branch", default="main", help="the branch the links point at (default: main)")
    parser.add_argument("--config", default=str(ROOT / "_config.yml"), help="the book's _config.yml")
    parser.add_argument("--out", help="write the substituted config here instead of changing --config")
    parser.add_argument("--no-config", action="store_true", help="leave the config alone (with --notebook)")
    parser.add_argument(
        "--notebook",
        action="extend",
        nargs="+",
        default=[],
        metavar="PATH",
        help="add or update the colab-install cell in these notebooks (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        url, branch = normalize_url(args.url), validate_branch(args.branch)
        if args.no_config and (args.out or not args.notebook):
            raise UsageError("--no-config: give --notebook, and no --out")
        if not args.no_config:
            written = set_repository(url, branch, args.config, args.out)
            print(f"{written}: repository {url} (branch {branch}), launch and repository buttons on")
        for path in args.notebook:
            changed = add_colab_install_cell(path, url, branch)
            print(f"{path}: colab-install cell {'written' if changed else 'already up to date'}")
    except UsageError as exc:
        parser.error(str(exc))
    except (ValueError, RuntimeError) as exc:  # a config or notebook the script cannot edit safely
        parser.error(f"--config/--notebook: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
