"""The Triton decode kernel (milestones/kernels/triton_decode.py) against the lesson's paged_decode_attention.

Without a GPU these run in Triton's interpreter (``TRITON_INTERPRET=1``, which tests/conftest.py sets before
anything imports triton), which executes the kernel on CPU tensors; on a GPU they run it compiled, and
tests/cuda/test_cuda.py adds a CUDA graph and an engine. Skipped where triton is not installed (CI does not install
it; CUDA builds of torch bring it).

Tolerance: float32 within 1e-5 (both sum the same positions in float32, in another order); bfloat16 and float16
within one unit in the last place of the lesson's output, which is the float32 result on the same numbers rounded
once, as the kernel's is (its float32 sums may land on the other side of a rounding boundary), plus float32's 1e-5
for outputs near zero, where a unit in the last place is smaller than the two float32 sums' difference.
"""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass

import pytest
import torch

import milestones.kernels.decode_attention as decode_attention
from milestones import m5
from milestones.kernels import check_attention_backend
from milestones.kernels.attention_backends import CacheLayout, DecodeKernelAttention
from milestones.m5 import attention as m5_attention
from milestones.m5.attention import paged_decode_attention
from tests.chain import assert_same_outputs, mixed_workload, run

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (CI does not install it; `.venv/bin/pip install triton` runs these in its "
                "interpreter on the CPU)", allow_module_level=True)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and triton's interpreter is off (tests/conftest.py turns it on before triton is imported)",
                allow_module_level=True)

from milestones.kernels import triton_decode  # noqa: E402  (only once triton is known to be there)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOAT32_ATOL = 1e-5
CONTEXTS = [1, 16, 17, 40, 100, 5, 33, 64]  # a context of one, one whole block, one past it, mid-block, ...
HEADS = [(9, 3, 64), (8, 2, 128), (4, 4, 24)]  # SmolLM2's; Llama-3.1-8B's group of 4 at 128; no grouping, dim 24


@dataclass(slots=True)
class PagedDecode:
    """One decode step's arguments in the m5 graph runner's shapes: a pool of blocks, padded tables, the lengths."""

    q: torch.Tensor  # [rows, heads, dim]
    pool_k: torch.Tensor  # [blocks, kv_heads, block_size, dim]: a transposed view, as attention.py passes the cache
    pool_v: torch.Tensor
    block_tables: torch.Tensor  # [rows, max_blocks], padded with the scratch block (the pool's last)
    context_lens: torch.Tensor  # [rows]

    def args(self, scale: float | None = None) -> tuple:
        return (self.q, self.pool_k, self.pool_v, self.block_tables, self.context_lens,
                scale or self.q.shape[-1] ** -0.5)


