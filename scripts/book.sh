#!/usr/bin/env bash
# Builds the book (docs/, mdBook) into target/book and checks every link in it, the way CI
# does; installs the tools when missing (mdbook from crates.io with cargo, LinkChecker from
# PyPI with pip — no root needed).
#
#   bash scripts/book.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.5.4
if ! mdbook --version 2>/dev/null | grep -q "v$MDBOOK_VERSION"; then
  echo "installing mdbook $MDBOOK_VERSION (cargo install; a few minutes, once)"
  # Without the default features: no `serve`/`watch` web server, which the build does not need.
  cargo install mdbook --version "=$MDBOOK_VERSION" --locked --no-default-features
fi
if ! python3 -c "import linkcheck" 2>/dev/null; then
  echo "installing LinkChecker (pip)"
  python3 -m pip install --quiet linkchecker==10.6.0 2>/dev/null \
    || python3 -m pip install --quiet --break-system-packages linkchecker==10.6.0
fi
mdbook build docs
# Every link of the built book to its pages and figures (LinkChecker, which does not check
# `#section` anchors: tests/book.rs checks those on the sources); links that leave the book
# (https://…) are not followed. As root LinkChecker reads as `nobody`: the checkout must be
# readable by others.
python3 -m linkcheck --no-status --no-warnings target/book/index.html
echo "book: target/book/index.html, every link resolves"
