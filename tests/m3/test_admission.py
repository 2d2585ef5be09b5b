"""m3's two admission rules without torch: the block of headroom and SGLang's reservation (``new_token_ratio``),
SGLang's retraction before the step, the ratio raised and decayed, and why waiting requests waited."""

from __future__ import annotations

import pytest

from milestones.m3.admission import RETRACT_DECODE_STEPS, Admission
from milestones.m3.config import EngineConfig
from milestones.m3.scheduler import Scheduler
from tests.m3.test_scheduler import compute, ids, make_seq, record_victims, run_step, run_to_the_end


def reserving(num_kv_blocks: int, ratio: float = 0.5, max_num_batched_tokens: int = 64, max_num_seqs: int = 4,
              min_ratio: float = 0.1, decay: float = 0.001) -> Scheduler:
    return Scheduler(EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=64, new_token_ratio=ratio,
                                  min_new_token_ratio=min_ratio, new_token_ratio_decay=decay))


def test_the_reservation_charges_a_newcomer_its_whole_prompt_and_output():
    """8 free blocks of 4 tokens; prompts of 8 tokens that may produce 12: 5 blocks each under SGLang's rule, where the
    headroom rule charges the first chunk (2 blocks) and admits three of them."""
    headroom = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_kv_blocks=8,
                                      max_model_len=64))
    reserve = reserving(num_kv_blocks=8)
    for scheduler in (headroom, reserve):
        for request_id in "abc":
            scheduler.add(make_seq(request_id, 8, max_tokens=12))
    assert ids(headroom.schedule().seqs) == ["a", "b", "c"]
    admitted = ids(reserve.schedule().seqs)
    assert admitted == ["a"], (
        f"admitted {admitted}: 'a' is charged blocks(8 + 12) = 5 of the 8, and is held back in full in the step that "
        "admits it, so 'b' (5 more) must wait"
    )
    assert reserve.admission.refusals["blocks"] == 1 and headroom.admission.refusals["blocks"] == 0


def test_a_running_request_holds_back_the_ratio_of_the_output_it_may_still_produce():
    admission = Admission(0.5, 0.1, 0.001, max_num_seqs=4, max_model_len=64, block_size=4)
    seq = make_seq("a", 8, max_tokens=20)  # 8 tokens, 2 blocks held once computed
    assert admission.held_back(seq, num_blocks=2) == 3, "blocks(8 + 0.5 * 20) = 5, two of them held already"
    seq.token_ids += [7] * 12  # 12 outputs: 8 may still come, half of them reserved
    assert admission.held_back(seq, num_blocks=5) == 1, "blocks(20 + 4) = 6, five held already"
    assert admission.held_back(seq, num_blocks=5, ratio=1.0) == 2, "blocks(20 + 8) = 7 at ratio 1"
    assert Admission(None, 0.1, 0.001, 4, 64, 4).held_back(seq, num_blocks=5) == 1, "the headroom rule: one block"


def test_later_requests_are_admitted_as_the_ratio_decays():
    """Two 8-token prompts that may each produce 40 tokens, in 16 blocks of 4: each is charged 12 blocks. The ratio
    decays from 1 by 0.25 a step (before admission) to 0.1; 'a' holds back less each step, and at step 4 'b' fits."""
    scheduler = reserving(num_kv_blocks=16, ratio=1.0, min_ratio=0.1, decay=0.25)
    for request_id in "ab":
        scheduler.add(make_seq(request_id, 8, max_tokens=40))
    steps = [ids(run_step(scheduler).seqs) for _ in range(4)]
    assert steps == [["a"], ["a"], ["a"], ["a", "b"]], (
        f"the steps ran {steps}: step 1 holds 'a' back in full (12 blocks, 2 taken: 4 left for 'b'); then 'a' holds "
        "back blocks(tokens + ratio * outputs to come) - its blocks: 4 at ratio 0.5 (9 free for 'b'), 2 at 0.25 "
        "(11), 1 at 0.1 (12: 'b' fits)"
    )
    assert scheduler.admission.new_token_ratio == 0.1
    assert scheduler.admission.refusals["blocks"] == 3


def test_the_ratio_decays_each_step_without_a_retraction_down_to_its_minimum():
    scheduler = reserving(num_kv_blocks=64, ratio=0.7, min_ratio=0.6, decay=0.04)
    scheduler.add(make_seq("a", 4, max_tokens=30))
    ratios = []
    for _ in range(4):
        run_step(scheduler)
        ratios.append(round(scheduler.admission.new_token_ratio, 6))
    assert ratios == [0.66, 0.62, 0.6, 0.6], f"the ratio went {ratios}: 0.7 - 0.04 a step, never below 0.6"


