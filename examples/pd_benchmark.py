"""What disaggregation buys (m9), measured in one process, rows interleaved, medians: the issue's three figures.

interference: steady decodes while long prompts arrive. m8 serves both in the same steps on both
  cores; m9 computes the prompts on a prefill worker (one core) and decodes on a decode worker
  (the other). Reported per row: p50/p99 inter-token latency of the decoding requests, the long
  prompts' time to first token, output tokens per second; for m9 the transfer (bytes and ms per
  prompt token moved, and its share of the long prompts' TTFT).
routing: two prefill workers, system prompts that do not all fit one worker's cache, requests in a
  shuffled order: prompt tokens the prefill workers computed, cache-aware against round-robin.

    python examples/pd_benchmark.py --part interference --rounds 3 --out docs/assets/benchmarks/m9-pd.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from milestones import m8, m9


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def interference_row(llm, args, rng: random.Random) -> dict:
    """Drive the engine by hand: the decoders at once, a long prompt every ``--arrival-s`` seconds."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    decode = m9.SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    longp = m9.SamplingParams(temperature=0, max_tokens=args.long_output, ignore_eos=True)
    decoders = [engine.add_request([rng.randrange(3, vocab) for _ in range(32)], decode) for _ in range(args.decoders)]
    arrivals = [args.warmup_s + i * args.arrival_s for i in range(args.long_prompts)]
    long_ids: dict[str, float] = {}
    stamps: dict[str, list[float]] = {r: [] for r in decoders}
    ttft: dict[str, float] = {}
    start, seen, tokens = time.perf_counter(), {}, 0
    while engine.has_unfinished_requests() or arrivals:
        now = time.perf_counter() - start
        while arrivals and arrivals[0] <= now:
            arrivals.pop(0)
            prompt = [rng.randrange(3, vocab) for _ in range(args.long_len)]
            long_ids[engine.add_request(prompt, longp)] = time.perf_counter()
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
            new = count - seen.get(out.request_id, 0)
            seen[out.request_id] = count
            tokens += new
            at = time.perf_counter()
            if out.request_id in stamps:
                stamps[out.request_id] += [at] * new
            elif out.request_id in long_ids and out.request_id not in ttft and count:
                ttft[out.request_id] = at - long_ids[out.request_id]
        if not engine.has_unfinished_requests() and arrivals:
            time.sleep(max(0.0, arrivals[0] - (time.perf_counter() - start)))
    wall = time.perf_counter() - start
    # while the long prompts arrive: the decoders' gaps after the first long prompt came, until the last one is out
    window = (start + args.warmup_s, start + args.warmup_s + args.long_prompts * args.arrival_s)
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:]) if window[0] <= b <= window[1]]
    row = {"itl_p50_ms": 1e3 * percentile(gaps, 0.5), "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
           "itl_max_ms": 1e3 * max(gaps), "gaps": len(gaps),
           "long_ttft_mean_s": statistics.mean(ttft.values()), "long_ttft_max_s": max(ttft.values()),
           "output_tokens_per_s": tokens / wall, "wall_s": wall}
    if hasattr(engine, "disaggregation_stats"):
        stats = engine.disaggregation_stats()
        decode_stats = next(v for k, v in stats.items() if k.startswith("decode"))
        moved = max(1, decode_stats["transferred_prompt_tokens"])
        row |= {"transfer_bytes_per_token": decode_stats["transfer_bytes"] / moved,
                "transfer_ms_per_token": 1e3 * decode_stats["transfer_seconds"] / moved,
                "transfer_ms_mean": 1e3 * decode_stats["transfer_seconds"] / max(1, decode_stats["transfers"])}
        row["transfer_share_of_long_ttft"] = row["transfer_ms_mean"] / 1e3 / row["long_ttft_mean_s"]
    return row


