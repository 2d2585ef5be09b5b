"""The Chinese edition keeps in step with the English one (issue 61).

Every English page of mkdocs.yml's nav, but for the measurement log and the notebooks, has its ``.zh.md`` beside it
(mkdocs-static-i18n's suffix layout), and the two pages share what is not prose:

* the same headings, at the same levels, with the same ids, in the same order (a zh heading keeps the English
  heading's id with ``{ #id }``, so a link to ``m3.md#block-tables`` lands in either edition);
* the same snippet includes (``--8<--``), diff markers (``<!-- diff ... -->``) and images (the same files; an image's
  alt text is prose, translated), in the same order; a generated table written in both languages is included as
  section ``NAME`` on the English page and ``NAME_zh`` on the zh one;
* the same fenced blocks (code, commands, diagrams), character for character: code is shared, never translated;
* the same figures in each section (numbers from 10 up and decimals, a count of millions in either language's unit).

And no zh page keeps an English paragraph, list item or table cell: prose of four English words or more has Chinese
in it. Run it on one page while translating: ``python -m tests.test_docs_editions docs/m3.zh.md``; the English
page's heading ids: ``python -m tests.test_docs_editions --ids docs/m3.md``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import markdown
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
ENGLISH_ONLY = {"measurements.md"}  # the measurement log: a record of runs, kept in one language

FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})")
SHARED_LINE = re.compile(r"^\s*--8<--.*|<!--\s*(?:diff|changed-files|results)\b.*?-->")  # an include starts a line
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]*)[^)]*\)", re.S)  # its alt text may run over lines
CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
INLINE_CODE = re.compile(r"(`+).+?\1")
LINK_TARGET = re.compile(r"\]\([^)]*\)|\{[^}]*\}|<[^>]+>|https?://\S+")
WORD = re.compile(r"\b[A-Za-z][a-z]+\b")
WIDE = re.compile(r"[\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\uff00-\uffef]+")  # Chinese text and punctuation
QUOTED = re.compile(r'"[^"\n]*"')  # a quotation kept in its language: a prompt, a docstring
BLOCK_START = ("#", "- ", "* ", "!!!", "???", "===", ":   ")  # a line that starts a new block (or is a heading)
BLOCK_MARK = re.compile(r"^([-*]|\d+\.|===|:)\s*")
ADMONITION = re.compile(r'^(?:!!!|\?\?\?\+?)\s*\w+(?:\s+"(.*)")?')
FIGURE = re.compile(r"(?<![\w.\-/#])(\d+(?:,\d{3})*(?:\.\d+)*)(\s*(?:million|billion|万|亿)|M(?![A-Za-z]))?")
SCALES = {"million": 1e6, "M": 1e6, "billion": 1e9, "万": 1e4, "亿": 1e8}  # 28 million is 2,800 万
HEADING = re.compile(r"^#+\s*(.*?)\s*(?:\{[^}]*\})?\s*$")


def nav_markdown_pages() -> list[str]:
    """The .md pages of mkdocs.yml's nav, as paths under docs/ (read as YAML; its python tags read as nothing)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((REPO_ROOT / "mkdocs.yml").read_text(), Loader=Loader)

    def walk(item) -> list[str]:
        if isinstance(item, str):
            return [item] if item.endswith(".md") else []
        values = item.values() if isinstance(item, dict) else item
        return [page for value in values for page in walk(value)]

    return walk(config["nav"])


def translated_pages() -> list[str]:
    return [page for page in nav_markdown_pages() if page not in ENGLISH_ONLY]


@dataclass(slots=True)
class Page:
    """What an edition of a page must share with the other: headings, includes, fenced blocks; and its prose."""

    headings: list[tuple[int, str]]  # (level, id)
    shared: list[str]  # snippet includes, diff markers, then the images' files, in order
    fences: list[str]  # each fenced block's text, dedented
    prose: list[str]  # paragraphs, list items and table cells outside fences
    figures: list[Counter]  # the figures of each section (before the first heading, then under each), in order


