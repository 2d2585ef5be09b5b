"""The ``linear_backend`` switch: which fast linear layers, if any, an engine's model gets."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import bf16_linear, packed_linear


# --8<-- [start:swap]
def swap_linear_layers(model: nn.Module, fast_layer: type[nn.Module]) -> nn.Module:
    """Swap every linear layer of the decoder for ``fast_layer(linear)``; return one made of the LM head.

    The LM head itself stays in the model (it may share its weight with the
    embedding); the runner calls the returned copy, which gives float32 logits
    (``logits=True``), instead of ``compute_logits``.
    """
    for parent in list(model.model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, fast_layer(child))
    return fast_layer(model.lm_head, logits=True)
# --8<-- [end:swap]


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
    if backend == "cpp" or (backend == "auto" and dtype == torch.bfloat16
                            and not packed_linear.onednn_available(dtype)):
        return _bf16_kernel_layers(backend, model)
    if packed_linear.onednn_available(dtype):
        return swap_linear_layers(model, packed_linear.PackedLinear)
    if backend == "onednn":
        raise RuntimeError(
            "this torch build lacks oneDNN's packed linear ops (torch.ops.mkldnn); use linear_backend='torch'"
        )
    warnings.warn("this torch build lacks oneDNN's packed linear ops; linear layers use plain F.linear", stacklevel=2)
    return None


def _bf16_kernel_layers(backend: str, model: nn.Module) -> nn.Module | None:
    """bfloat16 on a CPU without bfloat16 instructions: the compiled kernel, or F.linear if it cannot be built."""
    try:
        bf16_linear.load_bf16_linear()
    except Exception as error:  # a compiler error arrives as one of several exception types
        if backend == "cpp":
            raise RuntimeError(
                f"could not build the C++ bfloat16 linear kernel ({error}); use linear_backend='torch'"
            ) from error
        warnings.warn(f"C++ bfloat16 linear kernel unavailable ({error}); linear layers use plain F.linear",
                      stacklevel=3)
        return None
    return swap_linear_layers(model, bf16_linear.Bf16Linear)
