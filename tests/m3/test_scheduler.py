"""The m3 scheduler alone, without torch: admission keeps one free block per running request."""

from __future__ import annotations

from milestones.m3.config import EngineConfig
from milestones.m3.detokenizer import IncrementalDetokenizer
from milestones.m3.sampling_params import SamplingParams
from milestones.m3.scheduler import Scheduler
from milestones.m3.sequence import Sequence


def make_seq(request_id: str, prompt_len: int) -> Sequence:
    prompt = list(range(prompt_len))
    detokenizer = IncrementalDetokenizer(None, prompt, [])
    return Sequence(request_id, None, prompt, SamplingParams(max_tokens=4), seed=0, detokenizer=detokenizer)


def test_admission_leaves_one_free_block_per_running_request():
    # 10 blocks of 4 tokens; each prompt of 8 tokens needs 2 blocks.
    scheduler = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=10))
    for i in range(5):
        scheduler.add(make_seq(str(i), 8))
    batch = scheduler.schedule()
    # a: 2 blocks (8 free, 1 needed as headroom), b: 2 (4 free, 2 needed), c: 2 (2 free, 2 needed: no room for d)
    assert [s.request_id for s in batch.seqs] == ["0", "1", "2"]
    assert scheduler.block_manager.num_free_blocks == 4
    # admitting "3" would leave 2 free blocks for 4 running requests
    assert [s.request_id for s in scheduler.waiting] == ["3", "4"]


def test_the_first_request_needs_no_headroom_and_the_second_waits_for_it():
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_kv_blocks=4))
    scheduler.add(make_seq("a", 12))  # 3 blocks for the prompt, 4 once its 4 tokens are out: fits the pool
    scheduler.add(make_seq("b", 4))  # 1 block: free, but it is the block "a" needs to grow
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"] and scheduler.block_manager.num_free_blocks == 1
    assert [s.request_id for s in scheduler.waiting] == ["b"]
