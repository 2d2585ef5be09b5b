"""m1, step 4: the MLP against transformers' LlamaMLP, on SmolLM2's own weights.

SwiGLU: ``down(silu(gate(x)) * up(x))``, SiLU on the gate branch only.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from milestones.m1.model import MLP

from .closeness import FLOAT32, expect_close


@pytest.mark.parametrize("layer", [0, 17])
def test_mlp_matches_llama_mlp_on_smollm2(smollm2, layer):
    weights = smollm2.weights(f"model.layers.{layer}.mlp.")
    ours, theirs = MLP(smollm2.config), LlamaMLP(smollm2.hf_config)
    ours.load_state_dict(weights)
    theirs.load_state_dict(weights)
    norm = LlamaRMSNorm(576, smollm2.config.rms_norm_eps)  # the MLP's input: a normalised hidden state
    norm.load_state_dict(smollm2.weights(f"model.layers.{layer}.post_attention_layernorm."))
    with torch.no_grad():
        x = norm(torch.randn(5, 576, generator=torch.Generator().manual_seed(layer)))
        expect_close(f"MLP output of layer {layer} [5 tokens, 576]", ours(x), theirs(x), FLOAT32)
