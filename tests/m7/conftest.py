"""m7's own fixture: the tiny model with a small vocabulary, for the draft model's tests.

A draft-model step runs the draft once per guess and the target once, and every row that
samples pays for the model's head, a softmax and (with top-k or top-p) a sort over the whole
vocabulary: with the tokenizer's 49,152 tokens, most of a step's time on a CPU. The draft
tests' point is the bookkeeping (the draft's keys and values in the requests' blocks, the
guesses it makes, m6's tokens afterwards), which any vocabulary shows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

SMALL_VOCAB = 4096  # token ids 0 to 4095 of the tokenizer (1 is BOS, 2 is EOS, as in the whole one)


@pytest.fixture(scope="session")
def small_vocab_model_path(tiny_model_path, tmp_path_factory) -> Path:
    """The tiny model cut to its first SMALL_VOCAB tokens: the same layers, the first rows of its embeddings and
    head, the same tokenizer (whose ids past SMALL_VOCAB a prompt must not use). Not for structured outputs: their
    grammar covers the tokenizer's whole vocabulary, and the engine refuses a model with fewer tokens for them."""
    folder = tmp_path_factory.mktemp("small-vocab") / "tiny"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    vocab = config["vocab_size"]
    tensors = load_file(folder / "model.safetensors")
    save_file({name: t[:SMALL_VOCAB].contiguous() if t.shape[0] == vocab else t for name, t in tensors.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": SMALL_VOCAB}, indent=2))
    return folder
