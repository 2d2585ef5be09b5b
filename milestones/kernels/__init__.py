"""Platform speed-ups that are no lesson: the milestones opt in through two engine switches.

* ``attention_backend`` (m2 on): decode attention for every decoding request of a
  step in one compiled CPU call (``decode_attention.cpp``), registered as the torch
  op ``milestones::decode_attention``; "torch" keeps the lesson's own attention.
* ``linear_backend`` (every milestone): linear layers whose weights are packed once
  for oneDNN (``packed_linear.py``); "torch" keeps plain ``F.linear``.

Both apply on a CPU in float32 only; "auto" (the default) takes them where they apply
and work, and the plain-torch reference otherwise. The milestones' own code is the
reference: every fast path is checked against it (tests/kernels).
"""

from __future__ import annotations

import torch

from .decode_attention import DecodeKernel, decode_kernel_for, load_decode_kernel
from .packed_linear import PackedLinear, onednn_available, pack_linear_layers_for

ATTENTION_BACKENDS = ("auto", "torch", "cpp")  # auto: the compiled kernel where it applies and builds, else torch
LINEAR_BACKENDS = ("auto", "torch", "onednn")  # auto: weights packed for oneDNN on a CPU in float32, else torch

__all__ = [
    "ATTENTION_BACKENDS", "LINEAR_BACKENDS", "DecodeKernel", "PackedLinear", "check_attention_backend",
    "check_linear_backend", "decode_kernel_for", "load_decode_kernel", "onednn_available", "pack_linear_layers_for",
]


def check_attention_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an unknown name, or "cpp" where the kernel cannot run."""
    _check_backend("attention_backend", backend, ATTENTION_BACKENDS, "cpp", device, dtype)


def check_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an unknown name, or "onednn" where packed weights cannot run."""
    _check_backend("linear_backend", backend, LINEAR_BACKENDS, "onednn", device, dtype)


def _check_backend(
    option: str, backend: str, choices: tuple[str, ...], cpu_only: str, device: torch.device, dtype: torch.dtype
) -> None:
    if backend not in choices:
        raise ValueError(f"{option} must be one of {choices}, got {backend!r}")
    if backend == cpu_only and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"{option}={cpu_only!r} runs on the CPU in float32 only (got {device.type}, {dtype}); "
                         "use 'torch' or 'auto'")
