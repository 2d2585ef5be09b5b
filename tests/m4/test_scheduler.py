"""The m4 scheduler alone, without a model: the lpm sort orders by cached length and leaves the tree as it was; each
scheduling policy's order (policies.py) on a tree of known prefixes."""

from __future__ import annotations

import random
from collections import deque

from milestones.m4.config import EngineConfig
from milestones.m4.detokenizer import IncrementalDetokenizer
from milestones.m4.policies import LPM_MAX_WAITING, order_waiting
from milestones.m4.radix_tree import RadixTree
from milestones.m4.scheduler import Scheduler
from milestones.m4.sequence import Sequence
from milestones.m4.step import ScheduledBatch
from milestones.serving.sampling_params import SamplingParams

BLOCK_SIZE = 4
SYSTEM = list(range(100, 112))  # three whole blocks


def make_seq(request_id: str, prompt: list[int]) -> Sequence:
    detokenizer = IncrementalDetokenizer(None, prompt, [])
    return Sequence(request_id, None, prompt, SamplingParams(max_tokens=4), seed=0, detokenizer=detokenizer)


def compute(batch: ScheduledBatch) -> None:
    """What the engine does after a forward pass: count the computed tokens, append a token after the prompt."""
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(0)


def tree_state(scheduler: Scheduler) -> list[tuple]:
    """Every node's edge, blocks, parent edge, lock count and LRU time."""
    nodes = scheduler.tree._nodes()
    return sorted((n.tokens, tuple(n.blocks), n.parent.tokens, n.lock_ref, n.last_access) for n in nodes)


def test_lpm_sorts_by_cached_length_without_changing_the_tree():
    config = EngineConfig(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64, block_size=BLOCK_SIZE,
                          num_kv_blocks=32,
                          scheduling_policy="lpm")
    scheduler = Scheduler(config)
    warm = make_seq("warm", SYSTEM + [1])
    scheduler.add(warm)
    compute(scheduler.schedule())
    scheduler.finish(warm)  # the tree now holds SYSTEM as one edge of three blocks
    blocker = make_seq("blocker", [900, 901])  # runs alone (max_num_seqs=1), so nothing below is admitted
    scheduler.add(blocker)
    compute(scheduler.schedule())

    waiting = {
        "none": make_seq("none", [7] * 9),
        "short": make_seq("short", SYSTEM[:4] + [0] * 8),  # leaves the SYSTEM edge after its first block
        "long": make_seq("long", SYSTEM + [1, 2]),
    }
    for seq in waiting.values():
        scheduler.add(seq)
    before = tree_state(scheduler)
    batch = scheduler.schedule()

    assert [s.request_id for s in batch.seqs] == ["blocker"]
    assert [s.request_id for s in scheduler.waiting] == ["long", "short", "none"]
    assert tree_state(scheduler) == before, "sorting the waiting queue split an edge or refreshed an LRU time"
    scheduler.check_integrity()

    lengths = {rid: scheduler.tree.cached_prefix_length(seq.token_ids[:-1]) for rid, seq in waiting.items()}
    assert lengths == {"none": 0, "short": 4, "long": 12}
    assert lengths == {
        rid: len(scheduler.tree.match_prefix(seq.token_ids[:-1])[0]) * BLOCK_SIZE for rid, seq in waiting.items()
    }

    scheduler.finish(blocker)
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["long"] and waiting["long"].num_cached_tokens == 12
    scheduler.check_integrity()


def tree_with(*prefixes: list[int]) -> RadixTree:
    """A tree holding each prefix (whole blocks), on blocks of its own."""
    tree, next_block = RadixTree(BLOCK_SIZE), 0
    for prefix in prefixes:
        blocks = list(range(next_block, next_block + len(prefix) // BLOCK_SIZE))
        next_block += len(blocks)
        tree.insert(prefix, blocks)
    return tree


def ids(queue) -> list[str]:
    return [seq.request_id for seq in queue]


A, B = SYSTEM, [200 + i for i in range(8)]  # two cached prefixes: three blocks, and two


def test_dfs_weight_admits_the_busiest_branch_first_and_each_branch_together():
    tree = tree_with(A, B, A[:4] + [300 + i for i in range(4)])  # A and A' share their first block
    waiting = deque(make_seq(rid, prompt + [rid_n, 1]) for rid_n, (rid, prompt) in enumerate([
        ("b1", B), ("a1", A), ("none", [7] * 8), ("b2", B), ("a2", A), ("a3", A + [5] * 4), ("a'1", A[:4] + [0] * 4)]))
    before = sorted((n.tokens, n.lock_ref, n.last_access) for n in tree._nodes())
    order = ids(order_waiting(waiting, "dfs-weight", tree, random.Random(0), 64))
    # A's first block holds four waiting requests (a1, a2, a3 below A, a'1 at the edge A' leaves): heaviest first.
    assert order == ["a1", "a2", "a3", "a'1", "b1", "b2", "none"], order
    assert sorted((n.tokens, n.lock_ref, n.last_access) for n in tree._nodes()) == before, "the order changed the tree"


def test_lpm_is_fcfs_past_128_waiting_requests_as_in_sglang():
    tree = tree_with(A)
    few = deque([make_seq("cold", [7] * 9), make_seq("warm", A + [1])])
    assert ids(order_waiting(few, "lpm", tree, random.Random(0), 64)) == ["warm", "cold"]
    many = deque([make_seq("cold", [7] * 9), *(make_seq(f"w{i}", A + [i]) for i in range(LPM_MAX_WAITING))])
    assert ids(order_waiting(many, "lpm", tree, random.Random(0), 64)) == ids(many), "lpm sorted past the threshold"


def test_lof_admits_the_longest_output_first_and_no_limit_counts_as_max_model_len():
    waiting = deque(Sequence(rid, None, [1, 2], SamplingParams(max_tokens=n), seed=0,
                             detokenizer=IncrementalDetokenizer(None, [1, 2], []))
                    for rid, n in [("short", 4), ("none", None), ("long", 40), ("short2", 4)])
    assert ids(order_waiting(waiting, "lof", None, random.Random(0), 64)) == ["none", "long", "short", "short2"]


def test_random_is_a_shuffle_from_the_seed_and_the_cache_aware_policies_need_a_cache():
    waiting = deque(make_seq(f"r{i}", [i] * 5) for i in range(12))
    first = ids(order_waiting(waiting, "random", None, random.Random(3), 64))
    assert first == ids(order_waiting(waiting, "random", None, random.Random(3), 64)) != ids(waiting)
    assert sorted(first) == sorted(ids(waiting))
    for policy in ("lpm", "dfs-weight", "fcfs"):  # without a prefix cache: arrival order
        assert ids(order_waiting(waiting, policy, None, random.Random(0), 64)) == ids(waiting)
