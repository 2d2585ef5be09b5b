"""Every request of a step in one attention call per layer: whole prompts, chunks, decodes and m7's guesses alike.

The lessons' ``attention`` goes request by request, a few operators each. On a CPU that costs
little beside the step's products, and the compiled decode kernel takes the decodes; on CUDA
every operator is a launch from Python, so a step of many requests spends its time launching.
``attention_backend="batched"`` (and ``"auto"`` on CUDA) hands the whole step to one call per
layer instead, which reads each request's keys and values through its block table:

* ``varlen``: flash attention over ragged sequences, torch's ``varlen_attn``, where the torch
  build has it and it applies (CUDA, bfloat16 or float16). Each request's context is first
  gathered from the pool into one packed run: one copy per layer, of exactly the positions read.
* ``padded``: plain torch, which runs anywhere: every request's queries and context padded to
  the step's longest, one ``scaled_dot_product_attention`` call with a mask per row. It is the
  fall-back where varlen cannot run (float32, a CPU, a torch without it), and what a CPU checks.

Which one an engine gets is settled once, at start-up (``batched_attention_for``). varlen must
first agree with padded on a small probe, so a torch whose flash kernel is missing, or reads its
arguments otherwise than this file expects, falls back with a warning instead of failing or
computing something else.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch
import torch.nn.functional as F

from milestones.transfer import to_device

VARLEN_DTYPES = (torch.bfloat16, torch.float16)  # flash attention's
PROBE_ATOL = 2e-2  # varlen against padded on the start-up probe: a few units of bfloat16 at outputs of about 1

VarlenKernel = Callable[..., torch.Tensor]  # (q, keys, values, cu_seq_q, cu_seq_k, max_q, max_k) -> out


@dataclass(slots=True)
class VarlenBatch:
    """A step laid out for ``varlen_attn``: request r's queries are rows ``cu_q[r]:cu_q[r + 1]``, its keys the
    positions ``cu_k[r]:cu_k[r + 1]`` of the packed run that ``key_blocks`` and ``key_offsets`` gather."""

    kernel: VarlenKernel
    cu_q: torch.Tensor  # [requests + 1], int32
    cu_k: torch.Tensor  # [requests + 1], int32
    key_blocks: torch.Tensor  # [context positions of all requests]: the block of each, in order
    key_offsets: torch.Tensor  # and its place in the block
    max_q: int
    max_k: int

    def __call__(self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor) -> torch.Tensor:
        """q: [n, heads, dim]; pool_k, pool_v: [blocks, kv_heads, block_size, dim]. One gather and one kernel."""
        keys = pool_k[self.key_blocks, :, self.key_offsets]  # [positions, kv_heads, dim]: every context, packed
        values = pool_v[self.key_blocks, :, self.key_offsets]
        return self.kernel(q, keys, values, self.cu_q, self.cu_k, self.max_q, self.max_k)


@dataclass(slots=True)
class PaddedBatch:
    """A step laid out for one ``scaled_dot_product_attention`` call: a batch row per request, its queries and
    context padded to the step's longest (padding repeats a real row or position, and is masked or dropped)."""

    query_rows: torch.Tensor  # [requests, max_q]: the flat batch's row of each query
    key_blocks: torch.Tensor  # [requests, max_k]: the block of each context position
    key_offsets: torch.Tensor  # [requests, max_k]
    visible: torch.Tensor  # [requests, 1, max_q, max_k]: query i of a chunk of n sees positions 0 .. L - n + i
    out_rows: torch.Tensor  # [n]: where each row of the flat batch lies among the padded [requests * max_q]

    def __call__(self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor) -> torch.Tensor:
        """q: [n, heads, dim]; pool_k, pool_v: [blocks, kv_heads, block_size, dim]."""
        keys = pool_k[self.key_blocks, :, self.key_offsets].transpose(1, 2)  # [requests, kv_heads, max_k, dim]
        values = pool_v[self.key_blocks, :, self.key_offsets].transpose(1, 2)
        queries = q[self.query_rows].transpose(1, 2)  # [requests, heads, max_q, dim]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.visible, enable_gqa=True)
        return out.transpose(1, 2).flatten(0, 1)[self.out_rows]


RaggedBatch = VarlenBatch | PaddedBatch  # what attention calls: (q, pool_k, pool_v) -> out


