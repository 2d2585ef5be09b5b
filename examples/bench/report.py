"""What a run reports: the JSON's header (machine and settings), ratios to transformers, token agreement, the table."""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import torch
import transformers

from .workloads import Setup


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages, where the system has them: a busy machine gives noisy numbers."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_info(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    load = load_average()
    if load is not None:
        info["load_average_at_start"] = load
    return info


def memory_bandwidth(device: torch.device, num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second that summing a large tensor reads (the best of ``repeats``): the ceiling on weight streaming.

    Batch-1 decode reads every weight once per token, so tokens/s times weight bytes
    over this figure is how close a row comes to what the memory allows.
    """
    data = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        data.sum().item()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


# Bytes a weight of a quantized row: Q8_0 stores 32 one-byte weights and a float16 scale; int8 a byte each (and a
# scale per output column, too few to count). Q4_1 and mK@gguf run the bundled file's blocks: its bytes are counted.
QUANTIZED_BYTES = {"Q8_0": 34 / 32, "int8": 1.0}
BUNDLED_BLOCKS = ("Q4_1", "gguf")  # llama.cpp@q4_1's dtype and mK@gguf's quantization: the bundled file as it is


def add_bandwidth_fractions(rows: list[dict], weight_bytes_per_token: int, bandwidth: float,
                            dtype: torch.dtype) -> None:
    """Each decode row's weight bytes read per second over the measured bandwidth (batch 1 only: one token a step).

    ``weight_bytes_per_token`` is in ``dtype``; a row in another dtype (``m1@bf16``) reads its own number of bytes,
    a quantized row (``m1@int8``, ``llama.cpp@q8_0``) its blocks' bytes.
    """
    for row in rows:
        if row["workload"] == "decode" and row["status"] == "ok":
            row_bytes = weight_bytes_read(row, weight_bytes_per_token, dtype)
            row["bandwidth_fraction"] = row["output_tokens_per_s"] * row_bytes / bandwidth


def weight_bytes_read(row: dict, weight_bytes_per_token: int, dtype: torch.dtype) -> float:
    """The weight bytes a row's batch-1 decode reads per token, from its dtype or its quantization."""
    config = row.get("engine_config") or {}
    kind = (config.get("quantization") or row.get("dtype") or config.get("dtype", str(dtype))).replace("torch.", "")
    if kind in BUNDLED_BLOCKS:  # only the bundled model has these rows: the rows of another are errors
        return bundled_gguf_matrix_bytes()
    weights = weight_bytes_per_token / dtype.itemsize
    if kind in QUANTIZED_BYTES:
        return weights * QUANTIZED_BYTES[kind]
    return weights * torch.empty(0, dtype=getattr(torch, kind)).element_size()


@functools.cache
def bundled_gguf_matrix_bytes() -> int:
    """The bytes of the bundled GGUF's matrices (Q4_1 layers, a Q8_0 embedding that is also the LM head)."""
    import gguf

    from milestones.model_store import bundled_gguf_path

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(bundled_gguf_path()).tensors if len(t.shape) > 1)


def print_bandwidth(rows: list[dict], weight_bytes_per_token: int, bandwidth: float) -> None:
    fractions = [f"{r['engine']} {r['bandwidth_fraction']:.0%}" for r in rows if "bandwidth_fraction" in r]
    if fractions:
        print(f"batch-1 decode reads {weight_bytes_per_token / 1e6:.0f} MB of weights per token (--dtype; a row "
              "in another dtype scales by its element size, a quantized row counts its blocks); this machine sums "
              f"memory at {bandwidth / 1e9:.1f} GB/s; share of that ceiling reached: {', '.join(fractions)}")


