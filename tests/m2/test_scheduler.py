"""The m2 scheduler alone, without torch: budgets, arrival order, chunked prefill, leaving at once."""

from __future__ import annotations

import pytest

from milestones.m2.config import EngineConfig
from milestones.m2.detokenizer import IncrementalDetokenizer
from milestones.m2.scheduler import Scheduler
from milestones.m2.sequence import Sequence, SequenceStatus
from milestones.serving.sampling_params import SamplingParams


def make_seq(request_id: str, prompt_len: int) -> Sequence:
    prompt = list(range(prompt_len))
    return Sequence(
        request_id, None, prompt, SamplingParams(), seed=0, detokenizer=IncrementalDetokenizer(None, prompt, [])
    )


def check_slots(scheduler: Scheduler) -> None:
    """Each of the max_num_seqs KV slots is either a running request's (kv_slot) or free, never both, never lost."""
    owned, free = dict(scheduler.kv_slot), list(scheduler.free_slots)
    assert sorted([*owned.values(), *free]) == list(range(scheduler.config.max_num_seqs)), (
        f"the running requests' KV slots are {owned} and the free ones {free}: each of the "
        f"{scheduler.config.max_num_seqs} slots must be owned by one running request or be free, exactly once "
        "(admission takes its slot with self.free_slots.pop())"
    )


def step(scheduler: Scheduler, finished: set[str] = frozenset()):
    """Plan one step and pretend to run it: advance computed tokens, 'sample' a token when a chunk completes. The KV
    slots are checked after every plan."""
    batch = scheduler.schedule()
    check_slots(scheduler)
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


def test_admission_stops_at_max_num_seqs():
    """max_num_seqs=2 and three short prompts waiting: a and b are admitted, c waits. The scheduler has a KV slot for
    each of max_num_seqs requests and no more, so admitting a third pops from an empty self.free_slots."""
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    for request_id in "abc":
        scheduler.add(make_seq(request_id, 4))
    try:
        batch = scheduler.schedule()
    except IndexError as error:
        raise AssertionError(
            f"schedule() raised IndexError({error}) with max_num_seqs=2 and 3 requests waiting: self.free_slots holds "
            "max_num_seqs slots, so a third pop means a third request was admitted; admit only while "
            "len(self.running) < max_num_seqs"
        ) from error
    admitted, waiting = [s.request_id for s in batch.seqs], [s.request_id for s in scheduler.waiting]
    assert admitted == ["a", "b"] and waiting == ["c"], (
        f"the first step admitted {admitted} and left {waiting} waiting, expected ['a', 'b'] and ['c']: admission "
        "stops once max_num_seqs=2 requests run"
    )


def test_budgets_are_respected_every_step():
    scheduler = Scheduler(EngineConfig(max_num_seqs=3, max_num_batched_tokens=10))
    for i, n in enumerate([25, 4, 9, 1, 12]):
        scheduler.add(make_seq(f"r{i}", n))
    for _ in range(30):  # no request finishes: every step has work
        batch = step(scheduler)
        assert batch is not None, "the scheduler planned nothing while requests were waiting and running"
        assert sum(batch.num_new_tokens) <= 10, (
            f"a step computes {batch.num_new_tokens} tokens, {sum(batch.num_new_tokens)} in all: the budget "
            "max_num_batched_tokens=10 bounds them, so a request gets min(tokens left, budget left)"
        )
        assert len(batch.seqs) <= 3 and len(scheduler.running) <= 3, (
            f"{len(scheduler.running)} requests run and {len(batch.seqs)} are scheduled: at most max_num_seqs=3"
        )
        assert len(set(batch.kv_slots)) == len(batch.kv_slots), "two running requests share a KV slot"
        assert all(n >= 1 for n in batch.num_new_tokens), (
            f"num_new_tokens {batch.num_new_tokens}: a request with no token this step is not in the batch (stop "
            "taking requests once the budget is spent, and admit only while budget is left)"
        )
    assert len(scheduler.running) == 3 and all(seq.num_computed_tokens == seq.num_tokens - 1
                                                for seq in scheduler.running), "the running requests never decoded"


def test_long_prompt_is_chunked_and_progresses():
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=8))
    seq = make_seq("long", 30)
    scheduler.add(seq)
    chunks = [step(scheduler).num_new_tokens[0] for _ in range(4)]
    assert chunks == [8, 8, 8, 6], (
        f"a 30-token prompt with a budget of 8 went in as chunks {chunks}, expected [8, 8, 8, 6]: "
        "min(tokens left, budget left) each step"
    )
    assert seq.num_computed_tokens == 30 and seq.num_output_tokens == 1
    decode = step(scheduler).num_new_tokens
    assert decode == [1], f"once its prompt is computed a request decodes one token a step, not {decode}"


def test_decodes_are_never_stalled_by_a_long_prefill():
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=8))
    short = make_seq("short", 3)
    scheduler.add(short)
    step(scheduler)  # short is prefilled and now decodes
    scheduler.add(make_seq("long", 100))
    for _ in range(5):
        batch = step(scheduler)
        plan = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
        assert plan[0] == ("short", 1) and sum(batch.num_new_tokens) == 8, (
            f"the step planned {plan}, expected ('short', 1) first, then 7 tokens of 'long': decodes come first, "
            "then the prefill chunk gets what is left of the budget"
        )


