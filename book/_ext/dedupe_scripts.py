"""Drop repeated <script> entries from each page.

sphinx-thebe 0.3.1 (a default extension of Jupyter Book 1.x) registers its inline configuration
script once per read phase, so a page can carry ``const THEBE_JS_URL = ...`` twice, and the browser
reports "Identifier 'THEBE_JS_URL' has already been declared". Nothing newer of sphinx-thebe exists;
this keeps the first of identical scripts (same file or same inline body and attributes).
"""


def _key(script):
    attrs = tuple(sorted((k, str(v)) for k, v in getattr(script, "attributes", {}).items()))
    return (getattr(script, "filename", str(script)) or None, attrs)  # inline scripts: None or ""


def _dedupe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for s in scripts:
        k = _key(s)
        if k not in seen:
            seen.add(k)
            unique.append(s)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
