"""The m3 scheduler alone, without torch: admission by free blocks with headroom, and preemption by recompute.

``run_step`` plays the engine's part without a model: it schedules, checks that every scheduled request is running,
computes the batch (a generated token where a chunk reaches the end), finishes requests at max_tokens, and runs
the scheduler's integrity check.
"""

from __future__ import annotations

from milestones.m3.config import EngineConfig
from milestones.m3.detokenizer import IncrementalDetokenizer
from milestones.m3.scheduler import Scheduler
from milestones.m3.sequence import Sequence, SequenceStatus
from milestones.serving.sampling_params import SamplingParams


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    prompt = list(range(prompt_len))
    detokenizer = IncrementalDetokenizer(None, prompt, [])
    return Sequence(request_id, None, prompt, SamplingParams(max_tokens=max_tokens), seed=0, detokenizer=detokenizer)


def make_scheduler(num_kv_blocks: int, max_num_batched_tokens: int = 64) -> Scheduler:
    """A scheduler whose block manager refuses, with the rule, a grow that schedule should have seen coming: without
    it the block manager's own RuntimeError ends the step, and the check blames step 1's grow."""
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, block_size=4,
                                       num_kv_blocks=num_kv_blocks, max_model_len=64))
    manager, grow = scheduler.block_manager, scheduler.block_manager.grow

    def checked_grow(request_id: str, num_tokens: int) -> list[int]:
        if not manager.can_grow(request_id, num_tokens):
            raise AssertionError(
                f"schedule took request {request_id!r} with grow({request_id!r}, {num_tokens}), which needs "
                f"{manager.num_new_blocks(request_id, num_tokens)} new blocks, but only {manager.num_free_blocks} "
                "are free: before taking a request, preempt while `not self.block_manager.can_grow(request_id, "
                "num_computed_tokens + num_new)` (the tokens it will hold in all, not the new ones alone)"
            )
        return grow(request_id, num_tokens)

    manager.grow = checked_grow
    return scheduler


def record_victims(scheduler: Scheduler) -> list[str]:
    """The ids of the requests ``scheduler._preempt`` is called with, in order (the step-4 test records them too);
    each victim's blocks must be free once _preempt returns."""
    victims, preempt = [], scheduler._preempt

    def recording(seq):
        victims.append(seq.request_id)
        preempt(seq)
        held = scheduler.block_manager.block_tables.get(seq.request_id)
        assert held is None, (
            f"after _preempt({seq.request_id!r}) the block manager still holds its table {held}: preemption frees "
            "every block of the victim (self.block_manager.free), or the request that needs a block cannot get it"
        )

    scheduler._preempt = recording
    return victims


def compute(scheduler: Scheduler, batch) -> None:
    """What the engine does with a step's results: new tokens computed, a token where a chunk ends, finishing."""
    for seq in batch.seqs:
        assert seq.status is SequenceStatus.RUNNING and any(s is seq for s in scheduler.running), (
            f"request {seq.request_id!r} is in this step's batch but is {seq.status.value}: a request preempted in "
            "a step is never scheduled in it (the victim comes from the requests not yet scheduled; a request that "
            "preempts itself is left out of the step)"
        )
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                seq.finish("length")
                scheduler.finish(seq)
    scheduler.check_integrity()


def run_step(scheduler: Scheduler):
    batch = scheduler.schedule()
    assert batch is not None, "requests are waiting or running, yet schedule scheduled nothing"
    compute(scheduler, batch)
    return batch


def run_to_the_end(scheduler: Scheduler) -> None:
    for _ in range(100):
        if not scheduler.has_unfinished():
            return
        run_step(scheduler)
    raise AssertionError("100 steps and requests are still unfinished: the scheduler stopped making progress")


def ids(seqs) -> list[str]:
    return [seq.request_id for seq in seqs]


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


def test_the_headroom_counts_the_requests_already_running_not_the_newcomer():
    scheduler = make_scheduler(num_kv_blocks=5)  # prompts of 8 tokens: 2 blocks each
    for request_id in "012":
        scheduler.add(make_seq(request_id, 8))
    admitted = ids(scheduler.schedule().seqs)
    assert admitted == ["0", "1"], (
        f"admitted {admitted} from 5 free blocks: '0' takes 2, leaving 3; '1' needs 2 plus 1 of headroom for the "
        "one request already running, 3 <= 3, so it joins (the newcomer is not counted in the headroom: needed + "
        "len(running) <= free blocks); '2' would need 2 + 2 of the 1 left"
    )


def test_admission_is_first_come_first_served_even_when_a_later_request_would_fit():
    scheduler = make_scheduler(num_kv_blocks=6)
    for request_id, prompt_len in [("a", 8), ("big", 16), ("small", 4)]:  # 2, 4 and 1 blocks
        scheduler.add(make_seq(request_id, prompt_len))
    admitted = ids(scheduler.schedule().seqs)
    assert admitted == ["a"] and ids(scheduler.waiting) == ["big", "small"], (
        f"admitted {admitted}, waiting {ids(scheduler.waiting)}: admission is first come, first served; 'big' at the "
        "head of the queue does not fit (4 blocks + 1 of headroom > 4 free), so nobody behind it is admitted in this "
        "step either, not even 'small', which would fit (a long request is never starved by short ones)"
    )


