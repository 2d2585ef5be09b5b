"""Batched attention (attention_backend="batched") against the lessons' request-by-request attention.

Both layouts of ``milestones/kernels/batched_attention.py`` are checked on the CPU: the padded one as it runs, the
varlen one with a stand-in for flash's kernel written out per sequence (torch's varlen_attn runs on CUDA only;
tests/cuda/test_cuda.py checks the real one). A step mixes whole prompts, chunks that end a context, decodes and m7's
token-plus-guesses rows, over blocks shuffled through the pool, with 9 query heads over 3 kv heads.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.attention.varlen as varlen_module

import milestones.kernels.batched_attention as batched
import milestones.m2.attention as m2_attention
import milestones.m5.attention as m5_attention
from milestones import m2, m4, m5, m7
from milestones.kernels import ATTENTION_BACKENDS, batched_attention_for, check_attention_backend
from milestones.kernels.attention_backends import CacheLayout, RaggedAttention, TorchAttention
from milestones.kernels.batched_attention import BatchedAttention, PaddedBatch, probe_varlen, varlen_kernel
from milestones.m5.attention import AttentionContext, RequestSpan, attention
from tests.chain import assert_same_outputs, mixed_workload, run

CPU = torch.device("cpu")
# The batched output against the per-request one on the same numbers. float32: both sum the same positions in another
# order (seen: 6e-7). bfloat16: each path rounds its probabilities and its output to bfloat16 in its own order, so two
# units in the last place at the outputs' magnitude, 2 to 4 (seen: 2^-6 with the varlen stand-in, 2^-7 padded); and,
# with float32 on the same numbers as the yardstick, at most one unit (2^-7) further from it than the lesson's path.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}
YARDSTICK_SLACK = 2 ** -7
STEP = [(1, 37), (23, 23), (5, 40), (1, 1), (4, 19), (16, 48), (1, 64), (3, 3)]  # (new tokens, context) per request


@dataclass(slots=True)
class Heads:
    """A model's heads, as the start-up probe reads them."""

    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64


@dataclass(slots=True)
class PagedStep:
    """A random pool and a step over it, in the m5 runner's shapes."""

    q: torch.Tensor  # [rows, heads, dim]
    k: torch.Tensor  # [rows, kv_heads, dim]: the new tokens' keys, written by attention
    v: torch.Tensor
    k_cache: torch.Tensor  # [1 layer, kv_heads, blocks, block_size, dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: list[int]
    spans: list[RequestSpan]


def paged_step(step: list[tuple[int, int]], dtype: torch.dtype, device: torch.device = CPU, heads: int = 9,
               kv_heads: int = 3, dim: int = 64, block_size: int = 16, seed: int = 0) -> PagedStep:
    """Every request's blocks drawn at random from a pool with room to spare, its context filled with random keys."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-context // block_size) for _, context in step]
    free = list(range(sum(needed) + 5))
    rng.shuffle(free)
    shape = (1, kv_heads, len(free), block_size, dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(2))
    rows = sum(num_new for num_new, _ in step)
    q, k, v = (torch.randn(rows, h, dim, generator=generator).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    spans, tables, slots, row = [], [], [], 0
    for (num_new, context), count in zip(step, needed):
        table = [free.pop() for _ in range(count)]
        spans.append(RequestSpan(row, row + num_new, table, context, len(tables) * block_size))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context - num_new, context)]
        tables += table
        row += num_new
    return PagedStep(q, k, v, k_cache, v_cache, torch.tensor(slots, device=device), tables, spans)


def attend(step: PagedStep, batched_attention: BatchedAttention | None) -> torch.Tensor:
    """m5's attention over a fresh copy of the pool: request by request (None) or in one batched call."""
    tables = torch.tensor(step.block_tables, device=step.q.device)
    ctx = AttentionContext(step.k_cache.clone(), step.v_cache.clone(), step.slot_mapping, tables, step.spans)
    backend = (TorchAttention(attention) if batched_attention is None
               else RaggedAttention(batched_attention, attention, CacheLayout("paged")))
    backend.prepare_metadata(ctx)
    return backend.forward(step.q, step.k, step.v, 0, ctx)


