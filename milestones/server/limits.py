"""What one request may cost the server, bounded before any of it reaches the engine: its body's size and time, its
samples, its stop strings, and its sequences against what the server can ever run at once."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from milestones.server.errors import BadRequest, BodyTimeout, BodyTooLarge


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
