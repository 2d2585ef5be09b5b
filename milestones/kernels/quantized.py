"""Quantized linear layers (``quant_linear.cpp``): the CPU path of ``quantization="gguf"`` and ``"int8"``.

A decode step at batch 1 reads every weight once; SmolLM2-135M in float32 is 538 MB a token. The bundled file
is smaller because its weights are stored as small integers in blocks (GGUF's formats):

* Q4_1, the decoder's linear layers: 32 weights share a float16 scale ``d`` and minimum ``m``, and each is a 4-bit
  ``q``; the weight is ``d * q + m``. 20 bytes for 32 weights: 5 bits a weight.
* Q8_0, the token embedding (which is also the LM head): 32 weights share a scale, each an 8-bit ``q``: ``d * q``.

``"gguf"`` keeps those blocks as they are, repacked in panels of 16 output columns for the kernel, and makes each
weight a float32 in registers as it is used. ``d * q`` is exact in float32, so each weight is exactly the float32
number that transformers makes when it de-quantizes the file, the weights the chain runs on; the kernel sums in
panel_linear's order, so the logits are the float32 engine's, bit for bit. That is checked at load time, every
block against the float32 weight it replaces: a model the file does not hold is refused, not approximated.

``"int8"`` quantizes any checkpoint at load time: per output column, the largest weight's magnitude maps to 127
(symmetric), and the kernel multiplies the column's sum by its scale. That is an approximation; the benchmarks page
measures how close. The embedding stays float32 there (a lookup reads one row a token).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import rms_norm
from .build import compile_library
from .huge_pages import move_to_huge_pages

SOURCE = Path(__file__).with_name("quant_linear.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")  # no fast-math: the order of the sums is fixed
PANEL, BLOCK = 16, 32  # output columns per packed panel, k per block: as in quant_linear.cpp
QUANTIZATIONS = ("gguf", "int8")
FORMATS = {"Q4_1": 0, "Q8_0": 1, "int8": 2}  # the kernel's format codes
GGUF_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # a block of 32 weights in the file
LAYER_TENSORS = {  # our module's name in a decoder layer -> the GGUF tensors (llama's names) it is made of
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_proj": ("ffn_gate",),
    "mlp.up_proj": ("ffn_up",),
    "mlp.down_proj": ("ffn_down",),
}


def load_quant_linear() -> None:
    """Build (once per machine) and load ``torch.ops.milestones.quant_linear`` and ``quant_silu_mul``.

    Raises if it cannot be built, and at once on later calls: a failing build is tried once.
    """
    compile_library(SOURCE, FLAGS)
    _register_shape()


@functools.cache
def _register_shape() -> None:
    torch.library.register_fake("milestones::quant_linear", _quant_linear_shape)
    torch.library.register_fake("milestones::quant_silu_mul", _quant_silu_mul_shape)


def _quant_linear_shape(x, packed_weight, scale, bias, out_features, format):  # noqa: A002 (the op's own name)
    return x.new_empty((*x.shape[:-1], out_features))


def _quant_silu_mul_shape(x, packed_gate_up, scale, intermediate, format):  # noqa: A002
    return x.new_empty((*x.shape[:-1], intermediate))


# --8<-- [start:packed]
@dataclass(slots=True)
class QuantWeight:
    """A weight packed for the kernel: ``[panels, in / 32, bytes]`` uint8, and int8's scale per (padded) column."""

    format: str  # "Q4_1", "Q8_0" or "int8"
    packed: torch.Tensor
    scale: torch.Tensor | None
    out_features: int
# --8<-- [end:packed]


