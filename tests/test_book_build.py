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
