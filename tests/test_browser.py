"""Every chapter renders in a real browser (headless Chromium), offline.

Needs Debian's ``chromium`` (``.ci/run`` installs it, so CI always runs this test); elsewhere the
test is skipped with the reason. Requests that leave localhost are blocked, so the checks also prove
that the pages (MathJax included) need no internet.
"""

import functools
import http.server
import shutil
import threading

import pytest

CHAPTERS = ["ch1_model", "ch2_population", "ch3_factorization", "ch4_geometry", "ch5_algorithm", "ch6_scaling"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)"
    ),
]


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
    page.route(
        "**/*",
        lambda route: (
            route.continue_()
            if route.request.url.startswith(server)
            else (blocked.append(route.request.url), route.abort())
        ),
    )
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
        "main .math", "els => els.filter(e => !e.querySelector('mjx-container')).map(e => e.textContent)"
    )
    assert not untypeset, untypeset[:5]

    assert not errors, errors
    assert not [u for u in failed if u.startswith(server)], failed
    assert not blocked, f"the page asked for external resources: {blocked}"
    page.close()


# ---------------------------------------------------------------------------------------------
# Phone width: nothing makes a page wider than the screen (book/static/custom.css)

PHONE = {"width": 390, "height": 844}
PAGES = ["intro", *CHAPTERS, "notation", "api", "instructors", "references"]

# the page's widths, and every table wider than its container that has no horizontally
# scrolling box (overflow-x auto/scroll, inside the screen) around it
_LAYOUT_JS = """() => {
  const w = window.innerWidth;
  const article = document.querySelector('.bd-article');
  // the theme lets the whole article column scroll sideways (.bd-article-container: overflow-x
  // auto), which hides overflow from the page's width: the column itself must not need to scroll,
  // and a table's scrolling box must lie inside the article
  const column = document.querySelector('.bd-article-container');
  const unscrolled = [];
  for (const t of article.querySelectorAll('table')) {
    const parent = t.parentElement;
    if (t.getBoundingClientRect().width <= parent.clientWidth + 1) continue;
    let box = null;
    for (let el = parent; el && el !== article; el = el.parentElement) {
      const ox = getComputedStyle(el).overflowX;
      if (ox === 'auto' || ox === 'scroll') { box = el; break; }
    }
    if (!box || box.getBoundingClientRect().right > w + 1)
      unscrolled.push((t.id || t.className || 'table') + ' in ' + parent.className);
  }
  const wide = [...article.querySelectorAll('img')]
    .filter(i => i.getBoundingClientRect().width > i.parentElement.clientWidth + 1).map(i => i.src);
  return {inner: w, doc: document.documentElement.scrollWidth, body: document.body.scrollWidth,
          column: column.scrollWidth - column.clientWidth, unscrolled, wide_images: wide};
}"""


@pytest.fixture(scope="module")
def phone(browser):
    context = browser.new_context(viewport=PHONE)
    yield context
    context.close()


def _open(context, server, page_name):
    page = context.new_page()
    errors = []
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(server) else route.abort())
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server}/book/{page_name}.html", wait_until="load")
    if page.locator(".bd-article .math").count():  # let MathJax typeset first: it changes widths
        page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
        page.evaluate("() => MathJax.startup.promise")
    return page, errors


def _assert_fits(layout):
    assert layout["inner"] == PHONE["width"], layout
    assert layout["doc"] <= layout["inner"] + 1, f"the page scrolls sideways: {layout}"
    assert layout["body"] <= layout["inner"] + 1, f"the body is wider than the screen: {layout}"
    assert layout["column"] <= 1, f"the article column scrolls sideways: {layout}"
    assert not layout["unscrolled"], f"wide tables that do not scroll in their box: {layout['unscrolled']}"
    assert not layout["wide_images"], f"images wider than their column: {layout['wide_images']}"


@pytest.mark.parametrize("page_name", PAGES)
def test_page_fits_a_phone(page_name, server, phone):
    page, errors = _open(phone, server, page_name)
    _assert_fits(page.evaluate(_LAYOUT_JS))
    assert not errors, errors
    page.close()


def test_wide_outputs_scroll_on_a_phone(server, phone):
    """What a chapter may grow: a wide DataFrame-like table output, long printed output, a long
    code line, a big image and a wide Markdown table all stay inside the screen."""
    page, _ = _open(phone, server, "ch1_model")
    page.evaluate("""() => {
      const cells = Array.from({length: 30}, (_, j) => `<td>column_${j}_value</td>`).join('');
      const heads = Array.from({length: 30}, (_, j) => `<th>header_${j}</th>`).join('');
      const html = `
        <div class="cell docutils container" id="probe">
          <div class="cell_input docutils container"><div class="highlight-ipython3 notranslate">
            <div class="highlight"><pre>${'x = ' + '1 + '.repeat(80) + '1'}</pre></div></div></div>
          <div class="cell_output docutils container">
            <div class="output text_html"><table class="dataframe"><thead><tr>${heads}</tr></thead>
              <tbody><tr>${cells}</tr></tbody></table></div>
            <div class="output stream highlight-myst-ansi notranslate"><div class="highlight">
              <pre>${'0.123456789 '.repeat(40)}</pre></div></div>
            <div class="output text_plain highlight-myst-ansi notranslate"><div class="highlight">
              <pre>${'y'.repeat(300)}</pre></div></div>
            <img src="../_static/images/logo_binder.svg" width="1600" height="400" alt="wide">
          </div>
        </div>
        <div class="pst-scrollable-table-container"><table class="table"><tbody><tr>${cells}</tr></tbody>
        </table></div>`;
      document.querySelector('.bd-article section').insertAdjacentHTML('beforeend', html);
    }""")
    layout = page.evaluate(_LAYOUT_JS)
    assert page.locator("#probe table").evaluate("t => t.getBoundingClientRect().width") > PHONE["width"]
    _assert_fits(layout)
    page.close()