def varlen_stand_in(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_q: torch.Tensor,
                    cu_k: torch.Tensor, max_q: int, max_k: int, bottom_right: bool = True) -> torch.Tensor:
    """What flash's varlen kernel computes, sequence by sequence in float32: causal from the bottom right (query i of
    n sees the first L - n + i + 1 keys), kv heads shared by groups of query heads. ``bottom_right=False``: a kernel
    whose causal mask starts at the first key instead (query i sees i + 1), as the probe must notice."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and keys.shape[0] == cu_k[-1] and max_k == cu_k.diff().max()
    out = torch.empty_like(q)
    group = q.shape[1] // keys.shape[1]
    for first_q, end_q, first_k, end_k in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                                              cu_k[1:].tolist()):
        n, length = end_q - first_q, end_k - first_k
        assert n <= max_q
        queries = q[first_q:end_q].float().transpose(0, 1)  # [heads, n, dim]
        k = keys[first_k:end_k].float().transpose(0, 1).repeat_interleave(group, 0)  # [heads, L, dim]
        v = values[first_k:end_k].float().transpose(0, 1).repeat_interleave(group, 0)
        scores = queries @ k.transpose(1, 2) * q.shape[-1] ** -0.5
        visible = torch.arange(length) <= torch.arange(length - n if bottom_right else 0, length)[:n, None]
        out[first_q:end_q] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def assert_within(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    worst = (got.float() - expected.float()).abs().max().item()
    assert worst <= TOLERANCE[dtype], f"{what}: {worst:.2e} from the per-request path (tolerance {TOLERANCE[dtype]})"


def assert_matches_request_by_request(step: PagedStep, layout: BatchedAttention, what: str) -> None:
    """Within TOLERANCE of the lesson's path; in bfloat16 also measured against float32 on the same numbers."""
    dtype, expected, got = step.q.dtype, attend(step, None), attend(step, layout)
    assert_within(got, expected, dtype, what)
    if dtype == torch.bfloat16:
        widened = dataclasses.replace(step, **{name: getattr(step, name).float()
                                               for name in ("q", "k", "v", "k_cache", "v_cache")})
        truth = attend(widened, None)
        ours, lessons = ((out.float() - truth).abs().max().item() for out in (got, expected))
        assert ours <= lessons + YARDSTICK_SLACK, f"{what}: {ours:.2e} from float32, the lesson's path {lessons:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padded_layout_equals_request_by_request(dtype, seed):
    step = paged_step(STEP, dtype, seed=seed)
    assert_matches_request_by_request(step, BatchedAttention("padded", None), f"padded, {dtype}, seed {seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_varlen_layout_equals_request_by_request(dtype, seed):
    """The packing, the offsets and the gather of the varlen layout, with flash's arithmetic written out."""
    step = paged_step(STEP, dtype, seed=seed)
    assert_matches_request_by_request(step, BatchedAttention("varlen", varlen_stand_in), f"varlen, {dtype}, {seed}")


@pytest.mark.parametrize("step", [[(1, 5)], [(7, 7)], [(1, 9), (1, 80), (1, 16)], [(30, 30), (12, 50)]])
def test_steps_of_one_kind(step):
    """Only decodes, only prompts, one request: the padding is all at one end, or none."""
    paged = paged_step(step, torch.float32)
    expected = attend(paged, None)
    for layout in (BatchedAttention("padded", None), BatchedAttention("varlen", varlen_stand_in)):
        assert_within(attend(paged, layout), expected, torch.float32, f"{layout.name}, {step}")


def test_m2_slots_read_as_blocks_of_max_model_len():
    """m2's hook: each request's slot is one block of max_model_len, its context at the start of it."""
    torch.manual_seed(0)
    slots, kv_heads, max_len, dim = 5, 3, 96, 64
    k_cache, v_cache = torch.randn(1, slots, kv_heads, max_len, dim), torch.randn(1, slots, kv_heads, max_len, dim)
    step, kv_slots = [(1, 40), (12, 12), (6, 90)], [3, 0, 4]
    spans, token_slots, positions, row = [], [], [], 0
    for (num_new, context), slot in zip(step, kv_slots):
        spans.append(m2_attention.RequestSpan(row, row + num_new, slot, context))
        token_slots += [slot] * num_new
        positions += range(context - num_new, context)
        row += num_new
    q, k, v = torch.randn(row, 9, dim), torch.randn(row, kv_heads, dim), torch.randn(row, kv_heads, dim)
    outs = []
    for layout in (None, BatchedAttention("padded", None), BatchedAttention("varlen", varlen_stand_in)):
        ctx = m2_attention.AttentionContext(k_cache.clone(), v_cache.clone(), torch.tensor(token_slots),
                                            torch.tensor(positions), list(spans))
        backend = (TorchAttention(m2_attention.attention) if layout is None
                   else RaggedAttention(layout, m2_attention.attention, CacheLayout("slots")))
        backend.prepare_metadata(ctx)
        outs.append(backend.forward(q, k, v, 0, ctx))
    for out in outs[1:]:
        assert_within(out, outs[0], torch.float32, "m2")


def test_the_probe_accepts_flash_semantics_and_refuses_others():
    assert probe_varlen(varlen_stand_in, CPU, torch.float32, Heads()) is None
    top_left = functools.partial(varlen_stand_in, bottom_right=False)
    assert "differs" in probe_varlen(top_left, CPU, torch.float32, Heads())
    assert "differs" in probe_varlen(lambda *args: varlen_stand_in(*args) * 1.1, CPU, torch.float32, Heads())


def varlen_of_torch_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    return {"window_size": window_size}


def varlen_of_torch_2_13(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                         enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    return {"window_size": window_size, "enable_gqa": enable_gqa}


def varlen_with_a_flag(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
    return {"is_causal": is_causal}


def varlen_without_causal(q, k, v, cu_q, cu_k, max_q, max_k):
    return {}


@pytest.mark.parametrize("varlen_attn, expected", [
    (varlen_of_torch_2_11, {"window_size": (-1, 0)}),
    (varlen_of_torch_2_13, {"window_size": (-1, 0), "enable_gqa": True}),
    (varlen_with_a_flag, {"is_causal": True}),
    (varlen_without_causal, None),
])
def test_varlen_arguments_follow_the_torch_at_hand(monkeypatch, varlen_attn, expected):
    """Causal and grouped-query heads asked for as this torch's varlen_attn spells them; None if it cannot."""
    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_attn)
    kernel = varlen_kernel()
    assert (kernel is None) == (expected is None)
    if kernel is not None:
        assert kernel(None, None, None, None, None, 1, 1) == expected


def test_which_path_an_engine_gets():
    assert "batched" in ATTENTION_BACKENDS
    for backend in ("auto", "torch", "cpp"):  # a CPU keeps its defaults
        assert batched_attention_for(backend, CPU, torch.float32, Heads()) is None
    for dtype in (torch.float32, torch.bfloat16):  # "batched" on a CPU: the plain-torch layout
        assert batched_attention_for("batched", CPU, dtype, Heads()).name == "padded"
    check_attention_backend("batched", CPU, torch.float32)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        check_attention_backend("varlen", CPU, torch.float32)


def test_no_usable_varlen_falls_back_with_a_warning(monkeypatch):
    """On CUDA in bfloat16 a torch without varlen_attn, or one whose kernel fails, takes the padded path."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(batched, "varlen_kernel", lambda: None)
    with pytest.warns(UserWarning, match="no usable"):
        assert batched_attention_for("auto", cuda, torch.bfloat16, Heads()).name == "padded"

    def fails(*args):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(batched, "varlen_kernel", lambda: fails)
    monkeypatch.setattr(batched, "probe_varlen", lambda kernel, *args: kernel())
    with pytest.warns(UserWarning, match="no kernel image"):
        assert batched_attention_for("auto", cuda, torch.bfloat16, Heads()).name == "padded"
    assert batched_attention_for("auto", cuda, torch.float32, Heads()).name == "padded"  # flash has no float32


LIMITS = dict(device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)


@pytest.mark.parametrize("mod", [m2, m4])
def test_engine_gives_the_default_tokens(tiny_model_path, mod):
    """The chain's mixed workload (chunks beside decodes, sampled and greedy) with and without batched attention."""
    prompts, settings = mixed_workload(12, seed=5, max_prompt=90, max_output=24)
    reference = run(mod, mod.LLM(tiny_model_path, **LIMITS), prompts, settings)
    llm = mod.LLM(tiny_model_path, **LIMITS, attention_backend="batched")
    assert llm.engine.runner.attention.name == "padded"
    assert_same_outputs(run(mod, llm, prompts, settings), reference)


def test_m7_checking_steps_give_the_default_tokens(tiny_model_path):
    """m7's guesses ride after each request's last token, a short chunk: eager here, so every checking step is one
    batched call per layer."""
    prompts, settings = mixed_workload(8, seed=6, max_prompt=60, max_output=24)
    settings = [{k: v for k, v in s.items() if k != "structured_outputs"} for s in settings]
    guesses = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    limits = dict(LIMITS, enforce_eager=True, speculative_config=guesses)
    reference = run(m7, m7.LLM(tiny_model_path, **limits), prompts, settings)
    with m7.LLM(tiny_model_path, **limits, attention_backend="batched") as llm:
        assert_same_outputs(run(m7, llm, prompts, settings), reference)
        assert llm.engine.spec_stats()["num_draft_tokens"] > 0


def test_a_mixed_step_attends_once_per_layer(tiny_model_path, monkeypatch):
    """With batched attention an eager step calls attention once per layer, whatever its number of requests; the
    lesson's per-request functions are never called."""
    calls, steps = [], []
    real_call = PaddedBatch.__call__

    def counted(self, q, pool_k, pool_v):
        calls.append(len(self.out_rows))
        return real_call(self, q, pool_k, pool_v)

    def never(*args):
        raise AssertionError("a request was attended to on its own")

    monkeypatch.setattr(PaddedBatch, "__call__", counted)
    monkeypatch.setattr(m5_attention, "prefill_attention", never)
    monkeypatch.setattr(m5_attention, "decode_attention", never)
    llm = m5.LLM(tiny_model_path, **LIMITS, attention_backend="batched", enforce_eager=True)
    runner = llm.engine.runner
    real_prepare = runner.prepare_inputs

    def recorded(batch):
        steps.append(sorted(batch.num_new_tokens))
        return real_prepare(batch)

    runner.prepare_inputs = recorded
    prompts = [[5 + i] * length for i, length in enumerate([3, 70, 9, 50])]
    llm.generate(prompts, m5.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    num_layers = len(runner.model.model.layers)
    assert any(len(s) > 2 and s[0] == 1 and s[-1] > 1 for s in steps), f"no step mixed decodes and chunks: {steps}"
    assert len(calls) == num_layers * len(steps), f"{len(calls)} attention calls in {len(steps)} steps"

