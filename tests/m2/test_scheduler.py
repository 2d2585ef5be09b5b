"""The m2 scheduler alone, without torch: budgets, arrival order, chunked prefill, leaving at once."""

from __future__ import annotations

from milestones.m2.config import EngineConfig
from milestones.m2.detokenizer import IncrementalDetokenizer
from milestones.m2.sampling_params import SamplingParams
from milestones.m2.scheduler import Scheduler
from milestones.m2.sequence import Sequence


def make_seq(request_id: str, prompt_len: int) -> Sequence:
    prompt = list(range(prompt_len))
    return Sequence(
        request_id, None, prompt, SamplingParams(), seed=0, detokenizer=IncrementalDetokenizer(None, prompt, [])
    )


def step(scheduler: Scheduler, finished: set[str] = frozenset()):
    """Plan one step and pretend to run it: advance computed tokens, 'sample' a token when a chunk completes."""
    batch = scheduler.schedule()
    if batch is None:
        return None
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.request_id in finished:
                seq.finish("stop")
                scheduler.finish(seq)
    return batch


def test_budgets_are_respected_every_step():
    scheduler = Scheduler(EngineConfig(max_num_seqs=3, max_num_batched_tokens=10))
    for i, n in enumerate([25, 4, 9, 1, 12]):
        scheduler.add(make_seq(f"r{i}", n))
    for _ in range(30):  # no request finishes: every step has work
        batch = step(scheduler)
        assert batch is not None, "the scheduler planned nothing while requests were waiting and running"
        assert sum(batch.num_new_tokens) <= 10
        assert len(batch.seqs) <= 3 and len(scheduler.running) <= 3
        assert len(set(batch.kv_slots)) == len(batch.kv_slots), "two running requests share a KV slot"
        assert all(n >= 1 for n in batch.num_new_tokens)
    assert len(scheduler.running) == 3 and all(seq.num_computed_tokens == seq.num_tokens - 1
                                                for seq in scheduler.running), "the running requests never decoded"


def test_long_prompt_is_chunked_and_progresses():
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=8))
    seq = make_seq("long", 30)
    scheduler.add(seq)
    chunks = [step(scheduler).num_new_tokens[0] for _ in range(4)]
    assert chunks == [8, 8, 8, 6]
    assert seq.num_computed_tokens == 30 and seq.num_output_tokens == 1
    assert step(scheduler).num_new_tokens == [1]  # now it decodes


def test_decodes_are_never_stalled_by_a_long_prefill():
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=8))
    short = make_seq("short", 3)
    scheduler.add(short)
    step(scheduler)  # short is prefilled and now decodes
    scheduler.add(make_seq("long", 100))
    for _ in range(5):
        batch = step(scheduler)
        assert batch.seqs[0] is short and batch.num_new_tokens[0] == 1
        assert sum(batch.num_new_tokens) == 8


def test_admission_keeps_arrival_order():
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    for i in range(5):
        scheduler.add(make_seq(f"r{i}", 4))
    admitted = []
    for _ in range(20):
        batch = step(scheduler, finished={f"r{i}" for i in range(5)})
        if batch is None:
            break
        admitted += [s.request_id for s in batch.seqs if s.request_id not in admitted]
    assert admitted == [f"r{i}" for i in range(5)]


def test_finished_and_aborted_requests_leave_at_once_and_free_their_slot():
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=16))
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)
    for seq in (a, b, c):
        scheduler.add(seq)
    first = step(scheduler)
    assert [s.request_id for s in first.seqs] == ["a", "b"]
    slot_of_a = first.kv_slots[0]
    a.finish("abort")
    scheduler.finish(a)
    assert a not in scheduler.running and len(scheduler.free_slots) == 1
    second = step(scheduler)
    assert [s.request_id for s in second.seqs] == ["b", "c"]
    assert second.kv_slots[1] == slot_of_a
    scheduler.finish(c)  # abort a waiting-or-running request: both leave cleanly
    scheduler.finish(b)
    assert not scheduler.has_unfinished() and sorted(scheduler.free_slots) == [0, 1]


def test_budget_must_cover_one_decode_per_running_request():
    import pytest

    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4).resolve(1024)
