"""The app on a socket: uvicorn, with a deadline for each request's headers and a shutdown that ends open streams
cleanly; ``running`` serves it on a thread of this process, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI


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