def headings(text: str) -> list[tuple[int, str]]:
    """The page's headings as the site's table of contents has them (Python-Markdown's toc, as mkdocs renders)."""
    md = markdown.Markdown(extensions=["toc", "attr_list", "admonition", "tables", "md_in_html", "def_list",
                                       "pymdownx.superfences", "pymdownx.details", "pymdownx.tabbed"])
    md.convert(text)
    found: list[tuple[int, str]] = []

    def walk(tokens):
        for token in tokens:
            found.append((token["level"], token["id"]))
            walk(token["children"])

    walk(md.toc_tokens)
    return found


def same_section(include: str) -> str:
    """An include as both editions must have it: a snippet section ``NAME_zh`` (a generated table's zh edition) is
    ``NAME``'s."""
    return re.sub(r'_zh"$', '"', include.strip())


def read(path: Path) -> Page:
    text = path.read_text(encoding="utf-8")
    shared, fences, prose, block, sections = [], [], [], [], [[]]
    fence: tuple[str, str] | None = None  # (indent, marker) of the open fence
    body: list[str] = []
    for line in text.splitlines() + [""]:
        if fence is not None:
            if line.strip().startswith(fence[1]) and line.strip().strip(fence[1][0]) == "":
                fences.append("\n".join(body))
                fence, body = None, []
            else:
                body.append(line[len(fence[0]):] if line.startswith(fence[0]) else line.lstrip())
                shared += [same_section(m.group(0)) for m in SHARED_LINE.finditer(line) if "--8<--" in m.group(0)]
            continue
        opened = FENCE.match(line)
        if opened:
            fence = (opened.group(1), opened.group(2))
            body = [line.strip()]  # the opening line keeps the language and options
            continue
        shared += [same_section(m.group(0)) for m in SHARED_LINE.finditer(line)]
        stripped = line.strip()
        if stripped.startswith("#"):
            sections.append([])
        else:
            sections[-1].append(line)
        if stripped.startswith("|"):
            prose += [cell for cell in stripped.strip("|").split("|")]
        elif not stripped or stripped.startswith(BLOCK_START) or re.match(r"\d+\. ", stripped):
            if block:
                prose.append(" ".join(block))
            block = [BLOCK_MARK.sub("", stripped)] if stripped else []
            if stripped.startswith("#"):  # a heading's text is prose too; its id is compared with the headings
                block = [HEADING.match(stripped).group(1)]
            elif stripped.startswith(("!!!", "???")):  # an admonition's title, apart from its body
                prose.append(ADMONITION.match(stripped).group(1) or "")
                block = []
        else:
            block.append(stripped)
    if block:
        prose.append(" ".join(block))
    outside = re.sub(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[ \t]*$", "", text, flags=re.S | re.M)  # fences dropped
    shared += ["image " + m.group(1) for m in IMAGE.finditer(outside)]
    return Page(headings(text), shared, fences, prose, [figures("\n".join(lines)) for lines in sections])


def figures(text: str) -> Counter:
    """The figures of some prose that a translation must keep: decimals and numbers from 100 up, a count of millions
    in either language's unit (28 million, 2,800 万), outside code, link targets, ids and comments."""
    text = re.sub(r"<!--.*?-->|\]\([^)]*\)|\{[^}]*\}|https?://\S+", " ", INLINE_CODE.sub(" ", text), flags=re.S)
    found: Counter = Counter()
    for match in FIGURE.finditer(SHARED_LINE.sub(" ", text)):
        shown, unit = match.group(1), (match.group(2) or "").strip()
        if shown.count(".") > 1:  # a version: 2.13.0
            found[shown] += 1
            continue
        number = float(shown.replace(",", "")) * SCALES.get(unit, 1)
        if number >= 10 or "." in shown:
            found[f"{number:.6g}"] += 1
    return found


def english_prose(text: str) -> bool:
    """A block left untranslated (four English words or more and no Chinese), or an English sentence inside a
    Chinese one (six English words or more between two pieces of Chinese text). Code, link targets and quotations
    in double quotes do not count."""
    text = LINK_TARGET.sub(" ", SHARED_LINE.sub(" ", INLINE_CODE.sub(" ", text)))
    if not CJK.search(text):
        return len(WORD.findall(text)) >= 4
    return any(len(WORD.findall(segment)) >= 6 for segment in WIDE.split(QUOTED.sub(" ", text)))


def differences(english: Path, chinese: Path) -> list[str]:
    """What keeps ``chinese`` from being the zh edition of ``english``, one line each (none: in step)."""
    if not chinese.exists():
        return [f"{chinese.name} is missing: every page of the nav has its zh edition"]
    en, zh = read(english), read(chinese)
    problems = []
    if en.headings != zh.headings:
        padding = [None] * max(len(en.headings), len(zh.headings))
        for i, (a, b) in enumerate(zip(en.headings + padding, zh.headings + padding)):
            if a != b:
                problems.append(f"heading {i + 1}: English has {a} (level, id), zh has {b}; give the zh heading "
                                f"the English id with {{ #id }}")
                break
    if en.shared != zh.shared:
        missing = [s for s in en.shared if s not in zh.shared]
        extra = [s for s in zh.shared if s not in en.shared]
        problems.append(f"snippet includes, markers or images differ: missing in zh {missing}, only in zh {extra}"
                        + ("" if missing or extra else " (the same ones, in another order)"))
    if en.fences != zh.fences:
        missing = [f.splitlines()[0:2] for f in en.fences if f not in zh.fences]
        extra = [f.splitlines()[0:2] for f in zh.fences if f not in en.fences]
        problems.append(f"fenced blocks differ (code is shared, not translated): missing in zh {missing}, "
                        f"only in zh {extra}" + ("" if missing or extra else " (the same ones, in another order)"))
    names = ["(before the first heading)"] + [anchor for _, anchor in en.headings]
    for name, a, b in zip(names, en.figures, zh.figures):
        if a != b:
            problems.append(f"figures differ under {name!r}: only in English {sorted(a - b)}, "
                            f"only in the zh page {sorted(b - a)} (every figure stays, in its section)")
    problems += [f"English prose left in the zh page: {p[:100]!r}" for p in zh.prose if english_prose(p)]
    return problems


@pytest.mark.parametrize("page", translated_pages())
def test_every_page_has_its_chinese_edition_in_step(page):
    english = DOCS / page
    problems = differences(english, english.with_suffix(".zh.md"))
    assert not problems, f"{page} and its zh edition differ:\n  " + "\n  ".join(problems)


def test_no_chinese_page_outside_the_nav():
    pages = {DOCS / page for page in translated_pages()}
    strays = [p.relative_to(REPO_ROOT) for p in DOCS.rglob("*.zh.md")
              if p.with_suffix("").with_suffix(".md") not in pages]
    assert not strays, f"zh pages with no English page in the nav: {strays}"


def glossary_terms(path: Path) -> list[str]:
    """The terms of a glossary page: each line followed by a definition (``:   ``)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [lines[i].strip() for i in range(len(lines) - 1) if lines[i].strip() and lines[i + 1].startswith(":   ")]


def test_the_glossary_gives_each_term_in_both_languages():
    """The English glossary's "Token · 词元" is the Chinese glossary's "Token（词元）": both terms in both editions."""
    english, chinese = glossary_terms(DOCS / "glossary.md"), glossary_terms(DOCS / "glossary.zh.md")
    assert len(english) == len(chinese), f"{len(english)} English terms against {len(chinese)} Chinese ones"
    for en, zh in zip(english, chinese):
        term, _, name = en.partition(" · ")
        assert name and zh == f"{term}（{name}）", f"glossary term {en!r} (English page) against {zh!r} (zh page)"


def test_a_line_break_inside_chinese_text_is_not_drawn_as_a_space():
    spec = importlib.util.spec_from_file_location("chinese_hook", DOCS / "hooks" / "chinese.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    html = "<p>连续批处理让\n  多个请求共享，\nKV 缓存\nand English\nstays.</p><pre><code>一\n二</code></pre>"
    joined = "<p>连续批处理让多个请求共享，KV 缓存\nand English\nstays.</p><pre><code>一\n二</code></pre>"
    assert hook.join_chinese_lines(html) == joined
    tagged = '<p>这是\n<strong>重点</strong>\n，见\n<a href="m3/">块表</a>\n<code>x</code></p>'
    expected = '<p>这是<strong>重点</strong>，见<a href="m3/">块表</a>\n<code>x</code></p>'  # Latin after: a space
    assert hook.join_chinese_lines(tagged) == expected


def test_the_diff_hook_writes_its_words_in_the_pages_language():
    """A zh page's folded answers and "new file" marks are in Chinese, an English page's in English."""
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("diffs_hook", DOCS / "hooks" / "diffs.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    lesson = sorted(hook.lesson_files(REPO_ROOT, "m3"))[0]
    markdown = f"<!-- diff m2 m3 {lesson} -->\n\n<!-- changed-files m3 -->\n"
    config = SimpleNamespace(config_file_path=str(REPO_ROOT / "mkdocs.yml"))
    expected = {"m3.md": ("the lesson's answers", "(new file)"), "m3.zh.md": ("本课练习的答案", "（新文件）")}
    for page, words in expected.items():
        out = hook.on_page_markdown(markdown, SimpleNamespace(file=SimpleNamespace(src_uri=page)), config, None)
        assert all(word in out for word in words), f"{page}: {out[:200]}"


def test_the_check_finds_a_missing_include_a_missing_page_and_english_prose(tmp_path):
    """The check itself: a zh page with one snippet include deleted, a figure changed, or English left in it, is
    caught."""
    english = DOCS / "m3.md"
    chinese = english.with_suffix(".zh.md")
    text = chinese.read_text(encoding="utf-8")
    include = next(line for line in text.splitlines() if "--8<--" in line)
    dropped = tmp_path / "m3.zh.md"
    dropped.write_text(text.replace(include + "\n", "", 1), encoding="utf-8")
    assert any("snippet includes" in p for p in differences(english, dropped))
    assert any("missing" in p for p in differences(english, tmp_path / "absent.zh.md"))
    heading = next(line for line in text.splitlines() if line.startswith("## "))
    chinese_line = next(line for line in text.splitlines() if CJK.search(line) and not line.startswith(("#", "|")))
    left_in_english = {  # each one a mistake a translator makes
        "a paragraph": text + "\nThis paragraph was left in English by mistake.\n",
        "a sentence inside a Chinese one": text.replace(
            chinese_line, chinese_line + " This sentence was left in English by mistake.", 1),
        "a heading with the right id": text.replace(
            heading, "## Left in English by mistake " + heading[heading.index("{"):]),
        "an admonition's title": text + '\n!!! note "Where the project stands"\n    中文的正文。\n',
        "a definition": text + "\nToken（词元）\n:   The unit a language model reads and writes.\n",
    }
    changed_figure = tmp_path / "m3-figure.zh.md"
    changed_figure.write_text(text.replace("46,080", "46,081", 1), encoding="utf-8")
    assert any("figures differ" in p and "46080" in p for p in differences(english, changed_figure))
    for mistake, page in left_in_english.items():
        path = tmp_path / "m3-english.zh.md"
        path.write_text(page, encoding="utf-8")
        assert any("English prose" in p for p in differences(english, path)), f"{mistake} in English not found"


if __name__ == "__main__":  # python -m tests.test_docs_editions docs/m3.zh.md [...]; --ids docs/m3.md: its ids
    if sys.argv[1:2] == ["--ids"]:
        for name in sys.argv[2:]:
            for level, anchor in read(Path(name)).headings:
                print(f"{'#' * level} {{ #{anchor} }}")
        sys.exit(0)
    status = 0
    for name in sys.argv[1:]:
        chinese = (Path.cwd() / name).resolve()
        english = chinese.with_name(chinese.name.replace(".zh.md", ".md"))
        found = differences(english, chinese)
        print(f"{name}: " + ("in step" if not found else f"{len(found)} problem(s)"))
        for problem in found:
            print("  " + problem)
        status |= bool(found)
    sys.exit(status)