def test_the_victim_is_the_latest_admitted_request_not_yet_scheduled_and_goes_to_the_front():
    """4 blocks of 4 tokens and 4 tokens a step. A (a 1-token prompt) and B (8 tokens, in chunks) run; C (1 token)
    waits for headroom. At step 5 A needs a second block for its 5th token and none is free: B, admitted after A and
    not yet scheduled in that step, is preempted."""
    scheduler = make_scheduler(num_kv_blocks=4, max_num_batched_tokens=4)
    for request_id, prompt_len, max_tokens in [("A", 1, 7), ("B", 8, 8), ("C", 1, 4)]:
        scheduler.add(make_seq(request_id, prompt_len, max_tokens))
    victims = record_victims(scheduler)
    for _ in range(4):
        run_step(scheduler)
    assert ids(scheduler.running) == ["A", "B"] and ids(scheduler.waiting) == ["C"] and not victims, (
        "the first four steps: A decodes and B prefills in chunks of 3, 3 and 2 tokens, then decodes; C waits "
        "(1 block + 2 of headroom > the free blocks)"
    )
    assert scheduler.block_manager.num_free_blocks == 0, "after four steps A holds 1 block and B 3: none is free"
    b = scheduler.running[1]
    batch = scheduler.schedule()  # step 5
    assert victims, "A needed a block and none was free, but schedule did not call self._preempt(victim): preempt " \
                    "through it (the tests record the victims by patching it)"
    assert victims == ["B"], (
        f"the victim was {victims}, not ['B']: it is the most recently admitted running request not yet scheduled in "
        "this step, and the request that needs the block (A) only if there is none"
    )
    scheduled = [(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
    assert scheduled == [("A", 1)], (
        f"step 5 scheduled {scheduled}, not [('A', 1)]: nothing is admitted in a step that has just preempted "
        "(memory is short, and a newcomer would only push someone out again)"
    )
    assert ids(scheduler.waiting) == ["B", "C"], (
        f"the waiting queue is {ids(scheduler.waiting)}, not ['B', 'C']: a preempted request goes back to the front "
        "of the waiting queue (appendleft), to be readmitted first"
    )
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0, (
        f"the victim B is {b.status.value} with num_computed_tokens={b.num_computed_tokens}: preemption sets it "
        "WAITING and its num_computed_tokens to 0, since its keys and values are recomputed"
    )
    assert "B" not in scheduler.block_manager.block_tables, "preemption frees every block of the victim"
    assert scheduler.num_preemptions == 1, (
        f"scheduler.num_preemptions is {scheduler.num_preemptions} after one preemption: _preempt counts each one "
        "(the KV report shows it)"
    )
    compute(scheduler, batch)
    run_to_the_end(scheduler)
    assert victims == ["B"] and scheduler.block_manager.num_free_blocks == 4


def test_the_victim_is_the_latest_admitted_of_the_requests_not_yet_scheduled():
    """5 blocks of 4 tokens: A (a 1-token prompt), B and C (4 tokens each) are admitted together, then decode. At
    step 5 A needs a second block for its 5th token and none is free, while B and C are both still to be scheduled
    in that step: C, admitted last, is the victim, and B keeps its blocks."""
    scheduler = make_scheduler(num_kv_blocks=5)
    for request_id, prompt_len in [("A", 1), ("B", 4), ("C", 4)]:
        scheduler.add(make_seq(request_id, prompt_len, max_tokens=8))
    victims = record_victims(scheduler)
    for _ in range(4):
        run_step(scheduler)
    assert not victims and ids(scheduler.running) == ["A", "B", "C"], (
        f"after four steps the victims were {victims} and {ids(scheduler.running)} ran, expected none and A, B and "
        "C: the three fit the 5 blocks (1, 2 and 2) until A's 5th token"
    )
    batch = run_step(scheduler)  # step 5
    assert victims == ["C"], (
        f"the victims were {victims}, not ['C']: A needed a block, and of B and C, both not yet scheduled in this "
        "step, the victim is the most recently admitted, C (`max(queue, key=self.running.index)`), not the earliest"
    )
    assert ids(batch.seqs) == ["A", "B"], f"step 5 scheduled {ids(batch.seqs)}, expected A and B once C was preempted"


def test_a_request_with_no_victim_left_preempts_itself_and_is_left_out_of_the_step():
    """3 blocks of 4 tokens: A and B (4-token prompts) hold a block each. At step 2 A takes the last free block for
    its 5th token; B needs one too, and no request is left to schedule after it: B preempts itself."""
    scheduler = make_scheduler(num_kv_blocks=3)
    scheduler.add(make_seq("A", 4, max_tokens=3))
    scheduler.add(make_seq("B", 4, max_tokens=2))
    victims = record_victims(scheduler)
    assert ids(run_step(scheduler).seqs) == ["A", "B"], "step 1 admits A and B (1 block + 1 of headroom <= 2 free)"
    batch = scheduler.schedule()  # step 2
    assert victims == ["B"], (
        f"the victims were {victims}, not ['B']: B needed a block, none was free and every other running request "
        "was scheduled already, so B preempts itself"
    )
    assert ids(batch.seqs) == ["A"], (
        f"step 2 scheduled {ids(batch.seqs)}: a request that preempts itself is left out of the step (its blocks "
        "are gone and it waits at the front of the queue)"
    )
    assert ids(scheduler.waiting) == ["B"] and scheduler.waiting[0].num_computed_tokens == 0
    compute(scheduler, batch)
    run_to_the_end(scheduler)
    assert victims == ["B"] and scheduler.block_manager.num_free_blocks == 3
