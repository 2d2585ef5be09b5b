"""The ``linear_backend`` switch: which fast linear layers, if any, an engine's model gets."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import packed_linear, panel_linear


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

    None means the model was left as it is. On a CPU, ``"auto"`` takes the compiled kernel in
    float32, and in bfloat16 where this CPU has no bfloat16 instructions; weights packed for
    oneDNN in bfloat16 where it has them, and in float32 where the kernel cannot be built;
    plain ``F.linear``, with a warning, where neither is there. ``"onednn"`` and ``"cpp"``
    make a missing fast path an error.
    """
    if backend == "torch" or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None  # the engine's config already refused "onednn" and "cpp" where they cannot run
    onednn = packed_linear.onednn_available(dtype)
    if backend == "onednn" or (backend == "auto" and dtype == torch.bfloat16 and onednn):
        if not onednn:
            raise RuntimeError("this torch build lacks oneDNN's packed linear ops (torch.ops.mkldnn); "
                               "use linear_backend='cpp' or 'torch'")
        return swap_linear_layers(model, packed_linear.PackedLinear)
    try:
        panel_linear.load_panel_linear()
    except Exception as error:  # a compiler error arrives as one of several exception types
        if backend == "cpp":
            raise RuntimeError(
                f"could not build the C++ linear kernel ({error}); use linear_backend='torch'"
            ) from error
        fallback = "weights packed for oneDNN" if onednn else "plain F.linear"
        warnings.warn(f"C++ linear kernel unavailable ({error}); linear layers use {fallback}", stacklevel=2)
        return swap_linear_layers(model, packed_linear.PackedLinear) if onednn else None
    return swap_linear_layers(model, panel_linear.PanelLinear)
