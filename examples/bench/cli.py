"""The command line: parse and check the flags, build the workloads once, run every row, report."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from _common import REPO_ROOT, HelpFormatter

from milestones import MILESTONES

from .rows import (
    HF_CB_DEFAULTS,
    HF_ROWS,
    LLAMA_CPP_ROWS,
    ROW_OPTIONS,
    MilestoneRow,
    is_hf_row,
    measure_in_rounds,
)
from .workloads import WORKLOADS, Setup, build_workloads, fitting_max_model_len

DOCS_DIR = REPO_ROOT / "docs" / "assets" / "benchmarks"
POSITIVE_FLAGS = ("decode_tokens", "decode_prompt_len", "runs", "num_requests", "hf_batch_size", "mixed_runs",
                  "host_steps")


def int_range(text: str) -> tuple[int, int]:
    """LO,HI with 1 <= LO <= HI, e.g. --prompt-len-range 16,256."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers LO,HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def size_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. --batch-sizes 4,16,64."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return sorted(set(sizes))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark the milestones against each other and against transformers, in one process.",
        epilog=f"Milestones available: {', '.join(MILESTONES)}. A milestone row may take engine options after "
               f"'@', joined by '+': {', '.join(ROW_OPTIONS)} (e.g. m6@sync, m7@ngram, m7@draft, m2@torch+linear-torch;"
               " m8@tp2 and m8@tp3 run m8's tensor parallelism in 2 or 3 ranks, a process each, and skip, saying why, "
               "a workload whose model that many ranks cannot split: the bundled model's 9 heads take 3, not 2; "
               "m9@pd runs m9's prefill/decode disaggregation, a prefill and a decode worker behind a router, "
               "m9@pd2x1 two prefill workers and one decode worker (their host workload is skipped); "
               "m1@gguf runs the bundled file's Q4_1/Q8_0 blocks, m1@int8 per-channel int8 made at load: CPU, "
               "float32). "
               f"Rows for transformers: {', '.join(HF_ROWS)} "
               "('hf' = all three; hf-generate@bf16 or @fp32 in a dtype of its own). Rows for llama.cpp, only when "
               f"named and installed (pip install -e '.[llama-cpp]'): {', '.join(LLAMA_CPP_ROWS)} "
               "('llama.cpp' = all four: the bundled model in F32, in BF16, the bundled Q4_1 file itself, in Q8_0).",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--engines", default="all",
                   help="comma-separated rows: milestone names (m1,m2,...), each with options after '@' if wanted "
                        "(m7@ngram, m8@tp3: see below), 'hf' or hf-generate/hf-static/hf-continuous; 'all' = every "
                        "milestone (m8 in one rank, m9 in one engine) + hf")
    g.add_argument("--workloads", default="decode,mixed", help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    g.add_argument("--model", default=None, help="local folder or hub id; default: the bundled SmolLM2-135M-Instruct")
    g.add_argument("--device", default=None, help="cpu or cuda; default: cuda if available, else cpu")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="for every row; default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the whole run; default: torch's choice")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the engines")
    g.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="every row takes turns, transformers' and llama.cpp's too: every engine loaded at once, then "
                        "ROUNDS rounds in which each row measures each workload once (--runs and --mixed-runs count "
                        "per round); the median round")

    g = p.add_argument_group("decode workload")
    g.add_argument("--decode-tokens", type=int, default=128, help="forced output tokens per run")
    g.add_argument("--decode-prompt-len", type=int, default=32, help="prompt length in tokens")
    g.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    g.add_argument("--batch-sizes", type=size_list, default="4,16,64",
                   help="the batch workload: decode with this many requests at once, each size a row")

    g = p.add_argument_group("mixed workload")
    g.add_argument("--num-requests", type=int, default=64, help="requests, all submitted at once")
    g.add_argument("--prompt-len-range", type=int_range, default="16,256", metavar="LO,HI",
                   help="prompt tokens, uniform")
    g.add_argument("--output-len-range", type=int_range, default="32,256", metavar="LO,HI",
                   help="output tokens, uniform")
    g.add_argument("--m1-requests", type=int, default=16,
                   help="m1 runs only this prefix of the requests (it runs one at a time, so a full run is slow); "
                        "0 = all")
    g.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf-static row")
    g.add_argument("--mixed-runs", type=int, default=1,
                   help="timed runs of each served workload (mixed, shared, small, grounded, open) per row; the run "
                        "with the median throughput is reported")

    g = p.add_argument_group("shared-prefix workload (milestone rows only)")
    g.add_argument("--shared-prefix-len", type=int, default=600,
                   help="tokens of the system prompt every request shares")
    g.add_argument("--shared-output-len-range", type=int_range, default="32,128", metavar="LO,HI",
                   help="output tokens, uniform")

    g = p.add_argument_group("grounded and open workloads (milestone rows only; m7@ngram and m7@draft guess)")
    g.add_argument("--chat-requests", type=int, default=16,
                   help="chat requests in each: grounded ones ask to copy or edit a passage, open ones do not")
    g.add_argument("--chat-temperature", type=float, default=0.0,
                   help="sample the chat requests at this temperature, each with a seed of its own (0: greedy); "
                        "m7 rows still give m6's tokens, the noise depending on (seed, position) only")
    g.add_argument("--draft-layers", type=int, default=4,
                   help="m7@draft rows: the draft is the model's first this many layers")

    g = p.add_argument_group("host workload (milestone rows only): the engine's own work per step, on a tiny model")
    g.add_argument("--host-batch-sizes", type=size_list, default="1,8,64",
                   help="requests decoding at once, a row per size; m1 runs batch 1 only")
    g.add_argument("--host-steps", type=int, default=64, help="decode steps timed one by one; the median is reported")

    g = p.add_argument_group("engine options (passed only to milestones whose EngineConfig has them)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests running at once; default: the milestone's own "
                        f"(hf-continuous: {HF_CB_DEFAULTS['max_num_seqs']})")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step; default: the milestone's own "
                        f"(hf-continuous: {HF_CB_DEFAULTS['max_num_batched_tokens']})")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the smallest that fits the selected workloads (max prompt + max output)")
    g.add_argument("--tight-kv", type=int, default=None, metavar="N",
                   help="a tight KV memory budget of N * max_model_len tokens: m2 gets N slots (max_num_seqs=N), "
                        "paged milestones get the same bytes as a block pool (kv_cache_memory_bytes) and "
                        "--max-num-seqs")

    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("bench_results/benchmark.json"), help="JSON results file")
    g.add_argument("--plot", action="store_true", help="also write a bar chart next to the JSON (same name, .png)")
    g.add_argument("--docs", action="store_true",
                   help=f"write JSON and plot into {DOCS_DIR.relative_to(REPO_ROOT)}/ for the docs")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked; adds the rows to run, in order, each once: ``milestone_rows``, ``hf_rows`` and
    ``llama_cpp_rows``.

    ``milestones`` keeps the milestone rows' names, for the JSON.
    """
    p = build_parser()
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        p.error(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)}")
    engines: list[str] = []
    for name in (e.strip() for e in args.engines.split(",") if e.strip()):
        groups = {"all": [*MILESTONES, *HF_ROWS], "hf": HF_ROWS, "llama.cpp": LLAMA_CPP_ROWS}
        engines += [e for e in groups.get(name, [name]) if e not in engines]
    args.hf_rows = [e for e in engines if is_hf_row(e)]
    args.llama_cpp_rows = [e for e in engines if e in LLAMA_CPP_ROWS]
    try:
        args.milestone_rows = [MilestoneRow.parse(e, MILESTONES) for e in engines
                               if e not in args.hf_rows and e not in args.llama_cpp_rows]
    except ValueError as err:
        p.error(str(err))
    args.milestones = [row.name for row in args.milestone_rows]
    if args.interleave < 0:
        p.error("--interleave must be >= 0 (0: each row measured in turn, its runs back to back)")
    for flag in POSITIVE_FLAGS:
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if "batch" in args.workloads and max(args.batch_sizes) > (args.max_num_seqs or 16):
        print(f"note: batch sizes above --max-num-seqs ({args.max_num_seqs or 'the default 16'}) run in waves, not "
              "all at once; pass --max-num-seqs at least the largest batch size", flush=True)
    if args.docs:
        args.out, args.plot = DOCS_DIR / "benchmark.json", True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # torch and transformers load only once the flags are known good: --help and mistakes answer at once.
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from milestones.model_store import resolve_model

    from . import hf_rows, host_rows, milestone_rows, plots, report

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model_path = resolve_model(args.model)
    workloads = build_workloads(AutoTokenizer.from_pretrained(model_path), args)
    hf_config = AutoConfig.from_pretrained(model_path)
    setup = Setup(args, model_path, device, dtype, workloads,
                  max_model_len=args.max_model_len or fitting_max_model_len(args, workloads),
                  kv_bytes_per_token=hf_rows.kv_bytes_per_token(hf_config, dtype),
                  weight_bytes_per_token=hf_rows.weight_bytes_per_token(hf_config, dtype))
    results = report.new_results(setup, sys.argv[1:] if argv is None else argv)
    bandwidth = report.memory_bandwidth(device)
    results["machine"]["memory_bandwidth_gb_s"] = bandwidth / 1e9
    print_preamble(setup, results)

    rows = []

    def save_so_far(new_rows: list[dict]) -> None:
        """Keep what is measured: a run stopped midway (a time limit, a crash) still leaves its finished rows."""
        rows.extend(new_rows)
        results["results"] = [{k: v for k, v in r.items() if k != "_tokens"} for r in rows]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    if args.llama_cpp_rows:  # imported only when asked: llama-cpp-python is an optional extra
        from . import llama_cpp_rows
    if args.interleave:  # every row loaded at once, then they take turns
        loaded = [m for row in args.milestone_rows for m in milestone_rows.load_row(row, setup)]
        loaded += hf_rows.load_transformers(setup)
        loaded += llama_cpp_rows.load_llama_cpp(setup) if args.llama_cpp_rows else []
        save_so_far(measure_in_rounds(loaded, args.interleave))
    else:  # one engine or model loaded at a time, each row's runs back to back
        for row in args.milestone_rows:
            save_so_far(milestone_rows.run_milestone(row, setup))
        save_so_far(hf_rows.run_transformers(setup))
        save_so_far(llama_cpp_rows.run_llama_cpp(setup) if args.llama_cpp_rows else [])
    report.add_ratios_to_hf(rows, args.hf_batch_size)
    host_rows.add_host_per_row(rows)
    report.token_agreement(rows)
    report.add_bandwidth_fractions(rows, setup.weight_bytes_per_token, bandwidth, setup.dtype)
    load = report.load_average()
    if load is not None:
        results["machine"]["load_average_at_end"] = load
    results["results"] = rows

    print()
    report.print_table(rows)
    report.print_bandwidth(rows, setup.weight_bytes_per_token, bandwidth)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    if args.plot:
        png = args.out.with_suffix(".png")
        plots.write_plot(results, png)
        print(f"wrote {png}")
    failed = [f"{r['engine']} ({r['workload']})" for r in rows if r["status"] != "ok"]
    if failed:
        print(f"error: {len(failed)} row(s) failed: {', '.join(failed)}; their errors are in the JSON", file=sys.stderr)
        return 1
    return 0


def print_preamble(setup: Setup, results: dict) -> None:
    """What is about to run, and a warning when the machine is already busy (CPU numbers would be noisy)."""
    args, requests, config, machine = setup.args, setup.workloads.mixed, results["config"], results["machine"]
    print(f"benchmark: {config['model']} on {setup.device} ({config['dtype']}), {os.cpu_count()} CPUs, "
          f"torch {machine['torch']}; workloads {', '.join(args.workloads)}; "
          f"rows {', '.join(args.milestones + args.hf_rows + args.llama_cpp_rows)}", flush=True)
    load = machine.get("load_average_at_start", [0.0])[0]
    if load > 1.0 and setup.device.type == "cpu":
        print(f"note: the machine is busy (load average {load:.1f} on {os.cpu_count()} CPUs): CPU numbers will be "
              "noisy; with other processes competing, --threads 1 is often much faster than torch's default",
              flush=True)
    if "mixed" in args.workloads:
        m1_partial = "m1" in args.milestones and 0 < args.m1_requests < len(requests)
        print(f"mixed workload: {len(requests)} requests, {sum(len(r.prompt_ids) for r in requests)} prompt tokens, "
              f"{sum(r.max_tokens for r in requests)} output tokens"
              + (f"; m1 runs the first {args.m1_requests} only" if m1_partial else ""), flush=True)
