"""One engine, many clients: the engine runs on a thread of its own and batches every client's requests.

The HTTP server's handlers run on an asyncio event loop and must never wait for a
forward pass, so they hand their work to the ``EngineLoop``'s thread through a queue:
add this request, abort that one. Between two steps the thread takes the commands
waiting, then calls ``engine.step()``, which advances every running request together
(that is where continuous batching shows), and sends each request's output to the
client that waits for it. Only this thread touches the engine, so it works for every
milestone, m1 included, whose scheduler runs one request at a time. The server hands it
token ids: tokenizing, which a long prompt or conversation makes slow, happens elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class ServerBusy(Exception):
    """Too many requests in flight, or the engine loop has stopped: the client should retry later (HTTP 503)."""


@dataclass(slots=True, eq=False)
class Stream:
    """What a client waits on: the request's outputs as they come, then its end."""

    request_id: str
    weight: int = 1  # the sequences it runs (its n samples): what it counts toward --max-requests
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput, or an exception that ends it
    finished: bool = False  # the client has seen the request's last output
    released: bool = False  # its place in the count is given back (once)


class EngineLoop:
    def __init__(self, llm: Any, max_requests: int = 256, metrics: Any = None) -> None:
        self.llm, self.engine = llm, llm.engine
        self.max_requests = max_requests
        self.metrics = metrics  # milestones.metrics.ServerMetrics: told of each request added and each output
        self.streams: dict[str, tuple[Stream, asyncio.AbstractEventLoop]] = {}  # touched by the engine thread only
        self.commands: queue.Queue = queue.Queue()
        self.num_in_flight = 0  # sequences accepted and not yet released (n each); counted on the event loop's side
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._closed, self._closing = False, threading.Lock()  # no add or call queued once the last drain began
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    async def submit(self, prompt: Prompt, params: Any, arrived: float | None = None) -> Stream:
        """Queue a request; raises ValueError (bad input, with the engine's message) or ServerBusy. ``arrived``: when
        its HTTP request came (time.monotonic()), for its time to first token; default now."""
        if not self.is_alive():
            raise ServerBusy("the engine loop has stopped: this server cannot take requests")
        weight = getattr(params, "n", 1)
        if self.num_in_flight + weight > self.max_requests:
            raise ServerBusy(f"the server already has {self.num_in_flight} sequences in flight and this request adds "
                             f"{weight} (--max-requests {self.max_requests}): retry later")
        loop = asyncio.get_running_loop()
        stream, accepted = Stream(f"req-{next(self._ids)}", weight), loop.create_future()
        self._queue(("add", stream, loop, accepted, prompt, params, time.monotonic() if arrived is None else arrived))
        self.num_in_flight += weight
        try:
            await accepted  # the engine's add_request has validated the request
        except BaseException:
            self.release(stream)  # refused, or cancelled at shutdown: never run it for nobody
            raise
        return stream

    async def call(self, function: Callable[[Any], Any]) -> Any:
        """``function(engine)``, run on the engine's thread between two steps (reading its state safely)."""
        if not self.is_alive():
            raise ServerBusy("the engine loop has stopped")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queue(("call", loop, done, function))
        return await done

    def _queue(self, command: tuple) -> None:
        """Queue a command that waits for an answer, unless the loop has drained its queue for the last time (then
        nothing would ever answer it)."""
        with self._closing:
            if self._closed:
                raise ServerBusy("the engine loop has stopped: this server cannot take requests")
            self.commands.put(command)

    def release(self, stream: Stream) -> None:
        """The client is done with the request, at its end or because it went away (then it is aborted). Idempotent."""
        if stream.released:
            return
        stream.released = True
        self.num_in_flight -= stream.weight
        if not stream.finished:
            self.commands.put(("abort", stream.request_id))  # taken before the next step: its KV blocks are freed

    def cut(self, reason: str) -> None:
        """End every open request now, before the next step: each stream gets ``reason`` as its error (the server is
        shutting down), and the log one line each."""
        self.commands.put(("cut", reason))

    def stop(self) -> None:
        """Abort whatever is still running, end every stream, and stop the thread (blocks until it has)."""
        self._stopping.set()
        self.commands.put(("wake",))
        self.thread.join()

    # --8<-- [start:run]
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._take_commands(wait=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as err:  # a bug in the engine: fail loudly to every client rather than leave them waiting
            logger.exception("the engine loop failed")
            self._end_everything(RuntimeError(f"the engine loop failed: {err!r}"))
            raise
        self._end_everything(None)
        close = getattr(self.llm, "close", None)  # m6: processes the steps in flight, stops its forward worker
        if close is not None:
            close()

    def _take_commands(self, wait: bool) -> None:
        """Apply the commands waiting now (the ones arriving meanwhile wait for the next round: steps go on)."""
        try:
            self._apply(self.commands.get(timeout=0.5) if wait else self.commands.get_nowait())
        except queue.Empty:
            return
        for _ in range(self.commands.qsize()):
            self._apply(self.commands.get_nowait())
    # --8<-- [end:run]

    def _apply(self, command: tuple) -> None:
        kind, *args = command
        if kind == "add":
            stream, loop, accepted, prompt, params, arrived = args
            try:
                self.engine.add_request(prompt, params, request_id=stream.request_id)
            except Exception as err:  # ValueError: bad input, refused before anything was queued
                _call_soon(loop, _settle, accepted, err)
                return
            self.streams[stream.request_id] = (stream, loop)
            if self.metrics is not None:
                self.metrics.added(stream.request_id, arrived)
            _call_soon(loop, _settle, accepted, None)
        elif kind == "abort":
            output = self.engine.abort_request(args[0])
            if output is not None:
                self._deliver(output)
        elif kind == "cut":
            self._end_streams(RuntimeError(args[0]), log=True)
        elif kind == "call":
            loop, done, function = args
            try:
                _call_soon(loop, _settle, done, None, function(self.engine))
            except Exception as err:
                _call_soon(loop, _settle, done, err)
        # "wake" only ends the wait for a command, so that the loop sees it must stop

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # a failed forward: end every request in flight, keep serving the next ones
            logger.exception("a step failed; ending the requests in flight")
            self._end_streams(RuntimeError(f"the engine failed: {err}"), log=False)
            return
        for output in outputs:
            self._deliver(output)

    def _end_streams(self, error: RuntimeError, log: bool) -> None:
        """Abort every open request and end its stream with ``error`` (its tokens still counted in the metrics);
        with ``log``, a line per request."""
        for request_id, (stream, loop) in list(self.streams.items()):
            output = self.engine.abort_request(request_id)
            if output is not None and self.metrics is not None:
                self.metrics.delivered(output)
            if log:
                tokens = 0 if output is None else sum(len(c.token_ids) for c in output.outputs)
                logger.warning("%s cut after %d tokens: %s", request_id, tokens, error)
            _call_soon(loop, stream.outputs.put_nowait, error)
        self.streams.clear()

    def _deliver(self, output: Any) -> None:
        if self.metrics is not None:
            self.metrics.delivered(output)
        entry = self.streams.get(output.request_id)
        if entry is None:
            return
        stream, loop = entry
        _call_soon(loop, stream.outputs.put_nowait, output)
        if output.finished:
            del self.streams[output.request_id]

    def _end_everything(self, error: Exception | None) -> None:
        """At the end of the loop: abort every request, end every stream, refuse every add still queued."""
        for request_id, (stream, loop) in list(self.streams.items()):
            if error is None:
                output = self.engine.abort_request(request_id)
                if output is not None:
                    self._deliver(output)
                    continue
            _call_soon(loop, stream.outputs.put_nowait, error or RuntimeError("the server is shutting down"))
        self.streams.clear()
        with self._closing:
            self._closed = True
        while True:
            try:
                kind, *args = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind in ("add", "call"):  # (add, stream, loop, future, ...) and (call, loop, future, function)
                loop, future = (args[1], args[2]) if kind == "add" else (args[0], args[1])
                _call_soon(loop, _settle, future, ServerBusy("the server is shutting down"))


def _settle(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    if not future.done():  # the client may have gone while it waited
        future.set_exception(error) if error is not None else future.set_result(result)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args: Any) -> None:
    """``call_soon_threadsafe``, unless the event loop is already closed (the server is gone: nobody waits)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass
