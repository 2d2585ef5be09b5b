"""The docs site draws its mermaid diagrams with no network (issue 18).

mkdocs-material renders ```` ```mermaid ```` blocks with mermaid.js and, when the page has no
global ``mermaid``, loads it from unpkg.com; offline the diagrams then show as raw text. The site
ships a pinned copy instead (docs/assets/javascripts/mermaid.min.js, listed under
``extra_javascript`` in mkdocs.yml). These checks need no browser and build nothing: they read
mkdocs.yml and the vendored file, and, when a built site/ is newer than mkdocs.yml, its pages.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
JS_DIR = REPO_ROOT / "docs" / "assets" / "javascripts"
MERMAID = JS_DIR / "mermaid.min.js"
MERMAID_VERSION = "11.17.2"  # keep in step with docs/assets/javascripts/README.md
SITE = REPO_ROOT / "site"

# A CDN address that would fetch mermaid (or a mermaid plugin) from the network.
CDN_MERMAID = re.compile(r"(unpkg\.com|cdn\.jsdelivr\.net|cdnjs\.cloudflare\.com)/[^\"'\s]*mermaid", re.I)
# The notebook pages' own nbconvert mermaid loader (a cdnjs import) is dropped by docs/hooks/offline.py.


def extra_javascript() -> list[str]:
    """The ``extra_javascript`` list of mkdocs.yml (read as text: the file has python/name tags)."""
    text = (REPO_ROOT / "mkdocs.yml").read_text()
    match = re.search(r"^extra_javascript:\n((?:[ \t]+-[^\n]*\n)+)", text, re.M)
    assert match, "mkdocs.yml has no extra_javascript list"
    return [line.strip()[1:].strip().strip("\"'") for line in match.group(1).splitlines()]


def test_vendored_mermaid_is_present_and_listed():
    assert MERMAID.is_file(), f"{MERMAID.relative_to(REPO_ROOT)} is missing"
    assert (JS_DIR / "mermaid.LICENSE").is_file(), "mermaid's MIT license notice must ship with it"
    head = MERMAID.read_bytes()
    assert f'version:"{MERMAID_VERSION}"'.encode() in head, f"mermaid.min.js is not mermaid {MERMAID_VERSION}"
    # The IIFE build, which sets the global that material looks for (not the ES module build).
    assert head.rstrip().endswith(b'globalThis["mermaid"] = globalThis.__esbuild_esm_mermaid_nm["mermaid"].default;')
    assert "assets/javascripts/mermaid.min.js" in extra_javascript()


def test_vendored_mermaid_matches_the_major_version_material_loads():
    bundles = sorted(
        Path(sys.prefix).glob("lib/python3*/site-packages/material/templates/assets/javascripts/bundle.*.min.js")
    )
    if not bundles:
        pytest.skip("mkdocs-material is not installed in this environment")
    wanted = re.search(rb"unpkg\.com/mermaid@(\d+)/", bundles[0].read_bytes())
    assert wanted, "material's bundle no longer names a mermaid version: check how it loads mermaid now"
    assert MERMAID_VERSION.split(".")[0] == wanted.group(1).decode()


def test_built_site_does_not_fetch_mermaid_from_a_cdn():
    index = SITE / "index.html"
    if not index.is_file() or index.stat().st_mtime < (REPO_ROOT / "mkdocs.yml").stat().st_mtime:
        pytest.skip("no site/ built since mkdocs.yml changed (make docs builds it)")
    assert (SITE / "assets" / "javascripts" / "mermaid.min.js").is_file()
    pages = sorted(SITE.rglob("*.html"))
    for page in pages:
        html = page.read_text(encoding="utf-8")
        name = page.relative_to(SITE)
        if 'class="mermaid"' in html:  # a page with a diagram
            assert re.search(r"<script src=\"[./]*assets/javascripts/mermaid\.min\.js\"", html), \
                f"{name} does not load the vendored mermaid"
        cdn = CDN_MERMAID.search(html)
        assert cdn is None, f"{name} loads mermaid from a CDN: {cdn.group(0)}"
