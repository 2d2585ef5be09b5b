"""Paged attention: keys and values live in a pool of fixed-size blocks.

The cache of each layer is ``[num_blocks, kv_heads, block_size, head_dim]``. A
request's tokens are scattered over whichever blocks it was given; its *block
table* lists them in order. Writing uses the *slot mapping*: new token i goes to
slot ``slot_mapping[i] = block * block_size + offset``. Reading gathers the
request's blocks through its table, back into one contiguous run of keys.

This is plain torch, correct on CPU and CUDA. The gather copies keys and values
once per layer; a real paged-attention kernel (vLLM's) reads the blocks in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# --8<-- [start:context]
@dataclass(slots=True)
class AttentionContext:
    """What attention needs to know about this step, built by the model runner."""

    k_cache: torch.Tensor  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens]: block * block_size + offset of each new token
    prefills: list[tuple[int, int, torch.Tensor, int]]  # (first token, end token, block table, context length)
    decode_rows: torch.Tensor  # [num_decodes]: rows of the flat batch that are single-token requests
    decode_tables: torch.Tensor  # [num_decodes, most blocks]: their block tables, padded with block 0
    decode_mask: torch.Tensor | None  # [num_decodes, most blocks * block_size]: True past each context
# --8<-- [end:context]


# --8<-- [start:attention]
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: AttentionContext) -> torch.Tensor:
    """q: [n, heads, dim]; k, v: [n, kv_heads, dim] for the n new tokens of all requests."""
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    block_size = k_cache.shape[2]
    blocks, offsets = ctx.slot_mapping // block_size, ctx.slot_mapping % block_size
    k_cache[blocks, :, offsets] = k
    v_cache[blocks, :, offsets] = v
    out = torch.empty_like(q)
    for start, end, table, context_len in ctx.prefills:
        keys = gather(k_cache, table[None])[:, 0, :context_len]  # [kv_heads, context_len, dim]
        values = gather(v_cache, table[None])[:, 0, :context_len]
        out[start:end] = prefill_attention(q[start:end], keys, values)
    if ctx.decode_mask is not None:
        out[ctx.decode_rows] = decode_attention(q[ctx.decode_rows], k_cache, v_cache, ctx)
    return out
# --8<-- [end:attention]


# --8<-- [start:gather]
def gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Read blocks through block tables: [kv_heads, num_tables, blocks * block_size, dim], one copy."""
    num_blocks_each = tables.shape[1]
    picked = cache.transpose(0, 1)[:, tables]  # [kv_heads, num_tables, blocks, block_size, dim]
    return picked.view(cache.shape[1], tables.shape[0], num_blocks_each * cache.shape[2], cache.shape[3])
# --8<-- [end:gather]


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
    """All single-token requests at once: gather their blocks, one batched product, mask past each length."""
    num_decodes, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    keys = gather(k_cache, ctx.decode_tables).flatten(0, 1)  # [kv_heads * decodes, tokens, dim]
    values = gather(v_cache, ctx.decode_tables).flatten(0, 1)
    # Grouped-query: [decodes, kv_heads, group, dim] -> [kv_heads * decodes, group, dim], matching the keys.
    queries = q.view(num_decodes, num_kv_heads, -1, dim).transpose(0, 1).reshape(num_kv_heads * num_decodes, -1, dim)
    scores = torch.bmm(queries, keys.transpose(1, 2)) * dim**-0.5  # [kv_heads * decodes, group, tokens]
    scores = scores.view(num_kv_heads, num_decodes, -1, scores.shape[-1])
    scores.masked_fill_(ctx.decode_mask[None, :, None, :], float("-inf"))
    probs = scores.float().softmax(dim=-1).to(q.dtype).flatten(0, 1)
    out = torch.bmm(probs, values).view(num_kv_heads, num_decodes, -1, dim)
    return out.transpose(0, 1).reshape(num_decodes, num_heads, dim)
# --8<-- [end:decode_attention]
