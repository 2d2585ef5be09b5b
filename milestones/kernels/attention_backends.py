"""The one seam between a lesson's attention and the kernels: a backend, selected once by the runner.

Each milestone's ``attention.py`` holds the plain-torch reference its chapter teaches,
``attention(q, k, v, layer, ctx)``, and nothing else. The model calls whatever its runner chose
(``CausalLM.use_attention``); the runner chose once, at start-up (``attention_backend_for``), and calls
``prepare_metadata(ctx)`` once a step, after it has built the step's ``AttentionContext``. Two halves,
as mini-sglang's attention backends and vLLM's metadata builders have them:

* ``prepare_metadata(ctx)`` takes the backend's share of the step's requests out of ``ctx.requests``
  and lays it out for its kernel in ``ctx.metadata`` (the lesson's attention never reads it);
* ``forward(q, k, v, layer, ctx)`` calls the reference, which writes every new key and value and
  attends to the requests left to it, then fills the rows the kernel took.

The backends: ``TorchAttention`` (the reference alone); ``DecodeKernelAttention``, the compiled CPU
kernel or the Triton one on CUDA for every request with one new token (from m5, a captured step's
rows too); ``RaggedAttention`` on CUDA for all of an eager step's requests in one call; and m1's
``ContiguousDecodeKernel``, whose single request has no spans to share. How a milestone's cache is seen
as a pool of blocks, ``[blocks, kv_heads, block_size, dim]``, is its ``CacheLayout``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from milestones.transfer import to_device

from .batched_attention import BatchedAttention, batched_attention_for
from .decode_attention import DecodeKernel, decode_kernel_for

Attention = Callable[..., torch.Tensor]  # (q, k, v, layer, ctx) -> out: a lesson's attention, or a backend's forward
LAYOUTS = ("contiguous", "slots", "paged")  # m1's rows, m2's slots, m3's blocks


class AttentionBackend(Protocol):
    name: str

    def prepare_metadata(self, ctx: Any) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: Any) -> torch.Tensor: ...


@dataclass(slots=True)
class DecodeRows:
    """Requests with one new token each, for one call of a decode kernel, which reads their blocks in place."""

    rows: torch.Tensor | None  # [d]: the row of each request's token in the flat batch (m1: None, its one row)
    block_tables: torch.Tensor  # [d, max_blocks]: padded past each context (never read there)
    context_lens: torch.Tensor  # [d]
    # [d]: where each row's new key goes in ``pools`` (block * block_size + offset), given when the rows are every row
    # of the step, in order: then a fused layer may write the keys and values itself (fused_layers.py)
    slots: torch.Tensor | None = None


@dataclass(slots=True)
class TorchAttention:
    """The lesson's attention as it is: nothing to prepare."""

    forward: Attention
    name: str = "torch"

    def prepare_metadata(self, ctx: Any) -> None:
        pass


