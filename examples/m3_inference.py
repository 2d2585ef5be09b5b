"""Milestone 3 demo: the same batch as m2's, its KV cache now paged in blocks from a small pool.

Run from the repository root:

    python examples/m3_inference.py                          # eight chat questions, a pool of 20 blocks
    python examples/m3_inference.py --num-kv-blocks 64       # room for everyone: no preemption
    python examples/m3_inference.py --kv-cache-memory-mb 64 --num-prompts 32
    python examples/m3_inference.py --block-size 4 --num-kv-blocks 96

A request holds only the blocks its tokens fill (``block_size`` tokens each), taken
from one shared pool as it grows, instead of m2's slot of ``max_model_len`` tokens.
The default pool is deliberately too small for all eight requests at their longest:
when a running request needs a block and none is free, the most recently admitted one
is *preempted* (its blocks freed, sent back to wait) and later recomputes its prompt
and the tokens it had generated, then carries on, so its text is not changed.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import HelpFormatter, fmt_bytes
from m2_inference import add_arguments, build_requests, generate, load, print_completions, print_totals

DEMO_NUM_KV_BLOCKS = 20  # 320 tokens; the eight default requests fill ~27 blocks at once when nothing stops them


def add_paging_arguments(p: argparse.ArgumentParser, default_blocks: str) -> None:
    g = p.add_argument_group("paging")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help=f"blocks in the pool; default: {default_blocks}")
    g.add_argument("--kv-cache-memory-mb", type=float, default=None,
                   help="size the pool from a memory budget in MiB instead of a block count")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate for a batch of chat prompts with milestone 3 (paged KV cache, preemption by recompute) "
                    "and print how the block pool was used.",
        epilog="Examples: `%(prog)s --num-kv-blocks 64` (no preemption), "
               "`%(prog)s --kv-cache-memory-mb 64 --num-prompts 32`.",
        formatter_class=HelpFormatter,
    )
    add_arguments(p)
    add_paging_arguments(p, f"{DEMO_NUM_KV_BLOCKS}, small enough to preempt, unless --kv-cache-memory-mb is given")
    args = p.parse_args(argv)
    if args.num_kv_blocks is None and args.kv_cache_memory_mb is None:
        args.num_kv_blocks = DEMO_NUM_KV_BLOCKS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from milestones.m3 import LLM, SamplingParams

    try:
        llm, load_s = load(LLM, args)
        cfg = llm.engine.config
        print(f"KV pool: {cfg.num_kv_blocks} blocks of {cfg.block_size} tokens = "
              f"{cfg.num_kv_blocks * cfg.block_size} tokens ({fmt_bytes(llm.engine.runner.kv_cache_bytes)}) "
              f"shared by up to {cfg.max_num_seqs} running requests")
        texts, prompts, max_tokens = build_requests(llm, args)
        outputs, wall_s, watch = generate(llm, SamplingParams, args, prompts, max_tokens)
    except ValueError as err:  # a bad option, a request that can never fit in the pool, a prompt too long
        print(f"error: {err}", file=sys.stderr)
        return 2
    times = Counter(request_id for _, request_id in watch.preempted)
    notes = [f"preempted {times[o.request_id]}x, recomputed" if times[o.request_id] else "" for o in outputs]
    print_completions(texts, outputs, args.show, notes)

    usage = llm.engine.kv_usage()
    total = cfg.num_kv_blocks
    reserved, peak = watch.high["reserved_bytes"], watch.high["used_bytes"]
    per_token = llm.engine.runner.kv_bytes_per_token
    m2_bytes = cfg.max_num_seqs * cfg.max_model_len * per_token
    print(f"\nsummary (m3: paged KV cache; {total} blocks of {cfg.block_size} tokens, max_num_seqs={cfg.max_num_seqs}, "
          f"max_num_batched_tokens={cfg.max_num_batched_tokens}):")
    print_totals(outputs, wall_s, watch, load_s)
    print(f"  blocks:            at most {watch.high['blocks_in_use']:.0f} of {total} in use at once "
          f"(fewest free: {watch.low['blocks_free']:.0f})")
    if watch.preempted:
        steps = sorted({step for step, _ in watch.preempted})
        print(f"  preemptions:       {usage['num_preemptions']} (at step{'s' if len(steps) > 1 else ''} "
              f"{', '.join(map(str, steps))}): the pool ran out, the newest running request gave its blocks back "
              "and recomputed later")
    else:
        print("  preemptions:       0 (the pool was big enough; try --num-kv-blocks 16)")
    print(f"  KV cache:          {fmt_bytes(reserved)} reserved, at most {fmt_bytes(peak)} holding tokens "
          f"({100 * peak / reserved:.0f}%); m2 would reserve {fmt_bytes(m2_bytes)} "
          f"({cfg.max_num_seqs} slots x {cfg.max_model_len} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
