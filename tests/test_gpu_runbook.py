"""The GPU runbook rehearsed on the CPU (tests/gpu_runbook.py --device cpu), so the GPU's minutes go to measuring.

Each step runs as the runbook's user runs it, a separate command, on a tiny model: it must write its
files under the folder it is given and nowhere in the repository, exit 0 when all is well, and exit
non-zero when a benchmark row raised (its JSON still written, with the error). ``all`` runs every
step in one command, as a loan of minutes does, and packs the folder into one archive. The profile,
the attention diagnostic and the 8B group's checkpoint are checked on what that one run wrote.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.checkpoints import INDEX, LLAMA_SHAPES, is_complete
from tests.conftest import needs_compiler
from tests.gpu_profile import ROWS, busy_time, last_step
from tests.gpu_runbook import BENCH_GROUPS, TEST_GROUPS, bench_command
from tests.gpu_sdpa import MODES, PHASES, SHAPES
from tests.gpu_steps import NO_TESTS, Step, outcome

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
    assert proc.returncode == 0, proc.stdout[-3000:]  # on a CPU every CUDA test skips
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"tests-{group}.log", f"tests-{group}.xml"]
    log = (tmp_path / f"tests-{group}.log").read_text()
    # The batched attention's CUDA tests are being written: until they are there, their group selects none.
    assert "skipped" in log or (group == "attention" and "no tests (none selected)" in proc.stdout), log[-2000:]
    assert repository_changes() == before


def test_a_test_group_that_selects_nothing_is_no_failure_but_any_other_status_is():
    assert outcome(NO_TESTS, tests=True).ok and outcome(NO_TESTS, tests=True).text == "no tests (none selected)"
    assert not any(outcome(status, tests=True).ok for status in (1, 2, 124, -9))
    assert not outcome(NO_TESTS).ok  # from anything but pytest, 5 is a failure like any other


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


SUMMARY_HEAD = ["preflight: ok", "profile: ok", "sdpa: ok"]


def summary_lines(folder: Path) -> list[str]:
    """summary.txt's lines without the seconds each step took (every step that ran says them)."""
    lines = (folder / "summary.txt").read_text().splitlines()
    assert all(re.search(r", \d+ s$", line) for line in lines if "not run" not in line), lines
    return [re.sub(r", \d+ s$", "", line) for line in lines]


@needs_compiler  # the graphs group runs m5 and m6, which capture with torch.compile on a CPU
def test_all_runs_every_step_into_the_folder_and_packs_it(all_run):
    assert all_run.proc.returncode == 0, all_run.proc.stdout[-3000:] + all_run.proc.stderr[-3000:]
    assert not all_run.changed, f"the run wrote into the repository: {all_run.changed}"
    expected = {"preflight.json", "summary.txt", "profile", "profile.log", "sdpa.log", "sdpa.txt", "sdpa.json",
                *(f"tests-{g}.{e}" for g in TEST_GROUPS for e in ("log", "xml")),
                *(f"bench-{g}.{e}" for g in BENCH_GROUPS for e in ("json", "log"))}
    assert {p.name for p in all_run.folder.iterdir()} == expected
    summary = summary_lines(all_run.folder)
    attention = next(line for line in summary if line.startswith("tests attention: "))  # none selected, until written
    assert attention in ("tests attention: ok", "tests attention: no tests (none selected)")
    assert summary == [*SUMMARY_HEAD, *(f"tests {g}: ok" for g in TEST_GROUPS if g != "attention"), attention,
                       *(f"bench {g}: ok" for g in BENCH_GROUPS)]
    with tarfile.open(all_run.archive) as archive:
        names = {Path(name).relative_to(all_run.folder.name) for name in archive.getnames() if "/" in name}
    assert {str(name) for name in names if len(name.parts) == 1} == expected
    assert {name.name for name in names if name.parts[0] == "profile" and len(name.parts) > 1} == {
        p.name for p in (all_run.folder / "profile").iterdir()}


