"""What a checked guess changes, one call at a time: BlockManager.shrink, Scheduler.trim and Speculator.check.

The chain compares whole runs with m6, where blocks kept past a rejection or a lookahead that never shrinks give
the same tokens (the first only leaks until the request ends, the second only costs time). Here each rule is
checked on a request in a known state, right after the call that applies it.
"""

from __future__ import annotations

import pytest

from milestones import m7
from milestones.m7.block_manager import BlockManager

BLOCK_SIZE = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = list(range(100, 110))  # 10 tokens


def test_shrink_lets_go_of_the_blocks_past_the_tokens():
    manager = BlockManager(8, BLOCK_SIZE)
    table = list(manager.grow("r", 13))  # 4 blocks: the last one reached only by guesses
    manager.shrink("r", 9)
    assert manager.block_tables["r"] == table[:3], (
        f"after shrink('r', 9) the table is {manager.block_tables['r']}, expected {table[:3]}: the blocks past the "
        "first blocks_needed(9) = 3 go, from the end"
    )
    assert manager.ref_count[table[3]] == 0 and table[3] in manager.free_blocks, (
        f"block {table[3]} has {manager.ref_count[table[3]]} holders after shrink: it is released "
        "(self.release(block)), so with no other holder it is free again"
    )
    manager.shrink("r", 12)
    assert manager.block_tables["r"] == table[:3], "shrink to tokens the table already fits changes nothing"
    manager.hold(table[2])  # as the prefix cache holds a block it took over
    manager.shrink("r", 5)
    assert manager.block_tables["r"] == table[:2] and manager.ref_count[table[2]] == 1, (
        f"block {table[2]}, held by the cache too, has {manager.ref_count[table[2]]} holders after shrink, "
        "expected 1: shrink releases the request's hold (self.release), it does not free the block"
    )
    assert table[2] not in manager.free_blocks, "a block someone else holds never goes back to the free list"
    manager.shrink("gone", 4)  # preempted or finished: no table, nothing to do
    assert "gone" not in manager.block_tables, "shrinking a request with no table must not give it one"
    manager.check_integrity([table[2]])


@pytest.fixture
def engine(tiny_model_path):
    """An m7 engine with the ngram proposer, blocks of 4, and one request whose 10-token prompt was prefilled."""
    with m7.LLM(tiny_model_path, device="cpu", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                block_size=BLOCK_SIZE, enforce_eager=True, speculative_config=NGRAM) as llm:
        request_id = llm.engine.add_request(PROMPT, m7.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        llm.engine.step()
        yield llm.engine, llm.engine.scheduler.find(request_id)


def in_flight(engine, seq, num_rows: int) -> None:
    """As when a step checks the last token and num_rows - 1 guesses: one future id per row after the first's token
    is accepted, the rows computed, and the table grown to hold them."""
    seq.token_ids += [-1 - i for i in range(num_rows - 1)]
    seq.num_pending_tokens = num_rows - 1
    seq.num_computed_tokens = seq.num_tokens - 1
    engine.scheduler.block_manager.grow(seq.request_id, seq.num_tokens)


def test_trim_shrinks_to_the_tokens_and_counts_the_drafts_keys_back(engine):
    engine, seq = engine
    engine.scheduler.block_manager.grow(seq.request_id, seq.num_tokens + 6)  # blocks that guesses reached
    seq.spec.num_drafted_tokens = seq.num_tokens + 3  # a draft model wrote keys and values for rejected guesses
    engine.scheduler.trim(seq)
    table = engine.scheduler.block_manager.block_tables[seq.request_id]
    assert len(table) == engine.scheduler.block_manager.blocks_needed(seq.num_tokens), (
        f"after trim the request's table has {len(table)} blocks for {seq.num_tokens} tokens: "
        "self.block_manager.shrink(seq.request_id, seq.num_tokens)"
    )
    assert seq.spec.num_drafted_tokens == seq.num_tokens - 1, (
        f"after trim num_drafted_tokens is {seq.spec.num_drafted_tokens}, expected {seq.num_tokens - 1}: the slot "
        "whose token changed (the model's pick where the guess was) and those after it hold no draft keys and values, "
        "so num_drafted_tokens = min(num_drafted_tokens, num_tokens - 1)"
    )


def test_a_kept_guess_is_counted_and_raises_the_lookahead_up_to_num_speculative_tokens(engine):
    engine, seq = engine
    in_flight(engine, seq, 3)
    before = (list(seq.token_ids), seq.metrics.num_accepted_tokens, engine.speculator.num_accepted_tokens)
    seq.spec.num_lookahead = 2
    engine.speculator.check(seq, 7, 7)
    assert (seq.metrics.num_accepted_tokens, engine.speculator.num_accepted_tokens) == (before[1] + 1, before[2] + 1), (
        "a kept guess counts once for the request (seq.metrics.num_accepted_tokens) and once for the engine "
        "(self.num_accepted_tokens, which spec_stats reports)"
    )
    assert seq.spec.num_lookahead == 3, f"the lookahead went from 2 to {seq.spec.num_lookahead} on a kept guess, not 3"
    assert seq.token_ids == before[0], "a kept guess changes no token: the rows after it stand"
    seq.spec.num_lookahead = 4
    engine.speculator.check(seq, 7, 7)
    assert seq.spec.num_lookahead == 4, (
        f"the lookahead went from 4 to {seq.spec.num_lookahead}: it rises by one per kept guess up to "
        "num_speculative_tokens (4)"
    )


def test_a_rejected_guess_voids_the_rows_after_it_trims_and_halves_the_lookahead(engine):
    engine, seq = engine
    known = list(seq.token_ids)
    in_flight(engine, seq, 4)
    seq.spec.num_lookahead = 4
    engine.speculator.check(seq, 5, 6)
    assert seq.token_ids == known and seq.num_pending_tokens == 0, (
        f"after a rejected guess the request holds {seq.token_ids[len(known) - 1:]} past its known tokens, "
        f"{seq.num_pending_tokens} pending: the rows after it read a wrong token, so their tokens go "
        "(drop_pending_tokens(seq))"
    )
    assert seq.num_computed_tokens == seq.num_tokens - 1, (
        f"num_computed_tokens is {seq.num_computed_tokens} for {seq.num_tokens} tokens: the rejected rows' keys "
        "and values do not count (the model's pick is computed next step)"
    )
    table = engine.scheduler.block_manager.block_tables[seq.request_id]
    assert len(table) == engine.scheduler.block_manager.blocks_needed(seq.num_tokens), (
        f"the table kept {len(table)} blocks for {seq.num_tokens} tokens: self.scheduler.trim(seq) gives back the "
        "blocks only rejected guesses reached"
    )
    assert seq.spec.num_lookahead == 2, (
        f"the lookahead went from 4 to {seq.spec.num_lookahead} on a rejected guess, expected 2: halved, but not below "
        "self.proposer.min_lookahead"
    )
    seq.spec.num_lookahead = 1
    in_flight(engine, seq, 2)
    engine.speculator.check(seq, 5, 6)
    assert seq.spec.num_lookahead == 1, (
        f"the lookahead went from 1 to {seq.spec.num_lookahead}: the ngram proposer's min_lookahead is 1, never 0"
    )
