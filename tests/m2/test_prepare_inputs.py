"""The runner's prepare_inputs on the chapter's own example: ids, positions, KV slots, spans and the rows that sample.

The chain compares whole runs with m1, where a position off by one or a context length that forgets the cached
tokens surfaces as "output token T differs"; here the runner packs a scheduled batch by hand, so the field that
is wrong is named at the step that introduces it.
"""

from __future__ import annotations

import pytest
import torch

from milestones import m2
from milestones.kernels.attention_backends import CacheLayout, DecodeKernelAttention
from milestones.m2.attention import RequestSpan, attention
from milestones.m2.detokenizer import IncrementalDetokenizer
from milestones.m2.sequence import Sequence
from milestones.m2.step import ScheduledBatch


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    """A real runner with 4 KV slots; attention_backend="torch": every request goes through ctx.requests."""
    llm = m2.LLM(tiny_model_path, device="cpu", max_model_len=64, max_num_seqs=4, attention_backend="torch")
    return llm.engine.runner


def request(request_id: str, num_tokens: int, num_computed: int, first_id: int, **params) -> Sequence:
    """A request of ``num_tokens`` tokens (ids first_id, first_id + 1, ...), the first ``num_computed`` computed."""
    prompt = list(range(first_id, first_id + num_tokens))
    seq = Sequence(request_id, None, prompt, m2.SamplingParams(max_tokens=4, **params), seed=0,
                   detokenizer=IncrementalDetokenizer(None, prompt, []))
    seq.num_computed_tokens = num_computed
    return seq


def the_chapters_step() -> tuple[list[Sequence], ScheduledBatch]:
    """A, B and C decode at positions 7, 12 and 4 (slots 0, 1, 3); D prefills tokens 16 to 20 of 40 (slot 2)."""
    seqs = [request("A", 8, 7, 100), request("B", 13, 12, 200), request("C", 5, 4, 300), request("D", 40, 16, 400)]
    return seqs, ScheduledBatch(list(seqs), [1, 1, 1, 5], [0, 1, 3, 2])


def check_spans(spans: list[RequestSpan], want: list[RequestSpan], names: list[str]) -> None:
    assert len(spans) == len(want), f"{len(spans)} RequestSpans for {len(want)} requests: one per request"
    for span, expected, name in zip(spans, want, names):
        assert (span.start, span.end) == (expected.start, expected.end), (
            f"request {name}'s RequestSpan has rows {span.start}..{span.end}, expected {expected.start}.."
            f"{expected.end}: its new tokens' rows in the flat batch, one request after the other"
        )
        assert span.kv_slot == expected.kv_slot, (
            f"request {name}'s RequestSpan has kv_slot {span.kv_slot}, expected {expected.kv_slot}: the slot the "
            "scheduler gave it (batch.kv_slots)"
        )
        assert span.context_len == expected.context_len, (
            f"request {name}'s RequestSpan has context_len {span.context_len}, expected {expected.context_len}: "
            "the tokens it attends to, num_computed_tokens + its new tokens (this step's included)"
        )


def test_the_chapters_step_three_decodes_and_a_chunk(runner):
    """The chapter's table: rows 0-2 decode A, B, C; rows 3-7 are D's chunk, which stops midway and samples nothing."""
    seqs, batch = the_chapters_step()
    inputs = runner.prepare_inputs(batch)
    a, b, c, d = seqs
    want_ids = [a.token_ids[7], b.token_ids[12], c.token_ids[4], *d.token_ids[16:21]]
    assert inputs.input_ids.tolist() == want_ids, (
        f"input_ids are {inputs.input_ids.tolist()}, expected {want_ids}: every request's new tokens, "
        "token_ids[num_computed_tokens : num_computed_tokens + num_new], one request after the other"
    )
    assert inputs.positions.tolist() == [7, 12, 4, 16, 17, 18, 19, 20], (
        f"positions are {inputs.positions.tolist()}, the chapter's [7, 12, 4, 16, 17, 18, 19, 20]: a request's "
        "new tokens sit at num_computed_tokens, num_computed_tokens + 1, ... (not at 0)"
    )
    assert inputs.ctx.positions.tolist() == inputs.positions.tolist(), (
        "ctx.positions, where attention writes each token's key and value in its slot, are the tokens' positions"
    )
    assert inputs.ctx.token_slots.tolist() == [0, 1, 3, 2, 2, 2, 2, 2], (
        f"ctx.token_slots is {inputs.ctx.token_slots.tolist()}, the chapter's [0, 1, 3, 2, 2, 2, 2, 2]: every "
        "token goes to its request's KV slot"
    )
    check_spans(inputs.ctx.requests, [RequestSpan(0, 1, 0, 8), RequestSpan(1, 2, 1, 13), RequestSpan(2, 3, 3, 5),
                                      RequestSpan(3, 8, 2, 21)], ["A", "B", "C", "D"])
    assert inputs.ctx.metadata is None, "no kernel here (attention_backend='torch'): prepare_inputs sets no metadata"
    assert inputs.sample_rows == [0, 1, 2], (
        f"sample_rows is {inputs.sample_rows}, the chapter's [0, 1, 2]: the last row of each request whose chunk "
        "reaches the end of its tokens; D's chunk stops at token 20 of 40 and predicts nothing anyone needs"
    )
    assert [s.request_id for s in inputs.sample_seqs] == ["A", "B", "C"], (
        "sample_seqs: the request of each sample row, in the same order"
    )


