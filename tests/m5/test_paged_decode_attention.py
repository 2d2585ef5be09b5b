"""paged_decode_attention, the captured step's decode attention in plain torch, against decode_attention per request.

Each request reads every block of its padded table, the positions past its context masked off: the result must be
what ``decode_attention`` gives on that request's own keys and values, gathered in order. In bfloat16 both sum in
float32 and round once at the end.
"""

from __future__ import annotations

import torch

from milestones.m5.attention import decode_attention, paged_decode_attention
from tests.m1.closeness import EXACT, FLOAT32, expect_close

BLOCK_SIZE, NUM_BLOCKS, HEADS, KV_HEADS, DIM = 4, 12, 9, 3, 64
TABLES = [[7, 2, 9, 0], [4, 0, 0, 0], [5, 1, 11, 3]]  # padded with block 0; lengths below end inside the real blocks
LENGTHS = [10, 3, 16]


def batch(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(len(TABLES), HEADS, DIM, generator=generator).to(dtype)
    pool_k, pool_v = (torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, DIM, generator=generator).to(dtype)
                      for _ in range(2))
    return q, pool_k, pool_v, torch.tensor(TABLES), torch.tensor(LENGTHS)


def own_rows(pool: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """A request's keys (or values) in order, [kv_heads, length, dim]."""
    return torch.cat([pool[block] for block in table], dim=1)[:, :length]


def test_each_row_is_decode_attention_over_its_own_blocks():
    q, pool_k, pool_v, tables, lengths = batch(torch.float32)
    out = paged_decode_attention(q, pool_k, pool_v, tables, lengths, DIM**-0.5)
    for i, (table, length) in enumerate(zip(TABLES, LENGTHS)):
        expected = decode_attention(q[i : i + 1], own_rows(pool_k, table, length), own_rows(pool_v, table, length))
        expect_close(f"request {i} ({length} positions)", out[i : i + 1], expected, FLOAT32, source="decode_attention")


def test_in_bfloat16_it_sums_in_float32_and_rounds_once():
    q, pool_k, pool_v, tables, lengths = batch(torch.bfloat16)
    out = paged_decode_attention(q, pool_k, pool_v, tables, lengths, DIM**-0.5)
    assert out.dtype == torch.bfloat16
    in_float32 = paged_decode_attention(q.float(), pool_k.float(), pool_v.float(), tables, lengths, DIM**-0.5)
    expect_close("paged_decode_attention in bfloat16", out, in_float32.bfloat16(), EXACT,
                 source="float32 on the same numbers, rounded")
