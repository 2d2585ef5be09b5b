"""m1, step 1: RMSNorm against transformers' LlamaRMSNorm, on SmolLM2's own norm weights.

RMSNorm scales each vector to unit root mean square (no mean subtracted), with ``eps``
inside the square root, then by the learned weight; it is computed in float32 and returns
the input's dtype.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from milestones.m1.model import RMSNorm

from .closeness import FLOAT32, Tolerance, expect_close

# In bfloat16 a rounding done in another place (the weight applied before or after the cast) moves an element by at
# most one bfloat16 step, 2**-7 of its size.
BFLOAT16 = Tolerance(0.0, rtol=2**-7)

INPUTS = {  # [7 tokens, 576 dims], each a different way to get the formula wrong
    "inputs of unit scale": (1.0, 0.0),
    "tiny inputs (1e-3: eps matters)": (1e-3, 0.0),
    "inputs with a mean of 3 (RMSNorm does not subtract it)": (1.0, 3.0),
}
NORMS = ["model.layers.0.input_layernorm.", "model.norm."]


def norms(smollm2, prefix: str, dtype: torch.dtype) -> tuple[RMSNorm, LlamaRMSNorm]:
    """m1's RMSNorm and transformers', with the same weight from the checkpoint, in ``dtype``."""
    ours, reference = RMSNorm(576, smollm2.config.rms_norm_eps), LlamaRMSNorm(576, smollm2.config.rms_norm_eps)
    for module in (ours, reference):
        module.load_state_dict(smollm2.weights(prefix))
    return ours.to(dtype), reference.to(dtype)


@pytest.mark.parametrize("prefix", NORMS)
@pytest.mark.parametrize("inputs", INPUTS)
def test_rmsnorm_matches_transformers(smollm2, prefix, inputs):
    scale, mean = INPUTS[inputs]
    ours, reference = norms(smollm2, prefix, torch.float32)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(0)) * scale + mean
    with torch.no_grad():
        expect_close(f"RMSNorm({prefix}weight) of {inputs}", ours(x), reference(x), FLOAT32)


def test_rmsnorm_squares_in_float32(smollm2):
    """Inputs of 300 in float16: their squares (90,000) overflow float16 (max 65,504), not float32."""
    ours, reference = norms(smollm2, NORMS[0], torch.float16)
    x = 300 * torch.randn(7, 576, generator=torch.Generator().manual_seed(2)).sign().half()
    with torch.no_grad():
        expect_close("RMSNorm of float16 inputs of size 300 (squared in float32, or they overflow)", ours(x),
                     reference(x), Tolerance(0.0, rtol=2**-10))


def test_rmsnorm_in_bfloat16_returns_bfloat16(smollm2):
    ours, reference = norms(smollm2, NORMS[0], torch.bfloat16)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        expect_close("RMSNorm of bfloat16 inputs (a bfloat16 model)", ours(x), reference(x), BFLOAT16)
