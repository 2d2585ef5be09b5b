"""Every docs page, in both editions (English and its Chinese under zh/), as a real browser draws it with no network
(issues 18 and 61).

test_docs_offline.py checks the site's files; this module looks at the pages as rendered. It builds
the site into a temporary directory, serves it on 127.0.0.1 and loads each page in headless
Chromium (Debian's ``chromium`` package; ``.ci/run`` installs it), driven over the DevTools
protocol by tests/browser.py with every host other than 127.0.0.1 unreachable. For each page it
checks that:

* the page and its workers requested nothing but the test server's own addresses (the browser
  reports every request it tries, so a page that asks a CDN for a script fails here whatever the
  browser then shows for it);
* every mermaid diagram was drawn: no ``pre.mermaid`` block is left holding its source text, and
  each became material's ``div.mermaid`` with an ``<svg>`` in it;
* every notebook page shows cell outputs (``.jp-OutputArea-output`` with text).

Material draws each diagram into a *closed* shadow root (``attachShadow({mode: "closed"})``) of a
new ``div.mermaid``, which no script and no DOM dump can read. So the test server adds one small
script to each page it serves (the files on disk are untouched) that wraps
``Element.prototype.attachShadow`` and copies the shadow root's HTML into a ``data-shadow-html``
attribute of its host, where the DOM shows it.

With no ``chromium`` (or ``chromium-browser``) on PATH the tests that draw pages are skipped; those that read the
built files (every page built, the notebooks' outputs, the search index, the language switcher) still run.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from functools import partial
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from .browser import Browser, BrowserError, Page

REPO_ROOT = Path(__file__).resolve().parents[1]
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")

# Wraps attachShadow so that what material draws into a closed shadow root shows in the dumped DOM.
SHADOW_MIRROR = (
    "<script>(() => {"
    "const attach = Element.prototype.attachShadow;"
    "Element.prototype.attachShadow = function (init) {"
    "const root = attach.call(this, init), host = this;"
    "new MutationObserver(() => host.setAttribute('data-shadow-html', root.innerHTML))"
    ".observe(root, {childList: true, subtree: true, characterData: true});"
    "return root; };"
    "})();</script>"
)
# The first line of a mermaid diagram's source: a <pre> starting so on a rendered page is a diagram
# left as raw text (when mermaid fails, material leaves the block as `<pre class=""><code>...`).
MERMAID_SOURCE = re.compile(
    r"\s*(?:(?:flowchart|graph)\s+(?:TB|TD|BT|RL|LR)|sequenceDiagram|stateDiagram(?:-v2)?|classDiagram"
    r"|erDiagram|gantt|pie|mindmap|timeline|gitGraph)[ \t]*(?:\n|$)"
)
VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def nav_pages() -> list[str]:
    """The site path of every page in mkdocs.yml's nav ("" for the home page, "m1/", "notebooks/x/"), then of its
    Chinese edition's pages ("zh/", "zh/m1/"): every markdown page of the nav, served in English where it has no
    .zh.md (the notebooks stay in the English site only)."""
    text = (REPO_ROOT / "mkdocs.yml").read_text()
    sources = re.findall(r"^\s*-\s*(?:[^\n]*?:\s+)?\"?([\w/.-]+\.(?:md|ipynb))\"?\s*$", text, re.M)
    assert sources, "found no pages in mkdocs.yml's nav"
    pages, chinese = [], []
    for source in sources:
        stem = source.rsplit(".", 1)[0]
        page = "" if stem == "index" else stem.removesuffix("/index") + "/"
        pages.append(page)
        if source.endswith(".md"):
            chinese.append("zh/" + page)
    return pages + chinese


PAGES = nav_pages()


class Elements(HTMLParser):
    """The elements of a page with one of ``tags`` or a class in ``classes``: tag, classes, attrs, text."""

    def __init__(self, classes: set[str], tags: set[str]):
        super().__init__(convert_charrefs=True)
        self.wanted = classes
        self.tags = tags
        self.found: list[dict] = []
        self.open: list[tuple[dict, int]] = []  # wanted elements still open, with their depth
        self.depth = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        if classes & self.wanted or tag in self.tags:
            element = {"tag": tag, "classes": classes, "attrs": attrs, "text": ""}
            self.found.append(element)
            if tag not in VOID_TAGS:
                self.open.append((element, self.depth))
        if tag not in VOID_TAGS:
            self.depth += 1

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID_TAGS:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        self.depth = max(self.depth - 1, 0)
        while self.open and self.open[-1][1] >= self.depth:
            self.open.pop()

    def handle_data(self, data):
        for element, _ in self.open:
            element["text"] += data


def elements(html: str, *classes: str, tags: tuple[str, ...] = ()) -> list[dict]:
    parser = Elements(set(classes), set(tags))
    parser.feed(html)
    parser.close()
    return parser.found


class SiteHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the built site, adding SHADOW_MIRROR at the top of each HTML page's <head>."""

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if path.is_dir():
            path = path / "index.html"
        if path.suffix != ".html" or not path.is_file():
            return super().do_GET()
        html = path.read_text(encoding="utf-8").replace("<head>", "<head>" + SHADOW_MIRROR, 1)
        body = html.encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # keep the test output quiet
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with this interpreter's mkdocs, as `make docs` builds it."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