def _panels(rows: torch.Tensor) -> torch.Tensor:
    """``[out, ...]`` padded with zeros to whole panels of 16 rows: ``[panels, 16, ...]`` (zero blocks are weight 0)."""
    padded = torch.zeros((-(-rows.shape[0] // PANEL) * PANEL, *rows.shape[1:]), dtype=rows.dtype)
    padded[: rows.shape[0]] = rows
    return padded.view(-1, PANEL, *rows.shape[1:])


# --8<-- [start:pack_q4_1]
def pack_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF's Q4_1 blocks ``[out, in / 32, 20]`` (a row's blocks in order of k) to the kernel's panels.

    A file's block is ``d`` and ``m`` (float16), then 16 bytes: byte i holds weight i in its low 4 bits and weight
    i + 16 in its high 4. A panel's block is its 16 columns' ``d``, their ``m``, then for each pair of k
    (2j, 2j + 1) a byte per column, k = 2j in the low 4 bits: ``[panels, in / 32, 32 + 32 + 256]``.
    """
    panels = _panels(blocks)  # [panels, 16 columns, in / 32, 20]
    scales = panels[..., 0:2].permute(0, 2, 1, 3).flatten(2), panels[..., 2:4].permute(0, 2, 1, 3).flatten(2)
    nibbles = panels[..., 4:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # [panels, 16, in / 32, 32]: the 32 weights in order of k
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # [panels, 16, in / 32, 16 pairs]
    return torch.cat([*scales, pairs.permute(0, 2, 3, 1).flatten(2)], dim=-1).contiguous()
# --8<-- [end:pack_q4_1]


def pack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF's Q8_0 blocks ``[out, in / 32, 34]`` (``d``, then 32 signed bytes) to ``[panels, in / 32, 32 + 512]``:
    the panel's 16 ``d``, then for each k its 16 columns' bytes."""
    panels = _panels(blocks)
    scales = panels[..., 0:2].permute(0, 2, 1, 3).flatten(2)
    return torch.cat([scales, panels[..., 2:].permute(0, 2, 3, 1).flatten(2)], dim=-1).contiguous()


# --8<-- [start:quantize_int8]
def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Per output column, symmetric: ``q = round(w / s)``, ``s = max |w| / 127``; packed ``[panels, in / 32, 512]``."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"quantization='int8' needs every linear layer's in_features to be a multiple of {BLOCK}, "
                         f"got {in_features}")
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    panels = _panels(q.view(out_features, -1, BLOCK))  # [panels, 16, in / 32, 32]
    packed = panels.permute(0, 2, 3, 1).flatten(2).contiguous().view(torch.uint8)
    return QuantWeight("int8", packed, _panels(scale).flatten().contiguous(), out_features)
# --8<-- [end:quantize_int8]


# --8<-- [start:dequantize]
def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The float32 weights ``[out, in]`` the kernel makes in registers, made here with torch (for checking)."""
    packed = weight.packed
    panels, blocks = packed.shape[:2]
    if weight.format == "Q4_1":
        d, m = (packed[..., i : i + 32].contiguous().view(torch.float16).float() for i in (0, 32))  # [p, b, 16]
        pairs = packed[..., 64:].view(panels, blocks, BLOCK // 2, PANEL)
        q = torch.stack([pairs & 15, pairs >> 4], dim=3).view(panels, blocks, BLOCK, PANEL).float()
        w = d[:, :, None] * q + m[:, :, None]
    else:
        q = packed[..., -BLOCK * PANEL :].contiguous().view(torch.int8).view(panels, blocks, BLOCK, PANEL).float()
        w = q if weight.format == "int8" else packed[..., :32].contiguous().view(torch.float16).float()[:, :, None] * q
    w = w.permute(0, 3, 1, 2).reshape(panels * PANEL, blocks * BLOCK)[: weight.out_features]
    return w if weight.scale is None else w * weight.scale[: weight.out_features, None]
# --8<-- [end:dequantize]


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


def pack_gguf(blocks: list[tuple[str, torch.Tensor]]) -> QuantWeight:
    """GGUF tensors of one block type, stacked by output rows (q, k and v as one qkv_proj), packed for the kernel."""
    kinds = {kind for kind, _ in blocks}
    if len(kinds) != 1:
        raise ValueError(f"quantization='gguf' stacks tensors of one block type only, got {sorted(kinds)}")
    (kind,) = kinds
    rows = torch.cat([b for _, b in blocks])
    return QuantWeight(kind, (pack_q4_1 if kind == "Q4_1" else pack_q8_0)(rows), None, rows.shape[0])


# --8<-- [start:quant_linear]
class QuantLinear(nn.Module):
    """``nn.Linear``'s forward over a quantized weight, through the kernel; float32 in, float32 out (a head's too)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.format = weight.out_features, FORMATS[weight.format]
        # Buffers, so that a compiled step (m5's capture, which freezes them) holds them as constants, not inputs.
        self.register_buffer("packed_weight", weight.packed, persistent=False)
        self.register_buffer("scale", weight.scale, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.milestones.quant_linear(x, self.packed_weight, self.scale, self.bias, self.out_features,
                                                 self.format)
# --8<-- [end:quant_linear]


class QuantMLP(nn.Module):
    """A gated MLP, ``down(silu(gate(x)) * up(x))``, with gate and up as one quantized weight and one kernel call."""

    def __init__(self, gate_up: QuantWeight, intermediate: int, down_proj: QuantLinear) -> None:
        super().__init__()
        self.intermediate, self.format = intermediate, FORMATS[gate_up.format]
        self.register_buffer("packed_weight", gate_up.packed, persistent=False)
        self.register_buffer("scale", gate_up.scale, persistent=False)
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.ops.milestones.quant_silu_mul(x, self.packed_weight, self.scale, self.intermediate, self.format)
        return self.down_proj(up)


# --8<-- [start:embedding]
class QuantEmbedding(nn.Module):
    """A token embedding looked up in the LM head's Q8_0 panels (the bundled model ties the two): no float32 table.

    Token t is column t % 16 of panel t // 16: its 32-weight blocks are gathered and made float32 (``d * q``,
    exact), the rows the float32 table holds.
    """

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        self.head = head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        packed = self.head.packed_weight  # [panels, in / 32, 32 + 32 x 16]
        panel, column = input_ids // PANEL, input_ids % PANEL
        blocks = packed[panel]  # [..., in / 32, 544]
        d = blocks[..., :32].view(torch.float16).gather(-1, column[..., None, None].expand(*blocks.shape[:-1], 1))
        q = blocks[..., 32:].view(*blocks.shape[:-1], BLOCK, PANEL).view(torch.int8)
        q = q.gather(-1, column[..., None, None, None].expand(*q.shape[:-1], 1))[..., 0]  # [..., in / 32, 32]
        return (d.float() * q.float()).flatten(-2)
# --8<-- [end:embedding]


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
        return quantize_int8(torch.cat([_pad_rows(w) if pad else w for w in weights]))


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
            parts += [(kind, _pad_rows(b) if pad else b) for kind, b in blocks]
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


def _pad_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows padded with zeros to whole panels (a fused gate and up: each padded, as the kernel expects)."""
    return _panels(rows).flatten(0, 1)


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
