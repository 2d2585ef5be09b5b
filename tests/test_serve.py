"""The OpenAI-compatible server, driven by the official ``openai`` client against a server on 127.0.0.1.

The same greedy tokens as ``LLM.generate``; many clients at once; every bad input gets its
status and the server serves the next request; a client that disconnects mid-stream has
its KV blocks freed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from milestones.serve import command_line, engine_options, load_llm, main
from milestones.server.app import create_app
from milestones.server.limits import Limits
from milestones.server.listen import running

SERVED = ["m1", "m2", "m4", "m6", "m7"]  # one at a time, batched, paged with a prefix cache, overlapped, guessing
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}  # m7's option
PROMPTS = ["The capital of France is", "Count: one, two, three,", "def fibonacci(n):", "Once upon a time"]
LIMITS = dict(device="cpu", max_model_len=256)


@contextlib.contextmanager
def serving(llm, max_requests: int = 64):
    """Run the app on a free port of 127.0.0.1 in a thread; yield its base URL and the app."""
    app = create_app(llm, "tiny", Limits(max_requests=max_requests))
    with running(app) as url:
        yield url, app
    assert not app.state.engine_loop.is_alive(), "the engine loop did not stop with the server"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def greedy(mod, max_tokens=12):
    return mod.SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module", params=SERVED)
def served(request, tiny_model_path):
    """A server for one milestone, with what LLM.generate and LLM.chat give for the same prompts (computed first)."""
    mod = importlib.import_module(f"milestones.{request.param}")
    llm = mod.LLM(tiny_model_path, **LIMITS, **({"speculative_config": SPECULATIVE} if request.param == "m7" else {}))
    texts = [out.outputs[0] for out in llm.generate(PROMPTS, greedy(mod), use_tqdm=False)]
    chat = llm.chat([{"role": "user", "content": "Hello there"}], greedy(mod), use_tqdm=False)[0]
    with serving(llm) as (url, app):
        yield url, app, texts, chat


def test_completions_give_generates_tokens_whole_and_streamed(served):
    url, _, texts, _ = served
    api = client(url)
    for prompt, expected in zip(PROMPTS, texts):
        whole = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == expected.finish_reason
        assert whole.usage.completion_tokens == len(expected.token_ids)
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
        chunks = list(api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
        assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_gives_llm_chats_answer_whole_and_streamed(served):
    url, _, _, chat = served
    api = client(url)
    messages = [{"role": "user", "content": "Hello there"}]
    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == chat.outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(chat.prompt_token_ids)
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.outputs[0].text


def test_many_clients_at_once_all_get_their_own_answer(served):
    url, _, texts, _ = served
    api = client(url)

    def ask(index):
        prompt = PROMPTS[index % len(PROMPTS)]
        return index, api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(16), timeout=300))
    for index, answer in answers:
        assert answer.choices[0].text == texts[index % len(PROMPTS)].text


def test_models_and_health(served, request):
    url, _, _, _ = served
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok"
    assert ("speculation" in health) == (request.node.callspec.params["served"] == "m7")  # m7's guesses so far
    if "speculation" in health:
        assert {"num_draft_tokens", "num_accepted_tokens", "acceptance_rate"} <= set(health["speculation"])


@pytest.mark.parametrize("body, message, param", [
    (b"{not json", "not valid JSON", None),
    (b'["a", "list"]', "JSON object", None),
    (b'{"prompt": "hi", "temperature": -1}', "temperature", "temperature"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens", "max_tokens"),
    (b'{"prompt": "hi", "top_p": 2}', "top_p", "top_p"),
    (b'{"prompt": "hi", "logprobs": 30}', "logprobs must be None or in [0, 20]", "logprobs"),
    (b'{"prompt": "hi", "n": 0}', "n must be an integer >= 1", "n"),
    (b'{"prompt": "hi", "response_format": {"type": "xml"}}', "response_format must be", "response_format"),
    (b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
     b'{"type": "frob"}}}}', "structured_outputs: Invalid type: frob", "response_format"),
    (b'{"prompt": "hi", "frequency_penalty": 2.5}', "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
    (b'{"prompt": "hi", "echo": 1}', "echo must be true or false", "echo"),
    (b'{"prompt": "hi", "logit_bias": {"5": 1}}', "logit_bias", "logit_bias"),
    (b'{"prompt": "hi", "guided_json": {}}', "unsupported parameter(s) guided_json", "guided_json"),
    (b'{"prompt": ""}', "empty", "prompt"),
    (b'{"prompt": []}', "prompt must be", "prompt"),
    (b'{"prompt": ["a", 3]}', "prompt must be", "prompt"),
    (b'{"prompt": [1, 2, 99999999]}', "token ids must be in", "prompt"),
    (b'{"prompt": {"a": 1}}', "prompt must be", "prompt"),
    (b'{"prompt": "' + b"word " * 400 + b'"}', "max_model_len", "prompt"),
    (b'{"prompt": "hi", "stream": "false"}', "stream must be true or false", "stream"),
    (b'{"prompt": "hi", "stream_options": true}', "stream_options an object", "stream_options"),
])
def test_bad_input_gets_400_with_the_engines_message_and_the_server_serves_on(served, body, message, param):
    """The message says what to change, and ``param`` (OpenAI's) names the parameter at fault, where there is one."""
    url, app, texts, _ = served
    response = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == param, response.text
    answer = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert answer.choices[0].text == texts[0].text
    assert app.state.engine_loop.num_in_flight == 0


@pytest.mark.parametrize("change, message, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in [0, 20]", "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true", "top_logprobs"),
    ({"logprobs": 3}, "logprobs must be true or false in a chat", "logprobs"),
    ({"max_completion_tokens": 0}, "max_tokens must be an integer >= 1", "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1", "max_tokens"),
    ({"messages": []}, "messages must be a non-empty list", "messages"),
    ({"model": "gpt-4"}, "is not served here", "model"),
])
def test_a_refused_chat_names_the_parameter_as_the_request_spelled_it(served, change, message, param):
    """A chat's parameters have names of their own (top_logprobs, max_completion_tokens): an error names those."""
    url, _, _, _ = served
    body = {"messages": [{"role": "user", "content": "Hello there"}], **change}
    error = httpx.post(f"{url}/v1/chat/completions", json=body).json()["error"]
    assert message in error["message"] and error["param"] == param, error


