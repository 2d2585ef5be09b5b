"""How full the KV cache is, for ``engine.kv_usage()``: a report, no lesson, written once for every milestone.

Each milestone's cache shows in what its scheduler and runner hold, and the report reads what is there: m1 and
m2 a slot per request (bytes reserved and filled); m3 a pool of blocks (``scheduler.block_manager``: blocks in
use and free, preemptions); m4 on, a prefix cache over them (``scheduler.tree``: blocks only the tree holds, and
the share of prompt tokens found in it).
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
    if has_tree:
        usage["prefix_hit_rate"] = scheduler.num_cached_tokens / max(1, scheduler.num_prompt_tokens)
    return usage