def paged_decode(contexts: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, block_size: int = 16,
                 max_blocks: int | None = None, pool_blocks: int | None = None, seed: int = 0,
                 device: torch.device = DEVICE) -> PagedDecode:
    """Each row's blocks drawn at random from a pool with blocks to spare (``pool_blocks`` in all), every slot filled
    with random numbers; tables padded past each context with the scratch block, ``max_blocks`` wide (as for
    max_model_len)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-length // block_size) for length in contexts]
    width = max_blocks or max(needed) + 2
    free = list(range((pool_blocks or sum(needed) + 4) - 1))
    rng.shuffle(free)
    scratch = len(free)  # the pool's last block, which no row owns
    shape = (kv_heads, scratch + 1, block_size, dim)  # the engine's layout of a layer: [kv_heads, blocks, ...]
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(2))
    tables = [[free.pop() for _ in range(count)] + [scratch] * (width - count) for count in needed]
    q = torch.randn(len(contexts), heads, dim, generator=generator).to(device, dtype)
    return PagedDecode(q, k_cache.transpose(0, 1), v_cache.transpose(0, 1), torch.tensor(tables, device=device),
                       torch.tensor(contexts, device=device))


def assert_close_to_lesson(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """float32: within FLOAT32_ATOL. bfloat16, float16: within one unit in the last place of the expected value,
    plus FLOAT32_ATOL: near zero, where a unit is tiny, the two float32 sums' own difference shows (float16 at an
    output of 1e-4: 2 units, 1e-7 apart)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    error = (got.float() - expected.float()).abs()
    worst = error.max().item()
    if expected.dtype == torch.float32:
        assert worst <= FLOAT32_ATOL, f"{what}: max error {worst:.2e} (tolerance {FLOAT32_ATOL})"
        return
    magnitude = expected.abs()
    ulp = (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).float()
    excess = (error - ulp).max().item()
    assert excess <= FLOAT32_ATOL, (f"{what}: max error {worst:.2e}, {(error / ulp).max().item():.1f} units in the "
                                    f"last place; {excess:.2e} beyond one unit (tolerance {FLOAT32_ATOL})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, dim", HEADS)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_paged_decode_attention(dtype, heads, kv_heads, dim, seed):
    step = paged_decode(CONTEXTS, heads, kv_heads, dim, dtype, seed=seed)
    got = triton_decode.paged_decode_attention(*step.args())
    assert_close_to_lesson(got, paged_decode_attention(*step.args()), f"{dtype}, heads {heads}/{kv_heads}x{dim}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_reads_only_each_rows_own_context(dtype):
    """Every slot no row reads (the scratch block, the rest of each last block, the spare blocks) is NaN: one read of
    any of them, even scored and weighed by zero, would make the output NaN. The result is the clean pool's."""
    step = paged_decode(CONTEXTS, 9, 3, 64, dtype, max_blocks=16)
    expected = triton_decode.paged_decode_attention(*step.args())
    owned = torch.zeros(step.pool_k.shape[0], step.pool_k.shape[2], dtype=torch.bool, device=DEVICE)
    for table, length in zip(step.block_tables.tolist(), step.context_lens.tolist()):
        for position in range(length):
            owned[table[position // owned.shape[1]], position % owned.shape[1]] = True
    for pool in (step.pool_k, step.pool_v):
        pool.masked_fill_(~owned[:, None, :, None], float("nan"))
    got = triton_decode.paged_decode_attention(*step.args())
    assert not got.isnan().any(), "the kernel read a position past a row's context"
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_captured_steps_padding_rows_read_one_scratch_position(dtype):
    """What the graph runner pads a batch with: context length 1, a table all scratch block."""
    step = paged_decode([1, 1, 30], 9, 3, 64, dtype)
    scratch = step.pool_k.shape[0] - 1
    step.block_tables[:2] = scratch
    assert_close_to_lesson(triton_decode.paged_decode_attention(*step.args()), paged_decode_attention(*step.args()),
                           f"padding rows, {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_m1_and_m2_layouts_blocks_of_one_row_and_one_block_per_slot(dtype):
    """m1 passes its cache as blocks of one position and an unpadded table 0, 1, 2, ...; m2 each slot as one block
    of max_model_len positions (here 300: no power of two). The kernel finds each position's block either way."""
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 120, 3, 64, generator=generator).to(DEVICE, dtype)  # m1: [max_model_len, kv_heads, dim]
    q, length = torch.randn(1, 9, 64, generator=generator).to(DEVICE, dtype), 77
    args = (q, cache[0][:, :, None], cache[1][:, :, None], torch.arange(length, device=DEVICE)[None],
            torch.tensor([length], device=DEVICE), 64**-0.5)
    assert_close_to_lesson(triton_decode.paged_decode_attention(*args), paged_decode_attention(*args), f"m1, {dtype}")
    slots = torch.randn(2, 4, 3, 300, 64, generator=generator).to(DEVICE, dtype)  # m2: [slots, kv_heads, L, dim]
    q = torch.randn(3, 9, 64, generator=generator).to(DEVICE, dtype)
    args = (q, slots[0], slots[1], torch.tensor([[2], [0], [3]], device=DEVICE),
            torch.tensor([300, 1, 151], device=DEVICE), 64**-0.5)
    assert_close_to_lesson(triton_decode.paged_decode_attention(*args), paged_decode_attention(*args), f"m2, {dtype}")


def test_an_empty_batch_and_bad_input():
    step = paged_decode([5], 4, 2, 16, torch.float32)
    empty = triton_decode.paged_decode_attention(step.q[:0], step.pool_k, step.pool_v, step.block_tables[:0],
                                                 step.context_lens[:0], 0.25)
    assert empty.shape == (0, 4, 16)
    with pytest.raises(ValueError, match="share a dtype"):
        triton_decode.paged_decode_attention(*step.args()[:1], step.pool_k.half(), *step.args()[2:])
    with pytest.raises(ValueError, match="contiguous"):
        triton_decode.paged_decode_attention(step.q.transpose(1, 2).contiguous().transpose(1, 2), *step.args()[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_probe_accepts_the_kernel_and_refuses_one_that_computes_otherwise(monkeypatch, dtype):
    assert triton_decode.probe(DEVICE, dtype) is None
    real = triton_decode.paged_decode_attention

    def reads_the_whole_table(q, pool_k, pool_v, tables, lengths, scale):  # ignores the context lengths
        return real(q, pool_k, pool_v, tables, torch.full_like(lengths, tables.shape[1] * pool_k.shape[2]), scale)

    monkeypatch.setattr(triton_decode, "paged_decode_attention", reads_the_whole_table)
    assert "from plain torch's" in triton_decode.probe(DEVICE, dtype)


def test_which_backends_take_the_kernel_on_cuda(monkeypatch):
    """On CUDA "triton" takes the kernel, or raises if it cannot run; "auto", "batched" and "torch" keep their paths
    (batched attention for the eager steps, the lesson's paged_decode_attention for the captured one). A value that
    joined TRITON_BACKENDS without insisting would fall back with a warning. The option is refused off CUDA."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(decode_attention, "load_triton_decode_kernel", lambda device, dtype: "the kernel")
    assert decode_attention.decode_kernel_for("triton", cuda, torch.bfloat16) == "the kernel"
    for backend in ("auto", "batched", "torch"):
        assert decode_attention.decode_kernel_for(backend, cuda, torch.bfloat16) is None
    assert decode_attention.decode_kernel_for("triton", torch.device("cpu"), torch.float32) is None

    def fails(device, dtype):
        raise RuntimeError("row 1 (context 17) is 3.1e-01 from plain torch's")

    monkeypatch.setattr(decode_attention, "load_triton_decode_kernel", fails)
    with pytest.raises(RuntimeError, match="attention_backend='torch'"):
        decode_attention.decode_kernel_for("triton", cuda, torch.float16)
    monkeypatch.setattr(decode_attention, "TRITON_BACKENDS", ("triton", "auto"))
    with pytest.warns(UserWarning, match="plain-torch attention"):
        assert decode_attention.decode_kernel_for("auto", cuda, torch.bfloat16) is None
    with pytest.raises(ValueError, match="runs on CUDA"):
        check_attention_backend("triton", torch.device("cpu"), torch.float32)
    check_attention_backend("triton", cuda, torch.float16)


def test_the_kernel_loads_where_it_runs():
    """What an engine on CUDA would get, the probe run here (in the interpreter on a CPU)."""
    kernel = decode_attention.load_triton_decode_kernel(DEVICE, torch.float32)
    assert kernel is triton_decode.paged_decode_attention


def test_m5_eager_decodes_through_the_kernel_give_the_lessons_tokens(tiny_model_path):
    """m5's eager steps with the kernel in the runner (what "triton" gives on CUDA; here interpreted, on the tiny
    Llama: 4 query heads over 2 kv heads of 16) give the tokens of the lesson's attention. Eager: on a CPU m5
    captures with torch.compile, which cannot trace an interpreted kernel; tests/cuda captures it in a graph."""
    prompts, settings = mixed_workload(5, seed=5, max_prompt=40, max_output=12)  # the interpreter: ~0.1 s a call
    settings = [{k: v for k, v in s.items() if k != "structured_outputs"} for s in settings]
    limits = dict(device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=True,
                  attention_backend="torch", linear_backend="torch")
    reference = run(m5, m5.LLM(tiny_model_path, **limits), prompts, settings)
    llm = m5.LLM(tiny_model_path, **limits)
    calls = []

    def counted(*args):
        calls.append(len(args[0]))
        return triton_decode.paged_decode_attention(*args)

    runner = llm.engine.runner  # the backend "triton" selects on CUDA, given to the model as the runner would
    runner.attention = DecodeKernelAttention("triton", counted, m5_attention.attention, CacheLayout("paged"))
    runner.model.use_attention(runner.attention.forward)
    assert_same_outputs(run(m5, llm, prompts, settings), reference)
    assert len(calls) > 20 and max(calls) > 1, "the decodes did not go to the kernel in batches"