def test_head_asks_the_metrics_and_health_routes_what_get_does(served):
    """A probe that sends HEAD gets GET's status and headers, and no body."""
    url, _, _, _ = served
    for route in ("/metrics", "/health"):
        got, head = httpx.get(f"{url}{route}"), httpx.head(f"{url}{route}")
        assert head.status_code == got.status_code == 200, (route, head.status_code, head.text)
        assert head.headers["content-type"] == got.headers["content-type"] and head.content == b""


def test_null_parameters_mean_the_defaults(served):
    url, _, texts, _ = served
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "top_p": None, "seed": None, "stop": None}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == texts[0].text


def test_penalties_reach_the_engine(tiny_model_path):
    """OpenAI's presence and frequency penalties and vLLM's repetition penalty give what LLM.generate gives."""
    mod = importlib.import_module("milestones.m4")
    llm = mod.LLM(tiny_model_path, **LIMITS)
    # The tiny random model never repeats itself: penalties below 0 (and 1) that pull it back to the prompt show.
    penalties = dict(presence_penalty=-2, frequency_penalty=1, repetition_penalty=0.05)
    plain, penalized = (llm.generate(PROMPTS[1], mod.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **p),
                                     use_tqdm=False)[0].outputs[0].text for p in ({}, penalties))
    assert plain != penalized, "the penalties change nothing here: this test would pass without them"
    with serving(llm) as (url, _):
        answer = client(url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                                presence_penalty=-2, frequency_penalty=1,
                                                extra_body={"ignore_eos": True, "repetition_penalty": 0.05})
    assert answer.choices[0].text == penalized


