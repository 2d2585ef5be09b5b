"""Serve any milestone over an OpenAI-compatible HTTP API.

    python -m milestones.serve --milestone m4 [--model PATH] [--host 127.0.0.1] [--port 8000]
    make serve M=m4

Routes: ``POST /v1/completions`` (a prompt, or a batch of prompts: a choice each),
``POST /v1/chat/completions`` (streamed as server-sent events with ``"stream": true``),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus);
errors in OpenAI's shape on every route. Every client's requests go to one engine, stepped on
its own thread (``EngineLoop``), so requests from many clients are batched together: m1
serves them one at a time, m2 onwards together.

Bad input gets a 400 with the engine's own message and never reaches a step; a server
with ``--max-requests`` sequences in flight answers 503 with ``Retry-After`` (a request's
``n`` samples count ``n``); a client that disconnects mid-stream has its request aborted
and its KV blocks freed before the next step. What one request may cost is bounded before
it reaches the engine (``Limits``), and ``--api-key`` closes the ``/v1`` routes to callers
without it.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hmac
import importlib
import ipaddress
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from milestones import MILESTONES
from milestones.engine_loop import EngineLoop, Prompt, ServerBusy, Stream
from milestones.metrics import ServerMetrics, snapshot
from milestones.openai_api import (
    Answer,
    BadRequest,
    ChatPrompt,
    ModelNotFound,
    openai_param,
    parse_request,
    usage_chunk,
    whole,
)
from milestones.serving.prompts import tokenize_prompt
from milestones.serving.sampling_params import InvalidParam

logger = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 1  # a 503's Retry-After: a busy server frees places as requests finish, within seconds


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask of the server, checked before any of it reaches the engine's thread."""

    max_requests: int = 256  # sequences in flight (a request's n samples count n) before 503
    max_n: int = 128  # samples per prompt (OpenAI's limit)
    max_body_bytes: int = 4 << 20  # a request body's size: 4 MiB holds a prompt far longer than any max_model_len
    body_timeout: float = 30.0  # seconds a client may take between two parts of its body (a stalled upload, 408)
    body_seconds: float = 120.0  # seconds a whole body may take, however it trickles (408)
    max_stop: int = 16  # stop strings a request may give (each one is searched for at every token of every sample)
    header_timeout: float = 30.0  # seconds from a connection's opening (or its last answer) to a whole request line
    #                               and headers: uvicorn alone waits for them forever


class BodyTooLarge(Exception):
    """The request body is over ``Limits.max_body_bytes`` (HTTP 413)."""


class BodyTimeout(Exception):
    """The client stopped sending its body for ``Limits.body_timeout`` seconds (HTTP 408)."""


class Tokenizing:
    """Prompts to token ids on threads of their own, not the engine's: a long prompt or conversation then delays its
    own request only. Each thread has its own copy of the tokenizer (a fast tokenizer is not safe to share between
    threads), and text too long to fit ``max_model_len`` is refused before any of it is tokenized."""

    WORKERS = 4

    def __init__(self, llm: Any, max_waiting: int) -> None:
        self.source, self.engine = llm.tokenizer, llm.engine
        self.max_waiting, self.waiting = max_waiting, 0  # prompts queued or being tokenized: bounded, like the engine
        self.pool = ThreadPoolExecutor(self.WORKERS, thread_name_prefix="tokenize")
        self.local = threading.local()
        # No token covers more characters than the longest string in the vocabulary, so a text longer than that many
        # times max_model_len has more tokens than max_model_len: refused without tokenizing it.
        self.max_chars = max(map(len, llm.tokenizer.get_vocab())) * self.engine.config.max_model_len

    async def __call__(self, prompt: str | list[int] | ChatPrompt) -> Prompt:
        limit = self.engine.config.max_model_len
        if isinstance(prompt, list):
            if len(prompt) >= limit:  # checked here, not id by id on the engine's thread
                raise BadRequest(f"prompt has {len(prompt)} tokens but max_model_len is {limit}: shorten the prompt "
                                 "(it must leave room for one generated token)", "prompt")
        elif (size := prompt.chars if isinstance(prompt, ChatPrompt) else len(prompt)) > self.max_chars:
            raise BadRequest(f"the prompt is {size:,} characters, more than any {limit} tokens (max_model_len) can "
                             "hold: shorten it", "messages" if isinstance(prompt, ChatPrompt) else "prompt")
        if self.waiting >= self.max_waiting:
            raise ServerBusy(f"{self.waiting} prompts are waiting to be tokenized: retry later")
        self.waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._token_ids, prompt)
        finally:
            self.waiting -= 1

    def _token_ids(self, prompt: str | list[int] | ChatPrompt) -> list[int]:
        if not hasattr(self.local, "tokenizer"):
            self.local.tokenizer = copy.deepcopy(self.source)
        if isinstance(prompt, ChatPrompt):
            return prompt(self.local.tokenizer)
        return tokenize_prompt(self.local.tokenizer, prompt, self.engine.model_config.vocab_size)


