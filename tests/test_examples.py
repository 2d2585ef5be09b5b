"""The example scripts run end to end (as a user runs them: a subprocess from the repository root).

They use the tiny random checkpoint and a handful of tokens, so they check that the
scripts work, not how fast anything is: timings are never asserted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from milestones import MILESTONES, m2
from milestones.kernels import onednn_available
from tests.chain import LOGPROB_ATOL
from tests.conftest import HAS_KERNEL_TOOLCHAIN, needs_compiler

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str, timeout: int = 180, returncodes: tuple[int, ...] = (0,),
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run an example with this interpreter from the repository root; ``env`` adds to the environment."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else os.environ | env)
    assert proc.returncode in returncodes, \
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    return proc


def import_example(module: str) -> ModuleType:
    """examples/<module> (dotted), imported the way the scripts import their helpers (with examples/ on sys.path)."""
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(REPO_ROOT / "examples"))


def import_bench(module: str) -> ModuleType:
    """examples/bench/<module>, imported the way examples/benchmark.py imports it."""
    return import_example(f"bench.{module}")


@pytest.mark.parametrize("mode", ["generate", "stream"])
def test_m1_inference_runs(tiny_model_path, mode):
    extra = ["--stream"] if mode == "stream" else []
    proc = run_script("examples/m1_inference.py", "--model", str(tiny_model_path), "--device", "cpu",
                      "--prompt", "Hello there", "--prompt", "What is 2+2?", "--max-tokens", "4", "--threads", "1",
                      *extra)
    out = proc.stdout
    assert "[0] prompt: Hello there" in out and "[1] prompt: What is 2+2?" in out
    assert "[0] completion:" in out and "[1] completion:" in out
    assert "finish reason: length" in out  # a random model rarely says EOS within 4 tokens; max_tokens stops it
    assert "time to first token" in out and "model load" in out


def test_m1_inference_help():
    proc = run_script("examples/m1_inference.py", "--help")
    for flag in ("--model", "--prompt", "--no-chat", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                 "--stream"):
        assert flag in proc.stdout


@needs_compiler  # m5 and m6 capture by compiling
def test_benchmark_tiny(tiny_model_path, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--engines", "all",
                      "--workloads", "decode,mixed", "--runs", "1", "--threads", "1", "--decode-tokens", "8",
                      "--decode-prompt-len", "12", "--num-requests", "4", "--prompt-len-range", "8,24",
                      "--output-len-range", "4,12", "--hf-batch-size", "2", "--out", str(out), "--plot",
                      timeout=600,  # a cold inductor cache compiles m5's and m6's captures: about a minute each
                      returncodes=(0, 1))  # 1: a row failed (only hf-continuous may, below)
    data = json.loads(out.read_text())
    failed = [r["engine"] for r in data["results"] if r["status"] != "ok"]
    assert proc.returncode == (1 if failed else 0), "the benchmark exits 1 exactly when a row failed"
    assert {"machine", "config", "results"} <= set(data)
    assert {"cpu_count", "torch", "transformers", "device"} <= set(data["machine"])
    rows = {(r["workload"], r["engine"]): r for r in data["results"]}
    expected = [(w, m) for m in MILESTONES for w in ("decode", "mixed")]
    expected += [("decode", "hf-generate"), ("mixed", "hf-static-2"), ("mixed", "hf-continuous")]
    assert set(rows) == set(expected)
    keys = {"status", "error", "num_requests", "output_tokens", "wall_s", "output_tokens_per_s", "ttft_mean_s",
            "itl_mean_s", "kv_peak_mb", "kv_reserved_mb"}
    for key, row in rows.items():
        assert keys <= set(row), key
        if key[1] == "hf-continuous" and row["status"] != "ok":
            assert row["error"], "a skipped hf-continuous row must say why"
            continue
        assert row["status"] == "ok", (key, row["error"])
        assert row["output_tokens_per_s"] > 0 and row["wall_s"] > 0
    for m in MILESTONES:
        mixed = rows[("mixed", m)]
        assert mixed["num_requests"] == 4 and mixed["kv_reserved_mb"] > 0
        assert rows[("decode", m)]["output_tokens"] == 8 and "ratio_to_hf" in rows[("decode", m)]
    graphs = rows[("mixed", "m5")]["graph_stats"]  # m5 on: every step of the pass replayed or eager, none uncounted
    assert graphs["replays"] + graphs["piecewise_replays"] + graphs["eager_steps"] == rows[("mixed", "m5")]["steps"]
    # the same wanted tokens
    assert rows[("mixed", "hf-static-2")]["output_tokens"] == rows[("mixed", "m1")]["output_tokens"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_benchmark_grounded_and_open_workloads_with_m7_guessing(tiny_model_path, tmp_path):
    """m7's rows (prompt lookup, and a draft cut from the model) report the guesses they made and kept, and give the
    m6 row's tokens on both chat workloads, sampled with a seed per request."""
    out, guessing = tmp_path / "bench.json", ("m7@eager+ngram", "m7@eager+draft")
    run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
               "--engines", f"m6@eager,{','.join(guessing)}", "--workloads", "grounded,open", "--max-num-seqs", "1",
               "--chat-requests", "4", "--chat-temperature", "0.7", "--draft-layers", "1", "--out", str(out),
               timeout=600,
               env={"MILESTONES_CACHE": str(tmp_path / "cache")})
    rows = {(r["workload"], r["engine"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {(w, e) for w in ("grounded", "open") for e in ("m6@eager", *guessing)}
    for workload, engine in [(w, e) for w in ("grounded", "open") for e in guessing]:
        ours, reference = rows[(workload, engine)], rows[(workload, "m6@eager")]
        assert ours["status"] == reference["status"] == "ok", (ours["error"], reference["error"])
        assert ours["same_tokens_as_m6@eager"] == "4/4 requests"
        assert 0 <= ours["accepted_tokens"] <= ours["draft_tokens"] and "draft_tokens" not in reference
        assert ours["num_requests"] == 4 and ours["max_running"] == 1
    assert rows[("grounded", "m7@eager+draft")]["draft_tokens"] > 0  # a draft model guesses whatever the text


@needs_compiler  # m5 captures by compiling
def test_benchmark_batch_workload_and_bandwidth(tiny_model_path, tmp_path):
    """Decode at each --batch-sizes (m1 skipped), m5 replays unless @eager, batch-1 decode gets its bandwidth share."""
    out = tmp_path / "bench.json"
    run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
               "--engines", "m1,m4,m5,m5@eager", "--workloads", "decode,batch", "--batch-sizes", "3,2",
               "--max-num-seqs", "3", "--runs", "1", "--decode-tokens", "6", "--decode-prompt-len", "10",
               "--out", str(out), "--plot", timeout=600)
    data = json.loads(out.read_text())
    rows = {(r["workload"], r["engine"]): r for r in data["results"]}
    expected = {("decode", m) for m in ("m1", "m4", "m5", "m5@eager")}
    expected |= {(f"batch-{b}", m) for b in (2, 3) for m in ("m4", "m5", "m5@eager")}
    assert set(rows) == expected
    assert all(row["status"] == "ok" for row in rows.values()), [row["error"] for row in rows.values()]
    for size in (2, 3):
        assert rows[(f"batch-{size}", "m4")]["num_requests"] == size
        assert rows[(f"batch-{size}", "m4")]["output_tokens"] == 6 * size
        for engine in ("m5", "m5@eager"):
            assert rows[(f"batch-{size}", engine)]["same_tokens_as_m4"] == f"{size}/{size} requests"
    assert rows[("batch-3", "m5")]["graph_stats"]["replays"] > 0  # counted over the row's own timed runs
    assert rows[("batch-2", "m5")]["graph_stats"]["padded_rows"] > 0  # buckets 1 and 3: a batch of 2 is padded
    assert rows[("batch-3", "m5@eager")]["graph_stats"]["replays"] == 0
    assert data["machine"]["memory_bandwidth_gb_s"] > 0
    weight_bytes, bandwidth = data["config"]["weight_bytes_per_token"], data["machine"]["memory_bandwidth_gb_s"] * 1e9
    for engine in ("m1", "m4", "m5"):
        row = rows[("decode", engine)]
        assert row["bandwidth_fraction"] == pytest.approx(row["output_tokens_per_s"] * weight_bytes / bandwidth)
    assert "bandwidth_fraction" not in rows[("batch-2", "m4")]
    assert out.with_suffix(".png").stat().st_size > 0


def test_benchmark_host_rows_time_the_engines_own_steps(tmp_path):
    """The host workload: each row on the tiny host checkpoint, a row per batch size (m1: batch 1 only), every step
    of a captured milestone replayed, and the per-request slope between the smallest and the largest batch."""
    out = tmp_path / "host.json"
    run_script("examples/benchmark.py", "--device", "cpu", "--engines", "m1,m4,m6", "--workloads", "host",
               "--host-batch-sizes", "1,3", "--host-steps", "6", "--threads", "1", "--out", str(out), timeout=600)
    rows = {(r["workload"], r["engine"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("host-1", "m1"), ("host-1", "m4"), ("host-3", "m4"), ("host-1", "m6"), ("host-3", "m6")}
    for (workload, engine), row in rows.items():
        assert row["status"] == "ok", (workload, engine, row["error"])
        assert row["host_step_ms"] > 0 and row["output_tokens"] == row["batch_size"] * 6
        assert row["output_tokens_per_s"] == pytest.approx(row["batch_size"] / row["host_step_ms"] * 1e3)
        # the model's calls (forward or replay, LM head) timed apart: on a GPU they are the device's share
        assert 0 < row["host_model_ms"] < row["host_step_ms"] and 0 < row["host_engine_ms"] < row["host_step_ms"]
    assert "host_us_per_row" not in rows[("host-1", "m1")], "one batch size has no slope"
    for engine in ("m4", "m6"):
        small, large = rows[("host-1", engine)], rows[("host-3", engine)]
        assert small["host_us_per_row"] == large["host_us_per_row"] == pytest.approx(
            (large["host_step_ms"] - small["host_step_ms"]) / 2 * 1e3)
        engine_slope = (large["host_engine_ms"] - small["host_engine_ms"]) / 2 * 1e3
        assert small["host_engine_us_per_row"] == pytest.approx(engine_slope)
    for workload in ("host-1", "host-3"):  # every timed step of m6 replays its captured bucket
        assert rows[(workload, "m6")]["replays"] == 6 and rows[(workload, "m6")]["eager_steps"] == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2", "smollm2-135m"])
def test_weight_bytes_per_token_counts_every_matrix_a_token_reads(tiny_model_factory, kind):
    """Every linear layer's weight, the LM head included (with tied embeddings: the embedding table, read whole)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_model_factory(kind)
    model = AutoModelForCausalLM.from_pretrained(path)
    expected = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                   if isinstance(m, torch.nn.Linear))
    assert import_bench("hf_rows").weight_bytes_per_token(AutoConfig.from_pretrained(path), torch.float32) == expected


def test_benchmark_mixed_runs_report_the_median_pass(tiny_model_path, tmp_path):
    """--mixed-runs: every pass is kept, the row is the median pass, and mixed rows carry their ratio to hf-static."""
    out = tmp_path / "bench.json"
    stdout = run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
                        "--engines", "m2,hf-static", "--workloads", "mixed", "--mixed-runs", "3", "--num-requests", "4",
                        "--prompt-len-range", "8,24", "--output-len-range", "4,12", "--hf-batch-size", "2",
                        "--out", str(out)).stdout
    rows = {r["engine"]: r for r in json.loads(out.read_text())["results"]}
    for row in rows.values():
        assert row["status"] == "ok", row["error"]
        speeds = [run["tokens_per_s"] for run in row["runs"]]
        assert len(speeds) == 3 and row["output_tokens_per_s"] == sorted(speeds)[1]
        assert row["runs_same_tokens"] is True  # greedy passes over the same requests agree
    m2, hf = rows["m2"], rows["hf-static-2"]
    assert m2["ratio_to_hf_engine"] == "hf-static-2" and hf["ratio_to_hf"] == 1.0
    assert m2["ratio_to_hf"] == pytest.approx(m2["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert stdout.count("run 3/3:") == 2


@pytest.mark.parametrize("repeat", ["--mixed-runs", "--interleave"])
def test_benchmark_passes_do_not_share_a_prefix_cache(tiny_model_path, tmp_path, repeat):
    """Each pass after the first, or each round (--interleave), gets a new engine: m4's second must not find the
    prompts already cached."""
    out = tmp_path / "bench.json"
    run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
               "--engines", "m4", "--workloads", "shared", repeat, "2", "--num-requests", "4",
               "--max-num-seqs", "1", "--shared-prefix-len", "48", "--shared-output-len-range", "4,8",
               "--out", str(out))
    (row,) = json.loads(out.read_text())["results"]
    computed = [run["prompt_tokens_computed"] for run in row["runs"]]
    assert computed[0] == computed[1] < row["prompt_tokens"], computed  # the shared prefix is reused within a pass only


def test_benchmark_rows_choose_the_cpu_fast_paths(tiny_model_path, tmp_path):
    """mK@OPTION+OPTION: each row runs with the engine options it names, and says which fast paths it used."""
    out = tmp_path / "bench.json"
    run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
               "--engines", "m2,m2@torch+linear-torch,m3@linear-torch", "--workloads", "mixed", "--num-requests", "3",
               "--prompt-len-range", "8,24", "--output-len-range", "4,8", "--out", str(out))
    rows = {r["engine"]: r for r in json.loads(out.read_text())["results"]}
    plain, m3 = rows["m2@torch+linear-torch"], rows["m3@linear-torch"]
    assert plain["engine_config"]["attention_backend"] == "torch"
    assert plain["engine_config"]["linear_backend"] == "torch"
    assert not plain["decode_kernel"] and not plain["packed_linear"] and not m3["packed_linear"]
    assert rows["m2"]["engine_config"]["linear_backend"] == "auto" and rows["m2"]["packed_linear"] is onednn_available()
    proc = subprocess.run([sys.executable, "examples/benchmark.py", "--engines", "m2@torch+fast"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown engine 'm2@torch+fast'" in proc.stderr
    proc = subprocess.run([sys.executable, "examples/benchmark.py", "--engines", "m2@torch+cpp"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "sets one option twice" in proc.stderr


def test_interleaved_rows_take_turns_and_report_the_median_round(tiny_model_path, tmp_path):
    """Transformers' rows take their turn in every round too: a ratio to hf-static compares passes of one stretch."""
    out = tmp_path / "interleaved.json"
    proc = run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
                      "--engines", "m2,m3,hf-static", "--hf-batch-size", "2", "--workloads", "decode,mixed",
                      "--interleave", "3", "--runs", "1", "--decode-tokens", "4", "--num-requests", "3",
                      "--prompt-len-range", "4,12", "--output-len-range", "2,6", "--out", str(out))
    rounds = [line for line in proc.stdout.splitlines() if line.startswith(("round ", "- m", "- hf"))]
    one_round = [f"- {name}: {workload} ..." for name in ("m2", "m3") for workload in ("decode", "mixed")]
    one_round.append("- hf-static-2: mixed ...")
    assert rounds == [line for number in (1, 2, 3) for line in [f"round {number}/3", *one_round]]
    rows = json.loads(out.read_text())["results"]
    assert [(r["engine"], r["workload"]) for r in rows] == [("m2", "decode"), ("m2", "mixed"), ("m3", "decode"),
                                                             ("m3", "mixed"), ("hf-static-2", "mixed")]
    for row in rows:
        speeds = sorted(r["tokens_per_s"] for r in row["runs"])
        assert row["status"] == "ok" and row["interleaved_rounds"] == 3 and len(speeds) == 3
        assert row["output_tokens_per_s"] == speeds[1]  # the median round
    assert rows[3]["ratio_to_hf"] == pytest.approx(rows[3]["output_tokens_per_s"] / rows[4]["output_tokens_per_s"])
    bad = subprocess.run([sys.executable, "examples/benchmark.py", "--interleave", "-1"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--interleave must be >= 0" in bad.stderr


def test_median_run_picks_the_middle_pass():
    median_run = import_bench("rows").median_run

    def passes(speeds, tokens=None):
        tokens = tokens or [[[7]]] * len(speeds)
        rows = iter({"output_tokens_per_s": s, "wall_s": 1 / s, "_tokens": t}
                    for s, t in zip(speeds, tokens, strict=True))
        return lambda: next(rows)

    row = median_run(passes([3.0, 1.0, 2.0]), 3)
    assert row["output_tokens_per_s"] == 2.0 and [r["tokens_per_s"] for r in row["runs"]] == [3.0, 1.0, 2.0]
    assert row["runs_same_tokens"] is True
    assert median_run(passes([4.0, 1.0, 3.0, 2.0]), 4)["output_tokens_per_s"] == 2.0  # even: the slower middle
    assert median_run(passes([5.0]), 1)["runs"] == [{"wall_s": 0.2, "tokens_per_s": 5.0}]
    assert median_run(passes([1.0, 2.0], tokens=[[[1]], [[2]]]), 2)["runs_same_tokens"] is False


def test_benchmark_reads_kv_usage_outside_the_timed_region(tiny_model_path, monkeypatch):
    """A pass's wall time counts the engine's steps, not the benchmark's kv_usage() reads between them."""
    workloads, rows, milestone_rows = import_bench("workloads"), import_bench("rows"), import_bench("milestone_rows")

    class JumpingClock:  # the benchmark's clock, pushed an hour ahead by every kv_usage() read
        hours = 0

        def perf_counter(self) -> float:
            return time.perf_counter() + 3600 * self.hours

    clock = JumpingClock()
    monkeypatch.setattr(milestone_rows, "time", clock)
    llm = m2.LLM(tiny_model_path, device="cpu", max_model_len=64)
    real_kv_usage = llm.engine.kv_usage

    def kv_usage_taking_an_hour() -> dict:
        clock.hours += 1
        return real_kv_usage()

    llm.engine.kv_usage = kv_usage_taking_an_hour
    requests = [workloads.Request(list(range(100, 110 + i)), max_tokens=4) for i in range(3)]
    setup = workloads.Setup(argparse.Namespace(m1_requests=0), tiny_model_path, torch.device("cpu"), torch.float32,
                            workloads.Workloads([], requests, [], []), max_model_len=64, kv_bytes_per_token=0,
                            weight_bytes_per_token=0)
    row = milestone_rows.mixed_row(rows.MilestoneRow("m2", "m2", {}), m2, llm, setup, "mixed")
    assert clock.hours == row["steps"] > 0  # one read after every step ...
    assert row["wall_s"] < 3600  # ... and none of them on the clock
    assert row["output_tokens"] == 12 and row["kv_peak_mb"] > 0 and row["max_running"] == 3


def test_benchmark_rejects_zero_runs():
    proc = subprocess.run([sys.executable, "examples/benchmark.py", "--mixed-runs", "0"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--mixed-runs must be >= 1" in proc.stderr


def tiny_args(tiny_model_path, *extra: str) -> list[str]:
    return ["--model", str(tiny_model_path), "--device", "cpu", "--threads", "1", *extra]


def summary_value(out: str, name: str) -> str:
    """The text after ``name:`` on a summary line, e.g. summary_value(out, "requests") == "8"."""
    match = re.search(rf"^\s+{re.escape(name)}:\s+(.*)$", out, re.M)
    assert match, f"no {name!r} line in\n{out}"
    return match.group(1)


@pytest.mark.real_model
def test_structured_output_cost_measures_the_grammar_and_the_sampler(bundled_model_path):
    """The figures behind the choice of llguidance (docs/benchmarks.md): its rows, and the engine's own mask."""
    pytest.importorskip("llguidance", reason="structured output needs llguidance (requirements.txt)")
    out = run_script("examples/structured_output_cost.py", "--rounds", "1").stdout
    for fmt in ("json_schema", "json_object"):
        assert re.search(rf"^{fmt} +llguidance +compile +[\d.]+ ms +per token \(mask \+ read\) +[\d.]+ us", out,
                         re.MULTILINE), out
    assert re.search(r"the engine's grammar mask, json_schema, one row of 49152 logits: \d+ us per token", out), out


def test_bench_quickstart(tiny_model_path):
    out = run_script("examples/bench_quickstart.py", str(tiny_model_path)).stdout
    speeds = re.findall(r"^(m1|m2): 256 output tokens in [\d.]+ s = ([\d.]+) tokens/s$", out, re.M)
    assert [name for name, _ in speeds] == ["m1", "m2"] and all(float(s) > 0 for _, s in speeds), out
    assert "same tokens in m1 and m2: 8 of 8 prompts" in out  # greedy on the same model: the same tokens


def test_m2_inference_default_prompts(tiny_model_path):
    out = run_script("examples/m2_inference.py", *tiny_args(tiny_model_path, "--max-tokens", "4")).stdout
    assert "[0] prompt: What is the capital of Japan?" in out and "[7] prompt:" in out and "[8]" not in out
    assert out.count("completion:") == 8 and "finish reason: length" in out
    assert summary_value(out, "requests") == "8" and summary_value(out, "output tokens") == "32"
    assert summary_value(out, "largest batch").startswith("8 requests")  # all eight ran together
    assert summary_value(out, "engine steps").startswith("4 forward passes")  # one prefill step and three decodes
    assert re.match(r"[\d.]+ [KM]iB reserved, at most [\d.]+ [KM]iB used", summary_value(out, "KV cache"))


def test_m2_inference_cycles_prompts(tiny_model_path):
    out = run_script("examples/m2_inference.py", *tiny_args(tiny_model_path, "--num-prompts", "12", "--max-tokens", "6",
                                                             "--max-num-seqs", "4", "--show", "3")).stdout
    assert out.count("completion:") == 3 and "... and 9 more requests" in out
    assert summary_value(out, "requests") == "12"
    assert summary_value(out, "largest batch").startswith("4 requests")  # max_num_seqs caps the batch
    assert 12 < int(summary_value(out, "output tokens")) <= 12 * 6  # the repeats get fewer max_tokens


@pytest.mark.parametrize("pool", ["blocks", "memory"])
def test_m3_inference_runs(tiny_model_path, pool):
    # Blocks of 4 tokens and prompts of ~40: a pool of 24 blocks holds two requests, and they outgrow it.
    size = ["--num-kv-blocks", "24"] if pool == "blocks" else ["--kv-cache-memory-mb", "1"]
    out = run_script("examples/m3_inference.py", *tiny_args(tiny_model_path, "--max-tokens", "16", "--block-size", "4",
                                                             *size)).stdout
    assert out.count("completion:") == 8 and "KV pool:" in out
    assert summary_value(out, "requests") == "8" and summary_value(out, "output tokens") == str(8 * 16)
    assert re.match(r"at most \d+ of \d+ in use", summary_value(out, "blocks"))
    assert "m2 would reserve" in summary_value(out, "KV cache")
    if pool == "blocks":
        assert summary_value(out, "blocks").startswith("at most 24 of 24")
        assert int(summary_value(out, "preemptions").split()[0]) > 0 and "preempted" in out


def test_scheduling_policies_order_the_work_and_never_change_the_tokens(tiny_model_path):
    """Every policy on every table gives fcfs's tokens; on the tight pool the cache-aware ones compute fewer prompt
    tokens than arrival order (four groups take turns through a cache that holds about one prefix besides); with the
    long request last, lof takes fewer steps (5 short answers of 2 tokens fit beside the long one of 16)."""
    out = run_script("examples/scheduling_policies.py", "--model", str(tiny_model_path), "--groups", "4",
                     "--per-group", "3", "--prefix-len", "32", "--output-len", "2", "--tight", "10,2",
                     "--roomy", "40,4", "--short-requests", "5", "--long-len", "16", "--long-pool", "40,2").stdout
    tables, table = {}, None
    row_pattern = r"^(\S+)\s+\d+ of \d+\s+([\d.]+)x\s+\d+\s+(\d+)\s.*\s(same|DIFFERENT)$"  # policy, ratio, steps
    for line in out.splitlines():
        if found := re.match(r"^([\w-]+) pool \(", line):
            table = tables[found.group(1)] = {}
        elif table is not None and (row := re.match(row_pattern, line)):
            table[row.group(1)] = (float(row.group(2)), int(row.group(3)), row.group(4))
    assert set(tables) == {"tight", "roomy", "long-last"}, out
    for table in tables.values():
        assert set(table) == {"fcfs", "lpm", "dfs-weight", "lof", "random"}, out
        assert all(same == "same" for *_, same in table.values()), out
    assert tables["tight"]["lpm"][0] < 1 and tables["tight"]["dfs-weight"][0] < 1, out
    assert tables["long-last"]["lof"][1] < tables["long-last"]["fcfs"][1], out


def test_m4_inference_compare(tiny_model_path):
    out = run_script("examples/m4_inference.py", *tiny_args(tiny_model_path, "--max-tokens", "4", "--compare",
                                                             "--scheduling-policy", "lpm")).stdout
    assert "=== prefix cache on ===" in out and "=== prefix cache off ===" in out
    assert out.count("completion:") == 8  # the second run's texts are compared, not printed
    assert "[0] prompt: When is the museum open?" in out and "prompt tokens from the cache" in out
    rows = dict(re.findall(r"^  (prompt tokens computed|prefix hit rate)\s+(\S+\s+\S+)$", out, re.M))
    on, off = (int(x) for x in rows["prompt tokens computed"].split())
    assert 0 < on < off  # the shared system prompt was computed once, not eight times
    assert rows["prefix hit rate"].split()[1] == "0%"
    assert "outputs: identical, token for token, for all 8 requests" in out


@needs_compiler  # on a CPU, a capture is a torch.compile, which builds C++
def test_m5_inference_compare(tiny_model_path):
    # Three requests at a time and sizes 1 and 3: the last two requests' decodes are padded from 2 to 3.
    out = run_script("examples/m5_inference.py", *tiny_args(tiny_model_path, "--max-tokens", "6", "--compare",
                                                             "--max-num-seqs", "3", "--cudagraph-capture-sizes", "1,3"),
                     timeout=300).stdout
    assert "=== captured ===" in out and "=== eager ===" in out
    assert "decode step captured for batch sizes [1, 3]" in out
    assert out.count("completion:") == 8  # the second run's texts are compared, not printed
    rows = dict(re.findall(r"^  (steps replayed|steps run eagerly)\s+(\d+\s+\d+)$", out, re.M))
    replayed, eager = (tuple(int(x) for x in rows[name].split()) for name in ("steps replayed", "steps run eagerly"))
    assert replayed[0] > 0 and replayed[1] == 0  # the eager engine replays nothing
    assert eager[0] < eager[1]  # the prefills run eagerly in both; the decodes only in the eager one
    assert int(summary_value(out, "padded rows").split()[0]) > 0
    assert "outputs: identical, token for token, for all 8 requests" in out


@pytest.mark.real_model
def test_m7_inference_compare():
    # The bundled model, asked to copy a passage, repeats it: prompt lookup has something to find (a random tiny
    # model's text never repeats).
    out = run_script("examples/m7_inference.py", "--device", "cpu", "--threads", "1", "--max-tokens", "24",
                     "--num-prompts", "2", "--compare").stdout
    assert "=== ngram ===" in out and "=== no speculation ===" in out
    made, kept = (int(x) for x in re.search(r"guesses:\s+(\d+) made, (\d+) kept", out).groups())
    assert 0 < kept <= made, out
    assert "outputs: 2 of 2 identical, token for token" in out


def test_m8_inference_compare(tiny_model_path):
    # Two ranks (the tiny model's 4 heads and 2 KV heads split in two): one worker process, spawned by the script's
    # LLM under its main guard; then m7 in one process, whose tokens the ranks' must be.
    out = run_script("examples/m8_inference.py", *tiny_args(tiny_model_path, "--max-tokens", "4",
                                                             "--tensor-parallel-size", "2", "--compare")).stdout
    assert "=== m8, 2 ranks ===" in out and "=== m7, one process ===" in out
    assert out.count("completion:") == 3  # the m7 run's texts are compared, not printed
    rank0 = r"^    rank 0: [\d.]+ [KM]iB \(0\.50 of one rank's; counted on its loaded model\)$"
    assert re.search(rank0, out, re.M), out
    assert re.search(r"^    rank 1: [\d.]+ [KM]iB \(0\.50 of one rank's", out, re.M)
    assert summary_value(out, "KV pool").endswith("for its 1 of the model's 2 KV heads")
    assert "outputs: identical, token for token, for all 3 requests" in out


def test_m8_inference_under_torchrun(tiny_model_path):
    """torchrun starts both ranks, each runs the script; rank 1 serves steps inside LLM(...) and exits there, so
    only rank 0 prints (the ranks' number is torchrun's when no --tensor-parallel-size is given)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("no torchrun next to this interpreter")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "examples/m8_inference.py",
                           *tiny_args(tiny_model_path, "--max-tokens", "4", "--show", "0")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count("=== m8, 2 ranks ===") == 1 and proc.stdout.count("summary (") == 1, proc.stdout
    assert "rank 1: " in proc.stdout and summary_value(proc.stdout, "output tokens").startswith("12 ")


def test_m9_inference_compare(tiny_model_path):
    """A prefill worker and a decode worker, spawned by the script's LLM under its main guard: every prompt computed on
    one, its keys and values sent to the other, every byte sent received; then m8 in one engine, whose tokens the
    workers' must be. A prefill worker without a decode worker is refused before any process starts."""
    out = run_script("examples/m9_inference.py", *tiny_args(tiny_model_path, "--max-tokens", "4", "--compare")).stdout
    assert "=== m9, 1 prefill worker + 1 decode worker, router cache_aware ===" in out, out
    assert "=== m8, one engine ===" in out and out.count("completion:") == 3  # m8's texts are compared, not printed
    prompt_tokens = sum(int(n) for n in re.findall(r"^\[\d\] (\d+) prompt tokens, ", out, re.M))
    prefill = re.search(r"^    prefill worker 0: (\d+) prompt tokens computed \((\d+) more found in its prefix "
                        r"cache\); sent 3 transfers, ([\d.]+ KiB)$", out, re.M)
    decode = re.search(r"^    decode worker 0:  0 prompt tokens computed; received 3 transfers, ([\d.]+ KiB): the keys "
                       r"and values of (\d+) prompt tokens$", out, re.M)
    assert prefill and decode, out
    assert int(prefill[1]) + int(prefill[2]) == int(decode[2]) == prompt_tokens
    assert prefill[3] == decode[1], "every byte sent arrived"
    assert re.search(r"summed over the transfers: [\d.]+ ms per prompt token moved$", out, re.M), out
    assert "outputs: identical, token for token, for all 3 requests" in out
    refused = run_script("examples/m9_inference.py", *tiny_args(tiny_model_path, "--decode-workers", "0"),
                         returncodes=(2,))
    assert "a disaggregated engine needs at least one of each" in refused.stderr
    from milestones.m9.config import ROUTER_POLICIES

    assert import_example("m9_inference").ROUTER_POLICIES == ROUTER_POLICIES  # written out: --help needs no torch


def test_m6_inference_compare_and_trace(tiny_model_path, tmp_path):
    # Eager steps: no compiling, so the test needs no C++ compiler and takes seconds.
    trace = tmp_path / "trace.json"
    out = run_script("examples/m6_inference.py", *tiny_args(tiny_model_path, "--max-tokens", "6", "--compare",
                                                             "--enforce-eager", "--trace", str(trace))).stdout
    assert "=== overlap (async_scheduling=True) ===" in out and "=== sync (async_scheduling=False) ===" in out
    assert out.count("completion:") == 8  # the second run's texts are compared, not printed
    assert "outputs: identical, token for token, for all 8 requests" in out
    printed = [int(x) for x in re.findall(r"^  hidden host share:\s+(\d+)% ", out, re.M)]
    assert len(printed) == 2, out
    from milestones.trace import hidden_host_share

    shares = {}
    for label in ("overlap", "sync"):
        path = tmp_path / f"trace-{label}.json"  # with --compare, one file per run, labelled
        assert f"trace:             {path}" in out
        events = json.loads(path.read_text())["traceEvents"]
        complete = [e for e in events if e["ph"] == "X"]
        assert {e["name"] for e in complete} == {"schedule", "forward", "process"}
        for e in complete:
            assert set(e["args"]) == {"step", "batch_size"} and 1 <= e["args"]["batch_size"] <= 8, e
            assert e["dur"] >= 0 and e["ts"] >= 0
        steps = {name: [e["args"]["step"] for e in complete if e["name"] == name]
                 for name in ("schedule", "forward", "process")}
        assert sorted(steps["forward"]) == list(range(1, len(steps["forward"]) + 1))  # every launched step ran once
        assert sorted(steps["process"]) == sorted(steps["forward"]) == sorted(steps["schedule"])  # and was processed
        shares[label] = hidden_host_share(events)
    assert printed == [round(100 * shares["overlap"]), round(100 * shares["sync"])]  # the script reads its trace
    assert shares["sync"] == 0  # without overlap the host waits for every forward: nothing can be hidden
    assert not trace.exists()  # with --compare the name is only the stem
    # The two timelines, drawn one above the other, as on the m6 page.
    png = tmp_path / "timeline.png"
    traces = [str(tmp_path / f"trace-{label}.json") for label in ("sync", "overlap")]
    out = run_script("examples/plot_trace.py", *traces, "--steps", "1,3", "--out", str(png)).stdout
    assert f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, "examples/plot_trace.py", str(tmp_path / "none.json")], cwd=REPO_ROOT,
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "m6_inference.py --trace" in missing.stderr
    beyond = subprocess.run([sys.executable, "examples/plot_trace.py", traces[0], "--steps", "900,901"],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    assert beyond.returncode == 1 and "choose other --steps" in beyond.stderr


@pytest.mark.parametrize("script, flags", [
    ("m2_inference.py", ("--num-prompts", "--max-tokens", "--max-num-seqs", "--max-num-batched-tokens", "--threads")),
    ("m3_inference.py", ("--block-size", "--num-kv-blocks", "--kv-cache-memory-mb", "--max-num-seqs")),
    ("m4_inference.py", ("--compare", "--no-prefix-caching", "--scheduling-policy", "--system", "--block-size")),
    ("m5_inference.py", ("--compare", "--enforce-eager", "--cudagraph-capture-sizes", "--max-num-seqs")),
    ("m6_inference.py", ("--compare", "--no-async", "--trace", "--enforce-eager", "--cudagraph-capture-sizes")),
    ("m7_inference.py", ("--compare", "--num-speculative-tokens", "--prompt-lookup-min", "--prompt-lookup-max")),
    ("m8_inference.py", ("--compare", "--tensor-parallel-size", "--enforce-eager", "--max-num-seqs")),
    ("m9_inference.py", ("--compare", "--prefill-workers", "--decode-workers", "--router-policy", "--enforce-eager")),
])
def test_batched_demos_help(script, flags):
    proc = run_script(f"examples/{script}", "--help")
    for flag in ("--model", "--prompt", "--temperature", "--seed", "--device", "--dtype", *flags):
        assert flag in proc.stdout, flag


def test_serve_benchmark_reports_every_milestone(tiny_model_path, tmp_path):
    out = run_script("examples/serve_benchmark.py", "--model", str(tiny_model_path), "--device", "cpu",
                     "--milestones", "m1,m2", "--num-requests", "6", "--rate", "50", "--max-tokens", "3", "6",
                     "--json", str(tmp_path / "serve.json")).stdout
    result = json.loads((tmp_path / "serve.json").read_text())
    assert [row["milestone"] for row in result["rows"]] == ["m1", "m2"], out
    for row in result["rows"]:
        assert row["output_tokens"] == sum(a["max_tokens"] for a in result["arrivals"])  # ignore_eos: all of them
        assert 0 < row["ttft_s"]["p50"] <= row["ttft_s"]["p99"] <= row["e2e_s"]["p99"]
        assert row["output_tok_per_s"] > 0


def test_serve_soak_checks_answers_statuses_and_blocks(tiny_model_path, tmp_path):
    """A few seconds of the soak: greedy answers equal LLM.generate's, killed streams, hostile bodies answered with
    their status, blocks back to 0."""
    out = tmp_path / "soak.json"
    run_script("examples/serve_soak.py", "--model", str(tiny_model_path), "--minutes", "0.1", "--clients", "3",
               "--max-num-seqs", "4", "--out", str(out))
    summary = json.loads(out.read_text())
    counts = summary["counts"]
    assert counts.get("greedy, same text", 0) > 0 and any(k.startswith("hostile ") for k in counts), counts
    assert not any("WRONG" in k for k in counts) and summary["blocks_in_use_at_end"] == 0, summary


def test_a_benchmark_row_can_run_in_its_own_dtype(tiny_model_path, tmp_path):
    rows = import_bench("rows")
    assert rows.MilestoneRow.parse("m1@bf16", ["m1"]).engine_options == {"dtype": "bfloat16"}
    with pytest.raises(ValueError, match="sets one option twice"):
        rows.MilestoneRow.parse("m1@bf16+fp32", ["m1"])
    assert rows.is_hf_row("hf-generate@bf16") and rows.is_hf_row("hf-static") and not rows.is_hf_row("hf-static@fp16")
    run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
               "--engines", "m1,m1@bf16,hf-generate,hf-generate@bf16", "--workloads", "decode", "--runs", "1",
               "--decode-tokens", "4", "--out", str(tmp_path / "b.json"))
    results = json.loads((tmp_path / "b.json").read_text())["results"]
    assert [r["engine"] for r in results] == ["m1", "m1@bf16", "hf-generate", "hf-generate@bf16"]
    assert [r["engine_config"]["dtype"] for r in results[:2]] == ["torch.float32", "torch.bfloat16"]
    assert [r["dtype"] for r in results[2:]] == ["float32", "bfloat16"]
    fp32, bf16, hf_fp32, hf_bf16 = (r["bandwidth_fraction"] / r["output_tokens_per_s"] for r in results)
    assert bf16 == pytest.approx(fp32 / 2) and hf_bf16 == pytest.approx(hf_fp32 / 2)  # half the bytes per weight
    # the compiled kernel if it builds, else oneDNN's packed bfloat16 layers where the CPU has bfloat16 instructions
    fast_bf16 = HAS_KERNEL_TOOLCHAIN or onednn_available(torch.bfloat16)
    assert results[1]["packed_linear"] == fast_bf16, "m1 in bfloat16 takes the fast bfloat16 linear layers on a CPU"


def test_m8_rows_run_in_ranks_and_skip_a_model_their_ranks_cannot_split(tiny_model_path, tmp_path):
    """m8@tp2 and m8@tp3 set m8's tensor_parallel_size. On the tiny model and the host checkpoint (4 heads each),
    m8@tp2 gives one rank's tokens in two; m8@tp3 is skipped with the reason printed, and the run goes on."""
    rows = import_bench("rows")
    assert rows.MilestoneRow.parse("m8@tp3", ["m8"]).engine_options == {"tensor_parallel_size": 3}
    assert rows.MilestoneRow.parse("m8@eager+tp2", ["m8"]).engine_options == {"enforce_eager": True,
                                                                              "tensor_parallel_size": 2}
    with pytest.raises(ValueError, match="sets one option twice"):
        rows.MilestoneRow.parse("m8@tp2+tp3", ["m8"])
    out = tmp_path / "b.json"
    proc = run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
                      "--engines", "m8@eager,m8@tp2,m8@tp3", "--workloads", "decode,host", "--runs", "1",
                      "--decode-tokens", "6", "--host-batch-sizes", "1,2", "--host-steps", "3", "--out", str(out),
                      timeout=600)
    heads = "3 ranks do not divide the model's 4 attention heads"
    assert f"- m8@tp3: decode skipped ({heads})" in proc.stdout
    assert f"- m8@tp3: host skipped (on its tiny checkpoint, {heads})" in proc.stdout
    results = {(r["workload"], r["engine"]): r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {(w, e) for w in ("decode", "host-1", "host-2") for e in ("m8@eager", "m8@tp2")}
    assert all(r["status"] == "ok" for r in results.values()), [r["error"] for r in results.values()]
    ranks = results[("decode", "m8@tp2")]
    assert ranks["engine_config"]["tensor_parallel_size"] == 2 and ranks["same_tokens_as_m8@eager"] == "1/1 requests"
    assert results[("decode", "m8@eager")]["engine_config"]["tensor_parallel_size"] == 1


def test_m9_rows_are_refused_before_m9():
    """m9@pd and m9@pd2x1 set m9's worker counts, and name no option a milestone before m9 has: refused as the row is
    named, saying whose lesson it is."""
    rows = import_bench("rows")
    assert rows.MilestoneRow.parse("m9@pd", MILESTONES).engine_options == {"num_prefill_workers": 1,
                                                                           "num_decode_workers": 1}
    assert rows.MilestoneRow.parse("m9@eager+pd2x1", MILESTONES).engine_options == {
        "enforce_eager": True, "num_prefill_workers": 2, "num_decode_workers": 1}
    with pytest.raises(ValueError, match="sets one option twice"):
        rows.MilestoneRow.parse("m9@pd+pd2x1", MILESTONES)
    with pytest.raises(ValueError, match=r"'m8@pd': @pd needs m9 or later \(prefill/decode disaggregation is m9's "
                                         r"lesson\); m8 has no such option"):
        rows.MilestoneRow.parse("m8@pd", MILESTONES)
    with pytest.raises(ValueError, match="needs m9 or later"):
        rows.MilestoneRow.parse("m2@torch+pd2x1", MILESTONES)


def test_m9_pd_row_gives_one_engines_tokens_and_skips_the_host_workload(tiny_model_path, tmp_path):
    """m9@pd: the router in this process, a prefill and a decode worker; the decode row's tokens are one engine's, and
    it reports what moved. The host workload, which times one engine's steps, is skipped for it, saying why."""
    out = tmp_path / "b.json"
    proc = run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--threads", "1",
                      "--engines", "m9@eager,m9@pd+eager", "--workloads", "decode,host", "--runs", "1",
                      "--decode-tokens", "6", "--host-batch-sizes", "1", "--host-steps", "3", "--out", str(out))
    assert "- m9@pd+eager: host skipped (it times one engine's steps" in proc.stdout
    results = {(r["workload"], r["engine"]): r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {("decode", "m9@eager"), ("host-1", "m9@eager"), ("decode", "m9@pd+eager")}
    assert all(r["status"] == "ok" for r in results.values()), [r["error"] for r in results.values()]
    apart = results[("decode", "m9@pd+eager")]
    config = apart["engine_config"]
    assert (config["num_prefill_workers"], config["num_decode_workers"]) == (1, 1)
    assert apart["same_tokens_as_m9@eager"] == "1/1 requests"
    assert apart["kv_transfers"] == 1 and apart["kv_transfer_mb"] > 0  # the one timed run's prompt
    assert "kv_transfers" not in results[("decode", "m9@eager")]


def test_llama_cpp_rows_are_named_not_implied():
    """'all' leaves llama.cpp out (an optional, compiled extra); 'llama.cpp' names all four of its rows."""
    cli = import_bench("cli")
    assert cli.parse_args(["--engines", "all"]).llama_cpp_rows == []
    args = cli.parse_args(["--engines", "m1@bf16,llama.cpp"])
    assert args.llama_cpp_rows == ["llama.cpp@f32", "llama.cpp@bf16", "llama.cpp@q4_1", "llama.cpp@q8_0"]
    assert args.milestones == ["m1@bf16"]
    args = cli.parse_args(["--engines", "m1@gguf,m1@int8,llama.cpp@q8_0"])
    assert args.llama_cpp_rows == ["llama.cpp@q8_0"]
    assert [row.engine_options for row in args.milestone_rows] == [{"quantization": "gguf"}, {"quantization": "int8"}]
    proc = subprocess.run([sys.executable, "examples/benchmark.py", "--engines", "llama.cpp@q4"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "llama.cpp@bf16" in proc.stderr


def test_the_gguf_for_llama_cpp_holds_the_same_weights_in_its_own_type(tmp_path):
    """Matrices de-quantized and stored as BF16 (or F32, or Q8_0), vectors kept in F32, every metadata entry
    copied."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    rng = np.random.default_rng(0)
    matrix, norm = rng.standard_normal((8, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    source = tmp_path / "source.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    stored = gguf.quants.dequantize(gguf.GGUFReader(source).tensors[0].data, gguf.GGMLQuantizationType.Q8_0)

    llama_cpp_rows = import_bench("llama_cpp_rows")
    for type_name in ("BF16", "F32", "Q8_0"):
        target = tmp_path / f"{type_name}.gguf"
        llama_cpp_rows.write_gguf(source, target, type_name)
        reader = gguf.GGUFReader(target)
        tensors = {t.name: t for t in reader.tensors}
        up, attn_norm = tensors["blk.0.ffn_up.weight"], tensors["blk.0.attn_norm.weight"]
        assert up.tensor_type.name == type_name and attn_norm.tensor_type.name == "F32"
        if type_name == "Q8_0":  # the source's Q8_0 values, quantized again: the same blocks
            expected = torch.from_numpy(stored).float()
        else:
            expected = torch.from_numpy(stored).to(torch.bfloat16 if type_name == "BF16" else torch.float32).float()
        assert torch.equal(torch.tensor(gguf.quants.dequantize(up.data, up.tensor_type)).reshape(8, 64), expected)
        assert np.array_equal(attn_norm.data, norm)
        assert reader.fields["llama.block_count"].contents() == 1
        assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
        assert not target.with_suffix(".partial").exists()


@pytest.mark.real_model
@pytest.mark.parametrize("rounds", [0, 2])
def test_llama_cpp_rows_run_where_llama_cpp_is_installed(tmp_path, rounds):
    """In turn after the milestones, or taking turns with them (--interleave)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra: pip install -e '.[llama-cpp]'")
    run_script("examples/benchmark.py", "--device", "cpu", "--threads", "1", "--engines", "m1,llama.cpp",
               "--workloads", "decode", "--runs", "1", "--decode-tokens", "8", "--interleave", str(rounds),
               "--out", str(tmp_path / "b.json"), timeout=600)
    results = {r["engine"]: r for r in json.loads((tmp_path / "b.json").read_text())["results"]}
    for engine, dtype in (("llama.cpp@f32", "float32"), ("llama.cpp@bf16", "bfloat16"), ("llama.cpp@q4_1", "Q4_1"),
                          ("llama.cpp@q8_0", "Q8_0")):
        row = results[engine]
        assert row["status"] == "ok" and row["output_tokens"] == 8 and row["dtype"] == dtype, row
        assert row["threads"] == 1 and row["load_s"] > 0 and row.get("interleaved_rounds") == (rounds or None)
        assert "same_tokens_as_m1" in row  # greedy: compared with m1's tokens


def test_linear_benchmark_times_every_way_this_cpu_has(tmp_path):
    out = tmp_path / "linear.json"
    proc = run_script("examples/linear_benchmark.py", "--shapes", "40x24,20x16", "--rows", "1,7", "--reps", "1",
                      "--threads", "1", "--stream-layers", "3", "--stream-shapes", "40x24,24x40,100x24",
                      "--stream-rows", "1,9", "--out", str(out))
    record = json.loads(out.read_text())
    assert [(r["out_features"], r["rows"]) for r in record["results"]] == [(40, 1), (40, 7), (20, 1), (20, 7)]
    ways = set(record["results"][0]["ms"])
    assert {"fp32-torch", "bf16-torch"} <= ways and ways.isdisjoint(record["left_out"])
    assert ways | set(record["left_out"]) == {"fp32-torch", "bf16-torch", "fp32-onednn", "bf16-onednn", "fp32-cpp",
                                               "bf16-cpp"}
    assert "left out" in proc.stdout
    if "fp32-cpp" in ways:  # a model's weights streamed: 3 layers of two shapes, then the head, in both kinds of page
        stream = {(row["way"], row["pages"], row["rows"]): row for row in record["stream"]}
        assert set(stream) == {(way, pages, rows) for way in ("fp32-cpp", "bf16-cpp")
                               for pages in ("4 KiB pages", "2 MiB pages") for rows in (1, 9)}
        assert all(row["calls"] == 7 and row["ms"] > 0 for row in stream.values())
        packed = 3 * (48 * 24 + 32 * 40) + 112 * 24  # outputs padded to whole panels of 16
        assert stream["fp32-cpp", "2 MiB pages", 9]["megabytes"] == packed * 4 / 1e6
        flops = 2 * (3 * (40 * 24 + 24 * 40) + 100 * 24)  # a row's: every weight's unpadded outputs
        row = stream["fp32-cpp", "4 KiB pages", 9]
        assert row["gflop_per_s"] == pytest.approx(flops * 9 / row["ms"] / 1e6)
    bad = subprocess.run([sys.executable, "examples/linear_benchmark.py", "--stream-rows", "1,0"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "every row count must be >= 1" in bad.stderr


def test_attention_benchmark_times_each_way_in_both_dtypes(tmp_path):
    """Every way in both dtypes, a median round each, and errors against float64 that bfloat16's summing explains."""
    out = tmp_path / "attention.json"
    run_script("examples/attention_benchmark.py", "--contexts", "3,5", "--layers", "2", "--rounds", "3", "--threads",
               "1", "--out", str(out))
    record = json.loads(out.read_text())
    rows = {(row["dtype"], row["way"]): row for row in record["results"]}
    assert set(rows) == {(dtype, way) for dtype in ("float32", "bfloat16")
                         for way in ("float32-sums", "dtype-products", "sdpa")}
    assert all(len(row["rounds_us"]) == 3 and row["us_per_call"] == sorted(row["rounds_us"])[1]
               for row in rows.values())
    assert all(row["max_error"] < 1e-6 for (dtype, _), row in rows.items() if dtype == "float32")
    # each output a weighted mean of values drawn from N(0, 1), under 2 here, rounded once to 8 significant bits
    assert rows["bfloat16", "float32-sums"]["max_error"] < 2**-7


@needs_compiler  # the kernel it times is built here
def test_block_layout_benchmark_times_each_layout_in_both_dtypes(tmp_path):
    """Every layout in both dtypes, a median round each. The layouts' agreement is the script's own check (it raises
    on layer 0 before timing), so this test sees only that the script runs and reports; its tables are tested
    below."""
    out = tmp_path / "layout.json"
    run_script("examples/block_layout_benchmark.py", "--requests", "3", "--context", "40", "--layers", "2",
               "--rounds", "3", "--threads", "1", "--out", str(out))
    record = json.loads(out.read_text())
    rows = {(row["dtype"], row["layout"]): row for row in record["results"]}
    assert set(rows) == {(dtype, layout) for dtype in ("float32", "bfloat16")
                         for layout in ("contiguous", "interleaved", "shuffled")}
    assert all(len(row["rounds_ms"]) == 3 and row["ms_per_step"] == sorted(row["rounds_ms"])[1]
               for row in rows.values())


@needs_compiler  # both kernels it times are built here
@pytest.mark.skipif(shutil.which("git") is None or not (REPO_ROOT / ".git").exists(),
                    reason="--baseline reads the old kernel from git: this checkout has no git history")
def test_block_layout_benchmark_times_a_baseline_kernel_beside_this_one(tmp_path):
    """--baseline builds the kernel of a git revision under its own op namespace and times it beside today's, every
    layout in both dtypes and (--huge-pages) in both kinds of page, their outputs equal or the script raises; a
    revision git cannot show is refused."""
    out = tmp_path / "layout.json"
    huge = sys.platform.startswith("linux") and Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file()
    run_script("examples/block_layout_benchmark.py", "--requests", "2", "--context", "20", "--layers", "1",
               "--rounds", "1", "--threads", "1", "--baseline", "HEAD", *(["--huge-pages"] if huge else []),
               "--out", str(out))
    record = json.loads(out.read_text())
    assert record["baseline"] == "HEAD" and record["huge_pages"] == huge
    pages_kinds = ("4 KiB", "2 MiB") if huge else ("4 KiB",)  # --huge-pages is refused where Linux has no THP
    assert {(row["kernel"], row["pages"], row["dtype"], row["layout"]) for row in record["results"]} == {
        (kernel, pages, dtype, layout) for kernel in ("this tree", "HEAD") for pages in pages_kinds
        for dtype in ("float32", "bfloat16") for layout in ("contiguous", "interleaved", "shuffled")}
    failed = run_script("examples/block_layout_benchmark.py", "--layers", "1", "--rounds", "1",
                        "--baseline", "no-such-revision", returncodes=(1,))
    assert "--baseline no-such-revision: git cannot show" in failed.stderr


def test_block_layouts_place_each_block_where_its_table_says():
    """The interleaved table hands blocks out a request at a time, and every layout's pool reads back the blocks."""
    layout_benchmark = import_example("block_layout_benchmark")
    tables = layout_benchmark.block_tables(3, 2, torch.Generator().manual_seed(0))
    assert tables["interleaved"].tolist() == [[0, 3], [1, 4], [2, 5]]
    blocks = torch.arange(6.0).view(1, 1, 6, 1, 1).expand(1, 1, 6, 2, 2).contiguous()  # block b holds the number b
    for table in tables.values():
        assert sorted(table.flatten().tolist()) == list(range(6))
        pool = layout_benchmark.placed(blocks, table)
        for i, row in enumerate(table.tolist()):  # request i's block j sits where the table says
            assert [pool[0, 0, block, 0, 0].item() for block in row] == [i * 2 + j for j in range(2)]


def test_profile_step_sorts_the_time_of_a_decode_step(tiny_model_path, tmp_path):
    """Every category is found (a linear layer's and attention's operators are told apart by where they were called
    from), the shares add up to the whole step, and the bytes count every weight once plus the keys and values."""
    out = tmp_path / "profile.json"
    run_script("examples/profile_step.py", "--model", str(tiny_model_path), "--threads", "1", "--milestones", "m1,m2",
               "--batch-sizes", "1,3", "--steps", "6", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["copy_bandwidth_gb_per_s"] > 0
    assert [(row["milestone"], row["batch_size"]) for row in result["rows"]] == [
        ("m1", 1), ("m2", 1), ("m2", 3)]  # m1 runs one request at a time
    for row in result["rows"]:
        shares = row["shares"]
        assert abs(sum(shares.values()) - 1) < 1e-9, shares
        assert shares["linear"] > 0 and shares["attention"] > 0 and shares["other ops"] > 0, shares
        assert row["tokens_per_s"] == pytest.approx(row["batch_size"] / row["step_ms"] * 1e3)
    one, three = result["rows"][1], result["rows"][2]
    assert three["bytes_per_step"] > one["bytes_per_step"]  # two more requests' keys and values
    run_script("examples/profile_step.py", "--model", str(tiny_model_path), "--threads", "1", "--milestones", "m2",
               "--batch-sizes", "1", "--steps", "6", "--dtype", "bfloat16", "--out", str(out))
    half = json.loads(out.read_text())["rows"][0]
    assert half["bytes_per_step"] * 2 == one["bytes_per_step"]  # weights, keys and values in two bytes, not four


def test_tensor_parallel_costs_measure_each_rank_count(tiny_model_path, tmp_path):
    """One rank meets nobody; two spend part of rank 0's step in gloo's collectives, write their trace, and time a
    step's message both ways."""
    out, traces = tmp_path / "costs.json", tmp_path / "traces"
    run_script("examples/tensor_parallel_costs.py", "--model", str(tiny_model_path), "--sizes", "1,2", "--steps", "4",
               "--rounds", "1", "--out", str(out), "--trace", str(traces))
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "2"}
    assert not any(results["1"]["share"].values()) and "message" not in results["1"]
    assert 0 < results["2"]["share"]["all_reduce"] < 1
    message = results["2"]["message"]
    assert message["message_bytes"] > 0 and message["all_reduce_us"] > 0
    assert {path.name for path in traces.iterdir()} == {"tp1.json", "tp2.json"}


@pytest.mark.real_model
def test_quantization_quality_finds_gguf_within_float32_rounding_and_int8_close():
    """The bundled model's own blocks pick float32's token everywhere, each scored token's log-probability within the
    chain's tolerance (LOGPROB_ATOL), so a continuation's sum within its tokens' count of it; int8 mostly agrees."""
    out = run_script("examples/quantization_quality.py", timeout=600).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("m1", "llama.cpp"))}
    longest = int(re.search(r"the longest continuation (\d+)", out).group(1))
    top1, mean_shift, max_shift = rows["m1@gguf"][1:4]
    assert top1 == "100.0%", out
    assert float(mean_shift) <= LOGPROB_ATOL and float(max_shift) <= longest * LOGPROB_ATOL, (
        f"gguf moved a log-likelihood by up to {max_shift} (tolerance {longest} x {LOGPROB_ATOL}):\n{out}")
    assert float(rows["m1@int8"][1].rstrip("%")) > 90, out


def test_record_run_writes_a_recording_the_replay_page_reads(tiny_model_path, tmp_path):
    """The example a learner records a run with: m3 on a pool too small for four requests at once preempts, and
    the file holds every step (its checks against the engine are tests/test_recorder.py's)."""
    out_file = tmp_path / "run.json"
    out = run_script("examples/record_run.py", "--model", str(tiny_model_path), "--milestone", "m3", "--out",
                     str(out_file), "--num-kv-blocks", "8", "--max-tokens", "24").stdout
    record = json.loads(out_file.read_text())
    assert record["milestone"] == "m3" and len(record["requests"]) == 8, out
    assert f"{len(record['steps'])} steps of 8 requests" in out, out
    assert record["steps"][-1]["preemptions"] > 0 and f"preemptions {record['steps'][-1]['preemptions']}" in out, out
