"""A decoder layer's elementwise work on CUDA in three Triton kernels: toward ten launches a layer.

The lesson's layer (``model.py``) is written operator by operator, and on a GPU each operator is a kernel of
its own: RMSNorm is six (pow, mean, add, rsqrt, mul, mul), RoPE about eight (neg, cat, mul, add), SiLU-and-mul
two, writing the new keys and values three. At the 135M shape each kernel does a microsecond of work, so a
replayed decode step is 58 launches a layer and the GPU spends its time starting them. These kernels do the
same arithmetic in one launch each, one program a row (a token):

* ``rms_norm(x, weight, eps, residual=None)``: with a residual, ``residual + x`` first (the layer's skip
  connection) and both results back: the sum, which the next skip connection adds to, and its norm;
* ``silu_and_mul(gate, up)``: ``silu(gate) * up``, the MLP's activation between its products;
* ``rope_and_write_kv(q, k, v, cos, sin, pool_k, pool_v, slots)``: q and k rotated (RoPE), q returned, k and v
  written to their slots in the paged cache, where attention reads them.

Each rounds where the lesson's operators round, so in bfloat16 and float16 they differ from the lesson only
where a float32 sum in another order lands on the other side of a rounding (the norm's mean of squares): held
within a unit in the last place by ``tests/kernels/test_triton_fused.py``. Imported only where it runs, as
``triton_decode.py`` is (``TRITON_INTERPRET=1``, read at import, runs them on CPU tensors for the tests).
``fused_layers.py`` calls them (``rope.cpp`` and ``rms_norm.cpp`` are the CPU's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# --8<-- [start:rms_norm]
@triton.jit
def _rms_norm_kernel(x, residual, weight, out, residual_out, x_row, residual_row, out_row, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    h = tl.load(x + row * x_row + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:  # the skip connection, rounded to the model's dtype as the lesson's ``x + ...`` is
        h = (h.to(tl.float32) + tl.load(residual + row * residual_row + cols, mask=inside, other=0.0).to(tl.float32))
        h = h.to(residual_out.dtype.element_ty)
        tl.store(residual_out + row * out_row + cols, h, mask=inside)
    f = h.to(tl.float32)
    normed = (f * tl.math.rsqrt(tl.sum(f * f, axis=0) / n + eps)).to(out.dtype.element_ty)  # h.to(x.dtype)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * out_row + cols, (w * normed.to(tl.float32)).to(out.dtype.element_ty), mask=inside)
# --8<-- [end:rms_norm]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The lesson's ``RMSNorm`` of ``x`` (of ``residual + x`` if given), and what it normed.

    x, residual: [rows, n] of one dtype, each row contiguous; weight: [n]. Returns (norm, sum): the sum is x
    itself when there is no residual, else a new tensor, which the next call takes as its residual.
    """
    rows, n = x.shape
    _check_rows("rms_norm", x, residual)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else x
    if rows:
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, total, x.stride(0),
                                  (residual if residual is not None else x).stride(0), out.stride(0), n, eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out, total


# --8<-- [start:silu_and_mul]
@triton.jit
def _silu_and_mul_kernel(gate, up, out, gate_row, up_row, out_row, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, n, BLOCK):  # an MLP's row is thousands wide: a tile at a time
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n
        g = tl.load(gate + row * gate_row + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(up + row * up_row + cols, mask=inside, other=0.0).to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty)  # F.silu, rounded as it rounds
        tl.store(out + row * out_row + cols, (activated.to(tl.float32) * u).to(out.dtype.element_ty), mask=inside)
