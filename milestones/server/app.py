"""The FastAPI app: its routes, each answering in OpenAI's shape, and the API key that closes ``/v1``.

Routes: ``POST /v1/completions`` (a prompt, or a batch of prompts: a choice each),
``POST /v1/chat/completions`` (streamed as server-sent events with ``"stream": true``),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus);
errors in OpenAI's shape on every route. Every client's requests go to one engine, stepped on
its own thread (``EngineLoop``), so requests from many clients are batched together: m1
serves them one at a time, m2 onwards together.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from milestones.engine_loop import EngineLoop, ServerBusy, Stream
from milestones.metrics import ServerMetrics, snapshot
from milestones.server.answer import Answer, whole
from milestones.server.errors import error, refusal
from milestones.server.limits import Limits, check_cost, read_json
from milestones.server.request import parse_request
from milestones.server.streaming import ReleasingStreamingResponse, collect_answers, disconnected, events
from milestones.server.tokenizing import Tokenizing


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


class RequireKey:
    """vLLM's --api-key: the /v1 routes want ``Authorization: Bearer KEY``, compared in constant time; /health stays
    open. Plain ASGI, not Starlette's BaseHTTPMiddleware, so that streams and disconnects pass through untouched."""

    def __init__(self, app: Callable, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