def test_retraction_comes_before_the_step_and_takes_sglangs_victim():
    """12 blocks of 4 tokens and the ratio at a floor of 0.01, so four requests that may produce 20 tokens each get in
    one by one (each is charged its whole prompt and output in the step that admits it). When their tokens no longer
    fit, requests go back before the step runs, the fewest output tokens first: none is preempted during the step,
    which schedules every survivor, and the survivors have room for RETRACT_DECODE_STEPS tokens each."""
    scheduler = reserving(num_kv_blocks=12, ratio=0.01, min_ratio=0.01)
    for request_id, prompt_len in [("a", 3), ("b", 6), ("c", 5), ("d", 6)]:
        scheduler.add(make_seq(request_id, prompt_len, max_tokens=20))
    victims = record_victims(scheduler)
    for _ in range(40):
        expected = scheduler.admission.victim(scheduler.running) if scheduler.running else None
        batch = scheduler.schedule()
        if victims:
            break
        compute(scheduler, batch)
    assert victims, "in 40 steps the pool never ran short"
    assert victims[0] == expected.request_id, (
        f"the first victim was {victims[0]}, not {expected.request_id}: SGLang retracts the request with the fewest "
        "output tokens (then the longest prompt)"
    )
    survivors = ids(scheduler.running)
    assert ids(batch.seqs) == survivors, (
        f"the step ran {ids(batch.seqs)} with {survivors} running: retraction happens before the step, so every "
        "request still running is scheduled in it"
    )
    queue = sorted(scheduler.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
    short = scheduler.admission.shortfall(queue, 64, RETRACT_DECODE_STEPS, scheduler.block_manager.block_tables,
                                          scheduler.block_manager.num_free_blocks) if len(survivors) > 1 else 0
    assert short <= 0, f"after the retraction the survivors lack {short} blocks for {RETRACT_DECODE_STEPS} more tokens"
    compute(scheduler, batch)
    run_to_the_end(scheduler)
    assert scheduler.num_preemptions == len(victims) and scheduler.block_manager.num_free_blocks == 12


def test_the_victim_order_is_sglangs():
    admission = Admission(0.5, 0.1, 0.001, 4, 64, 4)
    few, many, long_prompt = make_seq("few", 4, 30), make_seq("many", 4, 30), make_seq("long", 9, 30)
    few.token_ids += [7] * 2
    many.token_ids += [7] * 5
    long_prompt.token_ids += [7] * 2
    assert admission.victim([many, few, long_prompt]).request_id == "long", "fewest outputs, then the longest prompt"
    assert admission.victim([many, few]).request_id == "few"


def test_a_retraction_sets_the_ratio_to_what_the_survivors_show():
    admission = Admission(0.2, 0.1, 0.001, 4, 64, 4)
    a, b = make_seq("a", 4, max_tokens=40), make_seq("b", 4, max_tokens=60)
    a.token_ids += [7] * 10
    b.token_ids += [7] * 30
    admission.after_step([a, b], retracted=True)
    expected = (10 + 30 + 2 * RETRACT_DECODE_STEPS) / (40 + 60)
    assert admission.new_token_ratio == pytest.approx(expected), (
        f"the ratio became {admission.new_token_ratio}, not (outputs so far + {RETRACT_DECODE_STEPS} per survivor) "
        f"/ all they may produce = {expected}"
    )
    admission.after_step([a, b], retracted=False)
    assert admission.new_token_ratio == pytest.approx(expected - 0.001)


def test_refusals_are_counted_by_reason():
    few_seqs = reserving(num_kv_blocks=64, max_num_seqs=1)
    few_seqs.add(make_seq("a", 4, max_tokens=2))
    few_seqs.add(make_seq("b", 4, max_tokens=2))
    run_step(few_seqs)
    assert few_seqs.admission.refusals == {"blocks": 0, "token_budget": 0, "max_num_seqs": 1, "preempted": 0}
    small_budget = reserving(num_kv_blocks=64, max_num_batched_tokens=4)
    small_budget.add(make_seq("a", 4, max_tokens=2))
    small_budget.add(make_seq("b", 4, max_tokens=2))
    run_step(small_budget)
    assert small_budget.admission.refusals == {"blocks": 0, "token_budget": 1, "max_num_seqs": 0, "preempted": 0}
    run_to_the_end(small_budget)


def test_no_request_is_admitted_in_a_step_that_retracted():
    scheduler = reserving(num_kv_blocks=12, ratio=0.01, min_ratio=0.01, max_num_seqs=5)
    for request_id, prompt_len in [("a", 3), ("b", 6), ("c", 5), ("d", 6)]:
        scheduler.add(make_seq(request_id, prompt_len, max_tokens=20))
    victims = record_victims(scheduler)
    for _ in range(40):
        scheduler.add(make_seq(f"late{_}", 1, max_tokens=1))  # a small newcomer, one a step
        refused = scheduler.admission.refusals["preempted"]
        batch = scheduler.schedule()
        if victims:
            break
        compute(scheduler, batch)
    assert victims, "in 40 steps the pool never ran short"
    assert not any(seq.request_id.startswith("late") for seq in batch.seqs if seq.num_computed_tokens == 0), (
        "a newcomer was admitted in the step that retracted: memory is short, it would only push someone out again"
    )
    assert scheduler.admission.refusals["preempted"] == refused + 1


@pytest.mark.parametrize("option, value", [("new_token_ratio", 0), ("new_token_ratio", 1.5),
                                           ("new_token_ratio", "0.7"), ("min_new_token_ratio", -0.1),
                                           ("new_token_ratio_decay", None)])
def test_bad_ratios_are_refused_with_what_to_change(option, value):
    with pytest.raises(ValueError, match=option):
        EngineConfig(**{option: value}).resolve(2048)
