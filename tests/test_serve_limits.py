"""The server under hostile traffic: each request's cost is bounded before it reaches the engine, and the door locks.

Every probe here once cost the other clients: ``n`` of 100,000 froze the server, a batch
larger than ``--max-requests`` ran 256 prompts before its 257th was refused, a lone
surrogate or JSON nested 100,000 deep answered 500. Each is now refused at once with the
status and the limit that applies, and the engine never sees it (no request is added).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from milestones.serve import _is_loopback, command_line, limits_from
from milestones.server.app import create_app
from milestones.server.limits import Limits
from milestones.server.listen import running
from tests.test_serve import LIMITS, PROMPTS, SERVED, SPECULATIVE, slowed, wait_until


@contextlib.contextmanager
def serving(llm, limits: Limits, api_key: str | None = None, shutdown_grace: float = 1.0):
    """The server on a free port, with the engine's add_request counted: what reached the engine at all."""
    added, add = [], llm.engine.add_request
    llm.engine.add_request = lambda *args, **kwargs: added.append(args) or add(*args, **kwargs)
    app = create_app(llm, "tiny", limits=limits, api_key=api_key)
    with running(app, shutdown_grace=shutdown_grace) as url:
        yield url, app, added


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    from milestones import m2

    return m2.LLM(tiny_model_path, **LIMITS)


def post(url: str, body: object, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30, **kwargs)


