"""The ``linear_backend`` switch: which fast linear layers, if any, an engine's model gets."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import bf16_linear, packed_linear


def pack_linear_layers_for(backend: str, model: nn.Module, device: torch.device,
                           dtype: torch.dtype) -> nn.Module | None:
    """Swap the model's linear layers for this (already checked) ``linear_backend``'s; return the LM head to call.

    None means the model was left as it is. On a CPU, ``"auto"`` takes weights packed
    for oneDNN in float32, and in bfloat16 where this CPU has bfloat16 instructions;
    otherwise in bfloat16 the compiled kernel; and plain ``F.linear``, with a warning,
    where that fast path is missing. ``"onednn"`` and ``"cpp"`` make it an error.
    """
    if backend == "torch" or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None  # the engine's config already refused "onednn" and "cpp" where they cannot run
    if backend == "onednn" or (backend == "auto" and (dtype == torch.float32 or packed_linear.onednn_available(dtype))):
        if packed_linear.onednn_available(dtype):
            return packed_linear.pack_linear_layers(model)
        if backend == "onednn":
            raise RuntimeError(
                "this torch build lacks oneDNN's packed linear ops (torch.ops.mkldnn); use linear_backend='torch'"
            )
        warnings.warn("this torch build lacks oneDNN's packed linear ops; linear layers use plain F.linear",
                      stacklevel=2)
        return None
    try:  # bfloat16 on a CPU without bfloat16 instructions
        bf16_linear.load_bf16_linear()
    except Exception as error:  # a compiler error arrives as one of several exception types
        if backend == "cpp":
            raise RuntimeError(
                f"could not build the C++ bfloat16 linear kernel ({error}); use linear_backend='torch'"
            ) from error
        warnings.warn(f"C++ bfloat16 linear kernel unavailable ({error}); linear layers use plain F.linear",
                      stacklevel=2)
        return None
    return bf16_linear.swap_bf16_linear_layers(model)