def create_app(llm: Any, model_name: str, limits: Limits = Limits(), api_key: str | None = None) -> FastAPI:
    """An app that serves ``llm`` (any milestone's ``LLM``) as ``model_name``; the app closes it when it stops.
    ``limits`` bounds each request; with ``api_key``, the ``/v1`` routes answer 401 to a caller whose
    ``Authorization: Bearer`` header does not carry it."""
    metrics = ServerMetrics(model_name)
    engine_loop, tokenizing = EngineLoop(llm, limits.max_requests, metrics), Tokenizing(llm, limits.max_requests)
    token_texts = llm.tokenizer.batch_decode([[token] for token in range(len(llm.tokenizer))])  # for log-probabilities

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop)  # aborts what is still running; the event loop stays free
        tokenizing.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="milestones", lifespan=lifespan)
    app.state.engine_loop, app.state.limits = engine_loop, limits

    if api_key is not None:
        app.add_middleware(RequireKey, expected=f"Bearer {api_key}".encode())

    async def serve(request: Request, chat: bool) -> Response:
        arrived = time.monotonic()  # the time to first token counts from here (/metrics)
        streams: list[Stream] = []  # one engine request per prompt (a batched completion has several)

        def release() -> None:
            for stream in streams:
                engine_loop.release(stream)  # aborts it if it did not finish

        body: object = None
        try:
            body = await read_json(request, limits)
            job = parse_request(body, chat, model_name)
            check_cost(len(job.prompts), job.params, limits)
            for prompt in job.prompts:
                streams.append(await engine_loop.submit(await tokenizing(prompt), job.params, arrived))
        except Exception as err:
            release()  # the prompts of a batch taken before one was refused
            return refusal(err, chat, body)
        echoed = [(prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt)) if job.echo else ""
                  for prompt in job.prompts]
        n = job.params.n  # choices: each prompt's n samples, prompt after prompt
        answers = [Answer(job, streams[0].request_id, model_name, index * n + sample, token_texts, text, sample)
                   for index, text in enumerate(echoed) for sample in range(n)]
        if job.stream:
            return ReleasingStreamingResponse(events(streams, answers), release, media_type="text/event-stream")
        collect = asyncio.ensure_future(collect_answers(streams, answers))
        gone = asyncio.ensure_future(disconnected(request))
        try:  # neither uvicorn nor Starlette cancels a handler whose client has gone: watch for it here
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return Response(status_code=499)  # nobody reads it; the request is aborted below
            collect.result()
        except RuntimeError as err:
            return error(500, str(err))
        finally:
            collect.cancel()
            gone.cancel()
            release()
        return JSONResponse(whole(answers))

    async def collect_answers(streams: list[Stream], answers: list[Answer]) -> None:
        n = len(answers) // len(streams)
        async for index, output in merged(streams):
            for answer in answers[index * n : (index + 1) * n]:
                answer.update(output)

    async def events(streams: list[Stream], answers: list[Answer]) -> AsyncIterator[str]:
        try:
            n = len(answers) // len(streams)
            async for index, output in merged(streams):
                for answer in answers[index * n : (index + 1) * n]:
                    if (delta := answer.update(output)) is not None:
                        yield f"data: {json.dumps(delta)}\n\n"
            if last := usage_chunk(answers):
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        except RuntimeError as err:  # the headers (200) are sent: the failure goes in the stream, as OpenAI does
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
            yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    card = {"id": model_name, "object": "model", "owned_by": "milestones", "created": 0,
            "max_model_len": llm.engine.config.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != model_name:
            return error(404, f"model {model_id!r} is not served here; this server serves {model_name!r}",
                         "model_not_found", "model")
        return JSONResponse(card)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown routes (404) and wrong methods (405) answered in OpenAI's shape, not FastAPI's ``detail``."""
        response = error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        response.headers.update(exc.headers or {})  # a 405 says which methods the route takes (Allow)
        return response

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: a probe's headers without the body, as GET's
    async def prometheus() -> Response:
        """Prometheus' text format: the counts and latencies so far, and the engine's state now (vLLM's names)."""
        try:
            metrics.state = await engine_loop.call(snapshot)
        except ServerBusy as err:
            return error(503, str(err))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not engine_loop.is_alive():
            return error(503, "the engine loop has stopped")
        health = {"status": "ok", "requests_in_flight": engine_loop.num_in_flight}
        if getattr(llm.engine.config, "speculative_config", None) is not None:  # m7: guesses made and kept so far
            health["speculation"] = llm.engine.spec_stats()
        return JSONResponse(health)

    return app


async def outputs(stream: Stream) -> AsyncIterator[Any]:
    """The request's outputs as the engine thread sends them, up to its last; an exception from it is raised."""
    while True:
        output = await stream.outputs.get()
        if isinstance(output, Exception):
            raise output
        stream.finished = output.finished
        yield output
        if output.finished:
            return


async def merged(streams: list[Stream]) -> AsyncIterator[tuple[int, Any]]:
    """The outputs of several requests as they come, each with its request's index, each request's in order."""
    iterators = [outputs(stream) for stream in streams]
    waiting = {asyncio.ensure_future(anext(it)): index for index, it in enumerate(iterators)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.get):
                index = waiting.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                waiting[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, output
    finally:
        for task in waiting:
            task.cancel()


async def read_json(request: Request, limits: Limits) -> object:
    """The body as JSON, read no further than ``max_body_bytes`` (a longer one is refused as it arrives, whatever its
    Content-Length says) nor waited for longer than ``body_timeout`` between two parts, and refused if it nests too
    deeply for the parser or holds text that is not Unicode."""
    max_bytes, declared = limits.max_body_bytes, request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the body is {int(declared):,} bytes; this server takes at most {max_bytes:,}")
    chunks, size, parts = [], 0, request.stream()
    deadline = time.monotonic() + limits.body_seconds
    while True:
        left = deadline - time.monotonic()
        try:
            chunk = await asyncio.wait_for(anext(parts), min(limits.body_timeout, max(left, 0)))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            why = (f"nothing came for {limits.body_timeout:g} s" if left > limits.body_timeout
                   else f"it took longer than {limits.body_seconds:g} s in all")
            raise BodyTimeout(f"the body stalled: {why}") from None
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the body is over {max_bytes:,} bytes, the most this server takes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError:
        raise BadRequest("the body's JSON nests too deeply to parse: send a flatter body") from None
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as err:  # a lone surrogate ("\ud800"): JSON allows it, no tokenizer does
        raise BadRequest(f"the body holds text that is not valid Unicode ({err.reason}: "
                         f"{err.object[err.start:err.end]!r}): send well-formed UTF-16 pairs") from None
    return body


def check_cost(prompts: int, params: Any, limits: Limits) -> None:
    """A request that asks more than any request may, or more than the server can ever run at once: 400 at once,
    rather than 503 after part of it has run."""
    n = params.n
    if len(params.stop) > limits.max_stop:
        raise BadRequest(f"stop has {len(params.stop)} strings; this server takes at most {limits.max_stop}", "stop")
    if n > limits.max_n:
        raise BadRequest(f"n is {n}; this server gives at most {limits.max_n} samples of a prompt", "n")
    if prompts * n > limits.max_requests:
        raise BadRequest(f"this request asks for {prompts} prompt(s) x n={n} = {prompts * n} sequences, more than "
                         f"this server ever runs at once ({limits.max_requests}, --max-requests): split it", "n")


def refusal(err: Exception, chat: bool = False, body: object = None) -> JSONResponse:
    """The answer to a request the server could not take, by the reason; an error of the engine's that names a
    parameter names it as the request (a chat's or a completion's ``body``) spelled it."""
    if isinstance(err, json.JSONDecodeError):
        return error(400, f"the body is not valid JSON: {err}")
    if isinstance(err, (BodyTooLarge, BodyTimeout)):  # the rest of the body is not read: the connection ends here
        response = error(413 if isinstance(err, BodyTooLarge) else 408, str(err))
        response.headers["Connection"] = "close"
        return response
    if isinstance(err, ModelNotFound):
        return error(404, str(err), "model_not_found", "model")
    if isinstance(err, ValueError):  # BadRequest, or the engine refusing the request (too long, bad tokens, ...)
        param = openai_param(err.param, chat, body) if isinstance(err, InvalidParam) else getattr(err, "param", None)
        return error(400, str(err), param=param)  # param: the parameter to change, when one is at fault
    if isinstance(err, ServerBusy):
        response = error(503, str(err))
        response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response
    return error(500, f"the engine could not take the request: {err!r}")  # not the client's fault


async def disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body is read already: nothing else can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ReleasingStreamingResponse(StreamingResponse):
    """A streamed answer that releases its request however the stream ends: finished, failed or cut by the client.

    Starlette does not close the body's generator when a client disconnects mid-send, so
    the generator's own ``finally`` could wait for garbage collection; this cannot.
    """

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.release()


class RequireKey:
    """vLLM's --api-key: the /v1 routes want ``Authorization: Bearer KEY``, compared in constant time; /health stays
    open. Plain ASGI, not Starlette's BaseHTTPMiddleware, so that streams and disconnects pass through untouched."""

    def __init__(self, app: Callable, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refused = error(401, "this server wants an API key: send the header 'Authorization: Bearer <key>' "
                                     "with the key it was started with (--api-key or MILESTONES_API_KEY)",
                                "invalid_api_key")
                refused.headers["WWW-Authenticate"] = "Bearer"
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape: message, type, param (the request's parameter at fault, or None) and code (a name
    such as ``model_not_found``, or None)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


@contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, shutdown_grace: float = 1.0) -> Iterator[str]:
    """Serve the app on a thread of this process (port 0: any free one); yield its base URL, then shut it down.

    For tests and benchmarks, which want the server and its engine in reach. Open streams
    get ``shutdown_grace`` seconds to finish at shutdown, then are aborted.
    """
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=shutdown_grace,
                            http=header_deadline(app.state.limits.header_timeout))
    server = graceful_server(config)
    thread = threading.Thread(target=server.run, name="http-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=shutdown_grace + 60)


def header_deadline(seconds: float) -> type:
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline for each request's line and headers: a connection that has
    not sent them ``seconds`` after it opened, or after its last answer, gets 408 and is closed. Without it a client
    that opens sockets and sends nothing, or a header a minute, holds them for ever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.deadline = self.loop.call_later(seconds, self.headers_too_slow)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers have come: its body has a timeout of its own
                self.deadline.cancel()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request at once
            self.deadline.cancel()
            if not self.transport.is_closing() and self.idle():  # kept alive: the next request's headers are due
                self.deadline = self.loop.call_later(seconds, self.headers_too_slow)

        def idle(self) -> bool:
            """No request between its headers and its answer's end (the deadline is for headers only)."""
            return self.cycle is None or self.cycle.response_complete

        def connection_lost(self, exc: Exception | None) -> None:
            self.deadline.cancel()
            super().connection_lost(exc)

        def headers_too_slow(self) -> None:
            if not self.transport.is_closing() and self.idle():
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    return HeaderDeadline


def graceful_server(config: Any) -> Any:
    """uvicorn's server, except that at the end of its graceful shutdown every stream still open ends the way a
    failed one does, with an error event and ``[DONE]``, rather than being cut mid-chunk (uvicorn cancels what
    runs past ``timeout_graceful_shutdown``)."""
    import uvicorn

    class Graceful(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            grace = self.config.timeout_graceful_shutdown or 0
            engine_loop = self.config.app.state.engine_loop
            cutting = asyncio.get_running_loop().call_later(
                max(grace - 0.5, grace / 2), engine_loop.cut,  # before uvicorn's own deadline
                f"the server is shutting down: the stream was cut after --shutdown-grace {grace:g} s")
            try:
                await super().shutdown(sockets)
            finally:
                cutting.cancel()

    return Graceful(config)


# milestones.kernels.QUANTIZATIONS, written out so that the command line loads without torch (a test checks them)
QUANTIZATIONS = ("gguf", "int8")


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m milestones.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--milestone", choices=MILESTONES, default="m4")
    parser.add_argument("--model", help="a checkpoint folder or hub id (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="the name clients use (default: the model's folder name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    default = Limits()
    parser.add_argument("--max-requests", type=int, default=default.max_requests,
                        help="sequences in flight (a request's n samples count n) before 503")
    parser.add_argument("--max-n", type=int, default=default.max_n, help="samples of one prompt a request may ask")
    parser.add_argument("--max-body-bytes", type=int, default=default.max_body_bytes, help="the largest request body")
    parser.add_argument("--body-timeout", type=float, default=default.body_timeout,
                        help="seconds a request body may stall before 408")
    parser.add_argument("--header-timeout", type=float, default=default.header_timeout,
                        help="seconds a connection may take to send a request's line and headers before 408")
    parser.add_argument("--api-key", default=os.environ.get("MILESTONES_API_KEY"),
                        help="the key the /v1 routes want, as 'Authorization: Bearer KEY' (default: "
                             "$MILESTONES_API_KEY)")
    parser.add_argument("--shutdown-grace", type=float, default=30,
                        help="seconds open streams get to finish at shutdown before they are aborted")
    parser.add_argument("--engine-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an EngineConfig option, e.g. max_num_seqs=16 (repeatable; values are JSON or text)")
    parser.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                        help='m7: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (vLLM\'s flag)')
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="m8: split the model over N ranks, each a process holding a shard of every layer "
                             "(vLLM's flag); N must divide the model's attention heads and MLP width")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="keep the weights quantized: gguf, the bundled file's 4-bit blocks; int8, made at load "
                             "(CPU, float32)")
    return parser


# The options that are a later milestone's lesson: the first milestone that takes each, and what it teaches
LATER_OPTIONS = {"speculative_config": ("m7", "speculative decoding"),
                 "tensor_parallel_size": ("m8", "tensor parallelism")}


def engine_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, object]:
    """The engine's options from the command line. A flag the milestone does not take (--tensor-parallel-size 2 with
    m7) is refused as a command-line error, before anything loads."""
    options = dict(_engine_option(text) for text in args.engine_option)
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.speculative_config is not None:
        options["speculative_config"] = args.speculative_config
    if args.tensor_parallel_size > 1:  # 1 is every milestone's way: one process, the whole model
        options["tensor_parallel_size"] = args.tensor_parallel_size
    if args.quantization is not None:  # None: every milestone's way, the weights in the engine's dtype
        options["quantization"] = args.quantization
    for name, (first, lesson) in LATER_OPTIONS.items():
        if name in options and MILESTONES.index(args.milestone) < MILESTONES.index(first):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} needs --milestone {first} or later ({lesson} is {first}'s lesson); "
                         f"{args.milestone} has no {name}")
    return options


def load_llm(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The milestone's LLM with the command line's options; an option the engine refuses (a tensor-parallel size
    that does not divide the model's heads, say) is a command-line error with the engine's message."""
    options = engine_options(parser, args)
    try:
        return importlib.import_module(f"milestones.{args.milestone}").LLM(args.model, **options)
    except ValueError as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = command_line()
    args = parser.parse_args(argv)
    llm = load_llm(parser, args)  # m8 with --tensor-parallel-size N: rank 0 here, and N - 1 worker processes
    name = args.served_model_name or _default_name(args.model)
    if args.api_key is None and not _is_loopback(args.host):
        logger.warning("serving on %s with no --api-key: anyone who reaches this address can use the model", args.host)
    limits = limits_from(args)
    config = uvicorn.Config(create_app(llm, name, limits=limits, api_key=args.api_key), host=args.host, port=args.port,
                            timeout_graceful_shutdown=args.shutdown_grace, http=header_deadline(limits.header_timeout))
    graceful_server(config).run()


def limits_from(args: argparse.Namespace) -> Limits:
    """The command line's limits (the others keep Limits' defaults)."""
    return Limits(max_requests=args.max_requests, max_n=args.max_n, max_body_bytes=args.max_body_bytes,
                  body_timeout=args.body_timeout, header_timeout=args.header_timeout)


def _is_loopback(host: str) -> bool:
    """127.0.0.1, ::1 and localhost reach this machine only; anything else (0.0.0.0 included) may reach others."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _engine_option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--engine-option takes NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _default_name(model: str | None) -> str:
    return "SmolLM2-135M-Instruct" if model is None else model.rstrip("/").rsplit("/", 1)[-1]


if __name__ == "__main__":
    main()
