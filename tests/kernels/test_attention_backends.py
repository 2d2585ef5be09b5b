"""The seam between the lessons' attention and the kernels (milestones/kernels/attention_backends.py).

Which backend an engine gets, and what each takes off the lesson's reference: the decodes of an eager step, the rows
of a captured one (m5 on), or every request; the rest is left to the reference, which writes every key and value.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from milestones.kernels import attention_backend_for
from milestones.kernels.attention_backends import (
    CacheLayout,
    ContiguousDecodeKernel,
    DecodeKernelAttention,
    RaggedAttention,
    TorchAttention,
)
from milestones.kernels.batched_attention import BatchedAttention
from milestones.m5 import attention as m5_attention
from milestones.m5.attention import AttentionContext, DecodeBatch, RequestSpan, paged_decode_attention
from tests.conftest import needs_compiler

CPU = torch.device("cpu")
HEADS, KV_HEADS, DIM, BLOCKS, BLOCK_SIZE = 4, 2, 8, 6, 4


def config(backend: str) -> SimpleNamespace:
    return SimpleNamespace(attention_backend=backend, device=CPU, dtype=torch.float32, max_model_len=64)


@needs_compiler
def test_which_backend_an_engine_gets_on_a_cpu():
    """"torch" keeps the reference; "cpp" and "auto" the compiled kernel (m1's over its rows); "batched" the padded
    layout, except for m1, which has no spans to batch."""
    heads = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    for layout in ("contiguous", "slots", "paged"):
        chosen = attention_backend_for(config("torch"), heads, m5_attention.attention, layout)
        assert isinstance(chosen, TorchAttention) and chosen.forward is m5_attention.attention
    for backend in ("cpp", "auto"):
        assert isinstance(attention_backend_for(config(backend), heads, m5_attention.attention, "contiguous"),
                          ContiguousDecodeKernel)
        chosen = attention_backend_for(config(backend), heads, m5_attention.attention, "paged")
        assert isinstance(chosen, DecodeKernelAttention) and chosen.name == "cpp"
    assert attention_backend_for(config("batched"), heads, m5_attention.attention, "slots").name == "padded"
    assert attention_backend_for(config("batched"), heads, m5_attention.attention, "contiguous").name == "torch"
    with pytest.raises(ValueError, match="layout must be one of"):
        attention_backend_for(config("torch"), heads, m5_attention.attention, "ragged")


def pool_step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool of random keys and values, and two decoding rows' queries, keys and values."""
    generator = torch.Generator().manual_seed(4)
    k_cache, v_cache = (torch.randn(1, KV_HEADS, BLOCKS, BLOCK_SIZE, DIM, generator=generator) for _ in range(2))
    q = torch.randn(2, HEADS, DIM, generator=generator)
    k, v = (torch.randn(2, KV_HEADS, DIM, generator=generator) for _ in range(2))
    return k_cache, v_cache, q, k, v


def captured_ctx(k_cache: torch.Tensor, v_cache: torch.Tensor) -> AttentionContext:
    """A captured step's context as m5's graph runner builds it: no spans, the rows in fixed shapes."""
    tables = torch.tensor([[3, 1, 5], [2, 0, 4]])
    decodes = DecodeBatch(torch.tensor([0, 1]), tables, torch.tensor([7, 10]))
    return AttentionContext(list(k_cache.unbind(0)), list(v_cache.unbind(0)), torch.tensor([1 * 4 + 2, 4 * 4 + 1]),
                            tables[:0, 0], [], decodes)


def test_a_kernel_backend_takes_a_captured_steps_rows_from_the_lesson():
    """The rows m5's lesson lays out for paged_decode_attention go to the kernel instead, once the keys are
    written; the reference, left with nothing, attends to nothing."""
    k_cache, v_cache, q, k, v = pool_step()
    calls = []

    def kernel(*args):
        calls.append(args[0].shape[0])
        return paged_decode_attention(*args)

    lesson = captured_ctx(k_cache.clone(), v_cache.clone())
    ours = captured_ctx(k_cache.clone(), v_cache.clone())
    backend = DecodeKernelAttention("cpp", kernel, m5_attention.attention, CacheLayout("paged"))
    backend.prepare_metadata(ours)
    assert ours.decodes is None and ours.metadata.rows.tolist() == [0, 1], "the backend takes the lesson's rows"
    expected, got = m5_attention.attention(q, k, v, 0, lesson), backend.forward(q, k, v, 0, ours)
    assert calls == [2], f"one kernel call for both rows, got {calls}"
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(ours.k_cache[0], lesson.k_cache[0], rtol=0, atol=0)


def test_batched_attention_leaves_a_captured_step_to_the_lesson():
    """On CUDA "auto" batches an eager step's requests; a captured step's rows stay with paged_decode_attention."""
    k_cache, v_cache, q, k, v = pool_step()
    lesson, ours = captured_ctx(k_cache.clone(), v_cache.clone()), captured_ctx(k_cache.clone(), v_cache.clone())
    backend = RaggedAttention(BatchedAttention("padded", None), m5_attention.attention, CacheLayout("paged"))
    backend.prepare_metadata(ours)
    assert ours.metadata is None and ours.decodes is not None
    torch.testing.assert_close(backend.forward(q, k, v, 0, ours), m5_attention.attention(q, k, v, 0, lesson),
                               rtol=0, atol=0)


def test_batched_attention_takes_every_request_of_an_eager_step():
    """A chunk and a decode, out-of-order blocks: every span taken, the same output as the reference's loop."""
    k_cache, v_cache, _, _, _ = pool_step()
    generator = torch.Generator().manual_seed(9)
    q = torch.randn(4, HEADS, DIM, generator=generator)
    k, v = (torch.randn(4, KV_HEADS, DIM, generator=generator) for _ in range(2))
    spans = [RequestSpan(0, 3, [4, 1], 6, first=0), RequestSpan(3, 4, [2, 0, 5], 9, first=8)]
    slots = [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 5 * 4 + 0]

    def ctx() -> AttentionContext:
        return AttentionContext(k_cache.clone(), v_cache.clone(), torch.tensor(slots), torch.tensor([4, 1, 2, 0, 5]),
                                [RequestSpan(s.start, s.end, s.block_table, s.context_len, s.first) for s in spans])

    lesson, ours = ctx(), ctx()
    backend = RaggedAttention(BatchedAttention("padded", None), m5_attention.attention, CacheLayout("paged"))
    backend.prepare_metadata(ours)
    assert ours.requests == [] and ours.metadata is not None, "batched attention takes every request"
    torch.testing.assert_close(backend.forward(q, k, v, 0, ours), m5_attention.attention(q, k, v, 0, lesson),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.k_cache, lesson.k_cache, rtol=0, atol=0)
