"""The runner's prepare_inputs on the chapter's own examples: slots, spans, the gathered tables and each span's first.

The paged-attention test builds its ``AttentionContext`` by hand; here the runner builds it from a scheduled
batch, so a slot off by one or a wrong ``first`` fails at this step, with the field that is wrong, rather than as
a different token when the whole engine runs.
"""

from __future__ import annotations

import pytest
import torch

from milestones import m3
from milestones.kernels.attention_backends import CacheLayout, DecodeKernelAttention
from milestones.m3.attention import attention
from milestones.m3.detokenizer import IncrementalDetokenizer
from milestones.m3.sequence import Sequence
from milestones.m3.step import ScheduledBatch

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    """A real runner with blocks of 4 tokens; attention_backend="torch": every request goes through ctx.requests."""
    llm = m3.LLM(tiny_model_path, device="cpu", max_model_len=64, block_size=BLOCK_SIZE, num_kv_blocks=10,
                 attention_backend="torch")
    return llm.engine.runner


def request(request_id: str, num_tokens: int, num_computed: int, **params) -> Sequence:
    """A request of ``num_tokens`` tokens (ids 100, 101, ...), the first ``num_computed`` of them computed."""
    prompt = list(range(100, 100 + num_tokens))
    seq = Sequence(request_id, None, prompt, m3.SamplingParams(max_tokens=4, **params), seed=0,
                   detokenizer=IncrementalDetokenizer(None, prompt, []))
    seq.num_computed_tokens = num_computed
    return seq


def prepare(runner, *scheduled: tuple[Sequence, int, list[int]]):
    """prepare_inputs for a batch of (request, new tokens, block table)."""
    seqs, num_new, tables = zip(*scheduled)
    return runner.prepare_inputs(ScheduledBatch(list(seqs), list(num_new), [list(t) for t in tables]))


def slots(table: list[int], positions: range) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def check_span(span, name: str, start: int, end: int, table: list[int], context_len: int, first: int) -> None:
    assert (span.start, span.end) == (start, end), (
        f"request {name}'s RequestSpan has rows {span.start}..{span.end}, expected {start}..{end}: its new tokens' "
        "rows in the flat batch, one request after the other"
    )
    assert span.block_table == table, (
        f"request {name}'s RequestSpan has block_table {span.block_table}, expected {table}: its table cut to the "
        "blocks of its context, table[: -(-end // block_size)]"
    )
    assert span.context_len == context_len, (
        f"request {name}'s RequestSpan has context_len {span.context_len}, expected {context_len}: the tokens it "
        "attends to, num_computed_tokens + its new tokens"
    )
    assert span.first == first, (
        f"request {name}'s RequestSpan has first={span.first}, expected {first}: where its keys start in the run "
        "gathered from ctx.block_tables, in tokens: block_size times the blocks of the tables before its own"
    )


def test_the_chapters_pool_two_whole_prompts_and_a_chunk_that_stops_midway(runner):
    """The chapter's pool: A (10 tokens, table [7, 2, 9]) and B (7 tokens, table [4, 0]), both prefilled whole, then
    C, 5 tokens of a 12-token prompt, whose table has a block past the chunk: its span carries only two blocks."""
    a, b, c = request("A", 10, 0), request("B", 7, 0), request("C", 12, 0)
    inputs = prepare(runner, (a, 10, [7, 2, 9]), (b, 7, [4, 0]), (c, 5, [3, 6, 1]))
    assert inputs.input_ids.tolist() == a.token_ids + b.token_ids + c.token_ids[:5], (
        "input_ids: every request's new tokens, token_ids[num_computed_tokens : num_computed_tokens + num_new], "
        "one request after the other"
    )
    assert inputs.positions.tolist() == [*range(10), *range(7), *range(5)], (
        "positions: a request's new tokens sit at num_computed_tokens, num_computed_tokens + 1, ..."
    )
    want = slots([7, 2, 9], range(10)) + slots([4, 0], range(7)) + slots([3, 6, 1], range(5))
    assert inputs.ctx.slot_mapping.tolist() == want, (
        f"slot_mapping is {inputs.ctx.slot_mapping.tolist()}, expected {want}: token p of a request goes to slot "
        "table[p // block_size] * block_size + p % block_size"
    )
    assert len(inputs.ctx.requests) == 3, "one RequestSpan per request in ctx.requests (no decode kernel here)"
    check_span(inputs.ctx.requests[0], "A", 0, 10, [7, 2, 9], 10, first=0)
    check_span(inputs.ctx.requests[1], "B", 10, 17, [4, 0], 7, first=3 * BLOCK_SIZE)
    check_span(inputs.ctx.requests[2], "C", 17, 22, [3, 6], 5, first=5 * BLOCK_SIZE)
    assert inputs.ctx.block_tables.tolist() == [7, 2, 9, 4, 0, 3, 6], (
        f"ctx.block_tables is {inputs.ctx.block_tables.tolist()}: the spans' block tables (cut to their context), "
        "one after the other, in the order of ctx.requests"
    )
    assert inputs.sample_rows == [9, 16] and [s.request_id for s in inputs.sample_seqs] == ["A", "B"], (
        f"sample_rows {inputs.sample_rows}: the last row of each request whose chunk reaches the end of its tokens "
        "(C's chunk stops midway and samples nothing)"
    )