def test_a_whole_prompt_and_a_chunk_that_ends_its_prompt_both_sample_their_last_row(runner):
    """E, a 5-token prompt in one go, and F, the last 5 tokens of a 15-token prompt: each samples from its last row."""
    e, f = request("E", 5, 0, 500), request("F", 15, 10, 600)
    inputs = runner.prepare_inputs(ScheduledBatch([e, f], [5, 5], [1, 0]))
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14], (
        f"positions are {inputs.positions.tolist()}: E's prompt from 0, F's chunk from its num_computed_tokens, 10"
    )
    check_spans(inputs.ctx.requests, [RequestSpan(0, 5, 1, 5), RequestSpan(5, 10, 0, 15)], ["E", "F"])
    assert inputs.sample_rows == [4, 9] and [s.request_id for s in inputs.sample_seqs] == ["E", "F"], (
        f"sample_rows is {inputs.sample_rows}, expected [4, 9]: a chunk that reaches the end of its tokens samples "
        "from its last row, whether it is a whole prompt or the last chunk of one"
    )


def test_a_decode_kernel_backend_takes_the_decodes_off_ctx_requests(runner):
    """The CPU's kernel backend (milestones/kernels/attention_backends.py) takes every request with one new token
    off the spans prepare_inputs made, each with its slot as its block table. A stand-in kernel: never called."""
    _, batch = the_chapters_step()
    inputs = runner.prepare_inputs(batch)
    DecodeKernelAttention("cpp", object(), attention, CacheLayout("slots")).prepare_metadata(inputs.ctx)
    assert inputs.ctx.token_slots.tolist() == [0, 1, 3, 2, 2, 2, 2, 2], "token_slots: decodes get theirs too"
    check_spans(inputs.ctx.requests, [RequestSpan(3, 8, 2, 21)], ["D"])
    rows = inputs.ctx.metadata
    assert rows.rows.tolist() == [0, 1, 2] and rows.block_tables.tolist() == [[0], [1], [3]], (
        f"the kernel's rows are {rows.rows.tolist()} and slots {rows.block_tables.tolist()}, expected A's, B's and "
        "C's: [0, 1, 2] and [[0], [1], [3]]: the spans' start and kv_slot"
    )
    assert rows.context_lens.tolist() == [8, 13, 5], "a decode's context_len counts its new token"


def test_prompt_logprob_rows_start_at_the_requests_first_row(runner):
    """G decodes at row 0; H, which asks for prompt_logprobs=2, prefills tokens 3 to 7 of its 12 at rows 1 to 5:
    those rows score its prompt tokens 4 to 8, from row 1 on."""
    g, h = request("G", 8, 7, 100), request("H", 12, 3, 700, prompt_logprobs=2)
    inputs = runner.prepare_inputs(ScheduledBatch([g, h], [1, 5], [0, 1]))
    found = [(rows.request_id, rows.first_row, rows.start, rows.token_ids, rows.k) for rows in inputs.prompt_rows]
    want = [("H", 1, 3, h.prompt_token_ids[4:9], 2)]
    assert found == want, (
        f"prompt_rows are {found} (request, first_row, start, token_ids, k), expected {want}: every request adds "
        "PromptLogprobRows.of(seq, row, start, end), row being its first row in the flat batch (the tokens packed "
        "before it), not 0 as in m1's batch of one request"
    )


def test_every_tensor_is_made_on_the_runners_device(runner, monkeypatch):
    """The runner's device stands in as "meta" (a device other than the CPU that every machine has): a tensor made
    without device=self.device (self._tensor does it) stays on the CPU, where a CUDA model cannot read it."""
    monkeypatch.setattr(runner, "device", torch.device("meta"))
    _, batch = the_chapters_step()
    inputs = runner.prepare_inputs(batch)
    tensors = {"input_ids": inputs.input_ids, "positions": inputs.positions, "ctx.token_slots": inputs.ctx.token_slots,
               "ctx.positions": inputs.ctx.positions}
    elsewhere = {name: str(tensor.device) for name, tensor in tensors.items() if tensor.device.type != "meta"}
    assert not elsewhere, (
        f"with the runner's device {runner.device}, prepare_inputs made {elsewhere}: make every tensor on "
        "self.device, with self._tensor(values) (a plain torch.tensor(values) is on the CPU)"
    )