def test_prefill_first_holds_the_decodes_back_while_a_prefill_runs():
    """SGLang's batch shape: with a long prompt in chunks beside a decoding request, the chunks run alone, each with
    the whole budget, and the decode resumes once the prompt is in; mixed steps carry both."""
    plans = {}
    for shape in ("mixed", "prefill-first"):
        scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, batch_shape=shape))
        scheduler.add(make_seq("short", 3))
        step(scheduler)  # short is prefilled and now decodes
        scheduler.add(make_seq("long", 20))
        plans[shape] = [[(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
                        for batch in (step(scheduler) for _ in range(5))]
    assert plans["prefill-first"] == [[("long", 8)], [("long", 8)], [("long", 4)],
                                      [("short", 1), ("long", 1)], [("short", 1), ("long", 1)]], (
        f"prefill-first planned {plans['prefill-first']}: while 'long' has prompt tokens left, a step carries its "
        "chunk alone (the budget is all its own) and 'short' waits; then both decode"
    )
    assert plans["mixed"][0] == [("short", 1), ("long", 7)], f"mixed planned {plans['mixed'][0]} first"


def test_prefill_first_runs_the_decodes_when_no_prefill_can_be_formed():
    """The waiting request cannot join (max_num_seqs): no prefill batch exists, so the decode batch runs."""
    scheduler = Scheduler(EngineConfig(max_num_seqs=1, max_num_batched_tokens=8, batch_shape="prefill-first"))
    scheduler.add(make_seq("a", 3))
    step(scheduler)
    scheduler.add(make_seq("b", 3))
    batch = step(scheduler)
    assert batch is not None and [s.request_id for s in batch.seqs] == ["a"], (
        "with 'b' waiting for a free place and 'a' decoding, the step must decode 'a' (prefill-first falls back to "
        "the decode batch), not plan nothing"
    )


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
    assert admitted == [f"r{i}" for i in range(5)], (
        f"requests were admitted in the order {admitted}: waiting requests are admitted in arrival order, from the "
        "front of the queue"
    )


def test_finished_and_aborted_requests_leave_at_once_and_free_their_slot():
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=16))
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)
    for seq in (a, b, c):
        scheduler.add(seq)
    first = step(scheduler)
    assert [s.request_id for s in first.seqs] == ["a", "b"], "max_num_seqs=2: a and b run, c waits"
    slot_of_a = first.kv_slots[0]
    a.finish("abort")
    scheduler.finish(a)
    assert a not in scheduler.running and len(scheduler.free_slots) == 1
    second = step(scheduler)
    assert [s.request_id for s in second.seqs] == ["b", "c"], (
        f"the step after a left planned {[s.request_id for s in second.seqs]}: c is admitted into its place at once"
    )
    assert second.kv_slots[1] == slot_of_a, "c takes the KV slot a returned (self.free_slots.pop())"
    scheduler.finish(c)  # abort a waiting-or-running request: both leave cleanly
    scheduler.finish(b)
    assert not scheduler.has_unfinished() and sorted(scheduler.free_slots) == [0, 1]


def test_budget_must_cover_one_decode_per_running_request():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4).resolve(1024)


def test_the_chapters_table_step_by_step():
    """The chapter's 16-token budget: A (5 tokens), B (9) and C (30) arrive with D (4) behind them, max_num_seqs=3;
    A finishes in step 4, and D takes its slot in step 5."""
    scheduler = Scheduler(EngineConfig(max_num_seqs=3, max_num_batched_tokens=16))
    seqs = {name: make_seq(name, n) for name, n in (("A", 5), ("B", 9), ("C", 30), ("D", 4))}
    for seq in seqs.values():
        scheduler.add(seq)
    table = [
        [("A", 5), ("B", 9), ("C", 2)],  # whole prompts, then the first 2 tokens of C: the budget is spent
        [("A", 1), ("B", 1), ("C", 14)],  # decodes first, then C's next chunk
        [("A", 1), ("B", 1), ("C", 14)],
        [("A", 1), ("B", 1), ("C", 1)],  # C's first token was sampled in step 3: it decodes
        [("B", 1), ("C", 1), ("D", 4)],  # A finished in step 4: D is admitted into its slot
    ]
    slots = {}
    for number, want in enumerate(table, 1):
        batch = step(scheduler)
        plan = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
        assert plan == want, (
            f"step {number} planned {plan}, the chapter's table {want}: decodes first, then unfinished prefills, "
            "then waiting requests in arrival order, each getting min(tokens left, budget left) of a 16-token budget "
            "while fewer than max_num_seqs=3 run"
        )
        for seq, slot in zip(batch.seqs, batch.kv_slots):
            assert seq.status is SequenceStatus.RUNNING and seq in scheduler.running, (
                f"request {seq.request_id} is scheduled but is {seq.status.value}: an admitted request is RUNNING "
                "and in self.running"
            )
            assert slots.setdefault(seq.request_id, slot) == slot, f"request {seq.request_id} changed KV slot"
        if number == 4:
            seqs["A"].finish("stop")
            scheduler.finish(seqs["A"])
    assert slots["D"] == slots["A"], f"D got slot {slots['D']}: the slot A returned, {slots['A']}, was the free one"


def test_nothing_to_schedule_is_none():
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=8))
    assert scheduler.schedule() is None, "with no request running or waiting, schedule() returns None, not a batch"


def test_decodes_keep_arrival_order_whatever_their_length():
    """X (12 tokens) arrived before Y (3 tokens): when both decode, X's token comes first (a stable sort)."""
    scheduler = Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=16))
    scheduler.add(make_seq("X", 12))
    scheduler.add(make_seq("Y", 3))
    step(scheduler)
    batch = step(scheduler)
    plan = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
    assert plan == [("X", 1), ("Y", 1)], (
        f"the step planned {plan}, expected [('X', 1), ('Y', 1)]: decodes come first in arrival order (sort the "
        "running requests only by whether they decode, with a stable sort)"
    )
