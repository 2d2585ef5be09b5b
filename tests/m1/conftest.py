"""The bundled SmolLM2-135M's own weights, read tensor by tensor, for the module tests (steps 1 to 6 of m1's exercise).

SmolLM2 has 9 query heads and 3 key/value heads, so grouped-query attention is exercised
by its real weights. Only the tensors a test asks for are read from the safetensors file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from milestones.m1.model import ModelConfig


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    hf_config: PretrainedConfig  # eager attention: transformers' plain formula, under the mask the test gives it
    config: ModelConfig  # the same numbers as m1 reads them

    def weights(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors whose names start with ``prefix``, named without it (ready for ``load_state_dict``)."""
        with safe_open(self.path / "model.safetensors", "pt") as tensors:
            return {name[len(prefix):]: tensors.get_tensor(name) for name in tensors.keys() if name.startswith(prefix)}


@pytest.fixture(scope="session")
def smollm2(bundled_model_path) -> Checkpoint:
    hf_config = AutoConfig.from_pretrained(bundled_model_path)
    hf_config._attn_implementation = "eager"
    return Checkpoint(bundled_model_path, hf_config, ModelConfig.from_hf(hf_config))
