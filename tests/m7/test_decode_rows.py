"""decode_inputs with guesses: a row per token, each with its own position, slot and a context that ends at itself.

The replay test finds a row that reads a later guess only as a different token; here the rows of one request
checking two guesses are built by hand, so the field that is wrong is named.
"""

from __future__ import annotations

from milestones import m7
from milestones.m7.detokenizer import IncrementalDetokenizer
from milestones.m7.sequence import Sequence
from milestones.m7.step import ScheduledBatch

BLOCK_SIZE = 4


def test_rows_of_a_replayed_checking_step_one_per_token_and_guess(tiny_model_path):
    llm = m7.LLM(tiny_model_path, device="cpu", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                 block_size=BLOCK_SIZE, num_kv_blocks=16, enforce_eager=True)
    prompt = list(range(100, 110))
    seq = Sequence("R", None, prompt, m7.SamplingParams(max_tokens=8), seed=0,
                   detokenizer=IncrementalDetokenizer(None, prompt, []))
    seq.token_ids.append(55)  # sampled last step: position 10, not computed yet
    seq.num_computed_tokens = 10
    seq.spec.draft_token_ids = [66, 77]  # guesses of positions 11 and 12
    table = [5, 2, 7, 1]
    inputs, sample_seqs = llm.engine.runner.decode_inputs(ScheduledBatch([seq], [3], [table]))
    assert inputs.token_ids == [55, 66, 77], (
        f"token_ids {inputs.token_ids}: the request's last token, then each guess, a row apiece "
        "((token_ids + draft_token_ids)[num_computed_tokens:])"
    )
    assert inputs.positions == [10, 11, 12], f"positions {inputs.positions}, expected [10, 11, 12]"
    want = [7 * BLOCK_SIZE + 2, 7 * BLOCK_SIZE + 3, 1 * BLOCK_SIZE + 0]
    assert inputs.slots == want, (
        f"slots {inputs.slots}, expected {want}: each row writes its own position's slot, "
        "table[p // block_size] * block_size + p % block_size"
    )
    assert inputs.context_lens == [11, 12, 13], (
        f"context_lens {inputs.context_lens}, expected [11, 12, 13]: a row's context ends at itself (position + 1), "
        "so a guess reads the rows before it and none after"
    )
    assert inputs.block_tables == [table] * 3, f"block_tables {inputs.block_tables}: the request's table per row"
    assert all(t is not table for t in inputs.block_tables), (
        "a row's table is a copy (list(table)): the host grows the live table while the step runs"
    )
    assert sample_seqs == [seq] * 3, "every row samples for its request: the token after it"
