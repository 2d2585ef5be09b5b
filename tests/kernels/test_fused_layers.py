"""``fuse_layers``: a decode step's layers in a few compiled calls (milestones/kernels/fused_layers.py), on a CPU.

On a CPU the fused calls round as the compiled norm and the lesson's operators round, so an engine with fused
layers gives the unfused engine's tokens and log-probabilities bit for bit (atol=0), in every milestone (m1's rows,
m2's slots, m3 on's blocks, m5 on's captured steps, which keep the lesson's layer under torch.compile, m7's guess
rows). The fused route must also be the one taken: its calls are counted. The ops alone are held to the lesson's
operators bit for bit; the switch refuses what it cannot do, saying what to change.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from milestones.kernels import FusedDecoderLayer, check_fuse_layers
from milestones.kernels.fused_layers import fused_ops_for
from milestones.kernels.rms_norm import FusedRMSNorm
from milestones.m5.model import RMSNorm, apply_rope
from tests.chain import LIMITS, assert_same_outputs, mixed_workload, run
from tests.conftest import needs_compiler

pytestmark = needs_compiler


def limits(mod) -> dict:
    return {k: v for k, v in LIMITS.items() if k in mod.EngineConfig.__dataclass_fields__}


@pytest.fixture(scope="module")
def ops():
    return fused_ops_for(torch.device("cpu"))


def count_fused_steps(monkeypatch, llm) -> list[int]:
    """Count the fused route's RoPE calls (one a layer a fused step) by wrapping the ops every fused layer holds."""
    calls = [0]
    layers = [layer for layer in llm.engine.runner.model.model.layers if isinstance(layer, FusedDecoderLayer)]
    rope = layers[0].ops.rope_and_write_kv

    def counted(*args):
        calls[0] += 1
        return rope(*args)

    counted_ops = dataclasses.replace(layers[0].ops, rope_and_write_kv=counted)
    for layer in layers:
        monkeypatch.setattr(layer, "ops", counted_ops)
    return calls


def test_fused_layers_give_the_unfused_engine_s_outputs_bit_for_bit(mod, tiny_model_path, monkeypatch):
    prompts, settings = mixed_workload(6, seed=3, max_prompt=40, max_output=16)
    options = limits(mod)
    if mod.__name__.endswith("m7"):  # a checking step's guess rows are decode rows too
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2}
    unfused = mod.LLM(tiny_model_path, fuse_layers=False, **options)
    assert not any(isinstance(layer, FusedDecoderLayer) for layer in unfused.engine.runner.model.model.layers)
    reference = run(mod, unfused, prompts, settings)
    fused = mod.LLM(tiny_model_path, fuse_layers=True, **options)
    layers = fused.engine.runner.model.model.layers
    assert all(isinstance(layer, FusedDecoderLayer) for layer in layers), "fuse_layers=True left a layer unfused"
    calls = count_fused_steps(monkeypatch, fused)
    assert_same_outputs(run(mod, fused, prompts, settings), reference, settings, atol=0)
    assert calls[0] > 0 and calls[0] % len(layers) == 0, f"{calls[0]} fused RoPE calls for {len(layers)} layers"


def test_auto_fuses_where_it_applies_and_leaves_the_lesson_elsewhere(tiny_model_path, tiny_model_factory):
    from milestones import m3

    def fused(path, **options) -> bool:
        layers = m3.LLM(path, max_model_len=128, **options).engine.runner.model.model.layers
        return all(isinstance(layer, FusedDecoderLayer) for layer in layers)

    assert fused(tiny_model_path)  # a CPU's defaults: the compiled decode kernel and norms
    assert not fused(tiny_model_path, attention_backend="torch")  # no decode kernel: the lesson's attention
    assert not fused(tiny_model_path, linear_backend="torch")  # no compiled norms
    assert not fused(tiny_model_factory("qwen3"))  # q and k normed before RoPE


@pytest.mark.parametrize("options, message", [
    (dict(attention_backend="torch"), "needs a decode kernel"),
    (dict(linear_backend="torch"), "compiled norms"),
])
def test_fuse_layers_true_says_what_is_missing(tiny_model_path, options, message):
    from milestones import m2

    with pytest.raises(RuntimeError, match=f"fuse_layers=True cannot fuse this engine's layers: .*{message}"):
        m2.LLM(tiny_model_path, max_model_len=128, fuse_layers=True, **options)


def test_fuse_layers_refuses_a_value_that_is_no_switch():
    with pytest.raises(ValueError, match="fuse_layers must be True, False or 'auto', got 'yes'"):
        check_fuse_layers("yes", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="fuse_layers=True runs in float32, bfloat16 on cpu"):
        check_fuse_layers(True, torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cpu_ops_are_the_lesson_s_operators_bit_for_bit(ops, dtype):
    generator = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim, block_size, blocks = 5, 9, 3, 64, 16, 6
    x, residual = (torch.randn(n, 576, generator=generator).to(dtype) for _ in range(2))
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=generator) + 0.5)
    norm = FusedRMSNorm(norm.to(dtype))
    normed, total = ops.add_rms_norm(x, residual, norm.norm.weight, norm.norm.eps)
    assert torch.equal(total, x + residual) and torch.equal(normed, norm(x + residual))
    assert torch.equal(ops.rms_norm(x, norm.norm.weight, norm.norm.eps), norm(x))

    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)
    angles = torch.rand(n, 1, dim // 2, generator=generator).repeat(1, 1, 2) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache = torch.full((2, kv_heads, blocks, block_size, dim), float("nan"), dtype=dtype)  # [k/v, heads, blocks, ...]
    slots = torch.tensor([0, 17, 95, 40, 3])
    rotated = ops.rope_and_write_kv(q, k, v, cos[:, 0], sin[:, 0], cache[0].transpose(0, 1),
                                    cache[1].transpose(0, 1), slots)
    assert torch.equal(rotated, apply_rope(q, cos, sin)), "q is not rotated as the lesson rotates it"
    written = cache[:, :, slots // block_size, slots % block_size]  # [k/v, heads, n, dim]
    assert torch.equal(written[0].transpose(0, 1), apply_rope(k, cos, sin)), "the cache's keys are not the rotated k"
    assert torch.equal(written[1].transpose(0, 1), v), "the cache's values are not v"
    assert cache.isnan().sum() == cache.numel() - written.numel(), "a slot no token owns was written"
    with pytest.raises(RuntimeError, match="slot 96 of token 0 is outside the cache's 96 slots"):
        ops.rope_and_write_kv(q, k, v, cos[:, 0], sin[:, 0], cache[0].transpose(0, 1), cache[1].transpose(0, 1),
                              torch.tensor([96, 0, 0, 0, 0]))
