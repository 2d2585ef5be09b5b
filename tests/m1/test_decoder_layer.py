"""m1, step 5: one decoder layer against transformers' LlamaDecoderLayer, with the KV cache, on SmolLM2's weights.

``x + self_attn(input_layernorm(x))``, then ``h + mlp(post_attention_layernorm(h))``: each
sub-block sees a normalised copy of its input and adds its output to it (the residual).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from milestones.m1.attention import AttentionContext
from milestones.m1.model import DecoderLayer
from tests.checkpoints import stacked_qkv

from .cached_steps import ROWS, causal_mask, chunks, what
from .closeness import FLOAT32, expect_close


def test_decoder_layer_matches_llama_decoder_layer_on_smollm2(smollm2):
    layer, prompt_len, total = 5, 9, 12
    weights = smollm2.weights(f"model.layers.{layer}.")
    ours, theirs = DecoderLayer(smollm2.config, layer), LlamaDecoderLayer(smollm2.hf_config, layer)
    ours.load_state_dict(stacked_qkv(weights))
    theirs.load_state_dict(weights)
    x = torch.randn(total, 576, generator=torch.Generator().manual_seed(0))  # a hidden state of unit scale
    cos, sin = LlamaRotaryEmbedding(smollm2.hf_config)(x, torch.arange(total)[None])
    k_cache = torch.zeros(smollm2.config.num_layers, ROWS, 3, 64)
    v_cache, cache = torch.zeros_like(k_cache), DynamicCache(config=smollm2.hf_config)
    with torch.no_grad():
        for start, end in chunks(prompt_len, total):
            ctx = AttentionContext(k_cache, v_cache, slot_mapping=torch.arange(start, end), context_len=end)
            out = ours(x[start:end], cos[0, start:end, None], sin[0, start:end, None], ctx)
            expected = theirs(x[None, start:end], attention_mask=causal_mask(start, end), past_key_values=cache,
                              position_embeddings=(cos[:, start:end], sin[:, start:end]))
            expect_close(f"DecoderLayer {layer} output, {what(start, end)}", out, expected[0], FLOAT32)
