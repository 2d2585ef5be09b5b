"""Paged attention: keys and values live in a pool of fixed-size blocks.

The cache of each layer is ``[kv_heads, num_blocks, block_size, head_dim]``. A
request's tokens are scattered over whichever blocks it was given; its *block
table* lists them in order. Writing uses the *slot mapping*: new token i goes to
slot ``slot_mapping[i] = block * block_size + offset``. Reading gathers the
request's blocks through its table, back into one contiguous run of keys: all
requests' tables at once, one copy per layer, after which each request reads its
own range exactly as in m2.

This is plain torch, correct on CPU and CUDA. A real paged-attention kernel
(vLLM's) reads the blocks in place instead of copying them; such kernels plug in
beside this reference, chosen once by the runner (``milestones/kernels/attention_backends.py``),
and take the decoding requests, or every request, off it. m5: a captured decode step's
rows come as ``decodes``, in fixed shapes (``paged_decode_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# --8<-- [start:context]
@dataclass(slots=True)
class AttentionContext:
    """What attention needs to know about this step, built by the model runner."""

    k_cache: torch.Tensor | list[torch.Tensor]  # [num_layers, kv_heads, blocks, block_size, dim], or a list by layer
    v_cache: torch.Tensor | list[torch.Tensor]
    slot_mapping: torch.Tensor  # [num_tokens]: block * block_size + offset of each new token
    block_tables: torch.Tensor  # the block tables of ``requests``, one after the other, gathered in one copy
    requests: list[RequestSpan]  # the requests that attention goes through one by one
    decodes: DecodeBatch | None = None  # m5: a captured step's rows, one new token each
    metadata: object = None  # what a kernel backend prepared for this step; attention() never reads it


@dataclass(slots=True)
class RequestSpan:
    """One request's new tokens in the flat batch, and where its keys and values are."""

    start: int  # its first row in the flat batch
    end: int  # one past its last row
    block_table: list[int]  # the blocks that hold its context, in order
    context_len: int  # tokens it attends to, this step's included
    first: int = 0  # where its keys begin in the run gathered from ``block_tables``


@dataclass(slots=True)
class DecodeBatch:
    """m5: requests with one new token each, in the fixed shapes of a captured step."""

    rows: torch.Tensor  # [d]: the row of each request's token in the flat batch
    block_tables: torch.Tensor  # [d, max_blocks]: each request's block table, padded past its context (masked)
    context_lens: torch.Tensor  # [d]
# --8<-- [end:context]


# --8<-- [start:attention]
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: AttentionContext) -> torch.Tensor:
    """q: [n, heads, dim]; k, v: [n, kv_heads, dim] for the n new tokens of all requests."""
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    block_size = k_cache.shape[2]
    blocks, offsets = ctx.slot_mapping // block_size, ctx.slot_mapping % block_size
    # Not m4's flat view of the slots: compiled, a write into an input itself stays in place, but a write through a
    # view of it becomes a copy of the layer's whole cache at every step (a replay: 10 -> 39 ms).
    k_cache[:, blocks, offsets] = k.transpose(0, 1)
    v_cache[:, blocks, offsets] = v.transpose(0, 1)
    out = torch.empty_like(q)
    if (batch := ctx.decodes) is not None:  # m5: read through the padded tables, in place
        pool_k, pool_v = k_cache.transpose(0, 1), v_cache.transpose(0, 1)  # [blocks, kv_heads, block_size, dim] views
        out[batch.rows] = paged_decode_attention(q[batch.rows], pool_k, pool_v, batch.block_tables,
                                                 batch.context_lens, q.shape[-1] ** -0.5)
    if not ctx.requests:  # a captured step, or every request taken by a kernel backend
        return out
    all_keys, all_values = gather(k_cache, ctx.block_tables), gather(v_cache, ctx.block_tables)
    for span in ctx.requests:
        keys = all_keys[:, span.first : span.first + span.context_len]
        values = all_values[:, span.first : span.first + span.context_len]
        attend = decode_attention if span.end - span.start == 1 else prefill_attention
        out[span.start : span.end] = attend(q[span.start : span.end], keys, values)
    return out
# --8<-- [end:attention]


# --8<-- [start:gather]
def gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Read blocks through block tables into one run: [kv_heads, len(tables) * block_size, dim], one copy."""
    num_kv_heads, _, block_size, dim = cache.shape
    return cache.index_select(1, tables).view(num_kv_heads, len(tables) * block_size, dim)
# --8<-- [end:gather]


# --8<-- [start:prefill_attention]
def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A chunk of n tokens at the end of a context of L tokens: query i sees keys 0..L-n+i.

    The tensors get a batch dimension of one: on a CPU only 4-D inputs reach
    torch's flash-attention kernel, and 3-D ones take the slower math path.
    """
    n, context_len = q.shape[0], keys.shape[1]
    q, keys, values = q.transpose(0, 1)[None], keys[None], values[None]  # [1, heads, n, dim], [1, kv_heads, L, dim]
    if n == context_len:  # the whole prompt at once: the plain causal mask
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    else:
        query_positions = torch.arange(context_len - n, context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device) <= query_positions[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
    return out[0].transpose(0, 1)
# --8<-- [end:prefill_attention]


# --8<-- [start:paged_decode_attention]
def paged_decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Every request's one new token at once, in fixed shapes: what a captured decode step runs.

    The compiled kernel's signature, in plain torch, summed in float32 as the kernel and
    ``decode_attention`` are. Each request reads every block of its (padded) table, and a
    mask hides the positions at or beyond its context length, so the shapes depend on the
    batch size and ``max_model_len`` alone, never on the data.
    q: [n, heads, dim]; pool_k, pool_v: [blocks, kv_heads, block_size, dim]; block_tables: [n, max_blocks].
    """
    n, num_heads, dim = q.shape
    _, num_kv_heads, block_size, _ = pool_k.shape
    keys = pool_k[block_tables].transpose(1, 2).reshape(n, num_kv_heads, -1, dim)  # [n, kv_heads, positions, dim]
    values = pool_v[block_tables].transpose(1, 2).reshape(n, num_kv_heads, -1, dim)
    q = q.view(n, num_kv_heads, num_heads // num_kv_heads, dim).float()  # query heads grouped by their kv head
    scores = torch.matmul(q, keys.float().transpose(2, 3)) * scale  # [n, kv_heads, group, positions], float32
    visible = torch.arange(keys.shape[2], device=q.device) < context_lens[:, None]  # [n, positions]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), values.float())
    return out.to(values.dtype).view(n, num_heads, dim)
# --8<-- [end:paged_decode_attention]


# --8<-- [start:decode_attention]
def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One new token sees every cached row, so no mask is needed.

    Grouped-query attention: query head h reads kv head ``h // group``, so the
    query heads are viewed as [kv_heads, group] and each kv head is read once.
    Summed in float32 whatever the cache holds (no copy in float32): in bfloat16 that is
    closer to the truth, and on a CPU faster, for torch's bfloat16 product costs more to
    start than these few rows take. Written out by hand: see the benchmarks page.
    """
    num_kv_heads, _, dim = keys.shape
    q = q.view(num_kv_heads, -1, dim).float()  # [kv_heads, group, dim]
    scores = torch.bmm(q, keys.float().transpose(1, 2)) * dim**-0.5  # [kv_heads, group, context_len]
    out = torch.bmm(scores.softmax(dim=-1), values.float())
    return out.to(values.dtype).view(1, -1, dim)
# --8<-- [end:decode_attention]