@needs_compiler
@pytest.mark.parametrize("group", BENCH_GROUPS)
def test_each_bench_group_writes_its_rows(group, all_run):
    rows = json.loads((all_run.folder / f"bench-{group}.json").read_text())["results"]
    engines = BENCH_GROUPS[group].rows("cpu").split(",")  # hf-static's rows carry their batch size: hf-static-2
    assert all(any(r["engine"] == e or r["engine"].startswith(e + "-") for r in rows) for e in engines), rows
    assert all(r["status"] == "ok" for r in rows)


@needs_compiler
def test_the_profile_writes_every_scenario_of_every_row(all_run):
    folder = all_run.folder / "profile"
    scenarios = ["decode-1", "decode-2", "mixed"]  # the rehearsal's sizes
    stems = {f"{row.replace('@', '-')}-{scenario}": row for row in ROWS for scenario in scenarios}
    assert {p.name for p in folder.iterdir()} == {f"{s}.{e}" for s in stems for e in ("txt", "json")} | {
        "summary.txt", "summary.json"}
    summary = json.loads((folder / "summary.json").read_text())
    assert [(s["row"], s["scenario"]) for s in summary["scenarios"]] == [(r, s) for r in ROWS for s in scenarios]
    assert "device: not measured" in (folder / "summary.txt").read_text()  # the CUDA-only pass says it skipped
    for stem, row in stems.items():
        found = json.loads((folder / f"{stem}.json").read_text())
        assert found["device"] is None and found["timing"]["wall_mean"] > 0
        # Decode steps of the rehearsal's eager engines, and in a mixed step a new request beside the others.
        assert found["graphs"]["eager_steps"] == found["steps"], (stem, found["graphs"])
        own, cumulative = found["functions"]["own"], found["functions"]["cumulative"]
        assert len(own) == len(cumulative) == 40
        assert any("milestones/m" in f["function"] and "engine.py" in f["function"] for f in cumulative)
        # Only m6 with overlap (the rows but m6@sync) has a forward worker thread, whose CPU time is measured apart.
        assert (found["timing"]["worker_thread_cpu"] is not None) == (row in ("m6", "m6@fused", "m6@no-pieces"))
        assert "top 40 by own time" in (folder / f"{stem}.txt").read_text()


def test_the_last_step_is_its_events_in_launch_order():
    work = [{"ts": ts, "dur": 2.0, "name": name} for ts, name in [(5, "b2"), (0, "a1"), (3, "a2"), (4, "b1")]]
    assert [line.split()[-1] for line in last_step(work, 2)] == ["b1", "b2"]
    assert last_step([], 3) == [] and last_step(work, 1)[0] == "    2.0 us  a1"


