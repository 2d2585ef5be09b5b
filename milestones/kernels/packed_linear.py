"""Linear layers whose weights are packed once for oneDNN: the CPU fast path behind ``linear_backend``.

On a CPU, matrix products are most of a step's time. ``F.linear`` hands the weight
to the BLAS in the checkpoint's ``[out, in]`` layout, and the BLAS re-arranges
panels of it into the blocked order its inner kernel streams, on every call.
oneDNN can do that re-arrangement once, at load time (``_reorder_linear_weight``),
then read the packed weight straight through (``_linear_pointwise``); the packed
tensor is opaque, usable only by oneDNN. vLLM's CPU backend packs its linear
layers the same way. The arithmetic is the same, but oneDNN sums in its own order,
so results differ from ``F.linear``'s in the last bits. What it buys is measured on
the benchmarks page. The packed LM head is a second copy of the head (the embedding
keeps the original); the decoder's packed weights replace the originals. Inductor
cannot lower oneDNN's op over an opaque weight, so inside ``torch.compile`` (m5's
captured CPU step) a layer calls it through the custom op ``milestones::packed_linear``,
which the compiled code then calls as it is.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("milestones::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear over a packed weight, opaque to torch.compile (which would try to lower it and fail)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))  # the packed weight keeps its [out, in] shape


# --8<-- [start:packed_linear]
class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight packed for oneDNN; ``logits=True`` returns float32 like a head."""

    def __init__(self, linear: nn.Linear, logits: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.logits = linear.in_features, linear.out_features, logits
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the custom op; eager: the op itself, without its dispatch
            out = packed_linear(x, self.packed_weight, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out.float() if self.logits else out
# --8<-- [end:packed_linear]


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build carries oneDNN's packed linear ops (x86 builds do), and this CPU runs them in ``dtype``.

    oneDNN packs bfloat16 weights only on a CPU with bfloat16 instructions (AVX-512 BF16, AMX or AVX-NE-CONVERT).
    """
    ops = ("_reorder_linear_weight", "_linear_pointwise")
    if not (torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in ops)):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
