"""RMS norms in one compiled call (``rms_norm.cpp``): the eager path that comes with ``linear_backend="cpp"``.

The lesson's ``RMSNorm`` is six torch operators; on a CPU each costs more in dispatch
than in arithmetic on a row of a few hundred numbers, and a decode step of SmolLM2 runs
61 norms. ``FusedRMSNorm`` wraps a model's norm and runs the same arithmetic as one
op, ``torch.ops.milestones.rms_norm``. Inside ``torch.compile`` (m5's captured step) it
runs the lesson's own norm instead, which inductor already fuses with its neighbours.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from .build import compile_library

SOURCE = Path(__file__).with_name("rms_norm.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")  # squares rounded, then summed, as torch does


def load_rms_norm() -> None:
    """Build (once per machine) and load the op; raises if it cannot be built (tried once per process)."""
    compile_library(SOURCE, FLAGS)
    _register_shape()


@functools.cache
def _register_shape() -> None:
    torch.library.register_fake("milestones::rms_norm", lambda x, weight, eps: torch.empty_like(x))
    torch.library.register_fake("milestones::add_rms_norm",
                                lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x)))


# --8<-- [start:fused_rms_norm]
class FusedRMSNorm(nn.Module):
    """A model's ``RMSNorm`` through one compiled call; the norm itself where torch.compile traces."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm  # the lesson's module: its weight and eps, and its forward for torch.compile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.norm(x)
        return torch.ops.milestones.rms_norm(x, self.norm.weight, self.norm.eps)
# --8<-- [end:fused_rms_norm]


def swap_rms_norms(model: nn.Module) -> int:
    """Wrap every norm of the decoder of the final norm's type in a ``FusedRMSNorm``; return how many."""
    norm_type, count = type(model.model.norm), 0
    for parent in list(model.model.modules()):
        for name, child in parent.named_children():
            if type(child) is norm_type:
                setattr(parent, name, FusedRMSNorm(child))
                count += 1
    return count
