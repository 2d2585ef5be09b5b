"""The public API, the same for every milestone: generate, sampling, stopping, chat."""

from __future__ import annotations

import pytest

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Write a poem about the sea."]


def greedy(mod, max_tokens=16, **kw):
    return mod.SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_outputs_follow_prompt_order_and_shape(mod, tiny_llm):
    outs = tiny_llm.generate(PROMPTS, greedy(mod, 8), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for out in outs:
        assert out.finished and len(out.outputs) == 1
        assert out.prompt_token_ids == tiny_llm.tokenizer.encode(out.prompt)
        completion = out.outputs[0]
        assert completion.finish_reason in ("stop", "length")
        assert 1 <= len(completion.token_ids) <= 8
        assert out.metrics.time_to_first_token is not None and out.metrics.time_to_first_token >= 0


def test_string_and_token_id_prompts_agree(mod, tiny_llm):
    by_text = tiny_llm.generate(PROMPTS[0], greedy(mod), use_tqdm=False)[0]
    by_ids = tiny_llm.generate(by_text.prompt_token_ids, greedy(mod), use_tqdm=False)[0]
    assert by_ids.prompt is None
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_ids.outputs[0].text == by_text.outputs[0].text


def test_greedy_is_independent_of_batch_company(mod, tiny_llm):
    alone = [tiny_llm.generate(p, greedy(mod), use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, greedy(mod), use_tqdm=False)]
    assert together == alone


def test_seeded_sampling_is_reproducible(mod, tiny_llm):
    params = mod.SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=12)
    first = tiny_llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    again = tiny_llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    # Other requests in the same call (with their own seeds) must not disturb this one.
    mixed = [greedy(mod), params, mod.SamplingParams(temperature=1.0, seed=3, max_tokens=12), greedy(mod)]
    in_company = tiny_llm.generate(PROMPTS, mixed, use_tqdm=False)[1].outputs[0].token_ids
    other_params = mod.SamplingParams(temperature=0.8, seed=8, max_tokens=12)
    other_seed = tiny_llm.generate(PROMPTS[1], other_params, use_tqdm=False)
    assert first == again == in_company
    assert other_seed[0].outputs[0].token_ids != first


def test_max_tokens_gives_length(mod, tiny_llm):
    out = tiny_llm.generate(PROMPTS[0], greedy(mod, 5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids_end_the_output(mod, tiny_llm):
    reference = tiny_llm.generate(PROMPTS[2], greedy(mod, 12, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = reference[4]
    params = greedy(mod, 12, ignore_eos=True, stop_token_ids=[stop_id])
    out = tiny_llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    first = reference.index(stop_id)
    assert out.token_ids == reference[: first + 1] and out.finish_reason == "stop"


def test_eos_ends_the_output_unless_ignored(mod, tiny_llm):
    reference = tiny_llm.generate(PROMPTS[3], greedy(mod, 10, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    eos_before = tiny_llm.engine.eos_token_ids
    tiny_llm.engine.eos_token_ids = {reference[3]}  # pretend the model declared this token as EOS
    try:
        stopped = tiny_llm.generate(PROMPTS[3], greedy(mod, 10), use_tqdm=False)[0].outputs[0]
        ignored = tiny_llm.generate(PROMPTS[3], greedy(mod, 10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    finally:
        tiny_llm.engine.eos_token_ids = eos_before
    assert stopped.token_ids == reference[: reference.index(reference[3]) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == reference and ignored.finish_reason == "length"


def test_stop_string_is_cut_from_the_text(mod, tiny_llm):
    full = tiny_llm.generate(PROMPTS[0], greedy(mod, 24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    out = tiny_llm.generate(PROMPTS[0], greedy(mod, 24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


def test_context_limit_ends_with_length(mod, tiny_model_path):
    llm = mod.LLM(tiny_model_path, device="cpu", max_model_len=40)
    prompt = list(range(1000, 1030))
    out = llm.generate(prompt, mod.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_chat_applies_the_template(mod, tiny_llm):
    messages = [{"role": "user", "content": "Hi there"}]
    out = tiny_llm.chat(messages, greedy(mod, 4), use_tqdm=False)[0]
    expected = tiny_llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tiny_llm.tokenizer.encode(expected, add_special_tokens=False)
    two = tiny_llm.chat([messages, [{"role": "user", "content": "Bye"}]], greedy(mod, 4), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_empty_prompt_list_returns_nothing(mod, tiny_llm):
    assert tiny_llm.generate([], greedy(mod), use_tqdm=False) == []


@pytest.mark.parametrize("kwargs", [{"max_model_len": 10**9}, {"dtype": "int8"}, {"device": "no-such-device"}])
def test_bad_engine_options_are_refused(mod, tiny_model_path, kwargs):
    with pytest.raises((ValueError, RuntimeError)):
        mod.LLM(tiny_model_path, **kwargs)


def test_unknown_option_and_model_are_refused(mod, tiny_model_path):
    with pytest.raises(TypeError, match="accepted"):
        mod.LLM(tiny_model_path, no_such_option=1)
    with pytest.raises(ValueError, match="unknown model"):
        mod.LLM("/definitely/not/a/model")
