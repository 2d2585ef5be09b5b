"""Processes that ``torchrun`` started: how many, and the store of its rendezvous."""

from __future__ import annotations

import os

import torch.distributed as dist


def torchrun_world_size() -> int | None:
    """How many processes ``torchrun`` started (it sets these variables); None: this one was not started by it."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return int(os.environ["WORLD_SIZE"]) if all(name in os.environ for name in names) else None


def torchrun_store() -> tuple[dist.Store, int]:
    """The store of torchrun's rendezvous (``MASTER_ADDR``/``MASTER_PORT``), and this process's rank."""
    store, rank, _ = next(dist.rendezvous("env://"))
    return store, rank


def local_rank() -> int:
    """This process's place among torchrun's processes on its machine: which GPU it takes."""
    return int(os.environ["LOCAL_RANK"])
