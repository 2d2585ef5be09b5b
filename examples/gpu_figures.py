"""Put a GPU run's figures in the docs: the folders tests/gpu_runbook.py filled, in, the benchmarks pages, out.

    python examples/gpu_figures.py RUN_DIR [RUN_DIR ...]       # the folders each runbook step wrote

It copies each step's benchmark JSON, the CUDA tests' logs, ``all``'s summary and the preflight's report into
docs/assets/benchmarks/gpu/, redraws each JSON's plot, and writes summary.md there: the machine, the CUDA
tests' counts by group, the issue's targets (met or not, from rows measured in one process run) and every row. The
benchmarks page and the m5 and m6 pages include that file's sections, so committing the folder
updates the site. ``--docs-dir`` writes elsewhere (the rehearsal's test does).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from _common import REPO_ROOT  # first: makes the examples' packages importable from a plain checkout
from bench import plots

DOCS_DIR = REPO_ROOT / "docs" / "assets" / "benchmarks" / "gpu"


@dataclass(frozen=True, slots=True)
class Target:
    """A row's output tokens/s over another's, in one benchmark JSON, against the ratio the issue asks for."""

    section: str  # the summary section it belongs to: m5 or m6
    what: str
    file: str
    workload: str
    engine: str
    baseline: str  # an engine name, or a prefix ending in '-' (hf-static-16)
    wanted: float


TARGETS = [
    *(Target("m5", f"m5 over m5@eager, decode at batch {b}", "bench-graphs.json", w, "m5", "m5@eager", 2.0)
      for b, w in ((1, "decode"), (4, "batch-4"), (8, "batch-8"))),
    Target("m6", "m6 over m6@sync, small workload", "bench-graphs.json", "small", "m6", "m6@sync", 1.3),
    Target("m6", "m6 over transformers' static batching, mixed", "bench-hf.json", "mixed", "m6", "hf-static-", 5.0),
    # Where overlap can pay: a device step as long as the host's (issue 55: 1.3x where the two are closest).
    *(Target("m6", f"m6 over m6@sync, Llama-3.1-8B's shape, {what}", "bench-8b.json", w, "m6", "m6@sync", 1.3)
      for what, w in (("decode at batch 1", "decode"), ("decode at batch 8", "batch-8"),
                      ("decode at batch 32", "batch-32"), ("mixed", "mixed"))),
]


def speed(results: dict, workload: str, engine: str) -> float | None:
    for row in results["results"]:
        name_matches = row["engine"].startswith(engine) if engine.endswith("-") else row["engine"] == engine
        if row["workload"] == workload and name_matches and row["status"] == "ok":
            return row["output_tokens_per_s"]
    return None


def target_lines(section: str, runs: dict[str, dict]) -> list[str]:
    lines = ["| target | measured | wanted | met |", "|---|---|---|---|"]
    for target in (t for t in TARGETS if t.section == section):
        results = runs.get(target.file)
        ours, base = (speed(results, target.workload, e) if results else None for e in (target.engine, target.baseline))
        if ours is None or base is None:
            lines.append(f"| {target.what} | not measured | {target.wanted:.1f}x | - |")
            continue
        ratio = ours / base
        lines.append(f"| {target.what} | {ratio:.2f}x ({ours:.0f} vs {base:.0f} tok/s) | {target.wanted:.1f}x | "
                     f"{'yes' if ratio >= target.wanted else 'no'} |")
    return lines


def test_counts(folders: list[Path]) -> list[str]:
    """A row per test group's JUnit XML, and one for each group that ``all``'s summary.txt names but that left no
    report (stopped at its time limit, or not run)."""
    lines = ["| group | passed | failed | errors | skipped |", "|---|---|---|---|---|"]
    reported = {p.stem.removeprefix("tests-") for folder in folders for p in folder.glob("tests-*.xml")}
    for folder in folders:
        summary = folder / "summary.txt"
        for line in summary.read_text().splitlines() if summary.is_file() else []:
            name, _, status = line.partition(": ")
            if name.startswith("tests ") and name.removeprefix("tests ") not in reported:
                lines.append(f"| {name.removeprefix('tests ')} | no report: {status} | - | - | - |")
    for xml in sorted(p for folder in folders for p in folder.glob("tests-*.xml")):
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        lines.append(f"| {xml.stem.removeprefix('tests-')} | {total - failed - errors - skipped} | {failed} | "
                     f"{errors} | {skipped} |")
    return lines


def row_lines(name: str, results: dict) -> list[str]:
    config = results["config"]
    command = results.get("command", "")
    command = command if isinstance(command, str) else " ".join(command)
    lines = [f"**{name}** (`{command}`), max_model_len {config['max_model_len']}:", "",
             "| workload | engine | tok/s | TTFT ms | ITL ms | status |", "|---|---|---|---|---|---|"]
    for r in results["results"]:
        ms = [f"{1000 * r[k]:.1f}" if r.get(k) is not None else "-" for k in ("ttft_mean_s", "itl_mean_s")]
        tok_s = f"{r['output_tokens_per_s']:.0f}" if r.get("output_tokens_per_s") else "-"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r.get('error') or '')[:80]}"
        lines.append(f"| {r['workload']} | {r['engine']} | {tok_s} | {ms[0]} | {ms[1]} | {status} |")
    return lines + [""]


def summary(folders: list[Path], runs: dict[str, dict], machine: dict) -> str:
    where = (f"{machine['gpu']} (CUDA {machine.get('cuda', '?')})" if "gpu" in machine
             else f"device {machine.get('device', '?')}: a rehearsal, no GPU figures")
    any_run = next(iter(runs.values()), {"config": {}})
    text = ["<!-- written by examples/gpu_figures.py from a run of tests/gpu_runbook.py: do not edit by hand -->",
            "<!-- --8<-- [start:machine] -->",
            f"Measured on {where}, torch {machine.get('torch', '?')}, transformers {machine.get('transformers', '?')}, "
            f"{'a seeded random model of SmolLM2-135M' if 'gpu' in machine else 'a tiny random model'}'s shape in "
            f"{any_run['config'].get('dtype', '?')}.",
            "<!-- --8<-- [end:machine] -->", "", "<!-- --8<-- [start:tests] -->", *test_counts(folders),
            "<!-- --8<-- [end:tests] -->", ""]
    longest = runs.get("bench-graphs.json", {"config": {}})["config"].get("max_model_len", "?")
    for section in ("m5", "m6"):
        text += [f"<!-- --8<-- [start:{section}] -->", *target_lines(section, runs), "",
                 # What the captured decode step reads, stated next to its figures (issue 32, finding 7).
                 f"A captured decode step reads every row's whole block table: `max_model_len` ({longest}, the "
                 "workload's longest request) positions per layer, not only the row's own context.",
                 f"<!-- --8<-- [end:{section}] -->", ""]
    text += ["<!-- --8<-- [start:rows] -->"]
    for name, results in runs.items():
        text += row_lines(name, results)
        text += [f"![{name}](assets/benchmarks/gpu/{Path(name).with_suffix('.png')})", ""]  # as the benchmarks page
    text += ["<!-- --8<-- [end:rows] -->"]
    return "\n".join(text) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+", help="folders written by tests/gpu_runbook.py steps")
    parser.add_argument("--docs-dir", type=Path, default=DOCS_DIR, help=f"default: {DOCS_DIR.relative_to(REPO_ROOT)}")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not f.is_dir()]
    if missing:
        parser.error(f"not a folder: {', '.join(missing)}")
    args.docs_dir.mkdir(parents=True, exist_ok=True)
    runs, machine = {}, {}
    for folder in args.folders:
        if (folder / "preflight.json").is_file():
            machine = json.loads((folder / "preflight.json").read_text())["facts"]
            shutil.copy(folder / "preflight.json", args.docs_dir / "preflight.json")
        for path in sorted(folder.glob("tests-*.log")):  # the CUDA tests' whole output, for the record
            shutil.copy(path, args.docs_dir / path.name)
        if (folder / "summary.txt").is_file():  # what ``all`` says of each step: ok, failed, stopped, not run
            shutil.copy(folder / "summary.txt", args.docs_dir / "runbook-summary.txt")
        for path in sorted(folder.glob("bench-*.json")):
            runs[path.name] = json.loads(path.read_text())
            shutil.copy(path, args.docs_dir / path.name)
            plots.write_plot(runs[path.name], args.docs_dir / path.with_suffix(".png").name)
    if not runs and not machine:
        parser.error("no preflight.json or bench-*.json in the folders given")
    (args.docs_dir / "summary.md").write_text(summary(args.folders, runs, machine))
    print(f"wrote {args.docs_dir / 'summary.md'} and {len(runs)} benchmark JSON(s) with their plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
