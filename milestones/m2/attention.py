"""Attention for a packed batch of many requests, each with its own contiguous KV slot.

The cache has one slot per running request, each long enough for
``max_model_len`` tokens: ``k_cache[layer][slot, head, pos]``. Keeping each head's
positions contiguous (head-major) lets one batched matrix multiply read every
slot's keys straight from the cache, with no copies.

A step mixes two kinds of requests:

* decodes (one new token each) are computed together: one batched product over
  all slots, masked to each slot's length, keeping the rows of the decoding slots;
* prefill chunks (several new tokens) are computed one request at a time, with a
  causal mask that also lets the chunk see the part of the prompt cached before it.
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
    prefills: list[tuple[int, int, int, int]]  # (first token, end token, slot, context length) per chunk
    decode_rows: torch.Tensor  # [num_decodes]: rows of the flat batch that are single-token requests
    decode_slots: torch.Tensor  # [num_decodes]: their KV slots
    decode_mask: torch.Tensor | None  # [num_slots, longest context]: True where a slot has no token
# --8<-- [end:context]


# --8<-- [start:attention]
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: AttentionContext) -> torch.Tensor:
    """q: [n, heads, dim]; k, v: [n, kv_heads, dim] for the n new tokens of all requests."""
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    k_cache[ctx.token_slots, :, ctx.positions] = k
    v_cache[ctx.token_slots, :, ctx.positions] = v
    out = torch.empty_like(q)
    for start, end, slot, context_len in ctx.prefills:
        out[start:end] = prefill_attention(q[start:end], k_cache[slot, :, :context_len], v_cache[slot, :, :context_len])
    if ctx.decode_mask is not None:
        out[ctx.decode_rows] = decode_attention(q, k_cache, v_cache, ctx)
    return out
# --8<-- [end:attention]


# --8<-- [start:prefill_attention]
def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A chunk of n tokens at the end of a context of L tokens: query i sees keys 0..L-n+i."""
    n, context_len = q.shape[0], keys.shape[1]
    if n == context_len:  # the whole prompt at once: the plain causal mask
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True, enable_gqa=True)
    else:
        visible = torch.arange(context_len, device=q.device) <= torch.arange(context_len - n, context_len, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=visible, enable_gqa=True)
    return out.transpose(0, 1)
# --8<-- [end:prefill_attention]


# --8<-- [start:decode_attention]
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """One batched product over *every* slot up to the longest context, then keep the decoding rows.

    Slots that are idle or prefilling this step are computed and thrown away: cheaper
    on a CPU than gathering the decoding slots' keys into a new tensor.
    """
    num_slots, num_kv_heads, _, dim = k_cache.shape
    longest = ctx.decode_mask.shape[1]
    queries = q.new_zeros(num_slots, q.shape[1], dim)
    queries[ctx.decode_slots] = q[ctx.decode_rows]
    queries = queries.view(num_slots, num_kv_heads, -1, dim)  # grouped-query: [slots, kv_heads, group, dim]
    scores = torch.matmul(queries, k_cache[:, :, :longest].transpose(-1, -2)) * dim**-0.5
    scores.masked_fill_(ctx.decode_mask[:, None, None, :], float("-inf"))
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    out = torch.matmul(probs, v_cache[:, :, :longest])  # [slots, kv_heads, group, dim]
    return out[ctx.decode_slots].view(-1, q.shape[1], dim)
# --8<-- [end:decode_attention]