def test_the_chapters_slot_table_a_chunk_and_a_decode(runner):
    """The chapter's worked example, table [5, 2, 7]: positions 4 to 9 prefilled in one chunk go to slots
    [8, 9, 10, 11, 28, 29]; the decode of position 9 alone goes to [29]."""
    chunk = prepare(runner, (request("R", 10, 4), 6, [5, 2, 7]))
    assert chunk.ctx.slot_mapping.tolist() == [8, 9, 10, 11, 28, 29], (
        f"positions 4-9 through table [5, 2, 7] went to slots {chunk.ctx.slot_mapping.tolist()}, the chapter's "
        "[8, 9, 10, 11, 28, 29]: slot = table[p // block_size] * block_size + p % block_size"
    )
    assert chunk.positions.tolist() == list(range(4, 10)), "positions: the chunk's tokens sit at 4, ..., 9"
    check_span(chunk.ctx.requests[0], "R", 0, 6, [5, 2, 7], 10, first=0)
    decode = prepare(runner, (request("R", 10, 9), 1, [5, 2, 7]))
    assert decode.ctx.slot_mapping.tolist() == [29], (
        f"the decode of position 9 through table [5, 2, 7] went to slot {decode.ctx.slot_mapping.tolist()}, "
        "the chapter's [29]"
    )
    check_span(decode.ctx.requests[0], "R", 0, 1, [5, 2, 7], 10, first=0)
    assert decode.sample_rows == [0], "a decode's one row samples the next token"


def test_a_decode_kernel_backend_takes_the_decodes_and_first_counts_the_others(runner):
    """The CPU's kernel backend (milestones/kernels/attention_backends.py) takes the decodes off ctx.requests (their
    tables read in place); only the others are gathered, so the first span after a decode starts at 0 again. A
    stand-in kernel: never called."""
    d, p = request("D", 10, 9), request("P", 7, 4)
    inputs = prepare(runner, (d, 1, [5, 2, 7]), (p, 3, [4, 0]))
    DecodeKernelAttention("cpp", object(), attention, CacheLayout("paged")).prepare_metadata(inputs.ctx)
    assert inputs.ctx.slot_mapping.tolist() == [29, *slots([4, 0], range(4, 7))], (
        "slot_mapping: decodes get their slots like any token, kernel or not"
    )
    assert [span.start for span in inputs.ctx.requests] == [1], "only P (row 1) is left to attention()"
    check_span(inputs.ctx.requests[0], "P", 1, 4, [4, 0], 7, first=0)
    assert inputs.ctx.block_tables.tolist() == [4, 0], "ctx.block_tables holds the tables of ctx.requests only"
    rows = inputs.ctx.metadata
    assert rows.rows.tolist() == [0] and rows.block_tables.tolist() == [[5, 2, 7]], (
        "the kernel's rows hold D's row and its table (cut to its context)"
    )
    assert rows.context_lens.tolist() == [10], "a decode's context_len counts its new token"


def test_prompt_logprob_rows_start_at_the_requests_first_row(runner):
    """G decodes at row 0; H, which asks for prompt_logprobs=2, prefills tokens 3 to 7 of its 12 at rows 1 to 5:
    those rows score its prompt tokens 4 to 8, from row 1 on."""
    g, h = request("G", 10, 9), request("H", 12, 3, prompt_logprobs=2)
    inputs = prepare(runner, (g, 1, [5, 2, 7]), (h, 5, [4, 0]))
    found = [(rows.request_id, rows.first_row, rows.start, rows.token_ids, rows.k) for rows in inputs.prompt_rows]
    want = [("H", 1, 3, h.prompt_token_ids[4:9], 2)]
    assert found == want, (
        f"prompt_rows are {found} (request, first_row, start, token_ids, k), expected {want}: every request adds "
        "PromptLogprobRows.of(seq, row, start, end), row being its first row in the flat batch (the tokens packed "
        "before it)"
    )


def test_every_tensor_is_made_on_the_runners_device(runner, monkeypatch):
    """The runner's device stands in as "meta" (a device other than the CPU that every machine has): a tensor made
    without device=self.device (self._tensor does it) stays on the CPU, where a CUDA model cannot read it."""
    monkeypatch.setattr(runner, "device", torch.device("meta"))
    inputs = prepare(runner, (request("A", 10, 0), 10, [7, 2, 9]), (request("R", 10, 4), 6, [5, 2, 7]))
    tensors = {"input_ids": inputs.input_ids, "positions": inputs.positions,
               "ctx.slot_mapping": inputs.ctx.slot_mapping, "ctx.block_tables": inputs.ctx.block_tables}
    elsewhere = {name: str(tensor.device) for name, tensor in tensors.items() if tensor.device.type != "meta"}
    assert not elsewhere, (
        f"with the runner's device {runner.device}, prepare_inputs made {elsewhere}: make every tensor on "
        "self.device, with self._tensor(values) (a plain torch.tensor(values) is on the CPU)"
    )
