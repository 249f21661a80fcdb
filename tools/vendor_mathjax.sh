#!/usr/bin/env bash
# Regenerate book/static/mathjax/ (the MathJax copy the book serves, so it reads offline) from the
# npm registry. Needs npm. The committed copy was made with this script; re-run it to update.
set -euo pipefail
VERSION="${1:-3.2.2}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/book/static/mathjax"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack "mathjax@$VERSION" >/dev/null 2>&1 && tar xzf "mathjax-$VERSION.tgz")
ES5="$TMP/package/es5"
rm -rf "$DEST"
mkdir -p "$DEST/input/tex" "$DEST/output/chtml/fonts"
# the combined component Sphinx loads, the TeX extensions it autoloads, the CHTML fonts,
# and the accessibility and menu components the MathJax menu loads on demand
cp "$ES5/tex-mml-chtml.js" "$DEST/"
cp -r "$ES5/input/tex/extensions" "$DEST/input/tex/"
cp -r "$ES5/output/chtml/fonts/woff-v2" "$DEST/output/chtml/fonts/"
cp -r "$ES5/a11y" "$ES5/ui" "$DEST/"
cp "$TMP/package/LICENSE" "$DEST/LICENSE"
echo "MathJax $VERSION (es5 subset, npm package 'mathjax'), Apache-2.0; made by tools/vendor_mathjax.sh" > "$DEST/VERSION"
du -sh "$DEST"
