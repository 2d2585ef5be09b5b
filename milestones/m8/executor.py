"""Start the other ranks, watch them, stop them: m8's worker processes (vLLM's executor, in small).

With ``tensor_parallel_size`` N > 1 the engine is rank 0 and starts N - 1 processes (``spawn``:
a fresh interpreter each, safe with CUDA and threads). Each says it has started, joins the
ranks' groups through a store that rank 0 opened on a free port, loads its shard of the model,
says it is ready (or sends the traceback of what failed), then runs the steps rank 0 sends
until told to stop. A worker ignores Ctrl-C (rank 0 decides what an interrupt means) and
exits when its parent does, however the parent ends.

Under ``torchrun`` the processes already exist, on one machine or several: each joins
through torchrun's rendezvous, and every rank but 0 serves steps inside ``LLM(...)`` and
ends its process when rank 0 closes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

from .config import EngineConfig
from .distributed import SINGLE, TensorParallel, join, torchrun_store, torchrun_world_size
from .model import ModelConfig
from .model_runner import ModelRunner

START_TIMEOUT = 300.0  # seconds for a worker to import torch and report (minutes on a loaded machine)
STOP_TIMEOUT = 10.0  # seconds a worker has to finish before it is killed


# --8<-- [start:start_ranks]
def start_ranks(config: EngineConfig, model_config: ModelConfig, path: Path) -> Workers | None:
    """Rank 0's handle on the other ranks, with its place among them (None: one rank, no group)."""
    size, world_size = config.tensor_parallel_size, torchrun_world_size()
    # Under torchrun, its processes are the ranks (a job of one too: the NCCL path on one GPU). One rank in a bigger
    # job is data parallelism, each process an engine of its own: m7 exactly, as without torchrun.
    if world_size is not None and (size > 1 or world_size == 1):
        if world_size != size:
            raise ValueError(f"torchrun started {world_size} processes but tensor_parallel_size is {size}: "
                             "pass --nproc-per-node (times --nnodes) equal to it")
        store, rank = torchrun_store()
        tp = join(store, rank, size, config.device)
        if rank > 0:  # every rank but 0 serves steps here and never returns to the script
            serve(replace(config, device=rank_device(config.device, int(os.environ["LOCAL_RANK"]))), model_config,
                  path, tp)
            sys.exit(0)
        return Workers([], [], tp)  # torchrun's processes: rank 0 waits for them to load, then tells them to stop
    if size == 1:
        return None
    threads = torch.get_num_threads()
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)  # port 0: a free one
    context = multiprocessing.get_context("spawn")
    workers = Workers([], [], threads_before=threads)
    threads = max(1, threads // size) if config.device.type == "cpu" else threads  # each rank's share of the cores
    try:  # whatever fails or is interrupted from here on, no worker is left behind
        for rank in range(1, size):
            pipe, child_pipe = context.Pipe()
            process = context.Process(target=run_worker, name=f"tensor-parallel-rank-{rank}", daemon=True, args=(
                rank, store.port, replace(config, device=rank_device(config.device, rank)), model_config, path,
                threads, child_pipe))
            process.start()
            child_pipe.close()
            workers.processes.append(process)
            workers.pipes.append(pipe)
        workers.wait_for("started", START_TIMEOUT)
        torch.set_num_threads(threads)  # rank 0's share too, until close() gives the caller's back
        workers.tp = join(store, 0, size, config.device)
    except BaseException:
        workers.close()
        raise
    return workers
# --8<-- [end:start_ranks]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A rank's device: the CPU for all of them, or the GPU after rank 0's for each next rank."""
    return device if device.type == "cpu" else torch.device("cuda", (device.index or 0) + rank)


# --8<-- [start:run_worker]
def run_worker(rank: int, port: int, config: EngineConfig, model_config: ModelConfig, path: Path, threads: int,
               pipe: Connection) -> None:
    """A worker process: join the ranks, load this rank's shard, say so, then serve steps until rank 0 stops. On a
    CPU the ranks share the cores (``threads`` each), or their threads would wait on each other at every operation."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (wait([parent.sentinel]), os._exit(1)), daemon=True).start()  # orphaned: end
    try:
        torch.set_num_threads(threads)
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)
        pipe.send("started")
        store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False,
                              timeout=timedelta(seconds=START_TIMEOUT))
        tp = join(store, rank, config.tensor_parallel_size, config.device)
        runner = ModelRunner(config, model_config, path, tp)
    except BaseException:
        pipe.send(traceback.format_exc())
        return
    pipe.send("ready")
    runner.serve()


def serve(config: EngineConfig, model_config: ModelConfig, path: Path, tp: TensorParallel) -> None:
    """Under torchrun, every rank but 0: load this rank's shard and run the steps rank 0 sends until it stops."""
    if config.device.type == "cuda":
        torch.cuda.set_device(config.device)
    runner = ModelRunner(config, model_config, path, tp)
    tp.messages.barrier().wait()  # loaded: rank 0 sends no step before every rank can take it
    runner.serve()
# --8<-- [end:run_worker]


@dataclass(slots=True)
class Workers:
    """Rank 0's handles on the worker processes it started: one process and one pipe per rank after 0."""

    processes: list[multiprocessing.Process]
    pipes: list[Connection]
    tp: TensorParallel = SINGLE
    threads_before: int | None = None  # the caller's torch thread count, given back on close
    caller: int = field(default_factory=threading.get_ident)  # the thread that set rank 0's share
    broken: bool = False  # a step failed midway: the ranks are at different points of it, none would read a message

    def wait_for(self, message: str, timeout: float | None) -> None:
        """Wait until every worker has sent ``message``; if one sends a traceback, dies or is silent for ``timeout``
        seconds, stop them all and raise what happened. Under torchrun (no processes of rank 0's), "ready" is the
        other ranks' barrier after loading."""
        if not self.processes:
            if message == "ready":
                self.tp.messages.barrier().wait()
            return
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), start=1):
            try:
                got = pipe.recv() if wait([pipe, process.sentinel], timeout) and pipe.poll() else None
            except EOFError:  # it died without a word
                got = None
            if got != message:
                self.close()
                if got is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed while starting:\n{got}")
                if process.exitcode is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {process.exitcode} while "
                                       "starting; its output above says why. (A worker is spawned: it imports the "
                                       "script that made the LLM, which must do so under if __name__ == '__main__':)")
                raise RuntimeError(f"tensor-parallel rank {rank} did not report {message!r} within {timeout} s")

    def stopped(self) -> str | None:
        """Which worker has exited, and how; None while all run."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"tensor-parallel rank {rank} has exited (code {process.exitcode})"
        return None

    def close(self) -> None:
        """Tell the workers to stop, give them ``STOP_TIMEOUT`` seconds, then kill any still running (at once if
        ``broken``)."""
        if self.tp.messages is not None and not self.broken and self.stopped() is None:
            try:
                self.tp.send_step(None)
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
