"""The ``linear_backend`` switch: which fast linear layers, if any, an engine's model gets."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import packed_linear, panel_linear, quantized, rms_norm
from .huge_pages import move_to_huge_pages


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


def pack_linear_layers_for(backend: str, model: nn.Module, device: torch.device, dtype: torch.dtype,
                           quantization: str | None = None) -> nn.Module | None:
    """Swap the model's linear layers for this (already checked) ``linear_backend``'s; return the LM head to call.

    None means the model was left as it is. On a CPU, ``"auto"`` takes the compiled kernel (on a
    CPU with AVX-512 BF16 it multiplies bfloat16 with the bfloat16 dot product), and with it the
    compiled RMS norm (``rms_norm.py``) and each MLP's gate and up in one call (``FusedMLP``); weights packed
    for oneDNN where the kernel cannot be built and oneDNN can pack this dtype; plain
    ``F.linear``, with a warning, where neither is there. ``"onednn"`` and ``"cpp"`` make a
    missing fast path an error. A ``quantization`` ("gguf", "int8": checked by the engine's config to run here)
    swaps them for quantized layers (``quantized.py``), or fails: it never falls back to float32.
    """
    if quantization is not None:
        return quantized.quantize_linear_layers(model, quantization)
    if backend == "torch" or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None  # the engine's config already refused "onednn" and "cpp" where they cannot run
    onednn = packed_linear.onednn_available(dtype)
    if backend == "onednn":
        if not onednn:
            raise RuntimeError("this torch build lacks oneDNN's packed linear ops (torch.ops.mkldnn); "
                               "use linear_backend='cpp' or 'torch'")
        return swap_linear_layers(model, packed_linear.PackedLinear)
    try:
        panel_linear.load_panel_linear()
        rms_norm.load_rms_norm()
    except Exception as error:  # a compiler error arrives as one of several exception types
        if backend == "cpp":
            raise RuntimeError(
                f"could not build the C++ linear kernel ({error}); use linear_backend='torch'"
            ) from error
        fallback = "weights packed for oneDNN" if onednn else "plain F.linear"
        warnings.warn(f"C++ linear kernel unavailable ({error}); linear layers use {fallback}", stacklevel=2)
        return swap_linear_layers(model, packed_linear.PackedLinear) if onednn else None
    rms_norm.swap_rms_norms(model)  # the same compiler built them: the norms go to one compiled call each too
    panel_linear.swap_mlps(model)  # each MLP's gate and up in one call
    return place_in_huge_pages(model, swap_linear_layers(model, panel_linear.PanelLinear))


def place_in_huge_pages(model: nn.Module, head: panel_linear.PanelLinear) -> panel_linear.PanelLinear:
    """Move the packed weights into 2 MiB pages in the order a step reads them (the layers, then the head); the head."""
    packed = (panel_linear.PanelLinear, panel_linear.FusedMLP)
    layers = [module for module in model.model.modules() if isinstance(module, packed)] + [head]
    weights, _ = move_to_huge_pages([layer.packed_weight for layer in layers])
    for layer, weight in zip(layers, weights):
        layer.packed_weight = weight
    return head
