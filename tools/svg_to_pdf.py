"""Render the book's hand-drawn SVG figures (book/figures/*.svg) to PDF for the LaTeX/PDF build.

Sphinx picks ``figures/argument.svg`` for the HTML pages and ``figures/argument.pdf`` for LaTeX
(the Markdown names ``figures/argument.*``). The PDF is printed by headless Chromium (the browser
the tests use), so no SVG converter is needed::

    python tools/svg_to_pdf.py            # every book/figures/*.svg whose PDF is missing or older
    python tools/svg_to_pdf.py --force    # all of them
"""

import argparse
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "book" / "figures"


def svg_size(svg: Path):
    """The (width, height) in px that the SVG's root element declares."""
    head = svg.read_text()[:2000]
    w = re.search(r'<svg[^>]*\swidth="([\d.]+)', head)
    h = re.search(r'<svg[^>]*\sheight="([\d.]+)', head)
    if not (w and h):
        raise ValueError(f"{svg}: expected width= and height= in px on the <svg> element")
    return float(w.group(1)), float(h.group(1))


def render(svgs, chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        for svg in svgs:
            w, h = svg_size(svg)
            page.set_content(f'<html><body style="margin:0">{svg.read_text()}</body></html>', wait_until="load")
            page.pdf(path=str(svg.with_suffix(".pdf")), width=f"{w}px", height=f"{h + 1}px", print_background=True)
            print(f"{svg.relative_to(ROOT)} -> {svg.with_suffix('.pdf').name}")
        browser.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="render every SVG, not only stale ones")
    args = ap.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium: not found (Debian: apt-get install chromium)")
    svgs = [
        s
        for s in sorted(FIGURES.glob("*.svg"))
        if args.force or not s.with_suffix(".pdf").exists() or s.with_suffix(".pdf").stat().st_mtime < s.stat().st_mtime
    ]
    render(svgs, chromium)


if __name__ == "__main__":
    main()
