"""Load and register the compiled decode-attention kernel (``decode_attention.cpp``).

The plain-torch attention in each milestone's ``attention.py`` is the reference: it
is what the lesson reads and what runs on CUDA. On the CPU its per-request operators
cost more in dispatch than in arithmetic, so ``attention_backend="cpp"`` (and
``"auto"`` on a CPU in float32 or bfloat16) hands every decoding request of a step to
one compiled call instead, built once per machine by ``build.py``. The library
registers the op ``torch.ops.milestones.decode_attention``; its fake (shape-only)
implementation below lets ``torch.compile`` trace through it as one opaque call.

On CUDA, ``attention_backend="triton"`` gives the engine the Triton kernel of the same
signature (``triton_decode.py``), once it has agreed with plain torch on a start-up probe.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from .build import compile_library
from .huge_pages import zeros_in_huge_pages

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")  # fast-math lets the compiler vectorise the dot products
DTYPES = (torch.float32, torch.bfloat16)  # bfloat16 is read as it is and summed in float32
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the Triton kernel's (CUDA): summed in float32
TRITON_BACKENDS = ("triton",)  # the attention_backend values that take the Triton kernel on CUDA (kernels.md says why
#                                 not "auto" and "batched": their eager steps give every row to batched attention)

DecodeKernel = Callable[..., torch.Tensor]  # (q, k, v, block_tables, context_lens, scale) -> out


def load_decode_kernel() -> DecodeKernel:
    """The compiled kernel; raises if it cannot be built, and at once on later calls: a failing build is tried once."""
    compile_library(SOURCE, FLAGS)
    return _registered_op()


@functools.cache
def _registered_op() -> DecodeKernel:
    """The op the library defined, with its shape rule registered (once) for tracing."""
    torch.library.register_fake("milestones::decode_attention", _decode_attention_shape)
    return torch.ops.milestones.decode_attention.default


def _decode_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """What the op returns, for tracing without running it: one output row per query, like q."""
    return q.new_empty(q.shape)


def decode_kernel_for(backend: str, device: torch.device, dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel an engine with this (already checked) ``attention_backend`` uses, or None for plain torch.

    ``"auto"`` falls back to torch with a warning when the kernel cannot be built
    (no compiler, say); ``"cpp"`` turns that into an error. On CUDA: the Triton kernel, or None.
    """
    if device.type == "cuda":
        return triton_decode_kernel_for(backend, device, dtype)
    if backend in ("torch", "batched", "triton") or device.type != "cpu" or dtype not in DTYPES:
        return None  # the engine's config already refused "cpp" where it cannot run
    try:
        return load_decode_kernel()
    except Exception as error:  # a compiler error arrives as one of several exception types
        if backend == "cpp":
            raise RuntimeError(
                f"could not build the C++ decode-attention kernel ({error}); use attention_backend='torch'"
            ) from error
        warnings.warn(f"C++ decode-attention kernel unavailable ({error}); using plain-torch attention", stacklevel=2)
        return None


def triton_decode_kernel_for(backend: str, device: torch.device, dtype: torch.dtype) -> DecodeKernel | None:
    """The Triton kernel for an engine on CUDA with this ``attention_backend``, or None for plain torch.

    ``"triton"`` insists: an error if triton does not import or the kernel fails its start-up probe. Any other
    value in ``TRITON_BACKENDS`` would fall back to plain torch with a warning instead.
    """
    if backend not in TRITON_BACKENDS or dtype not in TRITON_DTYPES:
        return None
    try:
        return load_triton_decode_kernel(device, dtype)
    except Exception as error:  # no triton, no compiler for this GPU, a kernel that computes something else
        if backend == "triton":
            raise RuntimeError(f"the Triton decode-attention kernel cannot run here ({error}); use "
                               f"attention_backend='torch' or 'auto'") from error
        warnings.warn(f"Triton decode-attention kernel unavailable ({error}); the captured decode step uses "
                      f"plain-torch attention", stacklevel=3)
        return None


def load_triton_decode_kernel(device: torch.device, dtype: torch.dtype) -> DecodeKernel:
    """The Triton kernel, once it has agreed with plain torch on a small step on this device; raises otherwise."""
    from . import triton_decode  # imported here: triton is only there on a GPU machine, and slow to import

    error = _triton_probe(str(device), dtype)
    if error is not None:
        raise RuntimeError(error)
    return triton_decode.paged_decode_attention


@functools.cache
def _triton_probe(device: str, dtype: torch.dtype) -> str | None:
    """The probe's verdict, once per device and dtype (a first call compiles the kernel: a second or so)."""
    from . import triton_decode

    return triton_decode.probe(torch.device(device), dtype)


# --8<-- [start:kv_cache_zeros]
def kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, backend: str) -> torch.Tensor:
    """A zeroed KV cache tensor: on a CPU, unless ``attention_backend`` is "torch", in 2 MiB pages.

    The same zeros either way; decode attention reads them with fewer page walks
    (kernels.md, "The KV cache in 2 MiB pages"). "torch" keeps the plain reference.
    """
    if backend == "torch" or device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return zeros_in_huge_pages(shape, dtype)
# --8<-- [end:kv_cache_zeros]
