"""m1, step 3: attention over the KV cache, against transformers' attention with its own cache.

A prompt is prefilled in one forward pass, then tokens are decoded one per step, each
reading every cached row. After every forward pass the outputs must equal transformers'
(eager attention under a causal mask, keys and values repeated for grouped heads), and the
cache must hold exactly the rows written so far: the rotated keys and the unrotated values,
in the layer's own slice of the cache, every other row untouched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from milestones.m1.attention import AttentionContext, attention, decode_attention
from milestones.m1.model import ModelConfig, SelfAttention
from tests.checkpoints import checkpoint_config, stacked_qkv

from .cached_steps import ROWS, causal_mask, chunks, what
from .closeness import EXACT, FLOAT32, expect_close


def expect_cache(k_cache, v_cache, layer: int, end: int, keys, values, step: str, source: str) -> None:
    """Rows 0..end-1 of the layer hold these keys and values; later rows and other layers are still zero."""
    expect_close(f"k_cache[{layer}][:{end}] after {step}", k_cache[layer, :end], keys, FLOAT32, source)
    expect_close(f"v_cache[{layer}][:{end}] after {step}", v_cache[layer, :end], values, FLOAT32, source)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect_close(f"{name}[{layer}][{end}:] after {step} (rows not written yet)", cache[layer, end:],
                     torch.zeros_like(cache[layer, end:]), EXACT, source="a fresh cache")
        others = torch.cat([cache[:layer], cache[layer + 1:]])
        expect_close(f"{name} of the layers other than {layer} after {step} (only layer {layer} ran)", others,
                     torch.zeros_like(others), EXACT, source="a fresh cache")


def grouped(num_heads: int, num_kv_heads: int) -> SimpleNamespace:
    """What transformers' eager attention reads from its module: the group size (query heads per key/value head)."""
    return SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, training=False)


def test_decode_attention_reads_the_key_value_head_of_each_query_heads_group():
    """One query, every cached row, no mask; query head h reads key/value head h // 3 (9 query heads, 3 kv heads)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 64, generator=generator)
    keys, values = torch.randn(3, 13, 64, generator=generator), torch.randn(3, 13, 64, generator=generator)
    expected, _ = eager_attention_forward(grouped(9, 3), q.transpose(0, 1)[None], keys[None], values[None], None,
                                          scaling=64**-0.5)
    expect_close("decode_attention(q [1, 9, 64], keys and values [3, 13, 64])", decode_attention(q, keys, values),
                 expected[0], FLOAT32)


def test_decode_attention_in_bfloat16_sums_in_float32_and_rounds_once():
    """bfloat16 in and out, float32 inside: the float32 result on the same numbers, rounded once at the end."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 9, 64, generator=generator).bfloat16()
    keys, values = (torch.randn(3, 40, 64, generator=generator).bfloat16() for _ in range(2))
    out = decode_attention(q, keys, values)
    assert out.dtype == torch.bfloat16
    in_float32 = decode_attention(q.float(), keys.float(), values.float()).bfloat16()
    expect_close("decode_attention in bfloat16", out, in_float32, EXACT, source="float32 on the same numbers, rounded")


@pytest.mark.parametrize("prompt_len", [11, 1])
def test_attention_writes_the_cache_and_matches_causal_attention(prompt_len):
    """Each token's output is full causal attention's at that token, computed from the cache a step at a time."""
    total, layer = prompt_len + 4, 1
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(total, 9, 64, generator=generator)
    k, v = torch.randn(total, 3, 64, generator=generator), torch.randn(total, 3, 64, generator=generator)
    full, _ = eager_attention_forward(grouped(9, 3), q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], causal_mask(0, total), scaling=64**-0.5)
    k_cache, v_cache = torch.zeros(3, ROWS, 3, 64), torch.zeros(3, ROWS, 3, 64)
    for start, end in chunks(prompt_len, total):
        ctx = AttentionContext(k_cache, v_cache, slot_mapping=torch.arange(start, end), context_len=end)
        out = attention(q[start:end], k[start:end], v[start:end], layer, ctx)
        expect_cache(k_cache, v_cache, layer, end, k[:end], v[:end], what(start, end),
                     "the k and v passed to attention()")
        expect_close(f"attention() output [tokens, 9 heads, 64], {what(start, end)}", out, full[0, start:end],
                     FLOAT32)


