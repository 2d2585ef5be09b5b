"""Decode attention on CUDA in one Triton kernel that reads each row's own context, and nothing more.

The lesson's ``paged_decode_attention`` (m5's ``attention.py``) is what a captured decode step
runs without it: a graph must have fixed shapes, so every row reads every block of its padded
table (``max_model_len`` positions), converted to float32, and a mask hides what lies past its
context. This kernel has the same signature and computes the same, but each row stops at
its own ``context_len``, read from the device: the launch is the same whatever the lengths
(one program per row and kv head), so a CUDA graph can capture it, and a replay reads only
the positions that count.

One program per (row, kv head) takes the ``group`` query heads that share that kv head, so each
key and value is read once for all of them (grouped-query attention). It walks the row's context
``TILE`` positions at a time: finds each position's block through the block table, loads the
keys, scores them in float32, and folds them into a running softmax (the running maximum, the
sum of exponentials, and the weighted sum of values, rescaled whenever the maximum grows), so the
scores of a long context are never all held at once. The result is written in q's dtype.

Imported only where it runs (``decode_kernel_for`` on CUDA, the tests): importing triton costs
time, and ``TRITON_INTERPRET=1``, which runs the kernel on CPU tensors for the CPU tests, is read
when ``@triton.jit`` wraps the function, that is at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The probe against plain torch, at outputs of magnitude up to ~3: float32 sums in another order, or in bfloat16 and
# float16 one rounding apart (a unit in the last place is 2^-6 and 2^-9 there), with room for a second.
PROBE_ATOL = {torch.float32: 1e-4, torch.bfloat16: 2**-5, torch.float16: 2**-8}
TILE_ELEMENTS = 8192  # GROUP x TILE x DIM products held at once (a few dozen registers a thread at 4 warps)


# --8<-- [start:kernel]
@triton.jit(do_not_specialize=["table_row"])  # eager steps' tables change width: one compiled kernel for any
def _paged_decode_kernel(
    q, pool_k, pool_v, block_tables, context_lens, out, scale,
    q_row, q_head,  # strides, in elements; every tensor's last dimension (head_dim) is contiguous
    k_block, k_head, k_pos,
    v_block, v_head, v_pos,
    table_row, out_row, out_head,
    block_size, group, dim,
    GROUP: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr,  # group and dim padded to powers of two
):
    row, kv_head = tl.program_id(0), tl.program_id(1)
    heads = tl.arange(0, GROUP)  # this kv head's query heads: kv_head * group + heads
    dims = tl.arange(0, DIM)
    head_ok, dim_ok = heads < group, dims < dim  # the padding is masked: never loaded, never stored
    query_at = q + row * q_row + (kv_head * group + heads)[:, None] * q_head + dims[None, :]
    query = tl.load(query_at, mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [GROUP, DIM]

    k_head_at = pool_k + kv_head.to(tl.int64) * k_head  # in 64 bits: a pool's heads may lie 2^31 elements apart
    v_head_at = pool_v + kv_head.to(tl.int64) * v_head
    context_len = tl.load(context_lens + row).to(tl.int32)  # read on the device: the same launch for any length
    best = tl.full([GROUP], float("-inf"), tl.float32)  # each head's largest score so far
    total = tl.zeros([GROUP], tl.float32)  # sum of exp(score - best) over the positions so far
    acc = tl.zeros([GROUP, DIM], tl.float32)  # sum of exp(score - best) * value
    for start in range(0, context_len, TILE):  # the row's own positions only
        positions = start + tl.arange(0, TILE)
        seen = positions < context_len  # the last tile may end past the context: those lanes load nothing
        blocks = tl.load(block_tables + row * table_row + positions // block_size, mask=seen, other=0)
        offsets = positions % block_size
        load_mask = seen[:, None] & dim_ok[None, :]
        keys_at = k_head_at + blocks[:, None] * k_block + offsets[:, None] * k_pos + dims[None, :]
        keys = tl.load(keys_at, mask=load_mask, other=0.0).to(tl.float32)  # [TILE, DIM]
        scores = tl.sum(query[:, None, :] * keys[None, :, :], axis=2) * scale  # [GROUP, TILE]
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))  # finite: every tile holds a position of the context
        rescale = tl.exp(best - new_best)  # what the sums so far were weighed with, relative to the new maximum
        weights = tl.exp(scores - new_best[:, None])  # 0 where not seen
        values_at = v_head_at + blocks[:, None] * v_block + offsets[:, None] * v_pos + dims[None, :]
        values = tl.load(values_at, mask=load_mask, other=0.0).to(tl.float32)  # [TILE, DIM]
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
        total = total * rescale + tl.sum(weights, axis=1)
        best = new_best

    out_at = out + row * out_row + (kv_head * group + heads)[:, None] * out_head + dims[None, :]
    tl.store(out_at, (acc / total[:, None]).to(out.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
# --8<-- [end:kernel]


# --8<-- [start:launch]
def paged_decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The lesson's ``paged_decode_attention``, reading each row's blocks up to its context length only.

    q: [n, heads, dim]; pool_k, pool_v: [blocks, kv_heads, block_size, dim], any strides but a contiguous last
    dimension; block_tables: [n, max_blocks]; context_lens: [n], each at least 1 and no more than its table covers
    (not checked: that would read them back to the host). Returns [n, heads, dim] in q's dtype. Nothing here depends
    on the data, so a CUDA graph can capture it: one output of q's shape, one launch of n x kv_heads programs.
    """
    n, num_heads, dim = q.shape
    _, num_kv_heads, block_size, _ = pool_k.shape
    if q.dtype != pool_k.dtype or pool_k.dtype != pool_v.dtype:
        raise ValueError(f"q, keys and values must share a dtype (got {q.dtype}, {pool_k.dtype}, {pool_v.dtype})")
    if q.stride(-1) != 1 or pool_k.stride(-1) != 1 or pool_v.stride(-1) != 1:
        raise ValueError("each head's head_dim numbers must be contiguous in q, keys and values")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    group = num_heads // num_kv_heads
    group_padded, dim_padded = triton.next_power_of_2(group), triton.next_power_of_2(dim)
    tile = max(16, min(64, TILE_ELEMENTS // (group_padded * dim_padded)))
    _paged_decode_kernel[(n, num_kv_heads)](
        q, pool_k, pool_v, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2),
        pool_v.stride(0), pool_v.stride(1), pool_v.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        block_size, group, dim,
        GROUP=group_padded, DIM=dim_padded, TILE=tile, num_warps=4,
    )
    return out
# --8<-- [end:launch]


def probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run the kernel on a small paged step on ``device``; None if it agrees with plain torch, else what went wrong.

    Contexts of 1, one block, one past a block and mid-block, blocks out of order, tables padded with a scratch
    block; 6 query heads over 2 kv heads of 80 dimensions (a group and a head size that need padding). The
    reference is written out here, row by row (the lesson's own is in each milestone's attention.py), in products
    and sums rather than matmuls, which TF32, if it is on, would round.
    """
    generator = torch.Generator(device="cpu").manual_seed(0)
    num_heads, num_kv_heads, dim, block_size = 6, 2, 80, 16
    pool_k, pool_v = (torch.randn(8, num_kv_heads, block_size, dim, generator=generator).to(device, dtype)
                      for _ in range(2))
    tables = [[3, 7, 7], [5, 1, 7], [0, 6, 2], [4, 7, 7]]  # 7: the scratch block, past each context
    lengths = [1, 17, 40, 16]
    q = torch.randn(len(lengths), num_heads, dim, generator=generator).to(device, dtype)
    got = paged_decode_attention(q, pool_k, pool_v, torch.tensor(tables, device=device),
                                 torch.tensor(lengths, device=device), dim**-0.5).float()
    for row, (table, length) in enumerate(zip(tables, lengths)):
        positions = torch.arange(length)
        blocks = torch.tensor(table)[positions // block_size].to(device)
        offsets = (positions % block_size).to(device)
        keys = pool_k[blocks, :, offsets].float().transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
        values = pool_v[blocks, :, offsets].float().transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
        scores = (q[row].float()[:, None, :] * keys).sum(-1) * dim**-0.5  # [heads, length]
        expected = (scores.softmax(-1)[:, :, None] * values).sum(1).to(dtype).float()  # [heads, dim]
        worst = (got[row] - expected).abs().max().item()
        if not worst <= PROBE_ATOL[dtype]:
            return f"row {row} (context {length}) is {worst:.2e} from plain torch's"
    return None
