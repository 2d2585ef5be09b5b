"""``quantization="gguf"`` and ``"int8"``: which quantized weights a model's linear layers get, checked, swapped in.

``"gguf"`` keeps the bundled file's blocks (``quant_blocks.py``), which the kernel (``quant_linear.py``) makes
float32 exactly, so the logits are the float32 engine's, bit for bit. That is checked at load time, every block
against the float32 weight it replaces: a model the file does not hold is refused, not approximated.

``"int8"`` quantizes any checkpoint at load time: per output column, the largest weight's magnitude maps to 127
(symmetric), and the kernel multiplies the column's sum by its scale. That is an approximation; the benchmarks page
measures how close. The embedding stays float32 there (a lookup reads one row a token).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from . import rms_norm
from .huge_pages import move_to_huge_pages
from .quant_blocks import GGUF_BLOCK_BYTES, QuantWeight, dequantize, pack_gguf, pad_rows, quantize_int8
from .quant_linear import QuantEmbedding, QuantLinear, QuantMLP, load_quant_linear

QUANTIZATIONS = ("gguf", "int8")
LAYER_TENSORS = {  # our module's name in a decoder layer -> the GGUF tensors (llama's names) it is made of
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_proj": ("ffn_gate",),
    "mlp.up_proj": ("ffn_up",),
    "mlp.down_proj": ("ffn_down",),
}


# --8<-- [start:gguf_blocks]
def gguf_blocks(reader, name: str, heads: int = 0) -> tuple[str, torch.Tensor]:
    """One GGUF tensor's block type and blocks ``[out, in / 32, bytes]``; ``heads`` undoes llama.cpp's order of the
    rows of q and k (each head's two halves interleaved, for its RoPE), as transformers does when it loads the file."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise ValueError(f"the GGUF file has no tensor {name!r}")
    kind = tensor.tensor_type.name
    if kind not in GGUF_BLOCK_BYTES:
        raise ValueError(f"quantization='gguf' runs Q4_1 and Q8_0 blocks; the file's {name} is {kind}")
    blocks = torch.from_numpy(np.array(tensor.data)).view(tensor.data.shape[0], -1, GGUF_BLOCK_BYTES[kind])
    if heads:
        out = blocks.shape[0]
        blocks = blocks.view(heads, out // heads // 2, 2, *blocks.shape[1:]).transpose(1, 2).reshape(blocks.shape)
    return kind, blocks
# --8<-- [end:gguf_blocks]


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype,
                       linear_backend: str) -> None:
    """Refuse an unknown name, or a quantization where its kernel cannot run (never a silent float32 fallback)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantization={quantization!r} runs on the CPU in float32 only (its kernel makes float32 "
                         f"weights in registers), got {device.type}, {dtype}; use device='cpu', dtype='float32'")
    if linear_backend not in ("auto", "cpp"):
        raise ValueError(f"quantization={quantization!r} runs through the compiled kernel: use linear_backend='auto' "
                         f"or 'cpp', not {linear_backend!r}")


def quantize_linear_layers(model: nn.Module, quantization: str) -> QuantLinear:
    """Swap the model's linear layers (and each MLP's gate and up, as one) for quantized ones; return the LM head.

    The head becomes ``model.lm_head`` too, and with ``"gguf"`` a tied embedding is looked up in its blocks, so that
    no float32 copy of a linear layer stays in memory. The norms go to their compiled call, as with
    ``linear_backend="cpp"``. Raises if the kernel cannot be built: a quantization is never skipped.
    """
    try:
        load_quant_linear()
        rms_norm.load_rms_norm()
    except Exception as error:  # a compiler error arrives as one of several exception types
        raise RuntimeError(f"could not build the quantized linear kernel ({error}); use quantization=None") from error
    rms_norm.swap_rms_norms(model)
    source = GgufRows(model) if quantization == "gguf" else Int8Rows(model)
    fused = set()  # MLPs swapped whole: their linear layers are done
    for parent_name, parent in list(model.model.named_modules(prefix="model")):
        for name, child in parent.named_children() if parent_name not in fused else ():
            full = f"{parent_name}.{name}"
            if name == "mlp" and all(isinstance(getattr(child, p, None), nn.Linear) for p in GATED):
                gate_up = source.pack([f"{full}.gate_proj", f"{full}.up_proj"], pad=True)
                down = QuantLinear(source.pack([f"{full}.down_proj"]), child.down_proj.bias)
                setattr(parent, name, QuantMLP(gate_up, child.gate_proj.out_features, down))
                fused.add(full)
            elif isinstance(child, nn.Linear):
                setattr(parent, name, QuantLinear(source.pack([full]), child.bias))
    head = QuantLinear(source.pack(["lm_head"]), model.lm_head.bias)
    if quantization == "gguf" and model.config.tie_word_embeddings:
        model.model.embed_tokens = QuantEmbedding(head)
    model.lm_head = head
    place_in_huge_pages(model)
    return head


GATED = ("gate_proj", "up_proj", "down_proj")


class Int8Rows:
    """int8 weights made from the model's own float weights."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def pack(self, names: list[str], pad: bool = False) -> QuantWeight:
        weights = [self.model.get_submodule(name).weight.detach() for name in names]
        return quantize_int8(torch.cat([pad_rows(w) if pad else w for w in weights]))


