"""The engine's outputs carried to the client: merged across a request's prompts, fed to its answers, and sent as
one body or as server-sent events; a request is released however its answer ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from milestones.engine_loop import Stream
from milestones.server.answer import Answer, usage_chunk


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

async def collect_answers(streams: list[Stream], answers: list[Answer]) -> None:
    """Every output fed to its prompt's answers (n each), for an answer sent in one body."""
    n = len(answers) // len(streams)
    async for index, output in merged(streams):
        for answer in answers[index * n : (index + 1) * n]:
            answer.update(output)


async def events(streams: list[Stream], answers: list[Answer]) -> AsyncIterator[str]:
    """The answers as server-sent events, a chunk per change, then the usage (if asked) and ``[DONE]``."""
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.release()
