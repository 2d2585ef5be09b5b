"""Platform speed-ups that are no lesson: the milestones opt in through four engine switches.

* ``attention_backend`` (every milestone): decode attention for every decoding request
  of a step in one compiled CPU call (``decode_attention.cpp``), registered as the torch
  op ``milestones::decode_attention``, over a KV cache in 2 MiB pages
  (``kv_cache_zeros``); "torch" keeps the lesson's own attention and plain zeros. On CUDA,
  "batched" (``batched_attention.py``): every request of an eager step in one call per layer;
  "triton" (``triton_decode.py``): the decodes, captured steps' included, in one Triton kernel that
  reads each row's blocks up to its own context length.
* ``linear_backend`` (every milestone): linear layers through a compiled kernel over
  weights packed in panels (``panel_linear.cpp``), or with weights packed once for
  oneDNN (``packed_linear.py``); "torch" keeps plain ``F.linear``.
* ``fuse_layers`` (every milestone): in a step of decode rows that a decode kernel takes, each decoder layer in
  about ten calls (``fused_layers.py``: the norms with the skip connection's add, RoPE with the KV write, the
  kernel, the products), on a CPU with the compiled norms, on CUDA in Triton; "auto" where it applies.
* ``quantization`` (every milestone): "gguf" keeps the bundled file's 4-bit (Q4_1) and 8-bit (Q8_0) blocks, "int8"
  makes 8-bit weights at load time (``quantized.py``, the blocks in ``quant_blocks.py``); a compiled kernel
  (``quant_linear.cpp``, called by ``quant_linear.py``) makes them float32 in registers as it multiplies. CPU and
  float32 only; refused elsewhere.

The compiled kernels apply on a CPU, in float32 or bfloat16; "auto" (the default) takes them
where they apply and work, batched attention on CUDA, and the plain-torch reference otherwise.
The milestones' own code is the reference: every fast path is checked against it (tests/kernels).
"""

from __future__ import annotations

import torch

from .attention_backends import AttentionBackend, attention_backend_for
from .batched_attention import BatchedAttention, RaggedBatch, batched_attention_for
from .decode_attention import DTYPES as ATTENTION_DTYPES
from .decode_attention import TRITON_DTYPES, DecodeKernel, decode_kernel_for, kv_cache_zeros, load_decode_kernel
from .fused_layers import FusedDecoderLayer, check_fuse_layers, fuse_layers_for
from .linear_layers import pack_linear_layers_for, swap_linear_layers
from .packed_linear import PackedLinear, onednn_available
from .panel_linear import DTYPES as PANEL_DTYPES
from .panel_linear import PanelLinear
from .quantized import QUANTIZATIONS, check_quantization

# auto: the compiled kernel where it applies and builds, batched on CUDA, else torch; batched: anywhere (its plain-torch
# layout on a CPU, for checking it); triton: CUDA only
ATTENTION_BACKENDS = ("auto", "torch", "cpp", "batched", "triton")
LINEAR_BACKENDS = ("auto", "torch", "onednn", "cpp")  # auto: cpp, else oneDNN, else torch

__all__ = [
    "ATTENTION_BACKENDS", "LINEAR_BACKENDS", "AttentionBackend", "BatchedAttention", "DecodeKernel",
    "FusedDecoderLayer", "PackedLinear", "PanelLinear", "QUANTIZATIONS", "RaggedBatch", "attention_backend_for",
    "batched_attention_for", "check_attention_backend", "check_fuse_layers", "check_linear_backend", "check_platform",
    "check_quantization", "decode_kernel_for", "fuse_layers_for", "kv_cache_zeros", "load_decode_kernel",
    "onednn_available", "pack_linear_layers_for", "swap_linear_layers",
]

def check_platform(config, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an engine config whose speed-up switches cannot run here (each milestone's ``resolve`` calls this)."""
    check_linear_backend(config.linear_backend, device, dtype)
    check_quantization(config.quantization, device, dtype, config.linear_backend)
    check_attention_backend(config.attention_backend, device, dtype)
    check_fuse_layers(config.fuse_layers, device, dtype)


def check_attention_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an unknown name, or "cpp" or "triton" where the kernel cannot run."""
    _check_name("attention_backend", backend, ATTENTION_BACKENDS)
    if backend == "cpp" and (device.type != "cpu" or dtype not in ATTENTION_DTYPES):
        raise ValueError(f"attention_backend='cpp' runs on the CPU in float32 or bfloat16 only "
                         f"(got {device.type}, {dtype}); use 'torch' or 'auto'")
    if backend == "triton" and (device.type != "cuda" or dtype not in TRITON_DTYPES):
        raise ValueError(f"attention_backend='triton' runs on CUDA in float32, bfloat16 or float16 only "
                         f"(got {device.type}, {dtype}); use 'torch' or 'auto'")


def check_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an unknown name, or "onednn" or "cpp" where they cannot run."""
    _check_name("linear_backend", backend, LINEAR_BACKENDS)
    if backend == "onednn" and (device.type != "cpu" or dtype != torch.float32) and not (
        device.type == "cpu" and onednn_available(dtype)
    ):
        raise ValueError(f"linear_backend='onednn' runs on the CPU in float32, or in bfloat16 on a CPU with "
                         f"bfloat16 instructions (got {device.type}, {dtype}); use 'cpp', 'torch' or 'auto'")
    if backend == "cpp" and (device.type != "cpu" or dtype not in PANEL_DTYPES):
        raise ValueError(f"linear_backend='cpp' runs on the CPU in float32 or bfloat16 only (got {device.type}, "
                         f"{dtype}); use 'torch' or 'auto'")


def _check_name(option: str, backend: str, choices: tuple[str, ...]) -> None:
    if backend not in choices:
        raise ValueError(f"{option} must be one of {choices}, got {backend!r}")
