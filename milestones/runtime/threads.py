"""A thread that computes what it is handed, in order, or the caller's thread inline: m6's forward worker's
plumbing (which thread, its torch thread count, a dead thread reported, a clean stop), apart from its lesson
(what a step computes, and when the host waits for it)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")
STOP = object()  # put by close(): the thread ends when it takes it (any item, None included, is computed)


class InOrderThread(Generic[Item, Result]):
    """Computes items one after another, in the order they are put, on a thread of its own (``threaded``) or inline,
    inside ``put``; results come out in the same order. A thread that dies is reported, never waited for."""

    def __init__(self, compute: Callable[[Item], Result], name: str, threaded: bool,
                 on_thread: Callable[[], None] = lambda: None) -> None:
        self.compute, self.name, self.on_thread = compute, name, on_thread
        self.results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self.inbox: queue.SimpleQueue[Item | object] = queue.SimpleQueue()
        self.closed = False
        self.thread = None
        if threaded:
            # A new thread starts with torch's default thread count, not the caller's: pass it on.
            self.thread = threading.Thread(target=self._loop, args=(torch.get_num_threads(),),
                                           name=name.replace(" ", "-"), daemon=True)
            self.thread.start()

    def put(self, item: Item) -> None:
        """Hand an item over; inline, it is computed before this returns. Refused once closed."""
        if self.closed:
            raise RuntimeError("the engine is closed: create a new LLM to generate again")
        if self.thread is None:
            self.results.put(self.compute(item))
        else:
            self.inbox.put(item)

    def get(self) -> Result:
        """The oldest result not taken yet, waiting for it."""
        while True:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError(f"the {self.name} has stopped: close this LLM and create a new one") from None

    def _loop(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        self.on_thread()
        while (item := self.inbox.get()) is not STOP:
            self.results.put(self.compute(item))

    def close(self) -> None:
        """Stop the thread once it has computed what it was given; later items are refused."""
        self.closed = True
        if self.thread is not None and self.thread.is_alive():
            self.inbox.put(STOP)
            self.thread.join()
