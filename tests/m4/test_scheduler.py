"""The m4 scheduler alone, without a model: the lpm sort orders by cached length and leaves the tree as it was."""

from __future__ import annotations

from milestones.m4.config import EngineConfig
from milestones.m4.detokenizer import IncrementalDetokenizer
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
