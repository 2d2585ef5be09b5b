"""Linear layers through a compiled kernel (``panel_linear.cpp``): the CPU path of ``linear_backend="cpp"``.

A decode step at small batch runs at the speed it reads weights from memory. The
kernel reads each weight once, front to back, in the order it multiplies: its weights
are packed once, at load time, in panels of 16 output columns (``pack_weight``), the
same numbers in the order the kernel streams them. In float32 it reaches closer to
the machine's memory bandwidth than torch's products at one row. In bfloat16 a weight
is half the bytes; torch's own bfloat16 product is fast only where the CPU multiplies
bfloat16 in hardware (AVX-512 BF16, AMX), and elsewhere falls back to generic code,
slower than float32 once a step has more than a few rows. The kernel widens each
bfloat16 weight to float32 as it loads it (exact), or, on a CPU with AVX-512 BF16,
multiplies bfloat16 pairs with its dot-product instruction. In both dtypes it sums in
float32, in one fixed order per output whatever the batch (then rounds once to bfloat16). The decoder's
packed weights replace the originals; the packed LM head is a second copy of the head
(the embedding keeps the original).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from .build import compile_library

SOURCE = Path(__file__).with_name("panel_linear.cpp")
PANEL = 16  # output columns per packed panel, as in panel_linear.cpp
DTYPES = (torch.float32, torch.bfloat16)
FLOAT32_COLUMNS = [*range(0, PANEL, 2), *range(1, PANEL, 2)]  # a float32 panel's order: even columns, then odd
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")  # no fast-math: the order of the sums is fixed


def load_panel_linear() -> None:
    """Build (once per machine) and load the kernel: ``torch.ops.milestones.panel_linear`` and ``panel_silu_mul``.

    Raises if it cannot be built, and at once on later calls: a failing build is tried once.
    """
    compile_library(SOURCE, FLAGS)
    _register_shape()


@functools.cache
def _register_shape() -> None:
    torch.library.register_fake("milestones::panel_linear", _panel_linear_shape)
    torch.library.register_fake("milestones::panel_silu_mul", _panel_silu_mul_shape)


def _panel_linear_shape(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                        out_features: int) -> torch.Tensor:
    """What the op returns, for tracing without running it: x's rows, out_features wide, in x's dtype."""
    return x.new_empty((*x.shape[:-1], out_features))


def _panel_silu_mul_shape(x: torch.Tensor, packed_gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """What the op returns, for tracing: x's rows, ``intermediate`` wide, in x's dtype."""
    return x.new_empty((*x.shape[:-1], intermediate))


@functools.cache
def bf16_pairs() -> bool:
    """Whether the built kernel multiplies bfloat16 pairs in hardware (AVX-512 BF16), so takes bfloat16 in pairs."""
    load_panel_linear()
    return torch.ops.milestones.panel_linear_bf16_pairs()


def pack_weight(weight: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """``[out, in]`` to ``[panels, in, PANEL]``: a panel's 16 output columns side by side for every k (zero-padded).

    float32 keeps a panel's even columns first, then its odd ones (the kernel's sums); bfloat16 keeps column order,
    or with ``pairs`` (the default where the kernel has the bfloat16 dot product) is ``[panels, in / 2, 2 * PANEL]``:
    for every pair of k, each column's two weights side by side (an odd ``in`` padded with a zero k).
    """
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    paired = weight.dtype == torch.bfloat16 and (bf16_pairs() if pairs is None else pairs)
    padded = torch.zeros(panels * PANEL, in_features + (paired and in_features % 2), dtype=weight.dtype)
    padded[:out_features, :in_features] = weight
    panel_rows = padded.view(panels, PANEL, -1)
    if paired:  # [panels, 16, in / 2, 2] -> [panels, in / 2, 16, 2]
        return panel_rows.view(panels, PANEL, -1, 2).transpose(1, 2).reshape(panels, -1, 2 * PANEL).contiguous()
    if weight.dtype == torch.float32:
        panel_rows = panel_rows[:, FLOAT32_COLUMNS]
    return panel_rows.transpose(1, 2).contiguous()


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """Two ``[intermediate, in]`` weights packed as one for ``panel_silu_mul``: the gate's panels, then up's.

    An ``intermediate`` that is no multiple of 16 is padded with zero columns to whole panels, in each of the
    two; ``pairs`` as in ``pack_weight``.
    """
    intermediate, in_features = gate.shape
    half = -(-intermediate // PANEL) * PANEL
    both = torch.zeros(2 * half, in_features, dtype=gate.dtype)
    both[:intermediate], both[half : half + intermediate] = gate, up
    return pack_weight(both, pairs)


# --8<-- [start:panel_linear]
class PanelLinear(nn.Module):
    """``nn.Linear``'s forward through the compiled kernel; ``logits=True`` returns float32 like a head."""

    def __init__(self, linear: nn.Linear, logits: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.logits = linear.in_features, linear.out_features, logits
        # Buffers, so that a compiled step (m5's capture, which freezes them) holds them as constants, not inputs.
        self.register_buffer("packed_weight", pack_weight(linear.weight.detach()), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.milestones.panel_linear(x, self.packed_weight, self.bias, self.out_features)
        return out.float() if self.logits else out
# --8<-- [end:panel_linear]


# --8<-- [start:fused_mlp]
class FusedMLP(nn.Module):
    """A gated MLP, ``down(silu(gate(x)) * up(x))`` (the lesson's ``MLP``), with gate and up in one kernel call.

    The numbers are those of the lesson's MLP over ``PanelLinear`` layers, bit for bit: one call fewer per layer,
    and no Python between the products and the activation.
    """

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        packed = pack_gate_up(mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)  # a buffer, as PanelLinear's
        self.down_proj = mlp.down_proj  # swapped for a PanelLinear with the model's other linear layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.ops.milestones.panel_silu_mul(x, self.packed_weight, self.intermediate))
# --8<-- [end:fused_mlp]


def swap_mlps(model: nn.Module) -> int:
    """Swap every gated MLP of the decoder (gate, up and down projections without bias) for a ``FusedMLP``; how many."""
    count = 0
    for parent in list(model.model.modules()):
        for name, child in parent.named_children():
            projections = [getattr(child, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
            if name == "mlp" and all(isinstance(p, nn.Linear) and p.bias is None for p in projections):
                setattr(parent, name, FusedMLP(child))
                count += 1
    return count
