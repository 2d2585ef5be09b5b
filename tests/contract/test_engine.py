"""The engine level: streaming, abort, and bad input that must not disturb other requests."""

from __future__ import annotations

import pytest


def run_to_completion(engine) -> dict:
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        assert steps < 10_000, "engine did not finish"
    return finals


def test_streamed_text_adds_up_to_the_final_text(mod, tiny_llm):
    engine = tiny_llm.engine
    params = mod.SamplingParams(temperature=0.9, seed=11, max_tokens=40, ignore_eos=True, stop=["zzzz"])
    engine.add_request("Tell me a story about 🐉 and 北京", params, request_id="s1")
    streamed, final, seen_tokens = "", None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            assert text.startswith(streamed), "streamed text was taken back"
            assert not text.endswith("\ufffd"), "half a UTF-8 character was streamed"
            streamed = text
            seen_tokens = out.outputs[0].token_ids
            final = out if out.finished else final
    assert final is not None and final.outputs[0].text == streamed
    assert len(seen_tokens) == 40


def test_abort_running_and_waiting_requests(mod, tiny_llm):
    engine = tiny_llm.engine
    params = mod.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = tiny_llm.generate("Keep me going", params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("Keep me going", params, request_id="keep")
    engine.add_request("Abort me while I run", params, request_id="run")
    engine.add_request("Abort me while I wait", params, request_id="wait")
    for _ in range(3):
        engine.step()
    aborted = [engine.abort_request("run"), engine.abort_request("wait")]
    assert all(a is not None and a.finished and a.outputs[0].finish_reason == "abort" for a in aborted)
    assert engine.abort_request("no-such-request") is None
    finals = run_to_completion(engine)
    assert set(finals) == {"keep"}
    assert finals["keep"].outputs[0].token_ids == alone


def test_duplicate_request_id_is_refused(mod, tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("one", mod.SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("two", mod.SamplingParams(max_tokens=2), request_id="dup")
    run_to_completion(engine)


BAD_PROMPTS = [
    ("", "empty"),
    ([], "empty"),
    ([1, 2, 10**7], "token ids"),
    ([1, -3], "token ids"),
    (["a", "b"], "string or a list of token ids"),
]


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS)
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(mod, tiny_llm, prompt, message):
    params = mod.SamplingParams(temperature=0, max_tokens=6)
    before = tiny_llm.generate("Still alive?", params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(["A fine prompt", prompt], params, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests(), "the good prompt of a refused batch was left queued"
    after = tiny_llm.generate("Still alive?", params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


def test_prompt_beyond_the_context_is_refused(mod, tiny_llm):
    limit = tiny_llm.engine.config.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        tiny_llm.generate([5] * limit, mod.SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="lower max_tokens"):
        tiny_llm.generate([5] * 10, mod.SamplingParams(max_tokens=limit), use_tqdm=False)
    fits = mod.SamplingParams(max_tokens=limit - 10, stop_token_ids=[], temperature=0)
    ok = tiny_llm.generate([5] * 10, fits, use_tqdm=False)
    assert ok[0].finished


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_nonsense_sampling_values_name_the_field(mod, kwargs, field):
    with pytest.raises(ValueError, match=field):
        mod.SamplingParams(**kwargs)


def test_wrong_number_of_sampling_params(mod, tiny_llm):
    with pytest.raises(ValueError, match="one per prompt"):
        tiny_llm.generate(["a", "b"], [mod.SamplingParams()], use_tqdm=False)


def test_kv_usage_reports_reserved_and_used_memory(mod, tiny_llm):
    engine = tiny_llm.engine
    idle = engine.kv_usage()
    assert idle["used_bytes"] == 0 and idle["reserved_bytes"] > 0
    engine.add_request(
        list(range(100, 120)), mod.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), request_id="kv"
    )
    engine.step()  # the prompt's 20 tokens are now in the cache
    busy = engine.kv_usage()
    engine.step()  # and one generated token more: the size of one token's keys and values
    per_token = engine.kv_usage()["used_bytes"] - busy["used_bytes"]
    assert per_token > 0 and busy["used_bytes"] == 20 * per_token <= busy["reserved_bytes"]
    run_to_completion(engine)
    assert engine.kv_usage()["used_bytes"] == 0


def test_every_llm_closes_and_is_a_context_manager(mod, tiny_model_path, lesson_options):
    """The same API in every milestone: m6 stops its forward worker on close, earlier ones have nothing to release."""
    # tiny_llm's options: a capture is cached
    with mod.LLM(tiny_model_path, device="cpu", max_model_len=512, **lesson_options) as llm:
        out = llm.generate([[5, 6, 7]], mod.SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.close()  # a second close is harmless
