"""Engine options checked from a table: a line per option, saying what its value must be; the device and
dtype every milestone resolves alike; and (m8) the tensor-parallel sizes a model and a machine can run.

Not a lesson: every milestone adds options, and with a table each one costs its
milestone a line (``"async_scheduling": FLAG``), not another ``if``. Checks that relate
two options (a budget at least the batch size) stay in ``EngineConfig.resolve``. An option
made of options (m7's ``speculative_config``, ``milestones/speculative_config.py``) is a dataclass of its own,
read by ``nested``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from milestones.runtime.torchrun import torchrun_world_size

if TYPE_CHECKING:  # only for type hints
    from milestones.hf_checkpoint import ModelConfig


@dataclass(frozen=True, slots=True)
class Kind:
    """What an option's value must be: the test, and the words the error uses for it."""

    accepts: Callable[[object], bool]
    description: str


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


FLAG = Kind(lambda v: isinstance(v, bool), "True or False")
FLAG_OR_AUTO = Kind(lambda v: isinstance(v, bool) or v == "auto", "True, False or 'auto'")
INTEGER = Kind(_is_int, "an integer")
POSITIVE = Kind(lambda v: _is_int(v) and v >= 1, "a positive integer")
NON_NEGATIVE = Kind(lambda v: _is_int(v) and v >= 0, "an integer >= 0")
POSITIVE_OR_NONE = Kind(lambda v: v is None or (_is_int(v) and v >= 1), "a positive integer, or None")
FRACTION = Kind(lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]")
RATIO_OR_NONE = Kind(lambda v: v is None or (_is_number(v) and 0 < v <= 1), "a number in (0, 1], or None")
PATH_OR_NONE = Kind(lambda v: v is None or isinstance(v, (str, os.PathLike)), "a path (a string), or None")


def one_of(*choices: str) -> Kind:
    return Kind(lambda v: isinstance(v, str) and v in choices, " or ".join(repr(c) for c in choices))


def check_sizes(sizes: object, name: str, largest: int, what: str) -> None:
    """Refuse ``sizes`` unless it is a non-empty list of integers in [1, ``largest``]; ``what`` names them in the
    error, with their bound."""
    if not isinstance(sizes, (list, tuple)) or not sizes or not all(_is_int(s) and 1 <= s <= largest for s in sizes):
        raise ValueError(f"{name} must be a non-empty list of {what}, got {sizes!r}")


def check(config: object, table: dict[str, Kind]) -> None:
    """Raise a ValueError naming the first option whose value its kind does not accept."""
    for name, kind in table.items():
        value = getattr(config, name)
        if not kind.accepts(value):
            raise ValueError(f"{name} must be {kind.description}, got {value!r}")


Config = TypeVar("Config")


def nested(cls: type[Config], given: object, table: dict[str, Kind], name: str) -> Config:
    """The dataclass ``cls`` from a dict of its fields (or one already made, checked again), each value checked by
    ``table``; the errors name the option ``name``."""
    if isinstance(given, cls):
        given = asdict(given)
    names = [f.name for f in fields(cls)]
    required = [f.name for f in fields(cls) if f.default is MISSING]
    if not isinstance(given, dict) or not set(given) <= set(names) or not set(required) <= set(given):
        raise ValueError(f"{name} takes the keys {', '.join(names)} ({' and '.join(required)} required), "
                         f"got {sorted(given) if isinstance(given, dict) else given!r}")
    config = cls(**given)
    try:
        check(config, table)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    return config


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The CPU or a CUDA GPU that is really there (None: CUDA if present); anything else is refused now rather than
    failing later."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported: use 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available; use device='cpu'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """float32, bfloat16 or float16, by name or as a torch dtype (None: bfloat16 on CUDA, float32 on a CPU)."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype; use 'float32', 'bfloat16' or 'float16'")
        dtype = getattr(torch, dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    return dtype


# --8<-- [start:check_tensor_parallel]
def check_tensor_parallel(size: int, model: ModelConfig, device: torch.device) -> None:
    """m8: refuse a tensor_parallel_size this model or machine cannot run, before any process starts."""
    if size == 1:
        return
    num_heads, num_kv_heads, intermediate_size = model.num_heads, model.num_kv_heads, model.intermediate_size
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {num_heads} attention heads: "
                         f"use one of {[n for n in range(1, num_heads + 1) if num_heads % n == 0]}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {num_kv_heads} KV heads or be a "
                         "multiple of them (each rank then holds a copy of one)")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the MLP's width ({intermediate_size})")
    if not dist.is_available() or not dist.is_gloo_available():
        raise ValueError("tensor_parallel_size > 1 needs torch.distributed with gloo, which this torch build lacks")
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError("tensor_parallel_size > 1 on CUDA needs NCCL, which this torch build lacks")
        first = device.index or 0  # rank r runs on the GPU r after rank 0's (torchrun: its LOCAL_RANK)
        if torchrun_world_size() is None and first + size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} from {device} needs GPUs {first} to {first + size - 1}; "
                             f"this machine has {torch.cuda.device_count()}: lower it, or run on device='cpu'")
# --8<-- [end:check_tensor_parallel]
