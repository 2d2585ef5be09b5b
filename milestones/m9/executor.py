"""Start the other ranks, and stop them: m8's worker processes (vLLM's executor, in small).

With ``tensor_parallel_size`` N > 1 the engine is rank 0 and starts N - 1 processes. Each
joins the ranks' groups through a store that rank 0 opened on a free port, loads its shard of
the model, then runs the steps rank 0 sends until told to stop. Starting, hearing that a
worker is ready, naming one that died and stopping them all is ``milestones.runtime``'s
(``WorkerProcesses``): no lesson of m8's.

Under ``torchrun`` the processes already exist, on one machine or several: each joins
through torchrun's rendezvous, and every rank but 0 serves steps inside ``LLM(...)`` and
ends its process when rank 0 closes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from milestones.runtime.processes import START_TIMEOUT, WorkerProcesses
from milestones.runtime.torchrun import local_rank, torchrun_store, torchrun_world_size

from .config import EngineConfig
from .distributed import SINGLE, TensorParallel, join
from .model import ModelConfig
from .model_runner import ModelRunner


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
            serve(replace(config, device=rank_device(config.device, local_rank())), model_config, path, tp)
            sys.exit(0)
        return Workers("tensor-parallel rank", tp=tp)  # torchrun's processes: rank 0 waits for them, then stops them
    if size == 1:
        return None
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)  # port 0: a free one
    workers = Workers("tensor-parallel rank")
    # On a CPU the ranks share the cores, or their threads would wait on each other at every operation.
    threads = max(1, torch.get_num_threads() // size) if config.device.type == "cpu" else torch.get_num_threads()
    try:  # whatever fails or is interrupted from here on, no worker is left behind
        for rank in range(1, size):
            workers.start(load_rank, rank, store.port, replace(config, device=rank_device(config.device, rank)),
                          model_config, path, threads)
        workers.wait_for("started")
        workers.share_threads(threads)  # rank 0's share too
        workers.tp = join(store, 0, size, config.device)
    except BaseException:
        workers.close()
        raise
    return workers
# --8<-- [end:start_ranks]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A rank's device: the CPU for all of them, or the GPU after rank 0's for each next rank."""
    return device if device.type == "cpu" else torch.device("cuda", (device.index or 0) + rank)


# --8<-- [start:load_rank]
def load_rank(rank: int, port: int, config: EngineConfig, model_config: ModelConfig, path: Path,
              threads: int) -> Callable[[], None]:
    """In a worker process: join the ranks and load this rank's shard; then it serves the steps rank 0 sends."""
    torch.set_num_threads(threads)
    if config.device.type == "cuda":
        torch.cuda.set_device(config.device)
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT))
    return ModelRunner(config, model_config, path, join(store, rank, config.tensor_parallel_size, config.device)).serve


def serve(config: EngineConfig, model_config: ModelConfig, path: Path, tp: TensorParallel) -> None:
    """Under torchrun, every rank but 0: load this rank's shard and run the steps rank 0 sends until it stops."""
    if config.device.type == "cuda":
        torch.cuda.set_device(config.device)
    runner = ModelRunner(config, model_config, path, tp)
    tp.messages.barrier().wait()  # loaded: rank 0 sends no step before every rank can take it
    runner.serve()
# --8<-- [end:load_rank]


@dataclass(slots=True)
class Workers(WorkerProcesses):
    """Rank 0's handles on the other ranks: the processes it started (none under torchrun), and their groups."""

    tp: TensorParallel = SINGLE

    def wait_until_loaded(self) -> None:
        """Every rank has its shard: each worker said "ready", or under torchrun, the ranks met after loading."""
        if self.processes:
            self.wait_for("ready", None)
        else:
            self.tp.messages.barrier().wait()

    def tell_stop(self) -> None:
        """A step of None: each rank's ``serve`` returns."""
        if self.tp.messages is not None:
            self.tp.send_step(None)
