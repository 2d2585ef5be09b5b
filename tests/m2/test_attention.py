"""attention over a packed batch, against attention written out by hand, request by request, in float64.

A wrong mask, a request reading another's slot, or a cache write after the attention that needs it fails here with
the request, the row and the size of the difference, rather than as a different token when the engine runs.
"""

from __future__ import annotations

import torch

from milestones.kernels.attention_backends import CacheLayout, DecodeKernelAttention
from milestones.m2.attention import AttentionContext, RequestSpan, attention

LAYERS, SLOTS, KV_HEADS, HEADS, MAX_LEN, DIM = 2, 3, 2, 4, 16, 8
LAYER = 1


def cache() -> torch.Tensor:
    return torch.randn(LAYERS, SLOTS, KV_HEADS, MAX_LEN, DIM, generator=torch.Generator().manual_seed(1))


def expected(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Each query at position p sees keys 0..p of its request; query head h reads kv head h // (HEADS // KV_HEADS)."""
    group = HEADS // KV_HEADS
    keys, values = keys.double().repeat_interleave(group, 0), values.double().repeat_interleave(group, 0)
    out = []
    for row, p in enumerate(positions):
        scores = torch.einsum("hd,hkd->hk", q[row].double(), keys[:, : p + 1]) * DIM**-0.5
        out.append(torch.einsum("hk,hkd->hd", scores.softmax(-1), values[:, : p + 1]))
    return torch.stack(out)


def the_step():
    """Row 0: Y decodes position 4 (slot 0, 4 tokens cached). Rows 1-3: X prefills positions 6-8 (slot 2, 6 cached)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(4, HEADS, DIM, generator=g), torch.randn(4, KV_HEADS, DIM, generator=g), \
        torch.randn(4, KV_HEADS, DIM, generator=g)
    k_cache, v_cache = cache(), cache() * 2
    positions = [4, 6, 7, 8]
    ctx = AttentionContext(k_cache, v_cache, torch.tensor([0, 2, 2, 2]), torch.tensor(positions),
                           [RequestSpan(0, 1, 0, 5), RequestSpan(1, 4, 2, 9)])
    return q, k, v, ctx, positions


def test_each_request_attends_to_its_own_slot_up_to_itself():
    q, k, v, ctx, positions = the_step()
    before_k, before_v = ctx.k_cache.clone(), ctx.v_cache.clone()
    out = attention(q, k, v, LAYER, ctx)
    for row, (slot, p) in enumerate(zip([0, 2, 2, 2], positions)):
        assert torch.equal(ctx.k_cache[LAYER, slot, :, p], k[row]) and torch.equal(ctx.v_cache[LAYER, slot, :, p],
                                                                                    v[row]), (
            f"row {row}'s key and value are not in the cache at layer {LAYER}, slot {slot}, position {p}: "
            "k_cache[ctx.token_slots, :, ctx.positions] = k (and the same for v) for this layer"
        )
    written = torch.zeros_like(before_k, dtype=torch.bool)
    written[LAYER, [0, 2, 2, 2], :, positions] = True
    changed = (ctx.k_cache != before_k) | (ctx.v_cache != before_v)
    assert not (changed & ~written).any(), (
        f"attention changed the cache at {(changed & ~written).nonzero()[:4].tolist()} (layer, slot, head, position, "
        "dim): only this layer's new tokens, at their slots and positions, are written"
    )
    for name, rows, slot in (("Y (a decode)", [0], 0), ("X (a chunk)", [1, 2, 3], 2)):
        want = expected(q[rows], ctx.k_cache[LAYER, slot], ctx.v_cache[LAYER, slot], [positions[r] for r in rows])
        diff = (out[rows].double() - want).abs()
        assert diff.max() < 1e-5, (
            f"request {name}: rows {rows} differ from attention written out by hand by up to {diff.max():.3g} "
            f"(row {rows[int(diff.amax((1, 2)).argmax())]}): each request reads only its own slot, its first "
            "context_len positions, and a query at position p sees keys 0..p (a chunk's mask), after its new keys "
            "and values were written"
        )


def test_a_decode_kernel_backend_takes_the_decodes_rows_after_the_cache_is_written():
    """The CPU's compiled kernel (milestones/kernels/attention_backends.py) takes Y's row, each slot seen as one block
    of max_model_len; X's chunk is left to this attention(). A stand-in kernel records its call."""
    q, k, v, ctx, positions = the_step()
    calls = []

    def kernel(q_rows, k_cache, v_cache, block_tables, context_lens, scale):
        calls.append((q_rows.clone(), k_cache, v_cache, block_tables.tolist(), context_lens.tolist(), scale,
                      k_cache[0, :, positions[0]].clone()))
        return torch.full_like(q_rows, 7.0)

    backend = DecodeKernelAttention("cpp", kernel, attention, CacheLayout("slots"))
    backend.prepare_metadata(ctx)
    assert [(span.start, span.end) for span in ctx.requests] == [(1, 4)], "the backend leaves X's chunk to attention()"
    out = backend.forward(q, k, v, LAYER, ctx)
    assert len(calls) == 1, f"the kernel was called {len(calls)} times: once per layer, for every decode at once"
    q_rows, k_cache, v_cache, block_tables, context_lens, scale, seen = calls[0]
    assert torch.equal(q_rows, q[[0]]), "the kernel gets the decodes' queries"
    same = k_cache.data_ptr() == ctx.k_cache[LAYER].data_ptr() and v_cache.data_ptr() == ctx.v_cache[LAYER].data_ptr()
    assert same, "the kernel takes this layer's caches, each slot a block"
    assert block_tables == [[0]] and context_lens == [5], f"Y's slot and length: got {block_tables}, {context_lens}"
    assert abs(scale - DIM**-0.5) < 1e-12, f"the kernel's scale is {scale}, expected head_dim ** -0.5"
    assert torch.equal(seen, k[0]), "the kernel ran before Y's new key was in the cache"
    assert torch.equal(out[0], torch.full_like(out[0], 7.0)), "Y's row is what the kernel returned"
    want = expected(q[1:], ctx.k_cache[LAYER, 2], ctx.v_cache[LAYER, 2], positions[1:])
    assert (out[1:].double() - want).abs().max() < 1e-5, "X's chunk, left in ctx.requests, goes through attention()"
