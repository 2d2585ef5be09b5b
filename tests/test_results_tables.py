"""The benchmarks page's results tables (docs/hooks/results.py): every cell is the ratio of two rows of its run.

The hook reads the JSON runs at build time; these tests read the same files on their own and check each cell's
figures, in both editions, and that a claim pointing at a row that is not there stops the build.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from mkdocs.exceptions import PluginError

REPO_ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("results_hook", REPO_ROOT / "docs/hooks/results.py")
results = sys.modules["results_hook"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(results)

CLAIMS = [(kind, claim) for kind, claims in results.TABLES.items() for claim in claims
          if isinstance(claim, results.Claim)]


def row_value(claim, engine: str, workload: str) -> float:
    run = json.loads((REPO_ROOT / results.RUNS / claim.run).read_text())
    if "interference" in run:  # pd_benchmark.py: each part's medians
        if workload == "interference":
            return run["interference"]["medians"][engine][claim.metric]
        return run["routing"][engine.removeprefix("m9@")]["computed_prompt_tokens"]
    rows = run["results"]
    if isinstance(rows, dict):  # tensor_parallel_costs.py: rank count -> figures
        return rows[engine.removeprefix("m8@tp")]["tokens_per_s"]
    return next(r[claim.metric] for r in rows if r["engine"] == engine and r["workload"] == workload)


@pytest.mark.parametrize("language", ["en", "zh"])
@pytest.mark.parametrize("kind,claim", CLAIMS, ids=[f"{k}-{c.milestone}-{c.row}-{c.workload}-{c.metric}"
                                                    for k, c in CLAIMS])
def test_each_cell_is_the_ratio_of_its_two_rows(kind, claim, language):
    row = row_value(claim, claim.row, claim.workload)
    baseline = row_value(claim, claim.baseline, claim.baseline_workload or claim.workload)
    ratio = baseline / row if claim.lower_is_better else row / baseline
    table = results.results_table(REPO_ROOT, (claim,), language)
    line = table.splitlines()[2]  # the header, its rule, then the claim's line
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    unit = {"output_tokens_per_s": " tok/s", "host_step_ms": " ms", "itl_p99_ms": " ms"}.get(claim.metric, "")
    words = {"en": ("against", claim.idea[0]), "zh": ("对比", claim.idea[1])}[language]
    shown = (f"`{claim.row}` {results.figure(row, claim.metric)} {words[0]} `{claim.baseline}` "
             f"{results.figure(baseline, claim.metric)}")
    assert cells[:4] == [claim.milestone, words[1], f"**{ratio:.2f}×**", shown], f"{claim}: the line is\n{line}"
    figures = re.findall(r"` ([\d,.]+)" + re.escape(unit) + r"(?: |$)", cells[3])
    assert len(figures) == 2 and all(shown_as(value, text) for value, text in zip((row, baseline), figures)), (
        f"{claim}: {cells[3]!r} does not show {row} and {baseline}{unit}")
    assert cells[4] == f"[1](#run-{results.slug(claim.run)})", "the cell links the first run of the list"
    assert claim.run in table and "examples/" in table, "the run and the command that reproduces it are listed"


def test_every_milestone_has_a_line_in_each_table():
    """A new milestone gets its line (a measured cell, or one that says it is not measured yet); m1 is the GPU
    table's baseline."""
    names = [p.name for p in sorted((REPO_ROOT / "milestones").glob("m[0-9]*")) if p.is_dir()]
    assert names
    for kind, claims in results.TABLES.items():
        said = {claim.milestone for claim in claims}
        baseline = {"m1"} if kind == "gpu" else set()
        assert set(names) - baseline <= said, f"the {kind} table says nothing of {sorted(set(names) - said)}"


def test_a_claim_on_a_missing_row_stops_the_build():
    claim = next(c for _, c in CLAIMS if c.run.endswith("prefix.json"))
    with pytest.raises(PluginError, match="has 0 rows"):
        results.results_table(REPO_ROOT, (replace(claim, row="m9"),), "en")
    with pytest.raises(PluginError, match="does not exist"):
        results.results_table(REPO_ROOT, (replace(claim, run="gone.json"),), "en")


# Figures the "What the figures say" bullets give that are not in a table cell: each read from its run.
def extra_figures() -> dict[str, float]:
    def rows(name):
        return json.loads((REPO_ROOT / results.RUNS / name).read_text())["results"]

    kv = {r["engine"]: r["kv_reserved_mb"] for r in rows("tight_kv.json")}
    m5 = next(r for r in rows("gpu/bench-graphs.json") if r["engine"] == "m5" and r["workload"] == "decode")
    assert kv["m2"] == kv["m3"], "the tight-KV run gives both milestones the same memory"
    return {"180": kv["m3"], "4.3": 1e3 * m5["itl_mean_s"]}


NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"


def shown_as(value: float, text: str) -> bool:
    """``text`` is ``value`` rounded as a table shows it (to its last digit)."""
    return abs(value - float(text.replace(",", ""))) <= 0.5 * 10 ** -len(text.partition(".")[2]) + 1e-9


@pytest.mark.parametrize("page", ["benchmarks.md", "benchmarks.zh.md"])
def test_the_summary_under_the_tables_gives_only_the_tables_figures(page):
    """Every figure in "What the figures say" is a cell of the tables (a ratio or one of its two rows), or one read
    here from its run: the prose cannot drift from the runs. Small counts (batch sizes, ranks, layers) are words."""
    text = (REPO_ROOT / "docs" / page).read_text(encoding="utf-8")
    assert "{ #what-the-figures-say }" in text or "### What the figures say\n" in text, f"{page} has no summary"
    section = re.split(r"### (?:What the figures say|.*\{ #what-the-figures-say \})\n", text)[1].split("\n## ")[0]
    tables = results.results_table(REPO_ROOT, results.CPU, "en") + results.results_table(REPO_ROOT, results.GPU, "en")
    in_tables = set(re.findall(NUMBER, tables))
    extra = extra_figures()
    for figure in re.findall(r"(?<![\w.])" + NUMBER, section):
        if float(figure.replace(",", "")) <= 32 and "." not in figure:
            continue  # a count: batch sizes, ranks, layers
        assert figure in in_tables or (figure in extra and shown_as(extra[figure], figure)), (
            f"{page}: {figure} in 'What the figures say' is in no table cell and no run this test reads")
