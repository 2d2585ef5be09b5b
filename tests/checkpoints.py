"""Seeded random checkpoints written to disk: no download and no bundled model needed.

They use the real SmolLM2 tokenizer (shipped in ``tests/assets/smollm2-135m`` with the
model's config, without its weights), so prompts are real text. Their embeddings and
projections are scaled up so that logits are *peaked*: a random model with flat logits has
near-ties that a change of summation order (batching, another device, bfloat16) can flip,
which would make token-for-token comparisons flaky for reasons unrelated to bugs.

Two families:

* tiny models (``llama``, ``llama3_rope``, ``qwen2``, ``qwen3``): two layers, fast enough
  for every test;
* ``smollm2-135m``: SmolLM2-135M-Instruct's exact shape, for the GPU check. It reads as
  many weight bytes per token as the real model, so it runs at the same speed.

From the command line (the GPU runbook's preflight makes one the same way):

    python -m tests.checkpoints smollm2-135m /tmp/smollm2-random
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

ASSETS = Path(__file__).parent / "assets" / "smollm2-135m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_KINDS = ("llama", "llama3_rope", "qwen2", "qwen3")
KINDS = (*TINY_KINDS, "smollm2-135m")


def stacked_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict named as transformers names it, renamed for our model: each attention's q, k and v projections
    (weights, and biases where there are) stacked, in that order, as one ``qkv_proj``, as ``load_weights`` does."""
    parts = ("q_proj", "k_proj", "v_proj")
    stacked = {name: tensor for name, tensor in state.items() if not any(f"{part}." in name for part in parts)}
    for name in state:
        if "q_proj." in name:
            stacked[name.replace("q_proj", "qkv_proj")] = torch.cat([state[name.replace("q_proj", p)] for p in parts])
    return stacked


def checkpoint_config(kind: str):
    from transformers import AutoConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if kind == "smollm2-135m":
        return AutoConfig.from_pretrained(ASSETS)
    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "llama3_rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    raise ValueError(f"unknown checkpoint kind {kind!r}; choose from {', '.join(KINDS)}")


def make_checkpoint(kind: str, folder: Path) -> Path:
    """Write a seeded random checkpoint of ``kind`` into ``folder`` (safetensors, config, tokenizer)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    config = checkpoint_config(kind)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Projections keep their outputs at the scale of their inputs whatever the width (0.1 at the tiny width of 64).
    proj_std = 0.1 * (64 / config.hidden_size) ** 0.5
    with torch.no_grad():  # peaked logits: large embeddings and head, so argmax margins are wide
        model.get_input_embeddings().weight.normal_(0, 1.0)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.normal_(0, 2.0)
        for name, p in model.named_parameters():
            if "proj" in name and p.dim() == 2:
                p.normal_(0, proj_std)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(ASSETS / name, Path(folder) / name)
    return Path(folder)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS:
        sys.exit(f"usage: python -m tests.checkpoints KIND FOLDER   (KIND: {', '.join(KINDS)})")
    print("wrote", make_checkpoint(sys.argv[1], Path(sys.argv[2])))