def new_results(setup: Setup, command: list[str]) -> dict:
    """The JSON's header: when, how it was called, the machine and every setting; rows go under ``results``."""
    args: argparse.Namespace = setup.args
    return {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(["examples/benchmark.py", *command]),
        "machine": machine_info(setup.device),
        "config": {"model": args.model or "SmolLM2-135M-Instruct (bundled)",
                   "dtype": str(setup.dtype).replace("torch.", ""), "workloads": args.workloads,
                   "milestones": args.milestones, "hf_rows": args.hf_rows,
                   "llama_cpp_rows": args.llama_cpp_rows, "seed": args.seed,
                   "decode_tokens": args.decode_tokens, "decode_prompt_len": args.decode_prompt_len, "runs": args.runs,
                   "batch_sizes": args.batch_sizes, "weight_bytes_per_token": setup.weight_bytes_per_token,
                   "num_requests": args.num_requests, "prompt_len_range": list(args.prompt_len_range),
                   "output_len_range": list(args.output_len_range), "m1_requests": args.m1_requests,
                   "hf_batch_size": args.hf_batch_size, "mixed_runs": args.mixed_runs,
                   "max_model_len": setup.max_model_len, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "tight_kv": args.tight_kv,
                   "shared_prefix_len": args.shared_prefix_len,
                   "shared_output_len_range": list(args.shared_output_len_range),
                   "chat_requests": args.chat_requests, "chat_temperature": args.chat_temperature,
                   "draft_layers": args.draft_layers},
        "results": [],
    }


def add_ratios_to_hf(rows: list[dict], hf_batch_size: int) -> None:
    """Each row's tok/s over transformers' on its workload: decode against hf-generate, mixed against hf-static.

    Only rows that served the same requests get one: m1 serves only the first
    --m1-requests of the mixed workload, so its mixed row has none.
    """
    for workload, engine in (("decode", "hf-generate"), ("mixed", f"hf-static-{hf_batch_size}")):
        ok = [r for r in rows if r["workload"] == workload and r["status"] == "ok"]
        ref = next((r for r in ok if r["engine"] == engine), None)
        for r in ok:
            if ref and r["num_requests"] == ref["num_requests"]:
                r["ratio_to_hf"] = r["output_tokens_per_s"] / ref["output_tokens_per_s"]
                r["ratio_to_hf_engine"] = engine


def token_agreement(rows: list[dict]) -> None:
    """Compare each row's tokens with the first row of its workload (greedy, so they should agree).

    Removes the tokens from the rows as it goes: they are too long for the JSON.
    """
    reference: dict[str, dict] = {}
    for row in rows:
        tokens = row.pop("_tokens", None)
        if tokens is None:
            continue
        ref = reference.setdefault(row["workload"], {"engine": row["engine"], "tokens": tokens})
        if ref["engine"] != row["engine"]:
            same = sum(a == b for a, b in zip(tokens, ref["tokens"], strict=False))
            row[f"same_tokens_as_{ref['engine']}"] = f"{same}/{min(len(tokens), len(ref['tokens']))} requests"


def fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def print_table(rows: list[dict]) -> None:
    header = ["workload", "engine", "tok/s", "runs", "vs hf", "TTFT ms", "ITL ms", "KV peak MB", "KV resv MB",
              "max run", "prompt computed", "wall s", "reqs", "note"]
    lines = [table_line(r) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    for i, line in enumerate([header, *lines]):
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("vs hf: decode rows against hf-generate, mixed rows against hf-static; "
          "runs: how many timed passes, slowest-fastest tok/s")


def table_line(r: dict) -> list[str]:
    if r["status"] != "ok":
        return [r["workload"], r["engine"], "error", "", "", "", "", "", "", "", "", "", "", (r["error"] or "")[:60]]
    runs = [x["tokens_per_s"] for x in r.get("runs", [])]
    spread = f"{len(runs)}: {min(runs):.1f}-{max(runs):.1f}" if len(runs) > 1 else ""
    return [r["workload"], r["engine"], fmt(r["output_tokens_per_s"], ".1f"), spread, fmt(r.get("ratio_to_hf"), ".2f"),
            fmt(r["ttft_mean_s"], ".0f", 1000), fmt(r["itl_mean_s"], ".1f", 1000), fmt(r["kv_peak_mb"], ".1f"),
            fmt(r["kv_reserved_mb"], ".1f"), fmt(r.get("max_running"), ".0f"),
            fmt(r.get("prompt_tokens_computed"), ".0f"), fmt(r["wall_s"], ".1f"), str(r["num_requests"]),
            r.get("note") or ""]
