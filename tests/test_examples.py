"""The example scripts run end to end (as a user runs them: a subprocess from the repository root).

They use the tiny random checkpoint and a handful of tokens, so they check that the
scripts work, not how fast anything is: timings are never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from milestones import MILESTONES

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("mode", ["generate", "stream"])
def test_m1_inference_runs(tiny_model_path, mode):
    extra = ["--stream"] if mode == "stream" else []
    proc = run_script("examples/m1_inference.py", "--model", str(tiny_model_path), "--device", "cpu",
                      "--prompt", "Hello there", "--prompt", "What is 2+2?", "--max-tokens", "4", "--threads", "1", *extra)
    out = proc.stdout
    assert "[0] prompt: Hello there" in out and "[1] prompt: What is 2+2?" in out
    assert "[0] completion:" in out and "[1] completion:" in out
    assert "finish reason: length" in out  # a random model rarely says EOS within 4 tokens; max_tokens stops it
    assert "time to first token" in out and "model load" in out


def test_m1_inference_help():
    proc = run_script("examples/m1_inference.py", "--help")
    for flag in ("--model", "--prompt", "--no-chat", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stream"):
        assert flag in proc.stdout


def test_benchmark_tiny(tiny_model_path, tmp_path):
    out = tmp_path / "bench.json"
    run_script("examples/benchmark.py", "--model", str(tiny_model_path), "--device", "cpu", "--engines", "all",
               "--workloads", "decode,mixed", "--runs", "1", "--threads", "1", "--decode-tokens", "8", "--decode-prompt-len", "12",
               "--num-requests", "4", "--prompt-len-range", "8,24", "--output-len-range", "4,12", "--hf-batch-size", "2",
               "--out", str(out), "--plot")
    data = json.loads(out.read_text())
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
    assert rows[("mixed", "hf-static-2")]["output_tokens"] == rows[("mixed", "m1")]["output_tokens"]  # the same wanted tokens
    assert out.with_suffix(".png").stat().st_size > 0