def test_the_device_busy_time_counts_overlapping_work_once():
    assert busy_time([]) == 0
    assert busy_time([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4  # [0, 3) and [5, 6)
    assert busy_time([(4, 8), (0, 10)]) == 10


@needs_compiler
def test_the_sdpa_diagnostic_times_each_shape_in_each_phase(all_run):
    results = json.loads((all_run.folder / "sdpa.json").read_text())
    assert [r["mode"] for r in results] == ["default", "no-cudnn"]  # cuDNN alone is CUDA only
    for result in results:
        assert result["error"] is None and list(result["ms"]) == list(PHASES)
        assert all(set(result["ms"][phase]) == {shape.name for shape in SHAPES} for phase in PHASES)
        assert set(result["backend"].values()) <= {"MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"}
    text = (all_run.folder / "sdpa.txt").read_text()
    assert f"cudnn: {MODES['cudnn']}: skipped, CUDA only" in text and "thread2 cold" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_mode_whose_backend_refuses_every_shape_says_so_and_still_reports():
    """On a CPU cuDNN alone runs nothing: each call's error is kept, its time is NaN, and the mode still exits 0."""
    proc = subprocess.run([sys.executable, "-m", "tests.gpu_sdpa", "--device", "cpu", "--mode", "cudnn"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert set(result["backend"].values()) == {"none"} and "No viable backend" in result["error"]
    assert all(ms != ms for ms in result["ms"]["thread cold"].values())  # NaN


def test_the_8b_group_makes_its_checkpoint_first_with_the_layers_asked_for(tmp_path):
    command = bench_command(tmp_path, "8b", "cuda", tmp_path / "smollm2", layers=16)
    assert command[:2] == ["sh", "-c"]
    make, bench = command[2].split(" && ")
    assert f"tests.checkpoints llama3.1-8b {tmp_path}/milestones-llama3.1-8b-random-16-layers --device cuda " \
           "--layers 16" in make
    assert "--engines m6@sync,m6 --workloads decode,batch,mixed --batch-sizes 8,32" in bench


@needs_compiler
def test_the_8b_group_made_its_checkpoint_in_parts_with_the_8b_vocabulary(all_run, rehearsal):
    """Written a layer per file, the index last; the group's rows ran on it (ids past the SmolLM2 tokenizer's 49152
    decode as nothing), and the log says how long the writing took."""
    _, model = rehearsal
    folder = model.parent / "milestones-llama3.1-8b-tiny-random"
    assert is_complete(folder) and json.loads((folder / "config.json").read_text())["vocab_size"] == 128256
    files = {p.name for p in folder.glob("*.safetensors")}
    assert len(files) == LLAMA_SHAPES["llama3.1-8b-tiny"].layers + 1
    assert set(json.loads((folder / INDEX).read_text())["weight_map"].values()) == files
    assert re.search(rf"wrote {folder}: [\d.]+ GB in [\d.]+ s", (all_run.folder / "bench-8b.log").read_text())


def test_all_with_no_time_left_starts_nothing_and_still_packs(rehearsal, tmp_path):
    _, model = rehearsal
    proc = runbook("all", str(tmp_path / "out"), "--device", "cpu", "--model", str(model), "--budget", "0",
                   "--pack", str(tmp_path / "gpu.tar.gz"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary_lines(tmp_path / "out") == [
        "preflight: ok", "profile: not run (no time left)", "sdpa: not run (no time left)",
        *(f"{kind} {g}: not run (no time left)" for kind, groups in (("tests", TEST_GROUPS), ("bench", BENCH_GROUPS))
          for g in groups)]
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"preflight.json", "summary.txt"}
    assert (tmp_path / "gpu.tar.gz").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_all_stops_after_a_failed_preflight(tmp_path):
    proc = runbook("all", str(tmp_path / "out"), "--model", str(tmp_path / "never-made"))
    assert proc.returncode == 1
    assert summary_lines(tmp_path / "out") == ["preflight: failed (exit status 1)"]
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
    assert proc.returncode == 2
    assert "bench needs --group, one of: graphs, host, overlap, 8b, hf, speculative, eager" in proc.stderr


def collected(*args: str) -> set[str]:
    command = [sys.executable, "-m", "pytest", "tests/cuda", "--collect-only", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, NO_TESTS), proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line for line in proc.stdout.splitlines() if line.startswith("tests/cuda/")}


def test_every_cuda_test_is_in_exactly_one_group():
    """A CUDA test no group selects would never run on the GPU; one in two groups would run twice. Every group but
    the batched attention's (its tests are being written) selects some."""
    with ThreadPoolExecutor() as pool:  # six collections, side by side
        everything, *found = pool.map(lambda args: collected(*args), [(), *(("-k", e) for e in TEST_GROUPS.values())])
    groups = dict(zip(TEST_GROUPS, found))
    assert everything and all(tests for group, tests in groups.items() if group != "attention"), groups
    assert set().union(*groups.values()) == everything, f"in no group: {everything - set().union(*groups.values())}"
    assert sum(len(tests) for tests in groups.values()) == len(everything), "a test is in two groups"
