"""m1, step 8: the generation loop against transformers' ``generate``, token for token, with every stop rule.

The runner computes a step's new tokens in one forward pass (the whole prompt, then the
token sampled last; a token's cache row is its position) and samples from the last row.
After each token the engine applies the stop rules in vLLM's order, the first that
matches winning: a stop token (the model's EOS unless ``ignore_eos``, or one of
``stop_token_ids``: "stop", kept in token_ids, no text), a stop string ("stop", the text
cut before it), ``max_tokens`` ("length"), a full context (``max_model_len``, "length").
transformers stops at the same token: ``eos_token_id``, ``stop_strings``,
``max_new_tokens``, ``max_length``. On a tiny random Llama (4 query heads, 2 KV heads).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from milestones.m1 import LLM, SamplingParams
from milestones.m1.detokenizer import IncrementalDetokenizer
from milestones.m1.sequence import Sequence
from milestones.m1.step import ScheduledBatch
from milestones.serving.outputs import CompletionOutput

from .closeness import EXACT, expect_close

PROMPT = "The capital of France is"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, device="cpu", dtype="float32", max_model_len=512, linear_backend="torch",
               attention_backend="torch")


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    return llm.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def reference(hf, prompt) -> list[int]:
    """transformers' greedy tokens for the prompt, with no stop rule but the length."""
    tokens = transformers_tokens(hf, prompt, max_new_tokens=MAX_TOKENS)
    assert hf.generation_config.eos_token_id not in tokens, "the tiny model emitted its EOS: pick another prompt"
    return tokens


def transformers_tokens(hf, prompt: list[int], **options) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **options)
    return out[0, len(prompt):].tolist()


def ours(llm, prompt: list[int], **params) -> CompletionOutput:
    return llm.generate(prompt, SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]


def expect_tokens(what: str, got: CompletionOutput, expected: list[int], finish_reason: str) -> None:
    """The same tokens as transformers, or the first that differs and where; then the finish reason."""
    tokens = got.token_ids
    same = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
    if same < min(len(tokens), len(expected)):
        raise AssertionError(f"{what}: token {same} differs: transformers gave {expected[same]}, this engine gave "
                             f"{tokens[same]} (the {same} tokens before it agree)")
    if len(tokens) != len(expected):
        when = "later" if len(tokens) > len(expected) else "earlier"
        raise AssertionError(f"{what}: this engine stopped {when}, after {len(tokens)} tokens; transformers after "
                             f"{len(expected)} (the first {same} agree): tokens {tokens}, transformers' {expected}")
    assert got.finish_reason == finish_reason, (
        f"{what}: the tokens agree, but the finish reason is {got.finish_reason!r}, not {finish_reason!r}"
    )


def test_prepare_inputs_for_the_prefill_and_a_decode_step(llm):
    runner, prompt = llm.engine.runner, [5, 6, 7, 8, 9]
    seq = Sequence("r", None, prompt, SamplingParams(), seed=0, detokenizer=IncrementalDetokenizer(None, prompt, []))
    for step, num_new in (("prefill", 5), ("decode step", 1)):
        start = seq.num_computed_tokens
        inputs = runner.prepare_inputs(ScheduledBatch([seq], [num_new]))
        new = torch.arange(start, start + num_new)
        expect_close(f"input_ids of the {step}", inputs.input_ids, torch.tensor(seq.token_ids[start:]), EXACT,
                     source="the sequence's new tokens")
        expect_close(f"positions of the {step}", inputs.positions, new, EXACT, source="the new tokens' positions")
        assert inputs.ctx.k_cache is runner.k_cache and inputs.ctx.v_cache is runner.v_cache, (
            f"the {step}'s AttentionContext must carry the runner's own k_cache and v_cache"
        )
        expect_close(f"ctx.slot_mapping of the {step} (a token's row is its position)", inputs.ctx.slot_mapping, new,
                     EXACT, source="the positions")
        assert inputs.ctx.context_len == start + num_new, (
            f"ctx.context_len of the {step} is {inputs.ctx.context_len}: the rows filled once this step's tokens "
            f"are written are {start + num_new}"
        )
        assert inputs.sample_rows == [num_new - 1] and inputs.sample_seqs == [seq], (
            f"the {step} samples rows {inputs.sample_rows}: only the last new token (row {num_new - 1}) predicts"
        )
        seq.num_computed_tokens += num_new
        seq.token_ids.append(11)


def test_execute_computes_the_logits_of_the_last_row_only(llm, monkeypatch):
    """Only the step's last token predicts: the LM head, the largest matrix, runs over that one row."""
    runner, prompt = llm.engine.runner, [5, 6, 7, 8, 9]
    rows = []
    head = runner.compute_logits
    monkeypatch.setattr(runner, "compute_logits", lambda hidden: rows.append(len(hidden)) or head(hidden))
    seq = Sequence("r", None, prompt, SamplingParams(temperature=0), seed=0,
                   detokenizer=IncrementalDetokenizer(None, prompt, []))
    output = runner.execute(ScheduledBatch([seq], [5]))
    assert rows == [1], f"the prefill of 5 tokens ran the LM head over {rows} rows; only the last row predicts"
    assert len(output.sampled) == 1, f"execute returns one token per sequence, got {output.sampled}"
    assert output.prompt_logprobs == {}, "a request that did not ask for prompt_logprobs gets no prompt scores"


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
def test_max_tokens_gives_the_tokens_of_max_new_tokens(llm, hf, prompt, max_tokens):
    expect_tokens(f"max_tokens={max_tokens}", ours(llm, prompt, max_tokens=max_tokens, ignore_eos=True),
                  transformers_tokens(hf, prompt, max_new_tokens=max_tokens), "length")


