"""Attention through block tables equals plain contiguous attention, on random data and ragged batches."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from milestones.kernels import load_decode_kernel
from milestones.kernels.attention_backends import CacheLayout, DecodeKernelAttention, TorchAttention
from milestones.m3.attention import AttentionContext, RequestSpan, attention, gather
from tests.conftest import needs_compiler

HEADS, KV_HEADS, DIM, LAYERS = 6, 2, 16, 2


def reference(q_new, keys, values):
    """Contiguous attention for one request: its new queries sit at the end of its keys."""
    n, total = q_new.shape[0], keys.shape[0]
    visible = torch.arange(total) <= torch.arange(total - n, total)[:, None]
    out = F.scaled_dot_product_attention(
        q_new.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible, enable_gqa=True
    )
    return out.transpose(0, 1)


def test_gather_reads_the_tables_blocks_in_order():
    """A cache of 2 kv heads and 6 blocks of 3 positions whose every value is its head * 18 + block * 3 + offset:
    tables [4, 1, 5] read blocks 4, 1 and 5 of each head, end to end."""
    cache = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3, 1).expand(-1, -1, -1, DIM).contiguous()
    got = gather(cache, torch.tensor([4, 1, 5]))
    want = torch.cat([cache[:, block] for block in (4, 1, 5)], dim=1)  # [kv_heads, 9, dim]
    assert got.shape == want.shape, (
        f"gather(cache [2, 6, 3, {DIM}], tables [4, 1, 5]) has shape {list(got.shape)}, not {list(want.shape)}: "
        "[kv_heads, len(tables) * block_size, dim]"
    )
    assert torch.equal(got, want), (
        f"gather read {got[:, :, 0].tolist()} (dim 0 of each head's 9 positions), expected {want[:, :, 0].tolist()} "
        "(head * 18 + block * 3 + offset): each head's blocks of the tables, in the tables' order, end to end"
    )


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_compiler)], ids=["torch", "kernel"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_equals_contiguous_for_ragged_batches(block_size, seed, use_kernel):
    """With the kernel backend on, decodes read their blocks in place and only prefill chunks are gathered."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 7 * 80 // block_size + 20  # room for 7 requests of up to 80 tokens
    k_cache = torch.zeros(LAYERS, KV_HEADS, num_blocks, block_size, DIM)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, out-of-order blocks, as after many allocations and frees
    # Each request: (tokens already cached, new tokens this step); 1 new token = a decode.
    requests = [(rng.randint(0, 60), rng.choice([1, 1, rng.randint(2, 20)])) for _ in range(7)]
    history = {
        i: (torch.randn(c + n, KV_HEADS, DIM), torch.randn(c + n, KV_HEADS, DIM)) for i, (c, n) in enumerate(requests)
    }
    slot_mapping, new_k, new_v, all_tables, spans = [], [], [], [], []
    q = torch.randn(sum(n for _, n in requests), HEADS, DIM)
    row = 0
    for i, (cached, n) in enumerate(requests):
        total = cached + n
        table = [free.pop() for _ in range(-(-total // block_size))]
        keys, values = history[i]
        for p in range(cached):  # the cached part is already in the pool
            k_cache[0, :, table[p // block_size], p % block_size] = keys[p]
            v_cache[0, :, table[p // block_size], p % block_size] = values[p]
        slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        new_k.append(keys[cached:]), new_v.append(values[cached:])
        spans.append(RequestSpan(row, row + n, table, total, first=len(all_tables) * block_size))
        all_tables += table
        row += n
    ctx = AttentionContext(
        k_cache, v_cache, torch.tensor(slot_mapping), torch.tensor(all_tables, dtype=torch.long), spans
    )
    backend = (DecodeKernelAttention("cpp", load_decode_kernel(), attention, CacheLayout("paged")) if use_kernel
               else TorchAttention(attention))
    backend.prepare_metadata(ctx)
    assert (ctx.metadata is not None) == use_kernel, "the kernel backend takes the decodes; torch's takes nothing"
    out = backend.forward(q, torch.cat(new_k), torch.cat(new_v), 0, ctx)
    rows = [0]
    for _, n in requests:
        rows.append(rows[-1] + n)
    for i, (start, end) in enumerate(zip(rows, rows[1:])):
        keys, values = history[i]
        torch.testing.assert_close(
            out[start:end], reference(q[start:end], keys, values), atol=1e-5, rtol=1e-5,
            msg=lambda message, i=i, start=start, end=end: (
                f"request {i} ({requests[i][0]} tokens cached, {requests[i][1]} new, rows {start}..{end}): attention "
                f"through its block table differs from contiguous attention over its keys and values. {message} "
                "Its keys are ctx.block_tables' blocks from span.first on (gather), this step's written first at "
                "ctx.slot_mapping"
            ),
        )
    assert not k_cache[1].any(), "another layer's cache was written"
