"""Attention for a packed batch of many requests, each with its own contiguous KV slot.

The cache has one slot per running request, each long enough for
``max_model_len`` tokens: ``k_cache[layer][slot, head, pos]``. The linear layers
ran once over the whole flat batch; attention now goes request by request, each
reading only its own slot, up to its own length: no padding, no copies.

A request in the batch is either decoding (one new token, which sees its whole
cache) or prefilling a chunk of its prompt (several new tokens, which see the
part of the prompt cached before them and, causally, each other). This is the
plain-torch reference; kernels that take the decoding requests, or every request, in one
call plug in beside it, chosen once by the runner (``milestones/kernels/attention_backends.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# --8<-- [start:context]
@dataclass(slots=True)
class AttentionContext:
    """What attention needs to know about this step, built by the model runner."""

    k_cache: torch.Tensor  # [num_layers, num_slots, num_kv_heads, max_model_len, head_dim]
    v_cache: torch.Tensor
    token_slots: torch.Tensor  # [num_tokens]: the KV slot of each new token's request
    positions: torch.Tensor  # [num_tokens]: where in its slot each new token goes
    requests: list[RequestSpan]  # the requests that attention goes through one by one
    metadata: object = None  # what a kernel backend prepared for this step; attention() never reads it


@dataclass(slots=True)
class RequestSpan:
    """One request's new tokens in the flat batch, and where its keys and values are."""

    start: int  # its first row in the flat batch
    end: int  # one past its last row
    kv_slot: int  # its KV slot
    context_len: int  # tokens it attends to, this step's included


# --8<-- [end:context]


# --8<-- [start:attention]
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: AttentionContext) -> torch.Tensor:
    """q: [n, heads, dim]; k, v: [n, kv_heads, dim] for the n new tokens of all requests."""
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    k_cache[ctx.token_slots, :, ctx.positions] = k
    v_cache[ctx.token_slots, :, ctx.positions] = v
    out = torch.empty_like(q)
    for span in ctx.requests:
        keys = k_cache[span.kv_slot, :, : span.context_len]  # a view of its slot, no copy
        values = v_cache[span.kv_slot, :, : span.context_len]
        attend = decode_attention if span.end - span.start == 1 else prefill_attention
        out[span.start : span.end] = attend(q[span.start : span.end], keys, values)
    return out
# --8<-- [end:attention]


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
