"""Serve any milestone over an OpenAI-compatible HTTP API.

    python -m milestones.serve --milestone m4 [--model PATH] [--host 127.0.0.1] [--port 8000]
    make serve M=m4

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /health``. Every client's
requests go to one engine, stepped on its own thread (``EngineLoop``), so requests from
many clients are batched together: m1 serves them one at a time, m2 onwards together.

Bad input gets a 400 with the engine's own message and never reaches a step; a server
with ``--max-requests`` requests in flight answers 503; a client that disconnects
mid-stream has its request aborted and its KV blocks freed before the next step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from milestones import MILESTONES
from milestones.engine_loop import EngineLoop, ServerBusy
from milestones.openai_api import Answer, parse_request


def create_app(llm, model_name: str, max_requests: int = 256) -> FastAPI:
    """An app that serves ``llm`` (any milestone's ``LLM``) as ``model_name``."""
    sampling_params = importlib.import_module(type(llm).__module__.rsplit(".", 1)[0]).SamplingParams
    engine_loop = EngineLoop(llm, max_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        yield
        engine_loop.stop()  # aborts what is still running: every open stream gets its end

    app = FastAPI(title="milestones", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    async def serve(request: Request, chat: bool):
        try:
            job = parse_request(await request.json(), chat, model_name, llm.tokenizer, sampling_params)
            stream = await engine_loop.submit(job.prompt, job.params)
        except json.JSONDecodeError as err:
            return error(400, f"the body is not valid JSON: {err}")
        except ValueError as err:  # BadRequest, or the engine refusing the request (too long, bad tokens, ...)
            return error(400, str(err))
        except ServerBusy as err:
            return error(503, str(err))
        answer = Answer(job, stream.request_id, model_name)
        if job.stream:
            return StreamingResponse(events(stream, answer), media_type="text/event-stream")
        try:
            async for output in outputs(stream):
                answer.update(output)
        except RuntimeError as err:
            return error(500, str(err))
        finally:
            if not answer.finished:
                engine_loop.abort(stream.request_id)
            engine_loop.finished(stream)
        return JSONResponse(answer.whole())

    async def outputs(stream):
        while True:
            output = await stream.outputs.get()
            if isinstance(output, Exception):
                raise output
            yield output
            if output.finished:
                return

    async def events(stream, answer):
        try:
            async for output in outputs(stream):
                delta = answer.update(output)
                if delta is not None:
                    yield f"data: {json.dumps(delta)}\n\n"
            if job_usage := answer.usage_chunk():
                yield f"data: {json.dumps(job_usage)}\n\n"
            yield "data: [DONE]\n\n"
        except RuntimeError as err:
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
        finally:  # also when the client disconnects: the stream is closed, and the request must not run on
            if not answer.finished:
                engine_loop.abort(stream.request_id)
            engine_loop.finished(stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "milestones",
                                            "created": 0, "max_model_len": llm.engine.config.max_model_len}]}

    @app.get("/health")
    async def health():
        if not engine_loop.is_alive():
            return error(503, "the engine loop has stopped")
        return {"status": "ok", "requests_in_flight": engine_loop.num_in_flight}

    return app


def error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


@contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, shutdown_grace: float = 1.0) -> Iterator[str]:
    """Serve the app on a thread of this process (port 0: any free one); yield its base URL, then shut it down.

    For tests and benchmarks, which want the server and its engine in reach. Open streams
    get ``shutdown_grace`` seconds to finish at shutdown, then are aborted.
    """
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=shutdown_grace)
    server = uvicorn.Server(config)
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


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m milestones.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--milestone", choices=MILESTONES, default="m4")
    parser.add_argument("--model", help="a checkpoint folder or hub id (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="the name clients use (default: the model's folder name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-requests", type=int, default=256, help="requests in flight before 503")
    parser.add_argument("--shutdown-grace", type=float, default=30,
                        help="seconds open streams get to finish at shutdown before they are aborted")
    parser.add_argument("--engine-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an EngineConfig option, e.g. max_num_seqs=16 (repeatable; values are JSON or text)")
    args = parser.parse_args(argv)
    options = dict(_engine_option(text) for text in args.engine_option)
    llm = importlib.import_module(f"milestones.{args.milestone}").LLM(args.model, **options)
    name = args.served_model_name or _default_name(args.model)
    uvicorn.run(create_app(llm, name, args.max_requests), host=args.host, port=args.port,
                timeout_graceful_shutdown=args.shutdown_grace)


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
