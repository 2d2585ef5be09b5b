"""The fused Triton kernels (milestones/kernels/triton_fused.py) against the lesson's operators they replace.

Without a GPU these run in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` before anything
imports triton), on CPU tensors; on a GPU, compiled. CI runs them in a stage of their own, which installs triton
(``make test-triton``); a plain ``make test`` without triton skips them with that reason.

Tolerance: the kernels round where the lesson's operators round, so what may differ is one rounding: a float32
intermediate computed in another order or by another instruction (the norm's mean of squares, ``exp``,
``rsqrt``) that lands on the other side of a rounding boundary, and, in Triton's interpreter only, every rounding
to bfloat16, which the interpreter truncates (triton 3.x; float16 and the GPU round to nearest). So each output is
held within one unit in the last place per rounding on its path (``roundings``), of the magnitude of the terms it
sums (for RoPE, ``|x| |cos| + |rotate_half(x)| |sin|``: its sums may cancel). The cache writes are exact: the slots
written hold the kernel's rotated keys and v's values, and a pool poisoned with NaN keeps NaN everywhere else; the
skip connection's sum is the lesson's bit for bit, except under the interpreter's bfloat16 truncation.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from milestones.hf_checkpoint import ModelConfig
from milestones.m5.model import RMSNorm, RotaryEmbedding, apply_rope, rotate_half

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (`make test-triton` installs it and runs these in its interpreter on the "
                "CPU)", allow_module_level=True)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and triton's interpreter is off (tests/conftest.py turns it on before triton is imported)",
                allow_module_level=True)

from milestones.kernels import triton_fused  # noqa: E402  (only once triton is known to be there)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS = [(9, 3, 64), (32, 8, 128), (4, 4, 24)]  # SmolLM2's; Llama-3.1-8B's; no grouping, a half of 12 (padded)
BLOCK_SIZES = [16, 32, 1]  # the default, a larger one, and a block of one position (m1's rows seen as blocks)


def assert_close(found: torch.Tensor, expected: torch.Tensor, what: str, roundings: int,
                 magnitude: torch.Tensor | None = None) -> None:
    """Within ``roundings`` units in the last place of ``magnitude`` (default: of ``expected``); prints the margin."""
    found, expected_f = found.float(), expected.float()
    scale = (magnitude if magnitude is not None else expected).float().abs()
    bound = roundings * torch.finfo(expected.dtype).eps * scale + torch.finfo(expected.dtype).tiny
    over = (found - expected_f).abs() - bound
    worst = over.flatten().argmax()
    assert (over <= 0).all(), (f"{what}: {int((over > 0).sum())} of {over.numel()} values off by more than "
                               f"{roundings} units in the last place; the worst is "
                               f"{(found - expected_f).abs().flatten()[worst].item():.3g} off, its bound "
                               f"{bound.flatten()[worst].item():.3g}")


def truncates(dtype: torch.dtype) -> bool:
    """Does this run round to ``dtype`` by truncation (Triton's interpreter, bfloat16)?"""
    return DEVICE.type != "cuda" and dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [576, 4096, 100])  # SmolLM2's hidden size, the 8B's, and one that needs padding
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_rms_norm_is_the_lesson_s_norm_of_the_skip_connection(dtype, n, with_residual):
    generator = torch.Generator().manual_seed(n)
    x, residual = (torch.randn(7, n, generator=generator).to(DEVICE, dtype) * 3 for _ in range(2))
    norm = RMSNorm(n, 1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=generator) + 0.5)
    norm = norm.to(dtype)
    found, total = triton_fused.rms_norm(x, norm.weight, norm.eps, residual if with_residual else None)
    expected_total = residual + x if with_residual else x  # the lesson's ``x = x + self_attn(...)``
    if truncates(dtype):
        assert_close(total, expected_total, "the skip connection's sum", roundings=1)
    else:
        assert torch.equal(total, expected_total), "the skip connection's sum is not the lesson's, bit for bit"
    with torch.no_grad():  # normed, then times the weight: two roundings, and one for the mean of squares
        assert_close(found, norm(total), "the norm", roundings=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1536, 14336, 100])  # SmolLM2's intermediate size, the 8B's (tiles), padding