# --8<-- [end:silu_and_mul]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in one launch. gate, up: [rows, n] of one dtype, each row contiguous (one [rows, 2n]
    product's two halves will do)."""
    _check_rows("silu_and_mul", gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    if rows:
        _silu_and_mul_kernel[(rows,)](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n,
                                      BLOCK=min(1024, triton.next_power_of_2(n)))
    return out


# --8<-- [start:rope_and_write_kv]
@triton.jit
def _rotate(x, row, head, half, x_row, x_head, cos_lo, cos_hi, sin_lo, sin_hi, HALF: tl.constexpr):
    """One head of one token rotated as the lesson's ``x * cos + rotate_half(x) * sin``, each product and the sum
    rounded to x's dtype, as torch's operators round them. Returns the two halves."""
    dims = tl.arange(0, HALF)
    inside = dims < half
    at = x + row * x_row + head * x_head + dims
    lo = tl.load(at, mask=inside, other=0.0)
    hi = tl.load(at + half, mask=inside, other=0.0)
    dtype = lo.dtype
    new_lo = (lo.to(tl.float32) * cos_lo).to(dtype).to(tl.float32) + (-hi.to(tl.float32) * sin_lo).to(dtype).to(
        tl.float32)
    new_hi = (hi.to(tl.float32) * cos_hi).to(dtype).to(tl.float32) + (lo.to(tl.float32) * sin_hi).to(dtype).to(
        tl.float32)
    return new_lo.to(dtype), new_hi.to(dtype), dims, inside


@triton.jit
def _rope_and_write_kv_kernel(q, k, v, cos, sin, pool_k, pool_v, slots, q_out,
                              q_row, q_head, k_row, k_head, v_row, v_head, cos_row, sin_row,
                              k_block, k_kv_head, k_pos, v_block, v_kv_head, v_pos, out_row, out_head,
                              num_heads, num_kv_heads, half, block_size,
                              HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)
    inside = dims < half
    # This token's angles, as ``RotaryEmbedding.forward`` hands them to every layer: already in the model's dtype.
    cos_lo = tl.load(cos + row * cos_row + dims, mask=inside, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos + row * cos_row + half + dims, mask=inside, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin + row * sin_row + dims, mask=inside, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin + row * sin_row + half + dims, mask=inside, other=0.0).to(tl.float32)
    for head in range(num_heads):
        lo, hi, dims, inside = _rotate(q, row, head, half, q_row, q_head, cos_lo, cos_hi, sin_lo, sin_hi, HALF)
        at = q_out + row * out_row + head * out_head + dims
        tl.store(at, lo, mask=inside)
        tl.store(at + half, hi, mask=inside)
    slot = tl.load(slots + row).to(tl.int64)
    block, offset = slot // block_size, slot % block_size
    for head in range(num_kv_heads):
        lo, hi, dims, inside = _rotate(k, row, head, half, k_row, k_head, cos_lo, cos_hi, sin_lo, sin_hi, HALF)
        at = pool_k + block * k_block + head * k_kv_head + offset * k_pos + dims
        tl.store(at, lo, mask=inside)
        tl.store(at + half, hi, mask=inside)
        value_at = v + row * v_row + head * v_head + dims
        at = pool_v + block * v_block + head * v_kv_head + offset * v_pos + dims
        tl.store(at, tl.load(value_at, mask=inside, other=0.0), mask=inside)
        tl.store(at + half, tl.load(value_at + half, mask=inside, other=0.0), mask=inside)
# --8<-- [end:rope_and_write_kv]


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q rotated (returned, a new [n, heads, dim] tensor); k rotated and v written to the cache at their slots.

    q: [n, heads, dim]; k, v: [n, kv_heads, dim] (views of one qkv product will do: each head's numbers
    contiguous); cos, sin: [n, dim], each token's angles in q's dtype (the lesson's ``RotaryEmbedding`` output);
    slots: [n]; pool_k, pool_v: [blocks, kv_heads, block_size, dim], any strides but a contiguous last dimension
    (the milestones' caches, seen as the decode kernel sees them). A slot is block * block_size + offset (not
    checked here: that would read them back to the host).
    """
    n, num_heads, dim = q.shape
    _, num_kv_heads, block_size, _ = pool_k.shape
    if dim % 2 or k.shape != (n, num_kv_heads, dim) or v.shape != k.shape or cos.shape != (n, dim) or \
            sin.shape != cos.shape:
        raise ValueError(f"q [n, heads, dim] with an even dim, k, v [n, kv_heads, dim] matching the pool's "
                         f"{num_kv_heads} kv heads, cos and sin [n, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(cos.shape)}")
    if len({q.dtype, k.dtype, v.dtype, cos.dtype, sin.dtype, pool_k.dtype, pool_v.dtype}) != 1:
        raise ValueError("q, k, v, cos, sin and the cache must share a dtype")
    if any(t.stride(-1) != 1 for t in (q, k, v, pool_k, pool_v, cos, sin)):
        raise ValueError("each head's dim numbers must be contiguous in q, k, v, the cache and the angles")
    out = torch.empty((n, num_heads, dim), dtype=q.dtype, device=q.device)
    if n:
        _rope_and_write_kv_kernel[(n,)](
            q, k, v, cos, sin, pool_k, pool_v, slots, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), pool_v.stride(0), pool_v.stride(1),
            pool_v.stride(2), out.stride(0), out.stride(1),
            num_heads, num_kv_heads, dim // 2, block_size,
            HALF=triton.next_power_of_2(dim // 2),
        )
    return out


def _check_rows(name: str, x: torch.Tensor, other: torch.Tensor | None) -> None:
    """Refuse what the kernels' addressing cannot read: rows of two dims, each contiguous, one dtype."""
    for t in (x, other):
        if t is not None and (t.dim() != 2 or t.stride(-1) != 1):
            raise ValueError(f"{name} takes [rows, n] tensors whose rows are contiguous, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")
    if other is not None and (other.dtype != x.dtype or other.shape != x.shape):
        raise ValueError(f"{name}: both inputs must have one shape and dtype, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(other.shape)} {other.dtype}")
