"""Worker processes a parent starts, hears from and stops, however either of them ends.

Each worker is spawned (a fresh interpreter: safe with CUDA and threads) with a pipe to its parent. It says
"started" once it runs, then loads what it needs and says "ready", or sends the traceback of what failed;
then it serves until told to stop. A worker ignores Ctrl-C (its parent decides what an interrupt means) and
ends when its parent does, however the parent ends (a thread waits on the parent's sentinel). The parent
names a worker that sent a traceback, exited or stayed silent, stops them all together, and kills any that
does not stop in time.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import NoReturn

import torch

START_TIMEOUT = 300.0  # seconds for a worker to import torch and report (minutes on a loaded machine)
STOP_TIMEOUT = 10.0  # seconds a worker has to finish before it is killed


# --8<-- [start:child]
def run_child(load: Callable[..., Callable[[], None]], args: tuple, pipe: Connection) -> None:
    """A worker process's life: say it started, ``load(*args)`` (which returns what the worker then serves), say
    it is ready or send what failed, serve. It ends with its parent, whatever way that ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (wait([parent.sentinel]), os._exit(1)), daemon=True).start()  # orphaned: end
    try:
        pipe.send("started")
        serve = load(*args)
    except BaseException:
        pipe.send(traceback.format_exc())
        return
    pipe.send("ready")
    serve()
# --8<-- [end:child]


@dataclass(slots=True)
class WorkerProcesses:
    """A parent's handles on the worker processes it started: one process and one pipe each, numbered from
    ``first``. A subclass says how to tell its workers to stop (``tell_stop``)."""

    name: str  # what a worker is, in errors: "tensor-parallel rank" gives "tensor-parallel rank 1 has exited"
    first: int = 1  # the first worker's number (m8: rank 1, the parent being rank 0)
    processes: list[multiprocessing.Process] = field(default_factory=list)
    pipes: list[Connection] = field(default_factory=list)
    threads_before: int | None = None  # the caller's torch thread count, given back on close
    caller: int = field(default_factory=threading.get_ident)  # the thread that set the parent's share
    broken: bool = False  # a step failed midway: the workers are at different points of it, none would read a message
    closed: bool = False

    def start(self, load: Callable[..., Callable[[], None]], *args: object) -> None:
        """Spawn a worker that runs ``load(*args)`` and then what it returns (``run_child``)."""
        context = multiprocessing.get_context("spawn")
        pipe, child_pipe = context.Pipe()
        number = self.first + len(self.processes)
        process = context.Process(target=run_child, name=f"{self.name.replace(' ', '-')}-{number}", daemon=True,
                                  args=(load, args, child_pipe))
        process.start()
        child_pipe.close()
        self.processes.append(process)
        self.pipes.append(pipe)

    def share_threads(self, threads: int) -> None:
        """Run the parent with ``threads`` torch threads (its share of the cores) until ``close`` gives the
        caller's count back."""
        if self.threads_before is None:
            self.threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)

    def wait_for(self, message: str, timeout: float | None = START_TIMEOUT) -> None:
        """Wait until every worker has sent ``message``; if one sends a traceback, dies or is silent for ``timeout``
        seconds, stop them all and raise what happened."""
        for number, (process, pipe) in enumerate(zip(self.processes, self.pipes), start=self.first):
            heard = wait([pipe, process.sentinel], timeout)  # empty: silent for ``timeout`` seconds
            try:
                got = pipe.recv() if heard and pipe.poll() else None
            except EOFError:  # it died without a word
                got = None
            if got != message:
                if heard and got is None:
                    process.join(1.0)  # it died: its pipe closes a moment before its exit code can be read
                exitcode = process.exitcode  # before close() kills a silent one
                self.close()
                if got is not None:
                    raise RuntimeError(f"{self.name} {number} failed while starting:\n{got}")
                if exitcode is not None:
                    raise RuntimeError(f"{self.name} {number} exited with code {exitcode} while starting; "
                                       "its output above says why. (A worker is spawned: it imports the script that "
                                       "made the LLM, which must do so under if __name__ == '__main__':)")
                raise RuntimeError(f"{self.name} {number} did not report {message!r} within {timeout} s")

    def stopped(self) -> str | None:
        """Which worker has exited, and how; None while all run."""
        for number, process in enumerate(self.processes, start=self.first):
            if process.exitcode is not None:
                return f"{self.name} {number} has exited (code {process.exitcode})"
        return None

    def tell_stop(self) -> None:
        """Ask every worker to finish what it does and end (how is the subclass's: m8 sends a step of None)."""
        raise NotImplementedError

    def abandon(self, error: BaseException, what: str) -> NoReturn:
        """``what`` failed midway: the workers are at different points of it, and each may wait for the others
        where they will never come. Kill them all at once and raise why; Ctrl-C stays Ctrl-C."""
        reason = self.stopped() or f"{what} failed"
        self.broken = True
        self.close()
        if not isinstance(error, Exception):
            raise error
        raise RuntimeError(f"{reason}, so every {self.name} was stopped: close this LLM and create a new one "
                           f"({error})") from error

    def close(self) -> None:
        """Tell the workers to stop, give them ``STOP_TIMEOUT`` seconds, then kill any still running (at once if
        ``broken``). Closing again does nothing: the caller's thread count comes back only if the first close runs
        in the thread that set the share (see below)."""
        if self.closed:
            return
        self.closed = True
        if not self.broken and self.stopped() is None:
            try:
                self.tell_stop()
            except RuntimeError:  # a worker is gone or stuck: the kill below ends the others
                pass
        deadline = time.monotonic() + (0.0 if self.broken else STOP_TIMEOUT)  # one for all, not one each
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        # A thread's count is its own (OpenMP's): given back only in the thread that lowered it. Closed from another
        # (a server's engine loop), the process keeps the share, so that every thread runs with the same count (a
        # step captured by torch.compile in one thread and replayed in another must find the one it was made with).
        if self.threads_before is not None and threading.get_ident() == self.caller:
            torch.set_num_threads(self.threads_before)
