"""What an engine reports of itself, ``engine.kv_usage()`` and ``engine.graph_stats()``: no lesson, written once.

Each milestone's cache shows in what its scheduler and runner hold, and ``kv_usage`` reads what is there: m1 and
m2 a slot per request (bytes reserved and filled); m3 a pool of blocks (``scheduler.block_manager``: blocks in
use and free, preemptions); m4 on, a prefix cache over them (``scheduler.tree``: blocks only the tree holds, and
the share of prompt tokens found in it). From m5, ``graph_stats`` counts the captured steps.
"""

from __future__ import annotations

from typing import Any


def kv_usage(scheduler: Any, runner: Any) -> dict[str, int | float]:
    """KV bytes reserved vs filled with tokens of running requests; the pool's blocks and the prefix cache's hits
    where the milestone has them."""
    computed = sum(seq.num_computed_tokens for seq in scheduler.running_seqs())
    usage: dict[str, int | float] = {"reserved_bytes": runner.kv_cache_bytes,
                                     "used_bytes": computed * runner.kv_bytes_per_token}
    blocks = getattr(scheduler, "block_manager", None)
    if blocks is None:  # m1, m2: a slot per request
        return usage
    in_use = {block for table in blocks.block_tables.values() for block in table}
    usage["blocks_in_use"] = len(in_use)
    has_tree = hasattr(scheduler, "tree")  # m4 on, even with enable_prefix_caching=False (None)
    if has_tree:
        cached = set(scheduler.tree.cached_blocks()) - in_use if scheduler.tree is not None else set()
        usage["blocks_cached"] = len(cached)
    usage["blocks_free"] = blocks.num_free_blocks
    usage["num_preemptions"] = scheduler.num_preemptions
    usage["num_preempted_tokens"] = scheduler.num_preempted_tokens
    admission = scheduler.admission  # why waiting requests waited: steps that admitted no more, by reason
    usage |= {f"refused_{reason}": count for reason, count in admission.refusals.items()}
    if admission.new_token_ratio is not None:
        usage["new_token_ratio"] = admission.new_token_ratio
    if has_tree:
        usage["prefix_hit_rate"] = scheduler.num_cached_tokens / max(1, scheduler.num_prompt_tokens)
    return usage


def graph_stats(runner: Any) -> dict[str, object]:
    """m5 on: which batch sizes and token counts were captured, and how many steps were replayed whole, replayed in
    pieces, padded, or run eagerly (and why)."""
    graphs, pieces = runner.graph_runner, runner.piecewise
    return {
        "captured_sizes": graphs.sizes if graphs else [],
        "replays": graphs.num_replays if graphs else 0,
        "eager_steps": runner.num_eager_steps,
        "eager_reasons": dict(runner.eager_reasons),
        "padded_rows": graphs.num_padded_rows if graphs else 0,
        "capture_seconds": (graphs.capture_seconds if graphs else 0.0) + (pieces.capture_seconds if pieces else 0.0),
        "piecewise_sizes": pieces.sizes if pieces else [],
        "piecewise_replays": pieces.num_replays if pieces else 0,
        "padded_tokens": pieces.num_padded_tokens if pieces else 0,
    }