def compare_with_cache(ours: SelfAttention, theirs: torch.nn.Module, hf_config, x: torch.Tensor, prompt_len: int,
                       layer: int, num_layers: int, name: str) -> None:
    """Run both modules over x, a prefill then decode steps, and compare the outputs and the caches after each."""
    cfg = ModelConfig.from_hf(hf_config)
    cos, sin = LlamaRotaryEmbedding(hf_config)(x, torch.arange(len(x))[None])  # [1, tokens, head_dim]
    k_cache = torch.zeros(num_layers, ROWS, cfg.num_kv_heads, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    cache = DynamicCache(config=hf_config)
    with torch.no_grad():
        for start, end in chunks(prompt_len, len(x)):
            ctx = AttentionContext(k_cache, v_cache, slot_mapping=torch.arange(start, end), context_len=end)
            out = ours(x[start:end], cos[0, start:end, None], sin[0, start:end, None], ctx)
            expected, _ = theirs(x[None, start:end], (cos[:, start:end], sin[:, start:end]),
                                 causal_mask(start, end), past_key_values=cache)
            # transformers' cache: [1, kv_heads, tokens, head_dim], keys after RoPE, values as projected. The cache
            # first: a wrong key or value says more than the attention output it spoils
            keys, values = (t[0].transpose(0, 1) for t in (cache.layers[layer].keys, cache.layers[layer].values))
            expect_cache(k_cache, v_cache, layer, end, keys, values, what(start, end), "transformers' cache")
            expect_close(f"{name} output, {what(start, end)}", out, expected[0], FLOAT32)


@pytest.mark.parametrize("prompt_len", [11, 1])
def test_self_attention_matches_llama_attention_on_smollm2(smollm2, prompt_len):
    """SmolLM2's layer 2: 9 query heads, 3 key/value heads; the cache has 3 layers, and only layer 2 is written."""
    layer, weights = 2, smollm2.weights("model.layers.2.self_attn.")
    ours, theirs = SelfAttention(smollm2.config, layer), LlamaAttention(smollm2.hf_config, layer)
    ours.load_state_dict(stacked_qkv(weights))
    theirs.load_state_dict(weights)
    norm = LlamaRMSNorm(576, smollm2.config.rms_norm_eps)  # the layer's input: a normalised hidden state
    norm.load_state_dict(smollm2.weights("model.layers.2.input_layernorm."))
    with torch.no_grad():
        x = norm(torch.randn(prompt_len + 4, 576, generator=torch.Generator().manual_seed(2)))
    compare_with_cache(ours, theirs, smollm2.hf_config, x, prompt_len, layer, 3, "SelfAttention (SmolLM2, layer 2)")


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_self_attention_matches_qwen_attention(kind):
    """Qwen2 adds a bias to the q, k and v projections; Qwen3 normalises each head of q and k before RoPE."""
    hf_config = checkpoint_config(kind)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(3)
    theirs = {"qwen2": Qwen2Attention, "qwen3": Qwen3Attention}[kind](hf_config, 1)
    with torch.no_grad():  # norm weights of 1 would hide a norm applied after RoPE (a rotation keeps the RMS)
        for name, parameter in theirs.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.3)
    ours = SelfAttention(ModelConfig.from_hf(hf_config), 1)
    ours.load_state_dict(stacked_qkv(theirs.state_dict()))
    x = torch.randn(10, hf_config.hidden_size, generator=torch.Generator().manual_seed(4))
    compare_with_cache(ours, theirs, hf_config, x, 6, 1, 2, f"SelfAttention ({kind})")


def test_self_attention_attends_through_attention_py(smollm2, monkeypatch):
    """attention.py's attention() is the one piece each later milestone replaces: SelfAttention must call it."""
    import milestones.m1.model as model

    calls = []

    def recorded(q, k, v, layer, ctx):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), layer))
        return attention(q, k, v, layer, ctx)

    monkeypatch.setattr(model, "attention", recorded)
    ours = SelfAttention(smollm2.config, 2)
    ours.load_state_dict(stacked_qkv(smollm2.weights("model.layers.2.self_attn.")))
    cos, sin = torch.ones(4, 1, 64), torch.zeros(4, 1, 64)  # position 0's rotation: none
    ctx = AttentionContext(torch.zeros(3, ROWS, 3, 64), torch.zeros(3, ROWS, 3, 64), torch.arange(4), 4)
    with torch.no_grad():
        ours(torch.randn(4, 576, generator=torch.Generator().manual_seed(5)), cos, sin, ctx)
    assert calls == [((4, 9, 64), (4, 3, 64), (4, 3, 64), 2)], (
        f"SelfAttention.forward must call attention(q, k, v, self.layer_index, ctx) once, with q [4, 9, 64] and k, v "
        f"[4, 3, 64] for 4 tokens, in layer 2: its calls were {calls}"
    )