def test_logprobs_in_openais_shapes_whole_and_streamed(tiny_model_path):
    """A completion's legacy lists (what lm-eval reads) and a chat's tokens with their top_logprobs carry the engine's
    own log-probabilities (within 1e-4: the server may batch the request with others), streamed or whole."""
    mod = importlib.import_module("milestones.m4")
    llm = mod.LLM(tiny_model_path, **LIMITS)
    expected = llm.generate(PROMPTS[0], mod.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
                            use_tqdm=False)[0].outputs[0]
    texts = [llm.tokenizer.decode([token]) for token in expected.token_ids]
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    with serving(llm) as (url, _):
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
        chunks = [json.loads(line[6:]) for line in httpx.post(f"{url}/v1/completions", json={**body, "stream": True},
                                                                timeout=120).text.splitlines()
                  if line.startswith("data: {")]
        chat = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                   "top_logprobs": 2})
    assert whole["tokens"] == texts
    for position, (token, entries) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert abs(whole["token_logprobs"][position] - entries[token].logprob) <= 1e-4, position
        assert len(whole["top_logprobs"][position]) == len({texts[position], *whole["top_logprobs"][position]})
    assert whole["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    streamed = [chunk["choices"][0]["logprobs"] for chunk in chunks if chunk["choices"]]
    assert sum((part["tokens"] for part in streamed), []) == whole["tokens"]
    assert sum((part["text_offset"] for part in streamed), []) == whole["text_offset"]
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(item.top_logprobs) == 3 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.logprob for item in content)  # greedy: the chosen is the likeliest
    assert refused.status_code == 400 and "top_logprobs needs logprobs: true" in refused.json()["error"]["message"]


def lm_eval_loglikelihood_body(prompts: list) -> dict:
    """What lm-eval's local-completions sends to score a continuation: prompt = context + continuation, echoed."""
    return {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def lm_eval_parse_logprobs(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's parse_logprobs (0.4.x): the continuation's summed log-probability, and whether it is greedy."""
    logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(token == max(top.values()) for token, top in zip(logprobs, tops))


def test_lm_eval_loglikelihood_reads_the_engines_prompt_logprobs(tiny_model_path):
    """echo with logprobs gives the prompt's tokens their log-probabilities (the first has none) before the generated
    token's: lm-eval sums them over a continuation. Token ids and text prompts alike, within 1e-4 of the engine."""
    mod = importlib.import_module("milestones.m4")
    llm = mod.LLM(tiny_model_path, **LIMITS)
    tokenizer = llm.tokenizer
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    expected = llm.generate(ids, mod.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    with serving(llm) as (url, _):
        tokenized = httpx.post(f"{url}/v1/completions", json=lm_eval_loglikelihood_body(ids), timeout=120).json()
        text = httpx.post(f"{url}/v1/completions", json=lm_eval_loglikelihood_body(PROMPTS[0]), timeout=120).json()
        streamed = [json.loads(line[6:]) for line in httpx.post(
            f"{url}/v1/completions", json={**lm_eval_loglikelihood_body(PROMPTS[0]), "stream": True},
            timeout=120).text.splitlines() if line.startswith("data: {")]
    for choice, prompt, out in zip(tokenized["choices"], ids, expected):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1, "the prompt's tokens, then the generated one"
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert choice["text"] == tokenizer.decode(prompt) + out.outputs[0].text
        for position, (token, found) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:]), 1):
            assert abs(logprobs["token_logprobs"][position] - found[token].logprob) <= 1e-4, position
        ctxlen = len(prompt) // 2
        total, _ = lm_eval_parse_logprobs(choice, ctxlen)
        want = sum(found[token].logprob for token, found in zip(prompt[ctxlen:], out.prompt_logprobs[ctxlen:]))
        assert abs(total - want) <= 1e-3, (total, want)
    assert text["choices"][0]["text"].startswith(PROMPTS[0])
    alone, batched = (answer["choices"][0]["logprobs"]["token_logprobs"] for answer in (text, tokenized))
    assert alone[0] is None and len(alone) == len(batched)  # the same tokens, in a batch of one or of four
    assert all(abs(a - b) <= 1e-4 for a, b in zip(alone[1:], batched[1:]))
    first = next(chunk["choices"][0] for chunk in streamed if chunk["choices"])
    assert first["text"].startswith(PROMPTS[0]) and first["logprobs"]["token_logprobs"][0] is None


def test_bad_chat_messages_get_400(served):
    url, _, _, _ = served
    for messages in ([], [{"role": "user"}], "hello", [{"role": "user", "content": 3}]):
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages})
        assert response.status_code == 400 and "messages must be" in response.json()["error"]["message"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": image})
    assert response.status_code == 400 and "part of type 'image_url'" in response.json()["error"]["message"]
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "echo": True})  # a completion's option only
    assert response.status_code == 400 and "echo true is not supported" in response.json()["error"]["message"]


