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