@dataclass(slots=True)
class BatchedAttention:
    """The way an engine attends to a whole step (``name``), and ``__call__``, which lays out each step for it."""

    name: str  # "varlen" or "padded"
    kernel: VarlenKernel | None  # varlen_attn with the arguments this torch wants for causal GQA; None: padded

    def __call__(self, query_lens: list[int], context_lens: list[int], key_starts: list[int], tables: torch.Tensor,
                 block_size: int) -> RaggedBatch:
        """Request r computes the last ``query_lens[r]`` of its ``context_lens[r]`` positions, which lie in order in
        the blocks ``tables[key_starts[r] // block_size ...]``; its rows follow request r - 1's in the flat batch.

        One copy to the device of a few numbers per request; the indices are made there, none per token on the host.
        """
        cu_q, cu_k = [0, *accumulate(query_lens)], [0, *accumulate(context_lens)]
        numbers = to_device(cu_q + cu_k + key_starts, torch.long, tables.device)
        count = len(query_lens)
        cu_q_t, cu_k_t, starts = numbers[: count + 1], numbers[count + 1 : 2 * count + 2], numbers[2 * count + 2 :]
        q_lens, k_lens = cu_q_t.diff(), cu_k_t.diff()
        max_q, max_k = max(query_lens), max(context_lens)
        if self.kernel is not None:  # each context's positions, packed: position p of request r at cu_k[r] + p
            packed = torch.repeat_interleave(starts - cu_k_t[:-1], k_lens, output_size=cu_k[-1])
            packed += torch.arange(cu_k[-1], device=tables.device)  # now its place in the run of the blocks
            return VarlenBatch(self.kernel, cu_q_t.int(), cu_k_t.int(), tables[packed // block_size],
                               packed % block_size, max_q, max_k)
        i, j = torch.arange(max_q, device=tables.device), torch.arange(max_k, device=tables.device)
        query_rows = cu_q_t[:-1, None] + torch.minimum(i, q_lens[:, None] - 1)  # padding repeats the last row
        positions = starts[:, None] + torch.minimum(j, k_lens[:, None] - 1)  # and the last position
        visible = j <= (k_lens - q_lens)[:, None, None] + i[:, None]  # [requests, max_q, max_k], causal at the end
        out_rows = torch.repeat_interleave(torch.arange(count, device=tables.device) * max_q - cu_q_t[:-1], q_lens,
                                           output_size=cu_q[-1]) + torch.arange(cu_q[-1], device=tables.device)
        return PaddedBatch(query_rows, tables[positions // block_size], positions % block_size, visible[:, None],
                           out_rows)


class Heads(Protocol):
    """What the start-up probe needs of a model's config."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def batched_attention_for(backend: str, device: torch.device, dtype: torch.dtype,
                          heads: Heads) -> BatchedAttention | None:
    """What an engine with this (already checked) ``attention_backend`` attends to a step with, or None for the
    lesson's request-by-request path: "batched" anywhere, "auto" on CUDA only (a CPU keeps its defaults)."""
    if not (backend == "batched" or (backend == "auto" and device.type == "cuda")):
        return None
    if device.type != "cuda" or dtype not in VARLEN_DTYPES:
        return BatchedAttention("padded", None)
    kernel = varlen_kernel()
    if kernel is None:
        warnings.warn("this torch has no usable torch.nn.attention.varlen.varlen_attn: batched attention takes the "
                      "padded plain-torch path (one call per layer all the same)", stacklevel=2)
        return BatchedAttention("padded", None)
    try:
        error = probe_varlen(kernel, device, dtype, heads)
    except Exception as failure:  # a flash kernel that is not built for this GPU or head size raises at its first call
        error = f"it failed: {failure}"
    if error is not None:
        warnings.warn(f"varlen_attn is not used ({error}): batched attention takes the padded plain-torch path",
                      stacklevel=2)
        return BatchedAttention("padded", None)
    return BatchedAttention("varlen", kernel)


def varlen_kernel() -> VarlenKernel | None:
    """torch's varlen_attn with causal masking and grouped-query heads asked for as this torch spells them, or None.

    torch 2.11 takes ``window_size=(-1, 0)`` for causal, and reads fewer kv heads than query heads as they come;
    2.13 also wants ``enable_gqa=True``. Flash's causal mask ends at the last key (bottom right): query i of a chunk
    of n sees the first L - n + i + 1 of its L keys, which is what a chunk at the end of a context needs.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" in parameters:
        options = {"window_size": (-1, 0)}
    elif "is_causal" in parameters:
        options = {"is_causal": True}
    else:
        return None
    if "enable_gqa" in parameters:
        options["enable_gqa"] = True

    def kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int) -> torch.Tensor:
        return varlen_attn(q, keys, values, cu_q, cu_k, max_q, max_k, **options)

    return kernel


def probe_varlen(kernel: VarlenKernel, device: torch.device, dtype: torch.dtype, heads: Heads) -> str | None:
    """Run both layouts on a small step of this model's heads (a chunk ending a context, a whole prompt, a decode,
    blocks out of order); None if varlen agrees with padded, else what went wrong."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    pool_k, pool_v = (torch.randn(6, heads.num_kv_heads, 4, heads.head_dim, generator=generator).to(device, dtype)
                      for _ in range(2))
    query_lens, context_lens, key_starts = [3, 5, 1], [9, 5, 7], [0, 12, 20]
    tables = torch.tensor([4, 0, 2, 1, 3, 5, 1, 2], device=device)
    q = torch.randn(sum(query_lens), heads.num_heads, heads.head_dim, generator=generator).to(device, dtype)
    ragged = [BatchedAttention("probe", k)(query_lens, context_lens, key_starts, tables, 4) for k in (kernel, None)]
    got, expected = (batch(q, pool_k, pool_v).float() for batch in ragged)
    if got.shape != expected.shape or not torch.allclose(got, expected, atol=PROBE_ATOL, rtol=0):
        worst = (got - expected).abs().max().item() if got.shape == expected.shape else got.shape
        return f"its result on a probe differs from the padded path's: {worst}"
    return None
