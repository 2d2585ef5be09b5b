"""The layers that run the compiled quantized kernel (``quant_linear.cpp``): the CPU path of ``quantization``.

The kernel reads a layer's blocks (``quant_blocks.py``) and makes their integers float32 in registers as it uses
them, so no float32 copy of a quantized weight is stored. A block's share of each output is summed in the factored
form llama.cpp uses, ``d * (x . q) + m * sum(x)``: one multiply-add a weight, and outputs within float32's summation
bound of the product with the de-quantized weights (the chain's), in an order that does not depend on the batch.
An int8 column's sum is multiplied by its scale once, at the end.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from .build import compile_library
from .quant_blocks import BLOCK, PANEL, QuantWeight

SOURCE = Path(__file__).with_name("quant_linear.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")  # no fast-math: the order of the sums is fixed
FORMATS = {"Q4_1": 0, "Q8_0": 1, "int8": 2}  # the kernel's format codes


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
