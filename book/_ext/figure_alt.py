"""Alt text of figures from their captions.

Sphinx writes an image's URI as its alt text when the image has none, so every notebook figure
(myst-nb's ``mystnb.figure`` metadata gives a caption but no alt) was announced by its file name,
a content hash. This gives every image inside a captioned figure that lacks an alt text (or whose
alt is its own file name) the caption's text, math as its TeX source without dollar signs.
"""

import re
from pathlib import PurePosixPath

from docutils import nodes


def caption_text(figure):
    """The plain text of ``figure``'s caption (whitespace collapsed), or ``""`` without one."""
    for caption in figure.findall(nodes.caption):
        return re.sub(r"\s+", " ", caption.astext()).strip()
    return ""


def _looks_like_file_name(alt, uri):
    if not alt:
        return True
    name = PurePosixPath(str(uri)).name
    return alt.strip() in {str(uri), name} or bool(re.fullmatch(r"[\w.-]+\.(png|svg|jpe?g|gif|pdf)", alt.strip()))


def _set_alt(app, doctree, docname):
    for figure in doctree.findall(nodes.figure):
        text = caption_text(figure)
        if not text:
            continue
        for image in figure.findall(nodes.image):
            if _looks_like_file_name(image.get("alt", ""), image.get("uri", "")):
                image["alt"] = text


def setup(app):
    app.connect("doctree-resolved", _set_alt)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
