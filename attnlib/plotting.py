"""The book's figure and table style, set in one place.

Figures are drawn for the book's text column (about 6.3 inches at 100 % zoom)
with fonts of at least 9 pt at display size; multi-panel figures share one
legend; every axis gets a label. Tables are pandas ``Styler`` objects with
formatted numbers, no index column and a CSS class that lets them scroll
horizontally inside the page on a phone.

Not imported by ``import attnlib`` (it loads matplotlib); use
``import attnlib.plotting as ap``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence

import matplotlib as mpl
import matplotlib.pyplot as plt

__all__ = [
    "COLUMN_WIDTH",
    "STYLE",
    "use_style",
    "inline_retina",
    "caption_html",
    "figure",
    "shared_legend",
    "table",
    "check_labelled",
]

#: Width of the book's text column in inches (figures are saved at this width).
COLUMN_WIDTH = 6.3

#: rcParams of every figure in the book.
STYLE = {
    "figure.dpi": 110,
    "savefig.dpi": 150,
    "figure.constrained_layout.use": True,
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.6,
    "lines.markersize": 4.5,
    "image.cmap": "viridis",
}


def use_style() -> None:
    """Apply :data:`STYLE` to matplotlib (call once at the top of a chapter).

    In a notebook with the inline backend it also makes figures crisp on high-density screens:
    :func:`inline_retina` (PNG at twice the pixels, shown at the column width).
    """
    mpl.rcParams.update(STYLE)
    inline_retina()


def inline_retina() -> bool:
    """Show inline figures as "retina" PNGs: drawn at twice ``figure.dpi``, displayed at the size of
    ``figure.dpi`` (the output's width/height metadata, which myst-nb writes into the page).

    Returns ``True`` where an IPython kernel is running (the setting applies to it), ``False``
    elsewhere (nothing changes; scripts and tests save figures as before). PNG rather than SVG:
    the book's LaTeX/PDF build takes PNGs as they are, and nbval ignores PNG data.
    """
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency of the book, not of attnlib
        return False
    shell = get_ipython()
    if shell is None or "image/png" not in shell.display_formatter.formatters:
        return False
    from matplotlib_inline.backend_inline import set_matplotlib_formats

    set_matplotlib_formats("retina")
    return True


def figure(ncols: int = 1, nrows: int = 1, *, height: float | None = None, **kwargs):
    """A figure of the column width with ``nrows x ncols`` panels; returns ``(fig, axes)``.

    ``height`` defaults to a panel aspect that keeps 9-pt fonts readable
    (about 2.6 inches per row for up to two columns, 2.2 for three or more).
    Extra keyword arguments go to :func:`matplotlib.pyplot.subplots`.
    """
    if int(ncols) < 1 or int(nrows) < 1:
        raise ValueError(f"ncols, nrows: expected integers >= 1, got {ncols!r}, {nrows!r}")
    if ncols > 3:
        raise ValueError(f"ncols: at most 3 panels side by side fit the column (fonts >= 9 pt), got {ncols}")
    use_style()
    if height is None:
        height = (2.6 if ncols <= 2 else 2.2) * nrows
    return plt.subplots(nrows, ncols, figsize=(COLUMN_WIDTH, height), **kwargs)


def shared_legend(fig, axes=None, *, ncol: int | None = None, loc: str = "outside lower center", **kwargs):
    """One legend for all panels, below them, from the labelled artists of ``axes`` (duplicates dropped)."""
    axes = fig.axes if axes is None else list(getattr(axes, "flat", axes))
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels and not lab.startswith("_"):
                handles.append(h)
                labels.append(lab)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if not handles:
        raise ValueError("axes: no labelled artists to put in a legend")
    ncol = min(len(labels), 4) if ncol is None else ncol
    return fig.legend(handles, labels, loc=loc, ncol=ncol, **kwargs)


def check_labelled(fig) -> None:
    """Raise ``ValueError`` naming the panel if an axis of ``fig`` (with data) has no label.

    A colorbar counts as labelled when its long axis has a label
    (``fig.colorbar(..., label=...)``).
    """
    for i, ax in enumerate(fig.axes):
        cbar = getattr(ax, "_colorbar", None)
        if cbar is not None:
            label = ax.get_ylabel() if cbar.orientation == "vertical" else ax.get_xlabel()
            if not label:
                raise ValueError(f"fig: colorbar (panel {i}) lacks a label: pass label= to fig.colorbar")
            continue
        if not ax.has_data() or not ax.axison:
            continue
        if not ax.get_xlabel() or not ax.get_ylabel():
            raise ValueError(
                f"fig: panel {i} ({ax.get_title()!r}) lacks an axis label "
                f"(x: {ax.get_xlabel()!r}, y: {ax.get_ylabel()!r})"
            )


def table(
    data,
    *,
    formats: Mapping[str, str] | str | None = None,
    caption: str | None = None,
    columns: Sequence[str] | None = None,
    name: str | None = None,
):
    """A styled table for the book: ``data`` is a pandas DataFrame, a list of dicts or a dict of columns.

    ``formats`` maps column names to format strings (``"{:.3g}"``) or gives one
    for all numeric columns. The index is hidden; the table gets the CSS class
    ``attnlib-table`` (the book's stylesheet makes it scroll inside its box on
    narrow screens).

    The rendered HTML is deterministic: the element ids come from ``name``
    (letters, digits, ``-`` and ``_``) or, without it, from a hash of the
    caption and the column names, so a notebook cell that shows the table can
    carry the ``nbval-check-output`` tag (pandas' default ids are random).
    Cell and column-header text is HTML-escaped (``"< 1e-10"`` shows as written).
    """
    import pandas as pd

    df = data if isinstance(data, pd.DataFrame) else pd.DataFrame(data)
    if columns is not None:
        missing = [c for c in columns if c not in df.columns]
        if missing:
            raise ValueError(f"columns: {missing} are not columns of the table ({list(df.columns)})")
        df = df[list(columns)]
    if isinstance(formats, str):
        formats = {c: formats for c in df.columns if pd.api.types.is_float_dtype(df[c])}
    if name is None:
        key = repr((caption, [str(c) for c in df.columns])).encode()
        name = hashlib.sha1(key).hexdigest()[:10]
    elif not re.fullmatch(r"[A-Za-z0-9_-]+", str(name)):
        raise ValueError(f"name: expected letters, digits, '-' or '_' only, got {name!r}")
    sty = df.style.hide(axis="index").set_table_attributes('class="attnlib-table"').set_uuid(str(name))
    # text is escaped: a cell such as "< 1e-10" or "theta'" must show as written, not as markup
    sty = sty.format(na_rep="-", escape="html").format_index(escape="html", axis=1)
    if formats:
        sty = sty.format({c: f for c, f in formats.items() if c in df.columns}, na_rep="-", escape="html")
    if caption:
        sty = sty.set_caption(caption_html(caption))
    return sty


_INLINE_MATH = re.compile(r"(?<![\\$])\$([^$]+?)(?<!\\)\$")


def caption_html(caption: str) -> str:
    """A table caption as HTML: text escaped, ``$...$`` as inline mathematics the book typesets.

    Sphinx's MathJax typesets only elements of class ``math`` (not a notebook's raw HTML output),
    so each ``$tex$`` becomes ``<span class="math notranslate nohighlight">\\(tex\\)</span>``,
    the markup Sphinx writes for inline math. ``\\$`` is a literal dollar sign.
    """
    import html

    if not isinstance(caption, str):
        raise ValueError(f"caption: expected a string, got {type(caption).__name__}")
    parts, last = [], 0
    for m in _INLINE_MATH.finditer(caption):
        parts.append(html.escape(caption[last : m.start()].replace("\\$", "$"), quote=False))
        tex = html.escape(m.group(1), quote=False)
        parts.append(f'<span class="math notranslate nohighlight">\\({tex}\\)</span>')
        last = m.end()
    rest = caption[last:]
    if rest.replace("\\$", "").count("$"):
        raise ValueError(f"caption: unbalanced '$' in {caption!r} (write \\$ for a dollar sign)")
    parts.append(html.escape(rest.replace("\\$", "$"), quote=False))
    return "".join(parts)