def test_silu_and_mul_is_the_lesson_s_activation(dtype, n):
    generator = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(5, 2 * n, generator=generator) * 4).to(DEVICE, dtype)  # one product's two halves
    gate, up = gate_up[:, :n], gate_up[:, n:]
    assert_close(triton_fused.silu_and_mul(gate, up), F.silu(gate) * up, "silu(gate) * up", roundings=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_rope_and_write_kv_rotates_as_the_lesson_and_writes_only_the_new_slots(dtype, heads, block_size):
    num_heads, num_kv_heads, dim = heads
    config = ModelConfig("llama", vocab_size=8, hidden_size=num_heads * dim, intermediate_size=8, num_layers=1,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=dim, rms_norm_eps=1e-5,
                         max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
                         rope_theta=10000.0, rope_scaling=None)
    rope = RotaryEmbedding(config, 512)
    generator = torch.Generator().manual_seed(dim + block_size)
    n, num_blocks = 6, 40 // block_size + 8
    q_size, kv_size = num_heads * dim, num_kv_heads * dim
    qkv = torch.randn(n, q_size + 2 * kv_size, generator=generator).to(DEVICE, dtype)  # one product, as the layer's
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(n, num_heads, dim), k.view(n, num_kv_heads, dim), v.view(n, num_kv_heads, dim)
    positions = torch.tensor([0, 1, 15, 16, 17, 39], device=DEVICE)  # a block's first and last, one past
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:n].to(DEVICE)  # anywhere in the pool
    # The engine's layer layout, [kv_heads, blocks, block_size, dim], seen as [blocks, kv_heads, block_size, dim].
    k_cache, v_cache = (torch.full((num_kv_heads, num_blocks, block_size, dim), float("nan"), dtype=dtype,
                                   device=DEVICE) for _ in range(2))
    lesson_cos, lesson_sin = rope.to(DEVICE)(positions, dtype)  # [n, 1, dim]: what every layer gets
    found_q = triton_fused.rope_and_write_kv(q, k, v, lesson_cos[:, 0], lesson_sin[:, 0], k_cache.transpose(0, 1),
                                             v_cache.transpose(0, 1), slots)
    expected_q, expected_k = apply_rope(q, lesson_cos, lesson_sin), apply_rope(k, lesson_cos, lesson_sin)
    # Three roundings (two products, their sum) on the terms' magnitude, and one to spare.
    both = torch.cat([q, k], 1).float()
    terms = both.abs() * lesson_cos.float().abs() + rotate_half(both).abs() * lesson_sin.float().abs()
    assert_close(found_q, expected_q, "the rotated queries", 4, terms[:, :num_heads])
    blocks, offsets = slots // block_size, slots % block_size
    assert_close(k_cache[:, blocks, offsets].transpose(0, 1), expected_k, "the rotated keys in the cache", 4,
                 terms[:, num_heads:])
    assert torch.equal(v_cache[:, blocks, offsets].transpose(0, 1), v), "the values in the cache are not v's"
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    for cache in (k_cache, v_cache):
        untouched = cache.view(num_kv_heads, -1, dim)[:, ~written]
        assert untouched.isnan().all(), "a slot that no new token owns was written"


def test_the_kernels_refuse_what_they_cannot_address():
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rows are contiguous"):
        triton_fused.rms_norm(x.t(), torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="one shape and dtype"):
        triton_fused.rms_norm(x, torch.ones(64, device=DEVICE), 1e-5, x.half())
    with pytest.raises(ValueError, match="one shape"):
        triton_fused.silu_and_mul(x, x[:, :32])
    pool = torch.zeros(2, 2, 16, 8, device=DEVICE)
    q, k = torch.randn(1, 4, 8, device=DEVICE), torch.randn(1, 2, 8, device=DEVICE)
    angles, slots = torch.ones(1, 8, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="kv heads"):
        triton_fused.rope_and_write_kv(q, k[:, :1], k[:, :1], angles, angles, pool, pool, slots)
    with pytest.raises(ValueError, match="share a dtype"):
        triton_fused.rope_and_write_kv(q, k.half(), k, angles, angles, pool, pool, slots)


@pytest.mark.parametrize("package", ["m1", "m3"])  # m1's cache of rows, m3's blocks
def test_a_layer_fused_with_the_triton_kernels_gives_the_lesson_s_tokens(package, tiny_model_path, monkeypatch):
    """CUDA's fused layer as a whole (the Triton norm, RoPE with the KV write, SiLU-and-mul, gate and up as one
    product), here in the interpreter on CPU tensors in float32: an engine whose decode steps run it gives the
    lesson's tokens, and log-probabilities within the chain's tolerance (the largest gap is printed)."""
    import importlib

    from milestones.kernels import FusedDecoderLayer, fused_layers
    from tests.chain import LIMITS, LOGPROB_ATOL, assert_same_outputs, mixed_workload, run

    mod = importlib.import_module(f"milestones.{package}")
    options = {k: v for k, v in LIMITS.items() if k in mod.EngineConfig.__dataclass_fields__}
    options.update(linear_backend="torch", attention_backend="cpp")  # the lesson's products and norms, as on CUDA
    prompts, settings = mixed_workload(4, seed=3, max_prompt=24, max_output=8)
    settings = [dict(s, logprobs=2) for s in settings]  # every token's three log-probabilities compared
    reference = run(mod, mod.LLM(tiny_model_path, fuse_layers=False, **options), prompts, settings)
    monkeypatch.setattr(fused_layers, "fused_ops_for", lambda device: fused_layers.triton_ops())
    monkeypatch.setattr(fused_layers, "_missing", lambda config, model, attention: None)  # CUDA's checks passed
    fused = mod.LLM(tiny_model_path, fuse_layers=True, **options)
    layers = fused.engine.runner.model.model.layers
    assert all(isinstance(layer, FusedDecoderLayer) for layer in layers)
    assert all(isinstance(layer.plan.mlp, fused_layers.GateUpMLP) for layer in layers)
    calls = [0]
    silu_and_mul = triton_fused.silu_and_mul

    def counted(gate, up):
        calls[0] += 1
        return silu_and_mul(gate, up)

    for layer in layers:
        monkeypatch.setattr(layer.plan.mlp, "silu_and_mul", counted)
    outputs = run(mod, fused, prompts, settings)
    assert calls[0] > 0 and calls[0] % len(layers) == 0, f"{calls[0]} fused MLP calls for {len(layers)} layers"
    gaps = [abs(a[token].logprob - b[token].logprob) for out, ref in zip(outputs, reference)
            for a, b in zip(out.logprobs or [], ref.logprobs or []) for token in a.keys() & b.keys()]
    print(f"\n{package}, fused with the Triton kernels: {calls[0] // len(layers)} fused steps; largest "
          f"log-probability gap {max(gaps, default=0.0):.2e} over {len(gaps)} (tolerance {LOGPROB_ATOL})")
    assert_same_outputs(outputs, reference, settings, atol=LOGPROB_ATOL)
