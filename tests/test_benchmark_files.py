"""Every file under docs/assets/benchmarks/ is cited somewhere, so superseded runs cannot pile up again (issue 61).

A run is cited when a page (``docs/*.md`` in either language, the README, or a summary a page includes), a hook, a
test or an example names its path: ``assets/benchmarks/NAME`` in a link, ``docs/assets/benchmarks/NAME`` in a
command or a snippet include, or ``"NAME"`` quoted in code that reads the folder (the results hook's claims). A run
that nothing cites any more leaves the folder; git history keeps it.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNS = REPO_ROOT / "docs/assets/benchmarks"


def citing_texts() -> dict[Path, str]:
    """The pages, hooks, tests and examples, and the files of RUNS that a page includes (a GPU run's summary.md)."""
    sources = [*REPO_ROOT.glob("docs/*.md"), REPO_ROOT / "README.md", *REPO_ROOT.glob("docs/hooks/*.py"),
               *REPO_ROOT.glob("tests/**/*.py"), *REPO_ROOT.glob("examples/**/*.py")]
    texts = {path: path.read_text(encoding="utf-8") for path in sources
             if path.is_file() and path.resolve() != Path(__file__).resolve()}
    # A text file of RUNS counts once something else cites it: an included summary cites its plots, but a summary
    # nothing includes keeps nothing alive.
    while True:
        added = {path: path.read_text(encoding="utf-8") for path in RUNS.rglob("*.md")
                 if path not in texts and is_cited(path, texts)}
        if not added:
            return texts
        texts.update(added)


def is_cited(path: Path, texts: dict[Path, str]) -> bool:
    name = path.relative_to(RUNS).as_posix()
    quoted = re.compile(r"[\"'`]" + re.escape(name) + r"[\"'`]")
    return any(f"assets/benchmarks/{name}" in text or quoted.search(text)
               for source, text in texts.items() if source != path)


def test_every_benchmark_file_is_cited():
    texts = citing_texts()
    orphans = sorted(path.relative_to(REPO_ROOT).as_posix() for path in RUNS.rglob("*")
                     if path.is_file() and not is_cited(path, texts))
    assert not orphans, (
        f"{len(orphans)} file(s) under docs/assets/benchmarks/ that no page, hook, test or example cites: "
        + ", ".join(orphans)
        + ". Link each from the page that quotes it (docs/measurements.md keeps the history), or `git rm` it: "
          "git history keeps superseded runs.")


def test_the_check_tells_a_cited_file_from_an_orphan():
    texts = citing_texts()
    assert not is_cited(RUNS / "cpu-speed-f32-0000000.json", texts)  # a name nothing cites (no file is written)
    assert is_cited(RUNS / "prefix.json", texts)  # quoted in the results hook's claims
    assert is_cited(RUNS / "gpu/bench-8b.png", texts)  # a plot of the GPU summary a page includes