@pytest.fixture(scope="module")
def base_url(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(SiteHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """The browser; one that will not start (a snap shim, missing libraries) skips the module, except in CI."""
    if BROWSER is None:
        pytest.skip("no chromium or chromium-browser on PATH to render the site (.ci/run installs Debian's chromium)")
    started = Browser(BROWSER, str(tmp_path_factory.mktemp("chromium-profile")))
    try:
        started.send("Browser.getVersion")
    except BrowserError as error:
        started.close()
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{BROWSER} would not start: {error}")
    with started:
        yield started


# A page is ready once it has loaded and material has turned every mermaid block into a drawn diagram.
DIAGRAMS_DRAWN = (
    'document.readyState === "complete" && !document.querySelector("pre.mermaid")'
    ' && [...document.querySelectorAll("div.mermaid")].every(d => (d.dataset.shadowHtml || "").includes("<svg"))'
)


def foreign(page: Page, base_url: str) -> list[str]:
    """The requests of a page that went anywhere but the test server (data: and blob: URLs stay in the page)."""
    home = urlsplit(base_url).netloc
    return [u for u in page.requests if urlsplit(u).scheme not in ("data", "blob") and urlsplit(u).netloc != home]


def test_every_built_page_is_checked(site):
    built = sorted(
        str(p.parent.relative_to(site)) + "/" if p.parent != site else ""
        for p in site.rglob("index.html")
        if p.parent.name != "search"
    )
    assert built == sorted(PAGES), "the built pages and mkdocs.yml's nav differ: update this test's page list"


def test_the_browser_cannot_reach_the_network_and_reports_what_a_page_asks_for(site, base_url, browser):
    """A page asking a CDN for mermaid: the request is recorded, and the script never arrives."""
    (site / "network-canary.html").write_text(
        '<!doctype html><html><head><script src="https://unpkg.com/mermaid@11/dist/mermaid.min.js"></script></head>'
        '<body><img src="http://cdn.example.org/x.png">'
        "<script>document.body.dataset.mermaid = typeof mermaid;</script></body></html>"
    )
    page = browser.render(base_url + "network-canary.html", ready='document.body.dataset.mermaid !== undefined')
    assert sorted(foreign(page, base_url)) == ["http://cdn.example.org/x.png",
                                               "https://unpkg.com/mermaid@11/dist/mermaid.min.js"], page.requests
    assert 'data-mermaid="undefined"' in page.dom, "a CDN script loaded in the test browser: it reached the network"


@pytest.mark.parametrize("page", PAGES, ids=[p or "index" for p in PAGES])
def test_page_renders_offline(page, site, base_url, browser):
    source = (site / page / "index.html").read_text(encoding="utf-8")
    diagrams = len(elements(source, "mermaid"))
    rendered = browser.render(base_url + page, ready=DIAGRAMS_DRAWN)
    off_machine = foreign(rendered, base_url)
    assert not off_machine, f"/{page} asked for addresses off this machine: {off_machine}"
    dom = rendered.dom

    found = elements(dom, "mermaid", tags=("pre",))
    raw = [e for e in found if e["tag"] == "pre" and ("mermaid" in e["classes"] or MERMAID_SOURCE.match(e["text"]))]
    assert not raw, f"{len(raw)} mermaid diagram(s) on /{page} left as raw text: {raw[0]['text'][:80]!r}"
    mermaid = [e for e in found if "mermaid" in e["classes"]]
    drawn = [e for e in mermaid if "<svg" in e["attrs"].get("data-shadow-html", "")]
    waited = "" if rendered.ready else " (some still drawing when the wait ran out)"
    assert len(drawn) == diagrams, f"/{page} has {diagrams} mermaid diagram(s) but {len(drawn)} drawn as SVG{waited}"
    broken = [e for e in drawn if "Syntax error" in e["attrs"]["data-shadow-html"]]
    assert not broken, f"{len(broken)} mermaid diagram(s) on /{page} drew mermaid's syntax-error picture"

    if page.startswith("notebooks/"):
        outputs = [e for e in elements(dom, "jp-OutputArea-output") if e["text"].strip()]
        assert outputs, f"notebook page /{page} shows no cell outputs"


def test_both_editions_are_searchable_and_each_page_links_its_other_edition(site):
    """One search index holds both editions, the Chinese pages cut into words (jieba puts a zero-width space between
    them, so a search for 分页注意力 finds a sentence that contains it); each page's language switcher leads to the
    same page in the other language."""
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    chinese = [doc for doc in index["docs"] if doc["location"].startswith("zh/")]
    assert chinese, "the search index has no page of the zh edition"
    assert "zh" in index["config"]["lang"] and "\\u200b" in index["config"]["separator"]
    assert any("\u200b" in doc["text"] for doc in chinese), "the zh pages' text is not cut into words (jieba missing?)"
    for page in PAGES:
        if page.startswith("zh/") or page.startswith("notebooks/"):
            continue
        english = (site / page / "index.html").read_text(encoding="utf-8")
        chinese_page = (site / "zh" / page / "index.html").read_text(encoding="utf-8")
        assert re.search(r'href="[./]*zh/' + re.escape(page) + r'" hreflang="zh"', english), f"/{page}: no link to zh"
        back = r'href="(?:(?:\.\./)+|/)' + re.escape(page) + r'" hreflang="en"'  # the home page's is "/"
        assert re.search(back, chinese_page), f"/zh/{page}: no link back to the same English page"


def test_notebook_pages_hold_their_outputs(site):
    """mkdocs-jupyter renders a notebook into a page with its stored outputs; with the i18n plugin on, the hook
    docs/hooks/notebooks.py keeps it so (without it the page is the notebook's raw JSON)."""
    for page in PAGES:
        if page.startswith("notebooks/"):
            html = (site / page / "index.html").read_text(encoding="utf-8")
            assert "jp-OutputArea-output" in html and not html.lstrip().startswith("{"), f"/{page} holds no outputs"


REPLAY_RUNS = ["m2", "m3", "m4", "m5", "m6", "m7"]
REPLAY_READY = 'document.getElementById("replay") && document.getElementById("replay").dataset.frames !== undefined'


def replay_frames(run: str) -> list[dict]:
    """The shipped recording's frames as the page should show them: the blocks in use at each, from the tables
    rebuilt out of the file's changes; the state after the run last."""
    record = json.loads((REPO_ROOT / "docs" / "assets" / "replay" / f"{run}.json").read_text())
    tables, frames = {}, []
    for step in [*record["steps"], record["end"]]:
        for gone in step.get("gone", []):
            del tables[str(gone)]
        tables.update(step.get("tables", {}))
        frames.append({"batch": len(step["batch"]), "in_use": len({b for t in tables.values() for b in t})})
    return frames


@pytest.mark.parametrize("edition", ["", "zh/"], ids=["en", "zh"])
def test_the_replay_page_steps_through_every_shipped_recording(edition, site, base_url, browser):
    """Each recording loads with no console error; a step forward shows that step's requests and blocks in use, as
    the recording has them; the last frame, after the run, shows a pool with nothing in use."""
    for run in REPLAY_RUNS:
        frames = replay_frames(run)
        with browser.tab(f"{base_url}{edition}replay/?run={run}", REPLAY_READY) as tab:
            shown = 'document.querySelectorAll("#replay tr[data-request]").length'
            in_use = '(document.querySelector("#replay .replay-pool") || {dataset: {}}).dataset.inUse'
            assert tab.evaluate('document.getElementById("replay").dataset.run') == run
            assert tab.evaluate(shown) == frames[0]["batch"], run
            tab.evaluate('document.querySelector("#replay button[aria-label]:last-of-type").click()')
            tab.wait('document.getElementById("replay").dataset.frame === "1"')
            assert tab.evaluate(shown) == frames[1]["batch"], run
            spans = tab.evaluate('(document.querySelector("#replay [data-spans]") || {dataset: {}}).dataset.spans')
            assert (spans is not None) == (run == "m6"), f"{run}: only m6's recording is traced, spans {spans}"
            if run != "m2":  # m2 keeps no pool
                assert int(tab.evaluate(in_use)) == frames[1]["in_use"], run
            tab.evaluate('document.getElementById("replay").dispatchEvent(new KeyboardEvent("keydown", {key: "End"}))')
            tab.wait(f'document.getElementById("replay").dataset.frame === "{len(frames) - 1}"')
            assert tab.evaluate(shown) == 0, f"{run}: nothing is scheduled after the run"
            if run != "m2":
                assert int(tab.evaluate(in_use)) == 0, f"{run}: the pool holds nothing in use after the run"
            assert not tab.errors(), f"{edition}replay/?run={run}: {tab.errors()}"


@pytest.mark.parametrize("width", [1280, 390])
def test_the_replay_page_fits_the_screen(width, site, base_url, browser, tmp_path_factory):
    """At a laptop's width and a phone's, the page has no horizontal overflow with any recording (its second step
    shown); a screenshot of each is kept under the test's folder (its path is printed)."""
    shots = tmp_path_factory.mktemp("replay-screenshots")
    for edition, run in [(edition, run) for edition in ("", "zh/") for run in REPLAY_RUNS]:
        with browser.tab(f"{base_url}{edition}replay/?run={run}", REPLAY_READY, width=width, height=800) as tab:
            tab.evaluate('document.querySelector("#replay button[aria-label]:last-of-type").click()')
            tab.wait('document.getElementById("replay").dataset.frame === "1"')
            overflow = tab.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            path = shots / f"replay-{edition.strip('/') or 'en'}-{run}-{width}.png"
            tab.screenshot(path)
            print(f"screenshot: {path}")
            assert overflow <= 0, f"{edition}replay/ at {width} px is {overflow} px wider than the screen ({path})"
            assert not tab.errors(), tab.errors()


def test_the_replay_page_loads_a_learners_own_recording(site, base_url, browser, tiny_model_path, tmp_path):
    """A recording the example writes, chosen with the page's file picker, replaces the shipped one."""
    own = tmp_path / "own.json"
    subprocess.run([sys.executable, "examples/record_run.py", "--model", str(tiny_model_path), "--milestone", "m3",
                    "--out", str(own), "--num-requests", "3", "--max-tokens", "4", "--num-kv-blocks", "16"],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    steps = len(json.loads(own.read_text())["steps"])
    with browser.tab(f"{base_url}replay/?run=m2", REPLAY_READY) as tab:
        tab.choose_file('#replay input[type="file"]', own)
        tab.wait('document.getElementById("replay").dataset.run === "own.json"')
        assert tab.evaluate('document.getElementById("replay").dataset.frames') == str(steps + 1)
        assert tab.evaluate('document.querySelector("#replay .replay-pool").dataset.free') is not None
        assert not tab.errors(), tab.errors()
