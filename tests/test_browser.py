"""Every chapter renders in a real browser (headless Chromium), offline.

Needs Debian's ``chromium`` (``.ci/run`` installs it, so CI always runs this test); elsewhere the
test is skipped with the reason. Requests that leave localhost are blocked, so the checks also prove
that the pages (MathJax included) need no internet.
"""
import functools
import http.server
import shutil
import threading
from pathlib import Path

import pytest

CHAPTERS = ["ch1_model", "ch2_population", "ch3_factorization", "ch4_geometry", "ch5_algorithm",
            "ch6_scaling"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install "
                                                          "chromium; .ci/run installs it)")]


@pytest.fixture(scope="module")
def server(built_book):
    html, log, returncode = built_book
    assert returncode == 0, log[-3000:]
    handler = functools.partial(_QuietHandler, directory=str(html))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_renders(chapter, server, browser):
    page = browser.new_page()
    blocked, failed, errors = [], [], []
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(server)
               else (blocked.append(route.request.url), route.abort()))
    page.on("requestfailed", lambda req: failed.append(req.url))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server}/book/{chapter}.html", wait_until="load")

    # title: the chapter's heading is the page's title
    h1 = page.locator("main h1").first.inner_text().strip().rstrip("#").strip()
    assert h1 and h1 in page.title(), (h1, page.title())

    # figures: every image has loaded and has a size
    imgs = page.eval_on_selector_all("main img", "els => els.map(e => [e.src, e.complete, e.naturalWidth])")
    assert imgs, "a chapter has figures"
    broken = [src for src, complete, width in imgs if not complete or width == 0]
    assert not broken, broken

    # no raw error output from the executed notebook
    body = page.locator("main").inner_text()
    assert "Traceback (most recent call last)" not in body
    assert page.locator("main .output.error, main .output.traceback").count() == 0

    # math typeset by the local MathJax: every math element holds MathJax output, no TeX errors
    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
    page.evaluate("() => MathJax.startup.promise")
    n_math = page.locator("main .math").count()
    n_typeset = page.locator("main .math mjx-container").count()
    assert n_math > 0 and n_typeset >= n_math, (n_math, n_typeset)
    assert page.locator("main mjx-merror").count() == 0
    untypeset = page.eval_on_selector_all(
        "main .math", "els => els.filter(e => !e.querySelector('mjx-container')).map(e => e.textContent)")
    assert not untypeset, untypeset[:5]

    assert not errors, errors
    assert not [u for u in failed if u.startswith(server)], failed
    assert not blocked, f"the page asked for external resources: {blocked}"
    page.close()
