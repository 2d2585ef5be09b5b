"""The quantized weights' block formats, packed in panels for the kernel and de-quantized: pure tensor functions.

A decode step at batch 1 reads every weight once; SmolLM2-135M in float32 is 538 MB a token. The bundled file
is smaller because its weights are stored as small integers in blocks (GGUF's formats):

* Q4_1, the decoder's linear layers: 32 weights share a float16 scale ``d`` and minimum ``m``, and each is a 4-bit
  ``q``; the weight is ``d * q + m``. 20 bytes for 32 weights: 5 bits a weight.
* Q8_0, the token embedding (which is also the LM head): 32 weights share a scale, each an 8-bit ``q``: ``d * q``.

``"gguf"`` keeps those blocks as they are, repacked here in panels of 16 output columns for the kernel
(``quant_linear.cpp``); ``"int8"`` makes 8-bit weights with a scale per output column. ``dequantize`` makes the
float32 weights the kernel makes in registers, another way, so that the load-time check (``quantized.py``) can hold
them to the weights they replace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL, BLOCK = 16, 32  # output columns per packed panel, k per block: as in quant_linear.cpp
GGUF_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # a block of 32 weights in the file


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


def pack_gguf(blocks: list[tuple[str, torch.Tensor]]) -> QuantWeight:
    """GGUF tensors of one block type, stacked by output rows (q, k and v as one qkv_proj), packed for the kernel."""
    kinds = {kind for kind, _ in blocks}
    if len(kinds) != 1:
        raise ValueError(f"quantization='gguf' stacks tensors of one block type only, got {sorted(kinds)}")
    (kind,) = kinds
    rows = torch.cat([b for _, b in blocks])
    return QuantWeight(kind, (pack_q4_1 if kind == "Q4_1" else pack_q8_0)(rows), None, rows.shape[0])


def pad_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows padded with zeros to whole panels (a fused gate and up: each padded, as the kernel expects)."""
    return _panels(rows).flatten(0, 1)
