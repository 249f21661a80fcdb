r"""MyST to plain Markdown, for the student versions of the chapters.

The book's Markdown is MyST (Jupyter Book): directives such as ``{exercise}``
and ``{prf:proposition}``, admonitions, and roles such as ``{cite}``,
``{doc}`` and ``{prf:ref}``. JupyterLab and the classic notebook show those
as raw source. :func:`to_markdown` rewrites them at release into the Markdown every
notebook front end renders (headings, bold lead-ins, block quotes, ``$$``
math), so the handouts need no JupyterLab extension. Maths in ``$...$`` and
``$$...$$`` is left alone: every front end renders it with MathJax.

Directives are found with markdown-it-py (MyST's own parser, with mdit-py-plugins' colon
fences), references are read with pybtex; roles are rewritten by a regular expression.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["to_markdown", "labels_of", "read_bib", "title_of"]

_OPEN = re.compile(r"^(?P<fence>`{3,}|~{3,}|:{3,})\{(?P<name>[\w:.-]+)\}[ \t]*(?P<arg>.*)$")
_OPTION = re.compile(r"^:(?P<key>[\w-]+):[ \t]*(?P<value>.*)$")
_ROLE = re.compile(r"\{(?P<name>[\w:.-]+)\}`(?P<text>[^`]*)`")
_EXPLICIT = re.compile(r"^(?P<text>.*?)\s*<(?P<target>[^<>]+)>$", re.S)

#: Directives that hold a solution: dropped from a student's version altogether.
SOLUTION_DIRECTIVES = {"solution", "solution-start", "solution-end"}
_ADMONITIONS = {
    "note",
    "tip",
    "hint",
    "important",
    "warning",
    "caution",
    "attention",
    "danger",
    "error",
    "seealso",
    "admonition",
}
_CODE = {"code", "code-block", "code-cell", "sourcecode"}


def _title(name: str) -> str:
    return name.split(":")[-1].replace("-", " ").capitalize()


def _body_lines(lines: List[str]):
    """Split a directive's lines into its options and its body."""
    options: Dict[str, str] = {}
    i = 0
    while i < len(lines) and _OPTION.match(lines[i]):
        m = _OPTION.match(lines[i])
        options[m["key"]] = m["value"].strip()
        i += 1
    if i < len(lines) and options and not lines[i].strip():
        i += 1
    return options, lines[i:]


def _render(name: str, arg: str, options: Dict[str, str], body: str) -> Optional[str]:
    """Markdown for one directive (``None``: drop it)."""
    body = body.strip("\n")
    if name in SOLUTION_DIRECTIVES:
        return None
    if name == "exercise":
        return f"### Exercise {arg}".rstrip() + ("\n\n" + body if body else "")
    if name == "prf:proof":
        return f"*Proof.* {body} $\\square$" if body else ""
    if name.startswith("prf:"):
        lead = _title(name) + (f" ({arg})" if arg else "")
        return f"**{lead}.** {body}"
    if name in _ADMONITIONS:
        lead = arg if name == "admonition" and arg else (arg or _title(name))
        text = f"**{lead}.** {body}" if name != "admonition" else f"**{lead}.**\n\n{body}"
        return "\n".join("> " + line if line else ">" for line in text.splitlines())
    if name in {"math", "prf:equation"}:
        return f"$$\n{body}\n$$"
    if name in _CODE:
        return f"```{arg}\n{body}\n```"
    if name in {"dropdown", "toggle", "card"}:
        return (f"**{arg}**\n\n" if arg else "") + body
    if name in {"figure", "image"}:
        return f"![{body or arg}]({arg})"
    return body


def _parser():
    from markdown_it import MarkdownIt
    from mdit_py_plugins.colon_fence import colon_fence_plugin

    return MarkdownIt("commonmark").use(colon_fence_plugin)


def _directives(text: str) -> str:
    """``text`` with every top-level MyST directive (a fence whose info is ``{name}``) rendered as Markdown.

    The blocks are found by markdown-it-py (with mdit-py-plugins' colon fences, as MyST parses
    them); a directive's body is converted recursively, other lines are kept as they are.
    """
    lines = text.split("\n")
    out: List[str] = []
    done = 0
    for tok in _parser().parse(text):
        if tok.level != 0 or tok.type not in ("fence", "colon_fence") or not tok.map:
            continue
        m = re.match(r"^\{(?P<name>[\w:.-]+)\}[ \t]*(?P<arg>.*)$", tok.info.strip())
        if not m:
            continue
        start, end = tok.map
        out += lines[done:start]
        options, body = _body_lines(tok.content.rstrip("\n").split("\n"))
        rendered = _render(m["name"], m["arg"].strip(), options, _directives("\n".join(body)))
        if rendered is not None:
            out.append(rendered)
        done = end
    out += lines[done:]
    return "\n".join(out)