# What real clients send, as they send it (captured from their requests): each must be served, not refused.
LANGCHAIN_COMPLETION = {"model": "tiny", "max_tokens": 12, "temperature": 0, "top_p": 1, "frequency_penalty": 0,
                        "presence_penalty": 0, "n": 1, "logit_bias": {}, "seed": None, "logprobs": None,
                        "best_of": 1, "echo": False, "store": False, "stream_options": {"include_usage": True}}
GUIDELLM_CHAT = {"model": "tiny", "max_tokens": 12, "max_completion_tokens": 12, "temperature": 0, "stream": False,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]}


def test_the_no_op_options_clients_send_are_accepted(served):
    url, _, texts, chat = served
    response = httpx.post(f"{url}/v1/completions", json={**LANGCHAIN_COMPLETION, "prompt": PROMPTS[0]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == texts[0].text
    response = httpx.post(f"{url}/v1/chat/completions", json=GUIDELLM_CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == chat.outputs[0].text  # text parts read as text


def test_lm_eval_chat_generation_body_is_served(served):
    """What lm-eval's local-chat-completions sends for a generation task (its _create_payload, 0.4.13)."""
    url, _, _, chat = served
    body = {"messages": [{"role": "user", "content": "Hello there"}], "model": "tiny", "max_tokens": 12,
            "temperature": 0, "stop": ["\n\n", "Question:"], "seed": 1234}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    expected = chat.outputs[0].text
    for stop in body["stop"]:  # LLM.chat's greedy answer, cut where the first stop string begins
        expected = expected.split(stop)[0]
    assert content == expected


def test_an_assistant_turn_without_content_is_an_empty_turn(served):
    url, _, _, _ = served
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "Go"}]
    answers = []
    for assistant_content in ("", None):
        turns[1]["content"] = assistant_content
        body = {"messages": turns, "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]


def test_a_batch_of_prompts_gets_a_choice_each_in_order(served):
    url, app, texts, _ = served
    tokenizer = app.state.engine_loop.llm.tokenizer
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    for prompt in (PROMPTS, ids):  # strings, and token ids as lm-eval sends them
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert [c["index"] for c in answer["choices"]] == list(range(len(PROMPTS)))
        assert [c["text"] for c in answer["choices"]] == [t.text for t in texts]
        assert answer["usage"]["completion_tokens"] == sum(len(t.token_ids) for t in texts)
    chunks = list(client(url).completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(len(PROMPTS))]
    assert streamed == [t.text for t in texts]
    assert chunks[-1].usage.completion_tokens == sum(len(t.token_ids) for t in texts)
    wait_until(lambda: app.state.engine_loop.num_in_flight == 0, seconds=10)  # released once the stream is sent


def test_n_samples_are_choices_prompt_after_prompt(served):
    """n samples of each prompt: choice p * n + s is prompt p's sample s, the engine's own (seed + s), streamed or
    whole; the prompt counts once in the usage."""
    url, app, _, _ = served
    llm = app.state.engine_loop.llm
    mod = importlib.import_module(type(llm).__module__)  # the milestone whose LLM it is
    settings = dict(temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    expected = [llm.generate(p, mod.SamplingParams(**settings, n=3), use_tqdm=False)[0] for p in PROMPTS[:2]]
    body = {"prompt": PROMPTS[:2], "n": 3, **settings}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    assert [c["text"] for c in answer["choices"]] == [c.text for out in expected for c in out.outputs]
    assert answer["usage"]["prompt_tokens"] == sum(len(out.prompt_token_ids) for out in expected)
    lines = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=120).text.splitlines()
    chunks = [json.loads(line[6:])["choices"][0] for line in lines if line.startswith("data: {")]
    for index in range(6):
        mine = [c for c in chunks if c["index"] == index]
        assert "".join(c["text"] for c in mine) == answer["choices"][index]["text"]
        assert [c["finish_reason"] for c in mine].count("length") == 1, f"choice {index}: one last chunk"
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                          **settings}, timeout=120).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    wait_until(lambda: app.state.engine_loop.num_in_flight == 0, seconds=10)


