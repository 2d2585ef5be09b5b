"""The GPU runbook rehearsed on the CPU (tests/gpu_runbook.py --device cpu), so the GPU's minutes go to measuring.

Each step runs as the runbook's user runs it, a separate command, on a tiny model: it must write its
files under the folder it is given and nowhere in the repository, exit 0 when all is well, and exit
non-zero when a benchmark row raised (its JSON still written, with the error). ``all`` runs every
step in one command, as a loan of minutes does, and packs the folder into one archive.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import needs_compiler
from tests.gpu_runbook import BENCH_GROUPS, TEST_GROUPS, Step

REPO_ROOT = Path(__file__).resolve().parents[1]


def runbook(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.gpu_runbook", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)


def repository_changes() -> set[str]:
    """Paths git sees as changed or new (ignored ones excluded): a step must add none."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    if status.returncode != 0:
        pytest.skip(f"not a git checkout: {status.stderr.strip()}")
    return set(status.stdout.splitlines())


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The preflight, run once: it makes the tiny model the other steps use."""
    out, model = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("model") / "tiny"
    before = repository_changes()
    proc = runbook("preflight", str(out), "--device", "cpu", "--model", str(model))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert repository_changes() == before
    return out, model


def test_preflight_reports_the_machine_and_makes_the_model(rehearsal):
    out, model = rehearsal
    report = json.loads((out / "preflight.json").read_text())
    assert report["ok"] and not report["problems"]
    assert {"python", "torch", "transformers", "pytest", "model", "llguidance"} <= set(report["facts"])
    assert (model / "model.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_preflight_refuses_a_machine_without_a_gpu_and_says_so(tmp_path):
    proc = runbook("preflight", str(tmp_path), "--model", str(tmp_path / "never-made"))
    assert proc.returncode == 1
    assert not (tmp_path / "never-made").exists(), "the model is made only once the machine passed"
    assert "sees no CUDA GPU" in proc.stderr
    assert json.loads((tmp_path / "preflight.json").read_text())["ok"] is False


@pytest.mark.parametrize("group", TEST_GROUPS)
def test_each_test_group_writes_its_report_under_the_folder(group, tmp_path):
    before = repository_changes()
    proc = runbook("tests", str(tmp_path), "--group", group)
    assert proc.returncode == 0, proc.stdout[-3000:]  # on a CPU every CUDA test skips; 5 would mean none selected
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"tests-{group}.log", f"tests-{group}.xml"]
    assert "skipped" in (tmp_path / f"tests-{group}.log").read_text()
    assert repository_changes() == before


@dataclass(frozen=True, slots=True)
class AllRun:
    proc: subprocess.CompletedProcess
    folder: Path
    archive: Path
    changed: set[str]  # what the run changed in the repository


@pytest.fixture(scope="module")
def all_run(rehearsal, tmp_path_factory) -> AllRun:
    """Every step in one command, as a loan of minutes runs them, packed into one archive."""
    _, model = rehearsal
    where, before = tmp_path_factory.mktemp("all"), repository_changes()
    proc = runbook("all", str(where / "out"), "--device", "cpu", "--model", str(model),
                   "--pack", str(where / "packed" / "gpu.tar.gz"))
    return AllRun(proc, where / "out", where / "packed" / "gpu.tar.gz", repository_changes() ^ before)


@needs_compiler  # the graphs group runs m5 and m6, which capture with torch.compile on a CPU
def test_all_runs_every_step_into_the_folder_and_packs_it(all_run):
    assert all_run.proc.returncode == 0, all_run.proc.stdout[-3000:] + all_run.proc.stderr[-3000:]
    assert not all_run.changed, f"the run wrote into the repository: {all_run.changed}"
    expected = {"preflight.json", "summary.txt", *(f"tests-{g}.{e}" for g in TEST_GROUPS for e in ("log", "xml")),
                *(f"bench-{g}.{e}" for g in BENCH_GROUPS for e in ("json", "log"))}
    assert {p.name for p in all_run.folder.iterdir()} == expected
    assert (all_run.folder / "summary.txt").read_text().splitlines() == [
        "preflight: ok", *(f"tests {g}: ok" for g in TEST_GROUPS), *(f"bench {g}: ok" for g in BENCH_GROUPS)]
    with tarfile.open(all_run.archive) as archive:
        assert {Path(name).name for name in archive.getnames() if "/" in name} == expected


@needs_compiler
@pytest.mark.parametrize("group", BENCH_GROUPS)
def test_each_bench_group_writes_its_rows(group, all_run):
    rows = json.loads((all_run.folder / f"bench-{group}.json").read_text())["results"]
    engines = BENCH_GROUPS[group].engines.split(",")  # hf-static's rows carry their batch size: hf-static-2
    assert all(any(r["engine"] == e or r["engine"].startswith(e + "-") for r in rows) for e in engines), rows
    assert all(r["status"] == "ok" for r in rows)


def test_all_with_no_time_left_starts_nothing_and_still_packs(rehearsal, tmp_path):
    _, model = rehearsal
    proc = runbook("all", str(tmp_path / "out"), "--device", "cpu", "--model", str(model), "--budget", "0",
                   "--pack", str(tmp_path / "gpu.tar.gz"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "out" / "summary.txt").read_text().splitlines() == [
        "preflight: ok", *(f"{kind} {g}: not run (no time left)" for kind, groups in (("tests", TEST_GROUPS),
                                                                                       ("bench", BENCH_GROUPS))
                           for g in groups)]
    assert not list((tmp_path / "out").glob("bench-*")) and (tmp_path / "gpu.tar.gz").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_all_stops_after_a_failed_preflight(tmp_path):
    proc = runbook("all", str(tmp_path / "out"), "--model", str(tmp_path / "never-made"))
    assert proc.returncode == 1
    assert (tmp_path / "out" / "summary.txt").read_text() == "preflight: failed (exit status 1)\n"
    assert not (tmp_path / "never-made").exists()


def test_a_step_past_its_time_is_stopped_and_keeps_what_it_printed(tmp_path):
    command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    step, began = Step.start(command, tmp_path / "slow.log", echo=False), time.monotonic()
    assert step.finish(deadline=time.monotonic() + 3) == 124
    assert time.monotonic() - began < 30
    log = (tmp_path / "slow.log").read_text()
    assert "started" in log and "stopped at its time limit" in log
    assert Step.start([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "fails.log", echo=False).finish() == 3


@needs_compiler
def test_the_figures_script_turns_the_returned_folders_into_the_docs_summary(all_run, tmp_path):
    folders = [str(all_run.folder)]
    proc = subprocess.run([sys.executable, "examples/gpu_figures.py", *folders, "--docs-dir", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {f"bench-{g}.{ext}" for g in BENCH_GROUPS for ext in ("json", "png")} | {"preflight.json", "summary.md"} \
        | {f"tests-{g}.log" for g in TEST_GROUPS} | {"runbook-summary.txt"} == {p.name for p in tmp_path.iterdir()}
    summary = (tmp_path / "summary.md").read_text()
    for section in ("machine", "tests", "m5", "m6", "rows"):  # the sections the pages include
        assert f"--8<-- [start:{section}]" in summary and f"--8<-- [end:{section}]" in summary
    # The rehearsal measures batch 2, not 4 or 8: those two targets are reported unmeasured, never invented.
    assert "| m5 over m5@eager, decode at batch 1 | " in summary and "x (" in summary
    assert "| m5 over m5@eager, decode at batch 4 | not measured |" in summary
    assert "| m6 over transformers' static batching, mixed | " in summary
    committed = (REPO_ROOT / "docs/assets/benchmarks/gpu/summary.md").read_text()
    assert set(re.findall(r"--8<-- \[\w+:\w+\]", committed)) == set(re.findall(r"--8<-- \[\w+:\w+\]", summary))


def test_a_row_that_raises_fails_the_step_and_is_kept_in_the_json(rehearsal, tmp_path):
    _, model = rehearsal
    # enforce_eager is m5's option: m2 refuses to start with it, so that row raises.
    proc = runbook("bench", str(tmp_path), "--group", "eager", "--device", "cpu", "--model", str(model),
                   "--engines", "m2,m2@eager")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "row(s) failed: m2@eager" in proc.stdout  # the step's output, which its log keeps too
    assert "row(s) failed: m2@eager" in (tmp_path / "bench-eager.log").read_text()
    rows = json.loads((tmp_path / "bench-eager.json").read_text())["results"]
    assert {r["status"] for r in rows if r["engine"] == "m2"} == {"ok"}
    assert {r["status"] for r in rows if r["engine"] == "m2@eager"} == {"error"}
    assert "enforce_eager" in rows[-1]["error"]


def test_groups_need_a_known_name(tmp_path):
    proc = runbook("bench", str(tmp_path), "--group", "everything")
    assert proc.returncode == 2 and "bench needs --group, one of: graphs, hf, speculative, eager" in proc.stderr


def collected(*args: str) -> set[str]:
    command = [sys.executable, "-m", "pytest", "tests/cuda", "--collect-only", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line for line in proc.stdout.splitlines() if line.startswith("tests/cuda/")}


def test_every_cuda_test_is_in_exactly_one_group():
    """A CUDA test no group selects would never run on the GPU; one in two groups would run twice."""
    everything = collected()
    groups = {group: collected("-k", expression) for group, expression in TEST_GROUPS.items()}
    assert everything and all(groups.values()), groups
    assert set().union(*groups.values()) == everything, f"in no group: {everything - set().union(*groups.values())}"
    assert sum(len(tests) for tests in groups.values()) == len(everything), "a test is in two groups"
