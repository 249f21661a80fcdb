"""Notebook tables in the PDF: the HTML of a table output becomes a docutils table for LaTeX.

The chapters show their tables with pandas Stylers (attnlib.plotting.table), whose outputs carry
HTML and, as text, only ``<pandas.io.formats.style.Styler at 0x...>``. For the LaTeX builder,
myst-nb is told to prefer the HTML (``nb_mime_priority_overrides`` in _config.yml, after images,
before text) and this turns each output that is one regular HTML table (caption, header row, body
rows) into a table the LaTeX writer typesets; ``\\(...\\)`` in a cell or the caption (what
attnlib.plotting.caption_html writes) becomes inline math. Other HTML is left as it is (the LaTeX
writer skips raw HTML). The HTML pages are untouched.
"""

import re
from html.parser import HTMLParser

from docutils import nodes

_MATH = re.compile(r"\\\((.+?)\\\)", re.S)


class _TableParser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables, self.caption, self.head, self.body = 0, None, [], []
        self._text, self._row, self._in = None, None, []

    def handle_starttag(self, tag, attrs):
        self._in.append(tag)
        if tag == "table":
            self.tables += 1
        elif tag == "caption":
            self._text = []
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._text = []

    def handle_endtag(self, tag):
        if self._in and self._in[-1] == tag:
            self._in.pop()
        if tag == "caption" and self._text is not None:
            self.caption, self._text = "".join(self._text).strip(), None
        elif tag in ("td", "th") and self._text is not None and self._row is not None:
            self._row.append(" ".join("".join(self._text).split()))
            self._text = None
        elif tag == "tr" and self._row is not None:
            (self.head if "thead" in self._in else self.body).append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._text is not None and "style" not in self._in:
            self._text.append(data)


def parse_table(html):
    """``(caption, header rows, body rows)`` of ``html`` if it holds exactly one regular table, else ``None``."""
    p = _TableParser()
    p.feed(html)
    rows = p.head + p.body
    if p.tables != 1 or not p.body or len({len(r) for r in rows}) != 1:
        return None
    return p.caption, p.head, p.body


def _inline(text):
    out, last = [], 0
    for m in _MATH.finditer(text):
        if m.start() > last:
            out.append(nodes.Text(text[last : m.start()]))
        out.append(nodes.math(m.group(1), m.group(1)))
        last = m.end()
    if last < len(text):
        out.append(nodes.Text(text[last:]))
    return out


def table_node(caption, head, body):
    """A docutils table with an optional title (the caption), header rows and body rows."""
    ncols = len((head or body)[0])
    table = nodes.table(classes=["attnlib-table"])
    if caption:
        table += nodes.title(caption, "", *_inline(caption))
    group = nodes.tgroup(cols=ncols)
    table += group
    for _ in range(ncols):
        group += nodes.colspec(colwidth=1)

    def rows(parent, cells):
        for r in cells:
            row = nodes.row()
            for c in r:
                row += nodes.entry("", nodes.paragraph("", "", *_inline(c)))
            parent += row

    if head:
        thead = nodes.thead()
        rows(thead, head)
        group += thead
    tbody = nodes.tbody()
    rows(tbody, body)
    group += tbody
    return table


def _convert(app, doctree, docname):
    if app.builder.format != "latex":
        return
    for raw in list(doctree.findall(nodes.raw)):
        if raw.get("format") != "html" or "<table" not in raw.astext():
            continue
        parsed = parse_table(raw.astext())
        if parsed is not None:
            raw.replace_self(table_node(*parsed))


def setup(app):
    app.connect("doctree-resolved", _convert)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