def test_response_format_holds_the_answer_to_json(served):
    """json_schema and json_object, as the openai client sends them, whole and streamed: the text parses."""
    pytest.importorskip("llguidance", reason="structured output needs llguidance (requirements.txt)")
    url, _, _, _ = served
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    api = client(url)
    messages = [{"role": "user", "content": "The weather in Paris, as JSON."}]
    answer = api.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "weather", "schema": schema}})
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool)
    stream = api.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0, stream=True,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "weather", "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer.choices[0].message.content
    body = {"prompt": "JSON:", "max_tokens": 60, "temperature": 0, "response_format": {"type": "json_object"}}
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    if completion["finish_reason"] == "stop":
        assert isinstance(json.loads(completion["text"]), dict)
    else:  # a random model may fill 60 tokens with one long string: the object is then cut, but began as one
        assert completion["text"].startswith("{")


def test_models_routes_and_errors_in_openais_shape(served):
    url, _, _, _ = served
    assert httpx.get(f"{url}/v1/models/tiny").json()["id"] == "tiny"
    for response in (httpx.get(f"{url}/v1/models/gpt-4"),
                     httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "model": "gpt-4"})):
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
        assert "is not served here" in response.json()["error"]["message"]
    unknown, wrong_method = httpx.get(f"{url}/v1/nowhere"), httpx.get(f"{url}/v1/completions")
    assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
    assert wrong_method.status_code == 405 and "POST" in wrong_method.headers["allow"]
    assert set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}


def slowed(llm, seconds=0.02):
    """The tiny model is fast: with each step slowed, a long request is surely still running when a test looks."""
    step = llm.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    llm.engine.step = slow_step  # the engine loop calls it through the instance
    return llm


def wait_until(condition, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def wait_until_idle(engine, seconds=60):
    wait_until(lambda: not engine.has_unfinished_requests(), seconds)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(tiny_model_path):
    from milestones import m4

    llm = slowed(m4.LLM(tiny_model_path, num_kv_blocks=64, enable_prefix_caching=False, **LIMITS))
    with serving(llm) as (url, app):
        body = {"prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60):
            wait_until(lambda: llm.engine.kv_usage()["blocks_in_use"] > 0)  # it is generating
        # The connection is closed with most of its 200 tokens to go: the request must be aborted, not run on.
        wait_until_idle(llm.engine, seconds=2)  # far less than its 200 slowed steps would take
        llm.engine.check_integrity()
        usage = llm.engine.kv_usage()
        assert usage["blocks_in_use"] == 0 and usage["blocks_free"] == 64, usage
        wait_until(lambda: app.state.engine_loop.num_in_flight == 0, seconds=10)


def test_a_full_server_answers_503_then_serves_again(tiny_model_path):
    from milestones import m2

    llm = slowed(m2.LLM(tiny_model_path, **LIMITS))
    with serving(llm, max_requests=1) as (url, app):
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60):  # headers: it was accepted
            busy = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
            assert busy.status_code == 503 and "retry later" in busy.json()["error"]["message"]
        wait_until_idle(llm.engine)
        wait_until(lambda: app.state.engine_loop.num_in_flight == 0, seconds=10)
        assert client(url).completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_a_non_streaming_client_that_goes_away_has_its_request_aborted(tiny_model_path):
    from milestones import m3

    llm = slowed(m3.LLM(tiny_model_path, **LIMITS))
    with serving(llm) as (url, app):
        body = {"prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):  # the client gives up long before its 200 slowed steps
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        wait_until_idle(llm.engine, seconds=2)
        wait_until(lambda: app.state.engine_loop.num_in_flight == 0, seconds=10)
        llm.engine.check_integrity()
        assert llm.engine.kv_usage()["blocks_in_use"] == 0


def test_a_failing_step_gives_500_and_the_server_serves_on(tiny_model_path):
    from milestones import m4

    llm = m4.LLM(tiny_model_path, **LIMITS)
    step, failures = llm.engine.step, [RuntimeError("injected failure")] * 2

    def failing_step():
        if failures:
            raise failures.pop()
        return step()

    llm.engine.step = failing_step
    with serving(llm) as (url, app):
        api = client(url)
        whole = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8})
        assert whole.status_code == 500 and "injected failure" in whole.json()["error"]["message"]
        with pytest.raises(openai.APIError, match="injected failure"):  # streamed: an error event after the 200
            list(api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, stream=True))
        assert api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8).usage.completion_tokens == 8
        wait_until(lambda: app.state.engine_loop.num_in_flight == 0, seconds=10)
        llm.engine.check_integrity()
        assert llm.engine.kv_usage()["blocks_in_use"] == 0