def expect_refused(response: httpx.Response, status: int, *words: str) -> None:
    """The status, in OpenAI's error shape, with a message that names what to change."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text[:300]}"
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, f"the {status}'s message should say {word!r}: {message!r}"


def test_n_above_the_limit_is_refused_before_the_engine_sees_it(tiny_model_path):
    from milestones import m2

    with serving(m2.LLM(tiny_model_path, **LIMITS), Limits(max_n=8)) as (url, app, added):
        began = time.monotonic()
        expect_refused(post(url, {"prompt": "hi", "n": 100_000, "max_tokens": 1}), 400, "n is 100000", "at most 8")
        assert time.monotonic() - began < 5 and added == [], "n=100000 reached the engine"
        assert post(url, {"prompt": "hi", "n": 8, "max_tokens": 1}).status_code == 200
        assert app.state.engine_loop.num_in_flight == 0


def test_a_batch_that_can_never_fit_is_a_400_at_once(tiny_model_path):
    """3 prompts x n=2 is 6 sequences; a server that runs 4 at most can never serve it: refused before any runs."""
    from milestones import m2

    with serving(m2.LLM(tiny_model_path, **LIMITS), Limits(max_requests=4)) as (url, _, added):
        expect_refused(post(url, {"prompt": PROMPTS[:3], "n": 2, "max_tokens": 2}), 400, "6 sequences",
                       "--max-requests", "split it")
        assert added == [], f"{len(added)} of its prompts reached the engine before the refusal"
        assert post(url, {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 2}).status_code == 200  # 4 fit


def test_samples_count_toward_max_requests_and_a_503_says_when_to_retry(tiny_model_path):
    from milestones import m2

    llm = slowed(m2.LLM(tiny_model_path, **LIMITS))
    with serving(llm, Limits(max_requests=4)) as (url, app, _):
        body = {"prompt": PROMPTS[0], "n": 3, "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60):  # headers: 3 sequences running
            assert app.state.engine_loop.num_in_flight == 3
            busy = post(url, {"prompt": "hi", "n": 2, "max_tokens": 1})
            expect_refused(busy, 503, "3 sequences in flight", "adds 2", "retry later")
            assert busy.headers.get("retry-after", "").isdigit(), f"a 503 without Retry-After: {busy.headers}"
            assert post(url, {"prompt": "hi", "max_tokens": 1}).status_code == 200  # one more fits
        wait_until(lambda: app.state.engine_loop.num_in_flight == 0, seconds=10)


def test_a_body_over_the_limit_is_413_however_it_is_sent(llm):
    with serving(llm, Limits(max_body_bytes=10_000)) as (url, _, added):
        text = "word " * 5_000  # 25,000 bytes
        expect_refused(post(url, {"prompt": text}), 413, "at most 10,000")  # Content-Length says so

        def chunks():  # no Content-Length: chunked, counted as it arrives
            yield b'{"prompt": "'
            for _ in range(50):
                yield b"word " * 100
            yield b'"}'

        sent = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                          timeout=30)
        expect_refused(sent, 413, "over 10,000 bytes")
        assert added == []
        assert post(url, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_json_nested_too_deep_and_lone_surrogates_are_400s(llm):
    with serving(llm, Limits()) as (url, _, added):
        deep = httpx.post(f"{url}/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                          headers={"content-type": "application/json"}, timeout=30)
        expect_refused(deep, 400, "nests too deeply")
        for route, body in (("completions", b'{"prompt": "a \\ud800 b", "max_tokens": 1}'),
                            ("chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')):
            response = httpx.post(f"{url}/v1/{route}", content=body, headers={"content-type": "application/json"},
                                  timeout=30)
            expect_refused(response, 400, "not valid Unicode", "\\ud800")
        assert added == []


def test_a_prompt_longer_than_any_context_is_refused_without_tokenizing_it(llm, monkeypatch):
    """1 MB of text cannot fit 256 tokens: refused by its length alone (tokenizing it took seconds on the engine's
    thread, and every stream waited)."""
    encoded = []
    with serving(llm, Limits()) as (url, _, added):
        monkeypatch.setattr(type(llm.tokenizer), "encode", lambda *args, **kwargs: encoded.append(1) or [1])
        expect_refused(post(url, {"prompt": "x" * 1_000_000, "max_tokens": 1}), 400, "1,000,000 characters",
                       "max_model_len")
        assert encoded == [] and added == [], "the text was tokenized, or reached the engine"


def test_a_conversation_or_token_ids_too_long_for_any_context_are_refused_before_tokenizing(llm, monkeypatch):
    encoded = []
    with serving(llm, Limits()) as (url, _, added):
        monkeypatch.setattr(type(llm.tokenizer), "apply_chat_template", lambda *a, **k: encoded.append(1) or "x")
        chat = {"messages": [{"role": "user", "content": "x" * 1_000_000}], "max_tokens": 1}
        expect_refused(httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30), 400, "1,000,000 characters")
        expect_refused(post(url, {"prompt": [5] * 100_000, "max_tokens": 1}), 400, "100000 tokens", "max_model_len")
        assert encoded == [] and added == []


def test_prompts_waiting_to_be_tokenized_are_bounded(llm, monkeypatch):
    """While max_requests prompts wait for a tokenizer thread, the next is a 503 at once (a flood of long
    conversations queued without bound before, every other request behind them)."""
    entered, release = threading.Event(), threading.Event()
    template = type(llm.tokenizer).apply_chat_template

    def held(self, messages, *args, **kwargs):
        entered.set()
        release.wait(30)
        return template(self, messages, *args, **kwargs)

    monkeypatch.setattr(type(llm.tokenizer), "apply_chat_template", held)
    with serving(llm, Limits(max_requests=1)) as (url, _, _), ThreadPoolExecutor(1) as pool:
        chat = {"messages": [{"role": "user", "content": "hold"}], "max_tokens": 1}
        slow = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert entered.wait(30)
        busy = post(url, {"prompt": "hi", "max_tokens": 1})
        expect_refused(busy, 503, "waiting to be tokenized")
        release.set()
        assert slow.result().status_code == 200


def test_tokenizing_runs_off_the_engine_thread_and_a_slow_one_delays_only_its_own_request(llm, monkeypatch):
    """A conversation whose chat template is held back (as 50,000 messages hold it for seconds) does not stop another
    client's request from being answered meanwhile, and no template or tokenizer ever runs on the engine's thread."""
    threads, entered, release = [], threading.Event(), threading.Event()
    template = type(llm.tokenizer).apply_chat_template

    def held(self, messages, *args, **kwargs):
        threads.append(threading.current_thread().name)
        if messages[0]["content"] == "hold":
            entered.set()
            release.wait(30)
        return template(self, messages, *args, **kwargs)

    monkeypatch.setattr(type(llm.tokenizer), "apply_chat_template", held)
    with serving(llm, Limits()) as (url, _, _), ThreadPoolExecutor(1) as pool:
        chat = {"messages": [{"role": "user", "content": "hold"}], "max_tokens": 2}
        slow = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert entered.wait(30), "the held conversation never reached its chat template"
        assert post(url, {"prompt": "hi", "max_tokens": 2}).status_code == 200
        quick = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=quick, timeout=30).status_code == 200
        assert not slow.done(), "the held request finished before it was released"
        release.set()
        assert slow.result().status_code == 200
    assert threads and all(name.startswith("tokenize") for name in threads), (
        f"chat templates ran on these threads: {threads}; the engine's thread (engine-loop) must never run them")


def test_an_api_key_locks_the_v1_routes_and_leaves_health_open(llm):
    with serving(llm, Limits(), api_key="s3cret") as (url, _, added):
        expect_refused(post(url, {"prompt": "hi"}), 401, "Authorization: Bearer")
        response = post(url, {"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert added == []
        ours = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", timeout=60, max_retries=0)
        assert ours.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                            ("0.0.0.0", False), ("192.168.1.5", False), ("example.org", False)])
def test_only_loopback_hosts_are_served_without_a_key_warning(host, loopback):
    assert _is_loopback(host) is loopback


def scrape(url: str) -> dict[str, float]:
    """GET /metrics, parsed with prometheus_client's own parser: each sample's name and labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain"), response.text
    return {sample.name + str(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def sample(samples: dict[str, float], name: str, **labels: str) -> float:
    key = name + str(sorted({"model_name": "tiny", **labels}.items()))
    assert key in samples, f"/metrics has no {key}; it has {sorted(samples)[:40]}"
    return samples[key]


def test_metrics_count_tokens_and_latencies_and_show_the_engine_now(tiny_model_path):
    """vLLM's names: requests running and waiting and the KV cache's use read from the engine at scrape time, prompt
    and generated tokens counted, a time to first token per request and a time between tokens."""
    from milestones import m4

    llm = slowed(m4.LLM(tiny_model_path, **LIMITS))
    with serving(llm, Limits()) as (url, _, _):
        before = scrape(url)
        assert sample(before, "vllm:num_requests_running") == 0 and sample(before, "vllm:kv_cache_usage_perc") == 0
        body = {"prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: a closed iterator closes the response, and the request is aborted
            next(lines)  # a token has come: it is running
            during = scrape(url)
            assert sample(during, "vllm:num_requests_running") == 1, "one request streams: one running"
            assert 0 < sample(during, "vllm:kv_cache_usage_perc") <= 1, "a running request holds KV blocks"
            for _ in lines:
                pass
        prompt_tokens = len(llm.tokenizer.encode(PROMPTS[0]))
        after = scrape(url)
        assert sample(after, "vllm:prompt_tokens_total") == prompt_tokens
        assert sample(after, "vllm:generation_tokens_total") == 60
        assert sample(after, "vllm:request_success_total", finished_reason="length") == 1
        assert sample(after, "vllm:time_to_first_token_seconds_count") == 1
        assert sample(after, "vllm:inter_token_latency_seconds_count") >= 1
        assert sample(after, "vllm:num_requests_running") == 0 and sample(after, "vllm:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("name", SERVED)
def test_every_milestone_can_be_scraped(tiny_model_path, name):
    """The gauges read each milestone's own state (m1's single slot, m2's slots, blocks from m3 on, m7's guesses)."""
    mod = importlib.import_module(f"milestones.{name}")
    llm = mod.LLM(tiny_model_path, **LIMITS, **({"speculative_config": SPECULATIVE} if name == "m7" else {}))
    with serving(llm, Limits()) as (url, _, _):
        assert post(url, {"prompt": PROMPTS[1], "max_tokens": 5, "ignore_eos": True}).status_code == 200
        samples = scrape(url)
        assert sample(samples, "vllm:generation_tokens_total") == 5
        assert sample(samples, "vllm:num_requests_running") == 0 and sample(samples, "vllm:kv_cache_usage_perc") == 0
        if name == "m7":
            drafted, kept = (sample(samples, f"vllm:spec_decode_num_{what}_tokens_total")
                             for what in ("draft", "accepted"))
            assert 0 <= kept <= drafted, (kept, drafted)
            assert 0 <= sample(samples, "milestones:spec_decode_acceptance_rate") <= 1


def test_a_stream_open_at_shutdown_ends_with_an_error_event_and_done_and_one_log_line(tiny_model_path, caplog):
    """At the end of --shutdown-grace a stream still open ends as a failed one does, an error in OpenAI's shape, then
    [DONE]; the log says so in one line per stream, with no traceback (uvicorn cancelled them mid-chunk before)."""
    from milestones import m2

    llm = slowed(m2.LLM(tiny_model_path, **LIMITS), seconds=0.05)
    lines, opened = [], threading.Event()

    def read(url: str) -> None:
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                lines.append(line)
                opened.set()

    uvicorn_log = logging.getLogger("uvicorn.error")  # it does not propagate to the root logger caplog reads
    uvicorn_log.addHandler(caplog.handler)
    with caplog.at_level("WARNING"), ThreadPoolExecutor(1) as pool:
        with serving(llm, Limits(), shutdown_grace=3) as (url, _, _):
            reader = pool.submit(read, url)
            assert opened.wait(30), "the stream never started"
        reader.result(timeout=30)
    uvicorn_log.removeHandler(caplog.handler)
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", f"the cut stream's last events: {events[-3:]}"
    assert "shutting down" in events[-2] and '"error"' in events[-2], f"no error event before [DONE]: {events[-3:]}"
    cut = [r for r in caplog.records if "cut after" in r.getMessage()]
    assert len(cut) == 1, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.exc_info or "Cancel" in r.getMessage()], (
        f"tracebacks or cancelled tasks in the log: {[r.getMessage() for r in caplog.records]}")


def test_a_stalled_body_is_a_408_and_frees_its_place(llm):
    """A client that sends part of its body and stops (a slow upload, or a socket held open on purpose) is answered
    408 once nothing has come for body_timeout seconds; the server serves the next request."""
    import socket
    from urllib.parse import urlsplit

    with serving(llm, Limits(body_timeout=0.5)) as (url, _, added):
        address = urlsplit(url)
        with socket.create_connection((address.hostname, address.port), timeout=30) as held:
            held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
            answer = b""
            while part := held.recv(65536):  # the headers and the body may come in two writes; then it closes
                answer += part
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408"), answer[:200]
        assert "the body stalled" in answer and added == []
        assert post(url, {"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half"])
def test_a_connection_that_never_finishes_its_headers_is_closed_with_a_408(llm, sent):
    """Sockets opened and left silent, or sending half a request's headers, are held for ever by uvicorn alone (a
    handful of clients could hold every socket): each gets 408 after header_timeout and is closed."""
    import socket
    from urllib.parse import urlsplit

    with serving(llm, Limits(header_timeout=0.5)) as (url, _, _):
        address = urlsplit(url)
        with socket.create_connection((address.hostname, address.port), timeout=30) as held:
            held.sendall(sent)
            answer = held.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert held.recv(65536) == b"", "the connection was left open after its 408"
        ours = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        completion = ours.completions.create(model="tiny", prompt="hi", max_tokens=2)  # a whole request: served
        assert completion.usage.completion_tokens == 2


def test_the_header_deadline_never_cuts_a_request_that_takes_longer(tiny_model_path):
    """The deadline is for a request's headers only: a request whose answer takes four times as long is answered,
    and so is the client's next one after a pause longer than the deadline (the idle connection got its 408 and was
    closed meanwhile, so the client opens another)."""
    from milestones import m2

    llm = slowed(m2.LLM(tiny_model_path, **LIMITS), seconds=0.05)
    with serving(llm, Limits(header_timeout=0.5)) as (url, _, _), httpx.Client(timeout=60) as http:
        body = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        first = http.post(f"{url}/v1/completions", json=body)  # 40 slowed steps: 2 s or more
        assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 40, first.text[:300]
        time.sleep(1)
        assert http.post(f"{url}/v1/completions", json=body | {"max_tokens": 2}).status_code == 200


def test_the_command_lines_limits_reach_the_server_each_to_its_own_field(monkeypatch):
    monkeypatch.delenv("MILESTONES_API_KEY", raising=False)
    args = command_line().parse_args(["--max-requests", "8", "--max-n", "3", "--max-body-bytes", "1000",
                                      "--body-timeout", "2", "--header-timeout", "5"])
    assert limits_from(args) == Limits(max_requests=8, max_n=3, max_body_bytes=1000, body_timeout=2,
                                       header_timeout=5), limits_from(args)
    assert args.api_key is None
    monkeypatch.setenv("MILESTONES_API_KEY", "from-the-environment")
    assert command_line().parse_args([]).api_key == "from-the-environment"
