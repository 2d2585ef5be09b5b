"""Attention over a preallocated, contiguous KV cache for a single request.

The cache holds one row per position: ``k_cache[layer][pos]`` is the key of the
token at ``pos``. Each step writes the new tokens' keys and values into their
rows (``slot_mapping``), then lets the queries attend to every row written so far.
Prefill writes the whole prompt at once; decode writes one row per step. This is the
plain-torch reference; a kernel that does the same sums faster plugs in beside it, chosen
once by the runner (``milestones/kernels/attention_backends.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# --8<-- [start:context]
@dataclass(slots=True)
class AttentionContext:
    """What attention needs to know about this step, built by the model runner."""

    k_cache: torch.Tensor  # [num_layers, max_model_len, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens]: the cache row of each new token
    context_len: int  # rows filled once this step's tokens are written
    metadata: object = None  # what a kernel backend prepared for this step; attention() never reads it
# --8<-- [end:context]


# --8<-- [start:attention]
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: AttentionContext) -> torch.Tensor:
    """q: [n, heads, dim]; k, v: [n, kv_heads, dim] for the n new tokens. Returns [n, heads, dim]."""
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    k_cache.index_copy_(0, ctx.slot_mapping, k)
    v_cache.index_copy_(0, ctx.slot_mapping, v)
    keys = k_cache[: ctx.context_len].transpose(0, 1)  # [kv_heads, context_len, dim]
    values = v_cache[: ctx.context_len].transpose(0, 1)
    if q.shape[0] == 1:
        return decode_attention(q, keys, values)
    # Prefill: the prompt's n tokens fill rows 0..n-1, and token i may see tokens 0..i.
    # A batch dimension of one: on a CPU only 4-D inputs reach torch's flash-attention
    # kernel (as in transformers); 3-D ones take the slower math path.
    q = q.transpose(0, 1)[None]  # [1, heads, n, dim]
    out = F.scaled_dot_product_attention(q, keys[None], values[None], is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)
# --8<-- [end:attention]


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