def test_shutting_down_aborts_open_streams_and_stops_the_engine(tiny_model_path):
    from milestones import m6

    llm = slowed(m6.LLM(tiny_model_path, async_scheduling=True, **LIMITS), seconds=0.05)
    with contextlib.ExitStack() as open_stream:
        with serving(llm) as (url, app):
            body = {"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
            open_stream.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60))
            wait_until(llm.engine.has_unfinished_requests)
            stopping = time.monotonic()
        # The request had some 12 s of slowed steps to go; the server gives open streams 1 s, then aborts them.
        assert time.monotonic() - stopping < 6
    # The server is down: the engine loop stopped, the request was aborted, and m6's worker was closed.
    assert not app.state.engine_loop.is_alive()
    assert not llm.engine.worker.steps.thread.is_alive()
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()


def test_m8_serves_in_two_ranks_the_tokens_of_one_and_its_shutdown_ends_the_worker(tiny_model_path):
    """--tensor-parallel-size 2 on the tiny model (4 heads, 2 KV heads): rank 0 in this process, rank 1 a worker
    process; the greedy answers are m7's, and the server's shutdown ends the worker (cleanly, not killed)."""
    from milestones import m7

    with m7.LLM(tiny_model_path, **LIMITS, enforce_eager=True) as reference:
        texts = [out.outputs[0].text for out in reference.generate(PROMPTS, greedy(m7), use_tqdm=False)]
    parser = command_line()
    args = parser.parse_args(["--milestone", "m8", "--model", str(tiny_model_path), "--tensor-parallel-size", "2",
                              *(f"--engine-option={name}={value}" for name, value in LIMITS.items())])
    before = set(multiprocessing.active_children())
    llm = load_llm(parser, args)
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert llm.engine.config.tensor_parallel_size == 2 and len(workers) == 1, workers  # rank 0 is this process
    with serving(llm) as (url, _):
        body = {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert [c["text"] for c in answer["choices"]] == texts
        streamed = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == texts[0]
        assert all(worker.is_alive() for worker in workers)
    # The server has stopped: its engine loop closed the LLM, which stopped rank 1 and waited for it to exit.
    assert not [p for p in multiprocessing.active_children() if p not in before], "a worker outlived the server"
    assert not any(Path(f"/proc/{worker.pid}").exists() for worker in workers), "a worker process remains"
    assert [worker.exitcode for worker in workers] == [0], "the worker was killed or failed rather than told to stop"


def test_m9_serves_through_a_prefill_and_a_decode_worker_the_tokens_of_one_engine(tiny_model_path):
    """--num-prefill-workers 1 --num-decode-workers 1: the router in this process, a worker process of each role; the
    greedy answers are m8's, every prompt's keys and values went from one worker to the other, and the server's
    shutdown ends both workers (cleanly, not killed)."""
    from milestones import m8

    with m8.LLM(tiny_model_path, **LIMITS, enforce_eager=True) as reference:
        texts = [out.outputs[0].text for out in reference.generate(PROMPTS, greedy(m8), use_tqdm=False)]
    parser = command_line()
    args = parser.parse_args(["--milestone", "m9", "--model", str(tiny_model_path), "--num-prefill-workers", "1",
                              "--num-decode-workers", "1", "--router-policy", "round_robin",
                              "--engine-option=enforce_eager=true",
                              *(f"--engine-option={name}={value}" for name, value in LIMITS.items())])
    before = set(multiprocessing.active_children())
    llm = load_llm(parser, args)
    workers = [p for p in multiprocessing.active_children() if p not in before]
    config = llm.engine.config
    assert (config.num_prefill_workers, config.num_decode_workers, config.router_policy) == (1, 1, "round_robin")
    assert len(workers) == 2, workers
    with serving(llm) as (url, _):
        body = {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert [c["text"] for c in answer["choices"]] == texts
        streamed = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == texts[0]
        stats = llm.engine.disaggregation_stats()
        assert stats["prefill worker 0"]["transfers"] == stats["decode worker 0"]["transfers"] == len(PROMPTS) + 1
        assert all(worker.is_alive() for worker in workers)
    assert not [p for p in multiprocessing.active_children() if p not in before], "a worker outlived the server"
    assert [worker.exitcode for worker in workers] == [0, 0], "a worker was killed or failed rather than told to stop"


def test_disaggregation_flags_reach_the_engine_options():
    """m9's three flags become its engine options; left out, they add none (every milestone's one engine). The router
    policies are m9's (written out in milestones/serve.py, so that the command line loads without torch)."""
    from milestones.m9.config import ROUTER_POLICIES

    parser = command_line()
    assert {action.dest: action.choices for action in parser._actions}["router_policy"] == ROUTER_POLICIES
    args = parser.parse_args(["--milestone", "m9", "--num-prefill-workers", "2", "--num-decode-workers", "1",
                              "--router-policy", "round_robin"])
    assert engine_options(parser, args) == {"num_prefill_workers": 2, "num_decode_workers": 1,
                                            "router_policy": "round_robin"}
    assert engine_options(parser, parser.parse_args(["--milestone", "m9"])) == {}
    assert engine_options(parser, parser.parse_args(["--milestone", "m8"])) == {}


def test_quantization_reaches_the_engine_config(tiny_model_path):
    """--quantization int8 is the engine's quantization="int8" (the weights made int8 at load); its choices are the
    kernels' (written out in milestones/serve.py, so that the command line loads without torch)."""
    from milestones import m1
    from milestones.kernels import QUANTIZATIONS

    parser = command_line()
    assert parser.parse_args([]).quantization is None  # the default: no quantization, the engine's own default
    assert {action.dest: action.choices for action in parser._actions}["quantization"] == QUANTIZATIONS
    args = parser.parse_args(["--milestone", "m1", "--model", str(tiny_model_path), "--quantization", "int8",
                              *(f"--engine-option={name}={value}" for name, value in LIMITS.items())])
    llm = load_llm(parser, args)
    assert llm.engine.config.quantization == "int8"
    params = m1.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids) == 4  # it runs


@pytest.mark.parametrize("argv, words", [
    (["--milestone", "m7", "--tensor-parallel-size", "2"], "--tensor-parallel-size needs --milestone m8 or later"),
    (["--milestone", "m6", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "--speculative-config needs --milestone m7 or later"),
    (["--milestone", "m8", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--milestone", "m8", "--num-prefill-workers", "1", "--num-decode-workers", "1"],
     "--num-prefill-workers needs --milestone m9 or later (prefill/decode disaggregation is m9's lesson)"),
    (["--milestone", "m8", "--num-decode-workers", "1"], "--num-decode-workers needs --milestone m9 or later"),
    (["--milestone", "m7", "--router-policy", "round_robin"], "--router-policy needs --milestone m9 or later"),
    (["--milestone", "m9", "--num-decode-workers", "-1"], "--num-decode-workers must be >= 0"),
    (["--milestone", "m9", "--num-prefill-workers", "1", "--engine-option", "device=cpu"],
     "a disaggregated engine needs at least one of each"),
    (["--milestone", "m9", "--num-prefill-workers", "1", "--num-decode-workers", "1", "--tensor-parallel-size", "2",
      "--engine-option", "device=cpu"], "m9's workers are one process each"),
    (["--milestone", "m8", "--tensor-parallel-size", "3", "--engine-option", "device=cpu"],
     "tensor_parallel_size 3 does not divide the model's 4 attention heads: use one of [1, 2, 4]"),
    (["--milestone", "m1", "--quantization", "gguf", "--engine-option", "device=cpu", "--engine-option",
      "dtype=bfloat16"], "quantization='gguf' runs on the CPU in float32 only"),
])
def test_a_flag_the_milestone_or_model_cannot_take_is_a_command_line_error(tiny_model_path, capsys, argv, words):
    """Refused as argparse refuses a bad flag (exit 2, the message on stderr), before any worker starts."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--model", str(tiny_model_path)])
    assert exited.value.code == 2
    assert words in capsys.readouterr().err