class GgufRows:
    """The bundled GGUF's blocks for the model's linear layers, each checked to be exactly the float weight it replaces.

    Tensors are found by llama.cpp's names (``blk.N.attn_q``, ...); q and k are stacked with v as ``qkv_proj``.
    """

    def __init__(self, model: nn.Module) -> None:
        import gguf

        from milestones.model_store import bundled_gguf_path

        self.model, self.path = model, bundled_gguf_path()
        self.reader = gguf.GGUFReader(self.path)

    def tensors(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """The file's blocks for one of our linear layers (several for qkv_proj)."""
        cfg = self.model.config
        if name == "lm_head":
            tied = cfg.tie_word_embeddings
            return [gguf_blocks(self.reader, "token_embd.weight" if tied else "output.weight")]
        layer, _, module = name.removeprefix("model.layers.").partition(".")
        if module not in LAYER_TENSORS or not layer.isdigit():
            raise ValueError(f"quantization='gguf' does not know which GGUF tensor holds {name!r}")
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        return [gguf_blocks(self.reader, f"blk.{layer}.{t}.weight", heads.get(t, 0)) for t in LAYER_TENSORS[module]]

    def pack(self, names: list[str], pad: bool = False) -> QuantWeight:
        parts = []
        for name in names:
            blocks = self.tensors(name)
            self.check(name, pack_gguf(blocks))
            parts += [(kind, pad_rows(b) if pad else b) for kind, b in blocks]
        return pack_gguf(parts)

    # --8<-- [start:check]
    def check(self, name: str, weight: QuantWeight) -> None:
        expected = self.model.get_submodule(name).weight.detach()
        found = dequantize(weight)
        if found.shape != expected.shape or not torch.equal(found, expected.float()):
            detail = (f"shape {tuple(found.shape)} for {tuple(expected.shape)}" if found.shape != expected.shape
                      else f"values differ by up to {(found - expected.float()).abs().max().item():.3g}")
            raise ValueError(f"quantization='gguf' keeps the blocks of {self.path.name}, but its tensor for {name} "
                             f"is not this model's weight ({detail}): the file does not hold this model; use "
                             f"quantization='int8' or None")
    # --8<-- [end:check]


def place_in_huge_pages(model: nn.Module) -> None:
    """The packed weights in 2 MiB pages, in the order a step reads them (the layers, then the head)."""
    layers = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantMLP))]
    layers = [m for m in layers if m is not model.lm_head] + [model.lm_head]
    weights, _ = move_to_huge_pages([layer.packed_weight for layer in layers])
    for layer, weight in zip(layers, weights):
        layer.packed_weight = weight


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (each tensor once): its resident weights."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
