"""The ``fuse_layers`` switch: a decode step's decoder layer in a few compiled calls, the lesson's layer otherwise.

The lesson's ``DecoderLayer`` is written operator by operator, and each operator is a call of its own: on a CPU a
trip through torch's dispatcher that costs more than its arithmetic on one token (a layer is about sixty of them),
on a GPU a kernel launch of a microsecond's work (58 a layer in a replayed step). ``FusedDecoderLayer`` wraps a
lesson layer and, in a step whose every row is a decode row that the attention backend's decode kernel takes (it
says so with ``DecodeRows.slots``), runs the same layer in about ten calls:

    norm -> qkv product -> RoPE and the KV write -> decode attention -> o product -> skip add and norm -> MLP -> add

with the lesson's own linear layers (or those the linear backend swapped in) for the products. The fused calls
are ``rms_norm.cpp`` and ``rope.cpp`` on a CPU, ``triton_fused.py`` on CUDA, where the MLP is three launches
(``GateUpMLP``: gate and up as one product, SiLU-and-mul, down): ten kernels a layer. On a CPU they round as the
compiled norm and the lesson's operators round, so a fused step gives the unfused step's outputs bit for bit; on
CUDA the norm's float32 sum runs in another order (within a unit in the last place,
tests/kernels/test_triton_fused.py), and the gate and up product may pick another cuBLAS kernel than either alone.
Every other step (a prefill chunk in it, the lesson's attention, torch.compile tracing a captured step, which
fuses on its own) runs the wrapped layer as it is.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention_backends import ContiguousDecodeKernel, DecodeKernelAttention, DecodeRows
from .build import compile_library
from .rms_norm import FusedRMSNorm, load_rms_norm

ROPE_SOURCE = Path(__file__).with_name("rope.cpp")
ROPE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")  # each product rounded, as torch rounds it
CPU_DTYPES = (torch.float32, torch.bfloat16)
CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class FusedOps:
    """One platform's fused calls (see the module's docstring)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, residual, weight, eps) -> (norm, sum)
    rope_and_write_kv: Callable[..., torch.Tensor]  # (q, k, v, cos, sin, pool_k, pool_v, slots) -> rotated q
    mlp: Callable[[nn.Module], nn.Module]  # the module a fused layer runs the lesson's MLP (or its swap) with


class GateUpMLP(nn.Module):
    """CUDA: the lesson's MLP in three launches. Gate and up are one product, their weights made views of one
    [2 * intermediate, hidden] tensor (so none is stored twice, and the lesson's MLP still reads them); then
    SiLU-and-mul over its two halves; then down."""

    def __init__(self, mlp: nn.Module, silu_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
        self.intermediate = gate.shape[0]
        self.weight = torch.cat([gate.data, up.data])
        gate.data, up.data = self.weight[: self.intermediate], self.weight[self.intermediate :]
        self.down_proj, self.silu_and_mul = mlp.down_proj, silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.weight)
        return self.down_proj(self.silu_and_mul(gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]))


