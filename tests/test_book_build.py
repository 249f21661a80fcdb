"""The book builds to HTML with warnings as errors (-W -n --keep-going).

The build is the session fixture `built_book` (tests/conftest.py): a copy of the sources, published
for a test repository, with the committed notebook outputs (execution off)."""

import pytest


@pytest.mark.slow
def test_book_builds_without_warnings(built_book):
    html, log, returncode = built_book
    assert returncode == 0, log[-6000:]
    assert (html / "book" / "intro.html").exists()
    assert "build succeeded" in log and "WARNING:" not in log, log[-4000:]


@pytest.mark.slow
def test_mathjax_is_served_by_the_book(built_book):
    html, _, _ = built_book
    page = (html / "book" / "ch2_population.html").read_text()
    assert "_static/mathjax/tex-mml-chtml.js" in page
    assert "cdn.jsdelivr" not in page and "mathjax@3" not in page
    assert (html / "_static" / "mathjax" / "tex-mml-chtml.js").is_file()
    assert (html / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()


@pytest.mark.slow
def test_phone_stylesheet_is_served(built_book):
    html, _, _ = built_book
    for chapter in ("ch1_model", "ch6_scaling"):
        page = (html / "book" / f"{chapter}.html").read_text()
        assert 'href="../_static/custom.css' in page
    css = (html / "_static" / "custom.css").read_text()
    assert "overflow-x: auto" in css and "max-width: 100%" in css


@pytest.mark.slow
def test_tool_markers_are_not_rendered(built_book):
    """nbval and nbgrader markers stay in the notebooks but not on the pages (book/_ext/hide_markers.py)."""
    html, _, _ = built_book
    pages = sorted((html / "book").glob("ch*.html"))
    assert pages
    for page in pages:
        text = page.read_text()
        for marker in ("NBVAL_CHECK_OUTPUT", "BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS"):
            assert marker not in text, (page.name, marker)


def test_marker_filter_keeps_code_and_drops_markers():
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "book" / "_ext"))
    from hide_markers import strip_markers

    src = "# NBVAL_CHECK_OUTPUT\nprint(1)\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n"
    src += "### BEGIN HIDDEN TESTS\nassert x == 1\n### END HIDDEN TESTS\ny = 2"
    assert strip_markers(src) == "print(1)\nx = 1\ny = 2"
    assert strip_markers("a = '# NBVAL_CHECK_OUTPUT'") == "a = '# NBVAL_CHECK_OUTPUT'"  # only whole marker lines


def test_html_table_outputs_become_latex_tables():
    """book/_ext/html_tables.py: a Styler's HTML (what the PDF would otherwise show as
    '<pandas...Styler at 0x...>') becomes a docutils table, math in its cells and caption."""
    import sys
    from pathlib import Path

    from docutils import nodes

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "book" / "_ext"))
    from html_tables import parse_table, table_node

    import attnlib.plotting as ap

    html = ap.table({"n": [16, 32], "excess": [0.5, 0.25]}, caption="Excess at $n \\le 32$", formats="{:.2f}")
    caption, head, body = parse_table(html.to_html())
    assert caption == "Excess at \\(n \\le 32\\)"
    assert head == [["n", "excess"]] and body == [["16", "0.50"], ["32", "0.25"]]
    table = table_node(caption, head, body)
    assert [m.astext() for m in table.findall(nodes.math)] == ["n \\le 32"]
    assert len(list(table.findall(nodes.row))) == 3 and len(list(table.findall(nodes.entry))) == 6
    assert parse_table("<p>no table</p>") is None
    assert parse_table("<table><tr><td>1</td></tr><tr><td>1</td><td>2</td></tr></table>") is None  # ragged


@pytest.mark.slow
def test_one_numbering_scheme_per_chapter(built_book):
    """Chapters are numbered 1..7 across the parts, and every numbered figure, proposition, lemma, theorem,
    definition and table of chapter k carries k.j (figure 6.3, proposition 6.1); exercises are titled k.j too."""
    import re
    from pathlib import Path

    import yaml

    html, _, _ = built_book
    toc = yaml.safe_load((Path(__file__).resolve().parents[1] / "_toc.yml").read_text())
    chapters = [e for part in toc["parts"] for e in part["chapters"] if Path(e["file"]).name.startswith("ch")]
    caption = re.compile(r'<span class="caption-number">([A-Za-z.]+) (\d+)(?:\.(\d+))? ')
    for k, entry in enumerate(chapters, start=1):
        pages = [Path(entry["file"]).name] + [Path(s["file"]).name for s in entry.get("sections", [])]
        figures, last = 0, 0
        for j, chapter in enumerate(pages):
            page = (html / "book" / f"{chapter}.html").read_text()
            if j == 0:
                assert f'<span class="section-number">{k}. </span>' in page, chapter
            else:  # a section page is numbered k.m, after the sections of the pages before it
                m = re.search(r'<h1>(?:<span class="section-number">(\d+)\.(\d+)\. </span>)', page)
                assert m and int(m[1]) == k and int(m[2]) > last, (chapter, m and m.group(0))
                last = int(m[2])
            labels = caption.findall(page)
            figures += sum(kind == "Fig." for kind, _, _ in labels)
            wrong = sorted({f"{kind} {a}.{b}" if b else f"{kind} {a}" for kind, a, b in labels if not b or int(a) != k})
            assert not wrong, f"{chapter}: numbers not of chapter {k}: {wrong[:8]}"
            exercises = re.findall(r"Exercise</span>\s*<span[^>]*>\s*\(?(\d+)\.(\d+)", page) or re.findall(
                r"Exercise (\d+)\.(\d+)", page
            )
            assert all(int(a) == k for a, _ in exercises), f"{chapter}: exercises {exercises[:4]}"
        assert figures, f"chapter {k} has no numbered figure"