def _roles(text: str, labels: Dict[str, str], docs: Dict[str, str], bib: Dict[str, str]) -> str:
    def repl(m: re.Match) -> str:
        name, raw = m["name"], m["text"]
        explicit = _EXPLICIT.match(raw)
        shown, target = (explicit["text"], explicit["target"]) if explicit else (None, raw)
        if name.startswith("cite"):
            keys = [k.strip() for k in target.split(",") if k.strip()]
            return "(" + "; ".join(bib.get(k, k) for k in keys) + ")"
        if name == "doc":
            stem = Path(target).name
            return shown or (f"*{docs[stem]}*" if stem in docs else stem)
        if name in {"ref", "numref", "prf:ref", "eq", "numref:", "any"}:
            if shown:
                return shown
            return labels.get(target, f"({target})" if name == "eq" else target)
        if name == "math":
            return f"${raw}$"
        return shown or target

    return _ROLE.sub(repl, text)


def to_markdown(
    text: str,
    *,
    labels: Optional[Dict[str, str]] = None,
    docs: Optional[Dict[str, str]] = None,
    bib: Optional[Dict[str, str]] = None,
) -> str:
    """Plain Markdown for the MyST ``text``.

    ``labels`` maps reference labels to what a reference should show
    (``{"prop-manifold": "Proposition (Balanced minima ...)"}``, see
    :func:`labels_of`), ``docs`` maps document names to titles
    (``{"ch3_factorization": "The matrix factorization equivalence"}``) and
    ``bib`` citation keys to short citations (see :func:`read_bib`).
    Solution directives are dropped; unknown directives keep their body;
    unknown roles keep their text.
    """
    if not isinstance(text, str):
        raise ValueError(f"text: expected a string of MyST Markdown, got {type(text).__name__}")
    lines = [line for line in text.split("\n") if not re.match(r"^\([\w:.-]+\)=\s*$", line)]
    lines = [line for line in lines if not line.startswith("% ") and line.strip() != "+++"]
    out = _directives("\n".join(lines))
    out = _roles(out, labels or {}, docs or {}, bib or {})
    return re.sub(r"\n{3,}", "\n\n", out).strip("\n")


def labels_of(sources: List[str]) -> Dict[str, str]:
    """``{label: what a reference to it shows}`` for the labelled directives in the MyST ``sources``."""
    out: Dict[str, str] = {}
    for text in sources:
        lines = text.split("\n")
        for i, line in enumerate(lines):
            m = _OPEN.match(line)
            if not m:
                continue
            options, _ = _body_lines(lines[i + 1 :])
            if "label" not in options:
                continue
            name, arg = m["name"], m["arg"].strip()
            if name == "exercise":
                out[options["label"]] = f"Exercise {arg.split(' ')[0]}" if arg else "the exercise"
            elif name == "math":
                out[options["label"]] = f"({options['label']})"
            else:
                out[options["label"]] = _title(name) + (f" ({arg})" if arg else "")
    return out


def title_of(source: str) -> Optional[str]:
    """The first level-one heading of a Markdown text, without the ``#``."""
    for line in source.split("\n"):
        if line.startswith("# "):
            return line[2:].strip()
    return None


def _clean_tex(s: str) -> str:
    s = re.sub(r"\\[a-zA-Z]+\s*", "", s)
    s = re.sub(r"\\.", "", s)
    return s.replace("{", "").replace("}", "").strip()


def read_bib(path) -> Dict[str, str]:
    """``{key: "Goel et al. 2026"}`` for the entries of a BibTeX file (authors' last names and year), read by pybtex."""
    from pybtex.database import parse_file

    out = {}
    for key, entry in parse_file(str(path), bib_format="bibtex").entries.items():
        people = entry.persons.get("author", [])
        last = [_clean_tex(" ".join(p.prelast_names + p.last_names)) for p in people]
        who = last[0] + " et al." if len(last) > 2 else " and ".join(last) if last else key
        year = entry.fields.get("year")
        out[key] = f"{who} {year}" if year else who
    return out