def test_the_models_eos_ends_the_output_unless_ignored(llm, hf, prompt, reference):
    eos = reference[3]
    before = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {eos}  # pretend the model declared this token as its EOS
    try:
        stopped = ours(llm, prompt, max_tokens=MAX_TOKENS)
        ignored = ours(llm, prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    finally:
        llm.engine.eos_token_ids = before
    expected = transformers_tokens(hf, prompt, max_new_tokens=MAX_TOKENS, eos_token_id=eos)
    expect_tokens(f"EOS {eos}", stopped, expected, "stop")
    text = llm.tokenizer.decode(expected[:-1])
    assert stopped.text == text, f"EOS adds no text: expected {text!r}, got {stopped.text!r}"
    expect_tokens(f"EOS {eos} with ignore_eos=True", ignored, reference, "length")


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_stop_token_id_ends_the_output_and_adds_no_text(llm, hf, prompt, reference, ignore_eos):
    """stop_token_ids stop like EOS, ignore_eos or not (it ignores the model's EOS only)."""
    stop = reference[4]
    got = ours(llm, prompt, max_tokens=MAX_TOKENS, stop_token_ids=[stop], ignore_eos=ignore_eos)
    expected = transformers_tokens(hf, prompt, max_new_tokens=MAX_TOKENS,
                                   eos_token_id=[hf.generation_config.eos_token_id, stop])
    expect_tokens(f"stop_token_ids=[{stop}], ignore_eos={ignore_eos}", got, expected, "stop")
    text = llm.tokenizer.decode(expected[:-1])
    assert got.text == text, f"a stop token adds no text: expected {text!r}, got {got.text!r}"


def stop_string(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """A token from the fourth on whose text first appears in the output as that token (so both stop there)."""
    for k in range(3, len(tokens)):
        piece, text = tokenizer.decode(tokens[k : k + 1]), tokenizer.decode(tokens[: k + 1])
        if piece.strip() and text.find(piece) == len(text) - len(piece):
            return k, piece
    raise AssertionError(f"no token of {tokens} can serve as a stop string: pick another prompt")


def test_a_stop_string_ends_the_output_and_is_cut_from_the_text(llm, hf, prompt, reference):
    k, stop = stop_string(llm.tokenizer, reference)
    got = ours(llm, prompt, max_tokens=MAX_TOKENS, stop=[stop])
    expected = transformers_tokens(hf, prompt, max_new_tokens=MAX_TOKENS, stop_strings=[stop], tokenizer=llm.tokenizer)
    expect_tokens(f"stop={[stop]}", got, expected, "stop")
    text = llm.tokenizer.decode(reference[: k + 1])[: -len(stop)]
    assert got.text == text, f"stop={[stop]}: the text ends just before the stop string: {text!r}, got {got.text!r}"


def test_a_full_context_ends_the_output_with_length(tiny_model_path, hf, prompt, reference):
    limit = len(prompt) + 7
    small = LLM(tiny_model_path, device="cpu", dtype="float32", max_model_len=limit, linear_backend="torch",
                attention_backend="torch")
    expected = transformers_tokens(hf, prompt, max_length=limit)
    expect_tokens(f"max_model_len={limit}, max_tokens=None", ours(small, prompt, max_tokens=None, ignore_eos=True),
                  expected, "length")
    eos = reference[6]
    small.engine.eos_token_ids = {eos}  # the token that fills the context is a stop token too: rule 1 wins
    expected = transformers_tokens(hf, prompt, max_length=limit, eos_token_id=eos)
    assert len(expected) == 7, f"EOS {eos} appears before the context is full: pick another prompt"
    expect_tokens(f"max_model_len={limit}, EOS {eos} as the token that fills it", ours(small, prompt, max_tokens=None),
                  expected, "stop")


def test_the_first_rule_that_matches_wins(llm, hf, prompt, reference):
    """A stop token or a stop string at the max_tokens-th token: "stop" (rules 1 and 2 come before max_tokens)."""
    stop = reference[4]
    k = reference.index(stop)
    expect_tokens(f"stop_token_ids=[{stop}] at the last token max_tokens={k + 1} allows",
                  ours(llm, prompt, max_tokens=k + 1, stop_token_ids=[stop]), reference[: k + 1], "stop")
    k, text = stop_string(llm.tokenizer, reference)
    got = ours(llm, prompt, max_tokens=k + 1, stop=[text])
    expect_tokens(f"stop={[text]} at the last token max_tokens={k + 1} allows", got, reference[: k + 1], "stop")


def test_the_metrics_follow_the_tokens(llm, prompt):
    """Set as the tokens come: the first token's time once, the last token's time and the count at every token."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), request_id="timed")
    (first,) = engine.step()
    first_token_time = first.metrics.first_token_time
    assert first_token_time is not None and first.metrics.num_output_tokens == 1, (
        f"after the first token: first_token_time {first_token_time}, num_output_tokens "
        f"{first.metrics.num_output_tokens} (expected a time, and 1)"
    )
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    m = out.metrics
    assert m.num_output_tokens == len(out.outputs[0].token_ids) == 5, (
        f"metrics.num_output_tokens is {m.num_output_tokens} after 5 tokens: update it with every token"
    )
    assert m.first_token_time == first_token_time, (
        f"first_token_time moved from {first_token_time} to {m.first_token_time}: the first token's time, set once"
    )
    times = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time]
    assert None not in times and times == sorted(times) and m.last_token_time > m.first_token_time, (
        "arrival, first scheduled, first token, last token (a later token's) and finish times must all be set, in "
        f"that order; got {times}"
    )
