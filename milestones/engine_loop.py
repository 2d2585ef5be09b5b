"""One engine, many clients: the engine runs on a thread of its own and batches every client's requests.

The HTTP server's handlers run on an asyncio event loop and must never wait for a
forward pass, so they hand their work to the ``EngineLoop``'s thread through a queue:
add this request, abort that one. Between two steps the thread takes those commands,
then calls ``engine.step()``, which advances every running request together (that is
where continuous batching shows), and sends each request's output to the client that
waits for it. Only this thread touches the engine, so it works for every milestone,
m1 included (whose scheduler runs one request at a time).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class ServerBusy(Exception):
    """Too many requests in flight: the client should retry later (HTTP 503)."""


@dataclass(slots=True)
class Stream:
    """What a client waits on: the request's outputs as they come, then its end."""

    request_id: str
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput, or an exception that ends it


class EngineLoop:
    def __init__(self, llm, max_requests: int = 256) -> None:
        self.llm, self.engine = llm, llm.engine
        self.max_requests = max_requests
        self.streams: dict[str, tuple[Stream, asyncio.AbstractEventLoop]] = {}  # touched by the engine thread only
        self.commands: queue.Queue = queue.Queue()
        self.num_in_flight = 0  # requests accepted and not yet finished; counted on the event loop's side
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    async def submit(self, prompt: str | list[int], params) -> Stream:
        """Queue a request; raises ValueError (bad input, with the engine's message) or ServerBusy."""
        if self.num_in_flight >= self.max_requests:
            raise ServerBusy(f"the server already has {self.num_in_flight} requests in flight "
                             f"(--max-requests {self.max_requests}): retry later")
        stream = Stream(f"req-{next(self._ids)}")
        accepted = asyncio.get_running_loop().create_future()
        self.num_in_flight += 1
        self.commands.put(("add", stream, asyncio.get_running_loop(), accepted, prompt, params))
        try:
            await accepted  # the engine's add_request has validated the request
        except BaseException as err:
            self.num_in_flight -= 1
            if not isinstance(err, ValueError):  # the client went away while it waited: do not run it for nobody
                self.abort(stream.request_id)
            raise
        return stream

    def finished(self, stream: Stream) -> None:
        """The client has seen the request's end (or gone): free its place in the count."""
        self.num_in_flight -= 1

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); its KV blocks are freed before the next step. Never blocks."""
        self.commands.put(("abort", request_id))

    def stop(self) -> None:
        """Abort whatever is still running, end every stream, and stop the thread."""
        self._stopping.set()
        self.commands.put(("wake",))
        self.thread.join()

    # --8<-- [start:run]
    def _run(self) -> None:
        while not self._stopping.is_set():
            idle = not self.engine.has_unfinished_requests()
            try:
                command = self.commands.get(timeout=0.5) if idle else self.commands.get_nowait()
            except queue.Empty:
                command = None
            if command is not None:
                self._apply(command)
                continue  # take every waiting command before the next step
            if not idle:
                self._step()
        for request_id in list(self.streams):
            self._apply(("abort", request_id))
        close = getattr(self.llm, "close", None)  # m6: processes the steps in flight, stops its forward worker
        if close is not None:
            close()

    # --8<-- [end:run]

    def _apply(self, command: tuple) -> None:
        kind, *args = command
        if kind == "add":
            stream, loop, accepted, prompt, params = args
            try:
                self.engine.add_request(prompt, params, request_id=stream.request_id)
            except ValueError as err:  # bad input: the engine refused it before queueing anything
                loop.call_soon_threadsafe(_settle, accepted, err)
                return
            self.streams[stream.request_id] = (stream, loop)
            loop.call_soon_threadsafe(_settle, accepted, None)
        elif kind == "abort":
            request_id = args[0]
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._deliver(output)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # a failed forward: end every request in flight, keep serving the next ones
            logger.exception("a step failed; ending the requests in flight")
            for request_id, (stream, loop) in list(self.streams.items()):
                self.engine.abort_request(request_id)
                loop.call_soon_threadsafe(stream.outputs.put_nowait, RuntimeError(f"the engine failed: {err}"))
                del self.streams[request_id]
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output) -> None:
        entry = self.streams.get(output.request_id)
        if entry is None:
            return
        stream, loop = entry
        loop.call_soon_threadsafe(stream.outputs.put_nowait, output)
        if output.finished:
            del self.streams[output.request_id]


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # the client may have gone while it waited
        future.set_exception(error) if error is not None else future.set_result(None)