@dataclass(slots=True)
class CacheLayout:
    """How a milestone's cache looks to a kernel: m2 sees each slot as one block of ``max_model_len`` positions
    (``block_size`` is the layer's dimension 2 either way), m3 on reads its blocks; m3 also gathers the blocks of
    the requests left to the reference in one copy (``ctx.block_tables`` and each span's ``first``)."""

    name: str  # "slots" or "paged"

    def table(self, span: Any) -> list[int]:
        return [span.kv_slot] if self.name == "slots" else span.block_table

    def pools(self, ctx: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values as [blocks, kv_heads, block_size, dim] (views, no copy)."""
        if self.name == "slots":
            return ctx.k_cache[layer], ctx.v_cache[layer]
        return ctx.k_cache[layer].transpose(0, 1), ctx.v_cache[layer].transpose(0, 1)

    def slots(self, ctx: Any, spans: list) -> torch.Tensor:
        """Each span's new key's slot in ``pools`` (spans of one token: m3 on, the step's own slot mapping)."""
        if self.name == "paged":
            return ctx.slot_mapping
        max_len = ctx.k_cache[0].shape[2]  # m2: a slot is a block of max_model_len positions
        return to_device([span.kv_slot * max_len + span.context_len - 1 for span in spans], torch.long,
                         ctx.k_cache[0].device)

    def keep(self, ctx: Any, spans: list) -> None:
        """Leave only ``spans`` to the reference (m3 on: and only their blocks to its gather)."""
        ctx.requests = spans
        if self.name == "paged" and spans:
            block_size, tables = ctx.k_cache[0].shape[2], []
            for span in spans:
                span.first = len(tables) * block_size
                tables += span.block_table
            ctx.block_tables = to_device(tables, torch.long, ctx.k_cache[0].device)


@dataclass(slots=True)
class DecodeKernelAttention:
    """A decode kernel (``q, pool_k, pool_v, block_tables, context_lens, scale``) for every one-token request."""

    name: str  # "cpp" or "triton"
    kernel: DecodeKernel
    reference: Attention
    layout: CacheLayout

    def prepare_metadata(self, ctx: Any) -> None:
        fixed = getattr(ctx, "decodes", None)  # m5 on: a captured step's rows (every row), laid out by the lesson
        if fixed is not None:
            ctx.metadata = DecodeRows(fixed.rows, fixed.block_tables, fixed.context_lens, ctx.slot_mapping)
            ctx.decodes = None
            return
        decodes = [span for span in ctx.requests if span.end - span.start == 1]
        if not decodes:
            return
        every_row = len(decodes) == len(ctx.requests)  # spans follow each other: the rows are 0, 1, 2, ...
        self.layout.keep(ctx, [span for span in ctx.requests if span.end - span.start > 1])
        tables = [self.layout.table(span) for span in decodes]
        width = max(len(table) for table in tables)
        device = ctx.k_cache[0].device
        ctx.metadata = DecodeRows(to_device([span.start for span in decodes], torch.long, device),
                                  to_device([table + [0] * (width - len(table)) for table in tables], torch.long,
                                            device),
                                  to_device([span.context_len for span in decodes], torch.long, device),
                                  self.layout.slots(ctx, decodes) if every_row else None)

    def pools(self, ctx: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layout.pools(ctx, layer)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: Any) -> torch.Tensor:
        out = self.reference(q, k, v, layer, ctx)  # every key and value written; the requests left to it attended
        if (rows := ctx.metadata) is not None:
            pool_k, pool_v = self.layout.pools(ctx, layer)
            out[rows.rows] = self.kernel(q[rows.rows], pool_k, pool_v, rows.block_tables, rows.context_lens,
                                         q.shape[-1] ** -0.5)
        return out


@dataclass(slots=True)
class RaggedAttention:
    """Every request of an eager step in one call per layer (``batched_attention.py``); a captured step's rows stay
    with the reference (m5's ``paged_decode_attention``)."""

    batched: BatchedAttention
    reference: Attention
    layout: CacheLayout

    @property
    def name(self) -> str:
        return self.batched.name  # "varlen" or "padded"

    def prepare_metadata(self, ctx: Any) -> None:
        spans = ctx.requests
        if not spans:
            return
        block_size, tables, starts = ctx.k_cache[0].shape[2], [], []
        for span in spans:
            starts.append(len(tables) * block_size)
            tables += self.layout.table(span)
        self.layout.keep(ctx, [])
        ctx.metadata = self.batched([span.end - span.start for span in spans], [span.context_len for span in spans],
                                    starts, to_device(tables, torch.long, ctx.k_cache[0].device), block_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: Any) -> torch.Tensor:
        out = self.reference(q, k, v, layer, ctx)  # every key and value written (and a captured step attended)
        if ctx.metadata is None:
            return out
        return ctx.metadata(q, *self.layout.pools(ctx, layer))


@dataclass(slots=True)
class ContiguousDecodeKernel:
    """m1's one request, its cache one row per position: a decode step in one call of the kernel, each row seen as
    a block of one position; a prefill stays with the reference."""

    name: str
    kernel: DecodeKernel
    reference: Attention
    block_table: torch.Tensor  # [1, max_model_len]: 0, 1, 2, ..., sliced to the context

    def prepare_metadata(self, ctx: Any) -> None:
        if ctx.slot_mapping.numel() == 1:
            lens = to_device([ctx.context_len], torch.long, self.block_table.device)
            ctx.metadata = DecodeRows(None, self.block_table[:, : ctx.context_len], lens, ctx.slot_mapping)

    def pools(self, ctx: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's rows as blocks of one position: [max_model_len, kv_heads, 1, dim] (views)."""
        return ctx.k_cache[layer][:, :, None], ctx.v_cache[layer][:, :, None]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: Any) -> torch.Tensor:
        if (rows := ctx.metadata) is None:
            return self.reference(q, k, v, layer, ctx)
        k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
        k_cache.index_copy_(0, ctx.slot_mapping, k)  # as the reference writes them
        v_cache.index_copy_(0, ctx.slot_mapping, v)
        return self.kernel(q, *self.pools(ctx, layer), rows.block_tables, rows.context_lens, q.shape[-1] ** -0.5)


def attention_backend_for(config: Any, heads: Any, reference: Attention, layout: str) -> AttentionBackend:
    """What an engine with this (already checked) ``attention_backend`` attends with, over a cache of this layout:
    a decode kernel where one applies (the compiled one on a CPU, "triton" on CUDA), else batched attention where it
    is asked for ("batched", or "auto" on CUDA; not m1's), else the lesson's ``reference``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    kernel = decode_kernel_for(config.attention_backend, config.device, config.dtype)
    name = "triton" if config.device.type == "cuda" else "cpp"
    if kernel is not None and layout == "contiguous":
        table = torch.arange(config.max_model_len, device=config.device)[None]
        return ContiguousDecodeKernel(name, kernel, reference, table)
    if kernel is not None:
        return DecodeKernelAttention(name, kernel, reference, CacheLayout(layout))
    batched = None if layout == "contiguous" else batched_attention_for(config.attention_backend, config.device,
                                                                          config.dtype, heads)
    if batched is not None:
        return RaggedAttention(batched, reference, CacheLayout(layout))
    return TorchAttention(reference)
