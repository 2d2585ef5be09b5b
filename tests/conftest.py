"""Shared fixtures: tiny random checkpoints (fast, no download) and the bundled real model.

The tiny checkpoints use the real SmolLM2 tokenizer, so prompts are real text, and
their embeddings and head are scaled up so that logits are *peaked*: a random model
with flat logits has near-ties that a change of summation order (batching) can flip,
which would make token-for-token comparisons flaky for reasons unrelated to bugs.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from milestones import MILESTONES
from milestones.model_store import resolve_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# The compiled decode kernel needs a C++ compiler (torch's cpp_extension uses $CXX, else c++) and
# ninja (pip's, next to this interpreter, will do). With both present, a failing build fails the tests.
HAS_KERNEL_TOOLCHAIN = shutil.which(os.environ.get("CXX", "c++")) is not None and (
    shutil.which("ninja") is not None or (Path(sys.executable).parent / "ninja").exists()
)
needs_compiler = pytest.mark.skipif(not HAS_KERNEL_TOOLCHAIN, reason="no C++ compiler or ninja to build the decode-attention kernel")


def selected_milestones() -> list[str]:
    """All milestones, or those in $MILESTONES (comma-separated), e.g. MILESTONES=m2 for `make test-m2`."""
    wanted = os.environ.get("MILESTONES")
    return [m for m in MILESTONES if not wanted or m in wanted.split(",")]


def pytest_generate_tests(metafunc):
    if "milestone" in metafunc.fixturenames:
        metafunc.parametrize("milestone", selected_milestones(), scope="module")


@pytest.fixture(scope="session")
def bundled_model_path() -> Path:
    return resolve_model(None)


def tiny_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

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
    raise ValueError(kind)


def make_tiny_checkpoint(kind: str, folder: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    with torch.no_grad():  # peaked logits: large embeddings and head, so argmax margins are wide
        model.get_input_embeddings().weight.normal_(0, 1.0)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.normal_(0, 2.0)
        for name, p in model.named_parameters():
            if "proj" in name and p.dim() == 2:
                p.normal_(0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, bundled_model_path):
    made: dict[str, Path] = {}

    def get(kind: str = "llama") -> Path:
        if kind not in made:
            made[kind] = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), bundled_model_path)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def mod(milestone):
    """The milestone package under test, e.g. ``milestones.m2``."""
    return importlib.import_module(f"milestones.{milestone}")


@pytest.fixture(scope="module")
def tiny_llm(mod, tiny_model_path):
    return mod.LLM(tiny_model_path, device="cpu", max_model_len=512)
