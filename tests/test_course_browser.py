"""A malicious submission's feedback page and formgrader view, opened in headless Chromium: nothing runs.

Needs Debian's ``chromium`` (``.ci/run`` installs it); elsewhere the test is skipped with the reason.
The submission's written answer, an added raw cell, a pre-filled output and an exception message
carry scripts, event handlers, ``javascript:`` links and images from another site. The feedback
page (``python -m attnlib.course feedback``) must run none of them and fetch nothing but itself;
the formgrader's view of the submission (rendered here with the formgrader's own exporter and
template, as its submission page does, not through a running Jupyter server) must run none of the
student's content and fetch nothing from elsewhere.
"""

import copy
import json
import shutil

import pytest

from attnlib import course
from attnlib.course.handout import read_notebook

CH = "ch1_model"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking", "--disable-sync"]
MARK = "XSSMARK"
PAYLOAD = (
    f"My derivation.\n\n<script>console.log('{MARK}-script'); document.title = '{MARK}'</script>\n\n"
    f"<img src=\"http://attacker.invalid/a.png\" onerror=\"console.log('{MARK}-img'); alert('{MARK}')\">\n\n"
    f"<svg onload=\"console.log('{MARK}-svg')\"></svg> <iframe src=\"javascript:console.log('{MARK}-iframe')\">"
    f"</iframe>\n\n[a link](javascript:console.log('{MARK}-link')) <a id=\"js\" href=\"javascript:alert(1)\">x</a>\n\n"
    "![remote](http://attacker.invalid/b.png) <style>body{background:url(http://attacker.invalid/c.png)}</style>\n\n"
    '<meta http-equiv="refresh" content="0;url=http://attacker.invalid/">\n\n'
    f"<input autofocus onfocus=\"console.log('{MARK}-focus')\"> [x](JaVa&#x53;cript:alert(1)) $a < b$"
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)"
    ),
]


def _nbg(cell):
    return cell.get("metadata", {}).get("nbgrader", {})


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser") / "course"
    course.init(root, timeout=10)
    nb = copy.deepcopy(read_notebook(course.release(root, [CH])[CH]))
    for cell in nb["cells"]:
        gid = _nbg(cell).get("grade_id")
        if gid == "ex1-3-answer":
            cell["source"] = PAYLOAD
        if gid == "ex1-1-solution":
            cell["source"] = (
                f"def my_attention(A, B, X):\n    raise ValueError(\"<img src=x onerror=console.log('{MARK}')>\")"
            )
            cell["outputs"] = [
                {
                    "output_type": "display_data",
                    "metadata": {},
                    "data": {"text/html": f"<script>console.log('{MARK}-output')</script>", "text/plain": "x"},
                }
            ]
    nb["cells"].append({"cell_type": "raw", "id": "raw1", "metadata": {"format": "text/html"}, "source": PAYLOAD})
    subs = tmp_path_factory.mktemp("subs")
    (subs / "mallory.ipynb").write_text(json.dumps(nb))
    assert course.collect(root, CH, [subs]).collected == ["mallory"]
    (report,) = course.grade(root, CH)
    assert report.scores["ex1-1"] == 0 and any("shown as text" in f for f in report.flags), report.lines()
    course.feedback(root, CH)
    return root


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


# counts DOM changes made after the page was parsed (init scripts run whatever the page's CSP says)
OBSERVER = """
window.__mutations = 0;
document.addEventListener('DOMContentLoaded', () => {
  new MutationObserver(ms => { window.__mutations += ms.length; })
    .observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
});
"""


def _open(browser, path, *, allow_local):
    page = browser.new_page()
    requests, console, dialogs = [], [], []
    page.on("console", lambda m: console.append(m.text))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))

    def route(r):
        requests.append(r.request.url)
        if r.request.url.startswith("file://") and allow_local:
            r.continue_()
        elif r.request.url == path.as_uri():
            r.continue_()
        else:
            r.abort()

    page.route("**/*", route)
    page.add_init_script(OBSERVER)
    page.goto(path.as_uri())
    page.wait_for_timeout(1500)
    dom = page.evaluate(
        """() => ({
        title: document.title,
        handlers: [...document.querySelectorAll('*')].filter(e => [...e.attributes].some(
            a => a.name.startsWith('on'))).length,
        student_handlers: [...document.querySelectorAll('*')].filter(e => [...e.attributes].some(
            a => a.name.startsWith('on') && !a.value.startsWith('toggle_name('))).length,
        js_links: [...document.querySelectorAll('a[href], iframe[src], img[src]')].filter(e =>
            (e.getAttribute('href') || e.getAttribute('src') || '').replace(/\\s/g, '').toLowerCase()
            .startsWith('javascript:')).length,
        student_scripts: [...document.scripts].filter(s => s.textContent.includes('XSSMARK')).length,
        remote: [...document.querySelectorAll('img[src], iframe[src], meta[http-equiv]')].filter(e =>
            (e.getAttribute('src') || e.getAttribute('content') || '').includes('attacker.invalid')).length,
        mutations: window.__mutations,
        text: document.body.innerText,
    })"""
    )
    page.close()
    return requests, console, dialogs, dom


def test_feedback_page_runs_nothing_and_fetches_nothing(graded, browser):
    (page,) = sorted((graded / "feedback" / "mallory" / CH).glob("*.html"))
    requests, console, dialogs, dom = _open(browser, page, allow_local=False)
    assert requests == [page.as_uri()], requests
    assert not dialogs and not [c for c in console if MARK in c], (dialogs, console)
    assert dom["title"] != MARK and dom["mutations"] == 0
    assert dom["handlers"] == dom["js_links"] == dom["student_scripts"] == dom["remote"] == 0, dom
    assert "<script>console.log" in dom["text"]  # the student's text is shown, as text
    assert "Content-Security-Policy" in page.read_text()


def test_formgrader_view_runs_none_of_the_students_content(graded, browser, tmp_path):
    from nbconvert.exporters import HTMLExporter
    from nbgrader.server_extensions.formgrader import handlers
    from traitlets.config import Config

    config = Config()
    config.HTMLExporter.template_name = "formgrade"
    config.HTMLExporter.extra_template_basedirs = [handlers.template_path]
    resources = {
        "assignment_id": CH,
        "notebook_id": CH,
        "submission_id": "x",
        "index": 0,
        "total": 1,
        "base_url": "",
        "student": "mallory",
        "last_name": None,
        "first_name": None,
        "notebook_path": f"autograded/mallory/{CH}/{CH}.ipynb",
    }
    html, _ = HTMLExporter(config=config).from_filename(
        str(graded / "autograded" / "mallory" / CH / f"{CH}.ipynb"), resources=resources
    )
    page = tmp_path / "formgrade.html"
    page.write_text(html)
    requests, console, dialogs, dom = _open(browser, page, allow_local=True)
    # the formgrader's own files, and the MathJax its template loads from a CDN; nothing of the student's
    own = ("file://", "https://cdnjs.cloudflare.com/ajax/libs/mathjax/")
    assert not [u for u in requests if not u.startswith(own)] and not [u for u in requests if "attacker" in u]
    assert not dialogs and not [c for c in console if MARK in c], (dialogs, console)
    assert dom["title"] != MARK  # the formgrader's own two onclick handlers (toggle_name) are the only ones
    assert dom["student_handlers"] == dom["js_links"] == dom["student_scripts"] == dom["remote"] == 0, dom