# --8<-- [start:fused_layer]
class FusedDecoderLayer(nn.Module):
    """A lesson ``DecoderLayer`` in about ten calls on a step of decode rows, the layer itself on every other."""

    def __init__(self, layer: nn.Module, ops: FusedOps, attention: DecodeKernelAttention | ContiguousDecodeKernel):
        super().__init__()
        self.layer, self.ops, self.attention = layer, ops, attention
        self.plan = LayerPlan.of(layer, ops.mlp(layer.mlp))  # read once: an attribute lookup costs more than its work
        self.pools: tuple[Any, tuple[torch.Tensor, torch.Tensor]] | None = None  # (the cache, this layer's views)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: Any) -> torch.Tensor:
        rows = ctx.metadata
        if not isinstance(rows, DecodeRows) or rows.slots is None or torch.compiler.is_compiling():
            return self.layer(x, cos, sin, ctx)
        plan, ops, n = self.plan, self.ops, x.shape[0]
        h = ops.rms_norm(x, plan.input_norm, plan.eps)
        q, k, v = plan.qkv_proj(h).split(plan.qkv_sizes, dim=-1)
        q, k, v = q.view(n, plan.num_heads, plan.head_dim), k.view(n, -1, plan.head_dim), v.view(n, -1, plan.head_dim)
        pool_k, pool_v = self._pools(ctx)
        q = ops.rope_and_write_kv(q, k, v, cos[:, 0], sin[:, 0], pool_k, pool_v, rows.slots)
        out = self.attention.kernel(q, pool_k, pool_v, rows.block_tables, rows.context_lens, plan.scale)
        h, x = ops.add_rms_norm(plan.o_proj(out.view(n, -1)), x, plan.post_norm, plan.eps)
        return x + plan.mlp(h)

    def _pools(self, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values as the kernels see them: views, made again only for another cache."""
        if self.pools is None or self.pools[0] is not ctx.k_cache:
            self.pools = ctx.k_cache, self.attention.pools(ctx, self.plan.layer_index)
        return self.pools[1]
# --8<-- [end:fused_layer]


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """What a fused layer reads of the lesson's layer, every step: its products, norms' weights and shapes."""

    qkv_proj: nn.Module
    o_proj: nn.Module
    mlp: nn.Module
    input_norm: torch.Tensor  # the norms' weights
    post_norm: torch.Tensor
    eps: float
    qkv_sizes: list[int]
    num_heads: int
    head_dim: int
    scale: float
    layer_index: int

    @classmethod
    def of(cls, layer: nn.Module, mlp: nn.Module) -> LayerPlan:
        attn = layer.self_attn
        input_norm, eps = norm_of(layer.input_layernorm)
        post_norm, post_eps = norm_of(layer.post_attention_layernorm)
        assert eps == post_eps, "a layer's two norms share their eps (the model's rms_norm_eps)"
        return cls(attn.qkv_proj, attn.o_proj, mlp, input_norm, post_norm, eps,
                   [attn.q_size, attn.kv_size, attn.kv_size], attn.num_heads, attn.head_dim, attn.head_dim**-0.5,
                   attn.layer_index)


def norm_of(norm: nn.Module) -> tuple[torch.Tensor, float]:
    """A norm's weight and eps, the lesson's ``RMSNorm`` or the compiled one that wraps it."""
    norm = norm.norm if isinstance(norm, FusedRMSNorm) else norm
    return norm.weight, norm.eps


def fuse_layers_for(config: Any, model: nn.Module, attention: Any) -> int:
    """Wrap every decoder layer in a ``FusedDecoderLayer`` where this (already checked) ``fuse_layers`` asks and the
    layer can be fused; return how many were. "auto" fuses where it applies and its calls build, and says nothing
    otherwise; True insists (an error naming what is missing); False leaves the model as it is."""
    if config.fuse_layers is False:
        return 0
    missing = _missing(config, model, attention)
    ops = None
    if missing is None:
        try:
            ops = fused_ops_for(config.device)
        except Exception as error:  # no triton, no compiler: a build error arrives as one of several types
            missing = f"its calls cannot run here ({error})"
            if config.fuse_layers == "auto":
                warnings.warn(f"fuse_layers: {missing}; every layer runs as the lesson writes it", stacklevel=2)
    if ops is None:
        if config.fuse_layers is True:
            raise RuntimeError(f"fuse_layers=True cannot fuse this engine's layers: {missing}; use 'auto' or False")
        return 0
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = FusedDecoderLayer(layer, ops, attention)
    return len(layers)


def _missing(config: Any, model: nn.Module, attention: Any) -> str | None:
    """What keeps these layers from fusing, or None."""
    if not isinstance(attention, (DecodeKernelAttention, ContiguousDecodeKernel)):
        return (f"it needs a decode kernel (attention_backend 'cpp' on a CPU, 'triton' on CUDA), and attention "
                f"runs on {attention.name!r}")
    if config.dtype not in (CUDA_DTYPES if config.device.type == "cuda" else CPU_DTYPES):
        return f"its calls do not run in {config.dtype} on {config.device.type}"
    if model.config.qk_norm:
        return "the model normalises q and k (Qwen3), which the fused RoPE does not"
    if getattr(config, "tensor_parallel_size", 1) > 1:
        return "a tensor-parallel layer adds its ranks' partial sums between the products"
    if config.device.type == "cpu" and not isinstance(model.model.norm, FusedRMSNorm):
        return "on a CPU it comes with the compiled norms (linear_backend 'cpp', or a quantization)"
    return None


def fused_ops_for(device: torch.device) -> FusedOps:
    """The fused calls for this device, built (CPU) or imported (CUDA) once; raises if they cannot run."""
    if device.type == "cuda":
        return triton_ops()
    load_rope()
    load_rms_norm()
    ops = torch.ops.milestones
    return FusedOps(ops.rms_norm, ops.add_rms_norm, ops.rope_and_write_kv, lambda mlp: mlp)  # mlp: the swap's


def triton_ops() -> FusedOps:
    """CUDA's fused calls, ``triton_fused.py`` (which Triton's interpreter also runs on CPU tensors, for the tests)."""
    from . import triton_fused  # imported here: triton is slow to import, and only there on a GPU machine

    return FusedOps(lambda x, weight, eps: triton_fused.rms_norm(x, weight, eps)[0],
                    lambda x, residual, weight, eps: triton_fused.rms_norm(x, weight, eps, residual),
                    triton_fused.rope_and_write_kv, lambda mlp: GateUpMLP(mlp, triton_fused.silu_and_mul))


def load_rope() -> None:
    """Build (once per machine) and load ``torch.ops.milestones.rope_and_write_kv``."""
    compile_library(ROPE_SOURCE, ROPE_FLAGS)
    _register_shape()


@functools.cache
def _register_shape() -> None:
    torch.library.register_fake("milestones::rope_and_write_kv",
                                lambda q, k, v, cos, sin, pool_k, pool_v, slots: torch.empty_like(q))


def check_fuse_layers(value: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a value that is not a switch, or True where the fused calls cannot run."""
    if not (value is True or value is False or value == "auto"):
        raise ValueError(f"fuse_layers must be True, False or 'auto', got {value!r}")
    dtypes = CUDA_DTYPES if device.type == "cuda" else CPU_DTYPES
    if value is True and dtype not in dtypes:
        raise ValueError(f"fuse_layers=True runs in {', '.join(str(d).removeprefix('torch.') for d in dtypes)} on "
                         f"{device.type} (got {dtype}); use 'auto' or False")
