"""The book's figure and table style."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import attnlib.plotting as ap  # noqa: E402


def test_figure_has_column_width_and_readable_fonts():
    fig, axes = ap.figure(3)
    assert fig.get_size_inches()[0] == pytest.approx(ap.COLUMN_WIDTH)
    assert len(axes) == 3
    assert plt.rcParams["xtick.labelsize"] >= 9 and plt.rcParams["legend.fontsize"] >= 9
    with pytest.raises(ValueError, match="ncols"):
        ap.figure(4)
    plt.close("all")


def test_shared_legend_collects_unique_labels_and_removes_panel_legends():
    fig, axes = ap.figure(2)
    for ax in axes:
        ax.plot([0, 1], [0, 1], label="a")
        ax.plot([0, 1], [1, 0], label="b")
        ax.legend()
    leg = ap.shared_legend(fig, axes)
    assert [t.get_text() for t in leg.get_texts()] == ["a", "b"]
    assert all(ax.get_legend() is None for ax in axes)
    fig2, ax2 = ap.figure()
    with pytest.raises(ValueError, match="no labelled artists"):
        ap.shared_legend(fig2, [ax2])
    plt.close("all")


def test_check_labelled_names_the_unlabelled_panel():
    fig, axes = ap.figure(2)
    for ax in axes:
        ax.plot([0, 1], [0, 1])
        ax.set_xlabel("n")
    axes[0].set_ylabel("excess")
    with pytest.raises(ValueError, match="panel 1"):
        ap.check_labelled(fig)
    axes[1].set_ylabel("excess")
    ap.check_labelled(fig)
    plt.close("all")


def test_table_formats_and_scrolls():
    sty = ap.table([{"n": 16, "excess": 0.0123456}, {"n": 32, "excess": 0.00321}], formats="{:.3g}", caption="demo")
    html = sty.to_html()
    assert 'class="attnlib-table"' in html and "0.0123" in html and "0.0123456" not in html and "demo" in html
    with pytest.raises(ValueError, match="columns"):
        ap.table({"n": [1]}, columns=["m"])


def test_table_html_is_deterministic():
    rows = [{"n": 16, "excess": 0.0123456}]
    a = ap.table(rows, formats="{:.3g}", caption="same").to_html()
    b = ap.table(rows, formats="{:.3g}", caption="same").to_html()
    assert a == b
    assert ap.table(rows, caption="other").to_html() != a
    assert "T_fixed-id" in ap.table(rows, name="fixed-id").to_html()
    with pytest.raises(ValueError, match="name"):
        ap.table(rows, name="bad id")


def test_check_labelled_accepts_labelled_colorbars_only():
    import numpy as np

    fig, ax = ap.figure(1)
    im = ax.imshow(np.eye(3))
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")
    cbar = fig.colorbar(im, ax=ax)
    with pytest.raises(ValueError, match="colorbar"):
        ap.check_labelled(fig)
    cbar.set_label("weight")
    ap.check_labelled(fig)
    plt.close("all")


def test_table_escapes_text():
    html = ap.table([{"L(theta') - L": "< 1e-10", "x": 0.5}], formats={"x": "{:.2f}"}).to_html()
    assert "&lt; 1e-10" in html and "< 1e-10" not in html
    assert "L(theta&#x27;) - L" in html or "L(theta&#39;) - L" in html
    assert "0.50" in html


def test_table_caption_typesets_math_and_escapes_text():
    cap = ap.caption_html("Excess $L_n - L^*$ < 1e-10 at $n = 2^{10}$, cost \\$5")
    assert cap == (
        'Excess <span class="math notranslate nohighlight">\\(L_n - L^*\\)</span> &lt; 1e-10 at '
        '<span class="math notranslate nohighlight">\\(n = 2^{10}\\)</span>, cost $5'
    )
    html = ap.table({"n": [1.0]}, caption="rows at $x < 1$").to_html()
    assert '<span class="math notranslate nohighlight">\\(x &lt; 1\\)</span>' in html
    with pytest.raises(ValueError, match="caption"):
        ap.caption_html("one $ sign")
    with pytest.raises(ValueError, match="caption"):
        ap.caption_html(3)


def test_inline_figures_are_retina_in_a_kernel():
    """In an IPython shell with the inline backend, use_style() makes PNGs of twice the pixels,
    displayed at the figure's size (width metadata); outside IPython nothing changes."""
    import subprocess
    import sys

    code = (
        "import matplotlib\n"
        "matplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "import base64, struct\n"
        "shell = InteractiveShell.instance()\n"
        "import attnlib.plotting as ap\n"
        "ap.use_style()\n"
        "fig, ax = ap.figure(1)\n"
        "ax.plot([0, 1], [0, 1])\n"
        "data, meta = shell.display_formatter.format(fig)\n"
        "png = base64.b64decode(data['image/png']) if isinstance(data['image/png'], str) else data['image/png']\n"
        "width = struct.unpack('>I', png[16:20])[0]\n"
        "print(width, meta['image/png']['width'])\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "MPLBACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    out = out.stdout.split()
    natural, shown = int(out[-2]), int(out[-1])
    assert abs(shown - ap.COLUMN_WIDTH * ap.STYLE["figure.dpi"]) < 0.05 * shown  # the column width
    assert natural >= 2 * shown - 2, (natural, shown)
    assert ap.inline_retina() is False  # no IPython shell in this process