def interference(args) -> dict:
    limits = dict(model=args.model, device="cpu", max_model_len=2048, max_num_seqs=args.decoders + 4,
                  enforce_eager=True)
    # m8 with vLLM's default token budget, and with a smaller one: chunked prefill bounds the wait, at a cost in TTFT
    rows: dict[str, list[dict]] = {"m8": [], f"m8@budget{args.small_budget}": [], "m9@pd": []}
    for round_ in range(args.rounds):
        for name in rows:
            rng = random.Random(round_)
            if name == "m8":
                llm = m8.LLM(**limits)
            elif name.startswith("m8@"):
                llm = m8.LLM(**limits, max_num_batched_tokens=args.small_budget)
            else:
                llm = m9.LLM(**limits, num_prefill_workers=1, num_decode_workers=1)
            with llm:
                for warmup in range(args.warmups):  # one-time costs out of the figures: the CPU kernels compile
                    interference_row(llm, args, random.Random(99 + warmup))  # per shape the first time they meet it
                rows[name].append(interference_row(llm, args, rng))
            print(name, round_, json.dumps({k: round(v, 4) for k, v in rows[name][-1].items()}), flush=True)
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rows.items()}
    for name in rows:
        if name.startswith("m8"):
            medians[f"p99_ratio_m9_to_{name}"] = medians["m9@pd"]["itl_p99_ms"] / medians[name]["itl_p99_ms"]
    return {"workload": {k: getattr(args, k) for k in ("decoders", "decode_tokens", "long_prompts", "long_len",
                                                        "long_output", "arrival_s", "warmup_s")},
            "rounds": rows, "medians": medians}


def routing(args) -> dict:
    """Prompt tokens computed by two prefill workers, cache-aware against round-robin, on the same requests."""
    rng = random.Random(0)
    vocab = 49152
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_len)] for _ in range(args.systems)]
    order = [i % args.systems for i in range(args.routing_requests)]
    rng.shuffle(order)
    prompts = [systems[s] + [rng.randrange(3, vocab) for _ in range(16)] for s in order]
    params = m9.SamplingParams(temperature=0, max_tokens=2)
    result = {}
    for policy in ("round_robin", "cache_aware"):
        with m9.LLM(args.model, device="cpu", max_model_len=1024, num_kv_blocks=args.blocks_per_worker,
                    enforce_eager=True, num_prefill_workers=2, num_decode_workers=1, router_policy=policy) as llm:
            for prompt in prompts:  # one at a time: what each worker holds when the next one comes is settled
                llm.generate([prompt], params, use_tqdm=False)
            stats = llm.engine.disaggregation_stats()
        prefill = [v for k, v in stats.items() if k.startswith("prefill")]
        result[policy] = {"computed_prompt_tokens": sum(s["prompt_tokens"] - s["cached_tokens"] for s in prefill),
                          "prompt_tokens": sum(s["prompt_tokens"] for s in prefill),
                          "per_worker": [s["prompt_tokens"] - s["cached_tokens"] for s in prefill]}
        print(policy, result[policy], flush=True)
    result["ratio_cache_aware_to_round_robin"] = (result["cache_aware"]["computed_prompt_tokens"]
                                                  / result["round_robin"]["computed_prompt_tokens"])
    result["workload"] = {"systems": args.systems, "system_len": args.system_len, "requests": args.routing_requests,
                          "blocks_per_worker": args.blocks_per_worker, "block_size": 16}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["interference", "routing", "both"], default="both")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=2, help="unmeasured runs of the workload before each row's")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=400)
    parser.add_argument("--small-budget", type=int, default=128, help="m8's second row: max_num_batched_tokens")
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--long-output", type=int, default=4)
    parser.add_argument("--arrival-s", type=float, default=1.5)
    parser.add_argument("--warmup-s", type=float, default=0.5)
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=400)
    parser.add_argument("--routing-requests", type=int, default=32)
    parser.add_argument("--blocks-per-worker", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"command": "python examples/pd_benchmark.py " + " ".join(sys.argv[1:]),
              "created": time.strftime("%Y-%m-%d"),
              "machine": {"cpu": cpu_name(), "cpu_count": torch.get_num_threads(), "torch": torch.__version__,
                          "torch_threads": "1 a worker, all for m8"},
              "config": {"model": args.model or "SmolLM2-135M-Instruct (bundled)", "dtype": "float32"}}
    if args.part in ("interference", "both"):
        result["interference"] = interference(args)
        print(json.dumps(result["interference"]["medians"], indent=1))
    if args.part in ("routing", "both"):
        result["routing"] = routing(args)
        print(json.dumps({k: v for k, v in result["routing"].items() if k != "workload"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
