"""Keep tool markers out of the rendered book.

The chapter notebooks are the single master of book, tests and assignments, so their code
carries markers for nbval (``# NBVAL_CHECK_OUTPUT``) and nbgrader (``### BEGIN SOLUTION`` /
``### END SOLUTION``, hidden-test regions). They mean nothing to a reader: this extension drops
those lines (and whole hidden-test regions) from every code block of the rendered pages. The
notebooks themselves are unchanged, so nbval and nbgrader still see them.
"""

import re

from docutils import nodes

_LINE = re.compile(r"^\s*(# NBVAL_[A-Z_]+|### (BEGIN|END) SOLUTION)\s*$")
_HIDDEN = re.compile(r"^\s*### BEGIN HIDDEN TESTS\s*$.*?^\s*### END HIDDEN TESTS\s*$\n?", re.M | re.S)


def strip_markers(text: str) -> str:
    """``text`` without marker lines and hidden-test regions."""
    text = _HIDDEN.sub("", text)
    return "\n".join(line for line in text.split("\n") if not _LINE.match(line))


def _clean(app, doctree, docname=None):
    for block in list(doctree.findall(nodes.literal_block)):
        old = block.astext()
        new = strip_markers(old)
        if new != old:
            block.children = [nodes.Text(new)]
            block.rawsource = new


def setup(app):
    app.connect("doctree-resolved", _clean)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
