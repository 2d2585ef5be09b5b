"""What the engines read of a Hugging Face checkpoint: its config, as the numbers a model needs, and its weights.

No lesson, and the same in every milestone: each ``model.py`` builds its network from a ``ModelConfig`` and says,
in ``checkpoint_tensors``, which of its tensors each name in the checkpoint fills (q, k and v stacked into one
``qkv_proj``; from m8, a rank's shard of each, read by ``copy_shard``); ``load_checkpoint`` reads the files into
them, refusing a file that does not fit the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The architecture numbers we need, read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict | None

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {hf.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported; only 'silu'")
        # transformers >= 5 keeps theta and scaling in `rope_parameters`; older configs keep them apart.
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = hf.num_attention_heads
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            qk_norm=hf.model_type == "qwen3",
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope,
        )


Target = TypeVar("Target")
Copy = Callable[[str, str, Any, Target], None]  # (file name, tensor name, the open file, target): read it into target


def load_checkpoint(folder: Path, targets: dict[str, Target], config: ModelConfig, copy: Copy | None = None) -> None:
    """Read every ``*.safetensors`` tensor in ``folder`` into its target (``copy``: the whole tensor, checked against
    the target's shape); a tensor the model has no place for, or one it lacks, is an error that names it."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    loaded = set()
    for file in files:
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                if name not in targets:
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # some checkpoints store the tied head anyway
                    raise ValueError(f"{file.name}: unexpected tensor {name!r} for {config.model_type}")
                (copy or copy_whole)(file.name, name, checkpoint, targets[name])
                loaded.add(name)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(targets) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def copy_whole(file: str, name: str, checkpoint: Any, target: torch.Tensor) -> None:
    """Copy the stored tensor into ``target``, whose shape it must have (copy_ would broadcast [1, n] silently)."""
    tensor = checkpoint.get_tensor(name)
    if tensor.shape != target.shape:
        raise ValueError(f"{file}: tensor {name!r} has shape {list(tensor.shape)}, but config.json makes it "
                         f"{list(target.shape)}: the weights and the config do not match")
    if not tensor.is_floating_point():
        raise ValueError(f"{file}: tensor {name!r} is {tensor.dtype}; weights must be floating point "
                         "(float32, bfloat16 or float16)")
    target.copy_(tensor)


@dataclass(slots=True, frozen=True)
class Shard:
    """What a rank copies (m8) of a checkpoint tensor of shape ``full_shape``: ``[start, stop)`` along ``dim`` (None:
    to the end, the whole tensor), into ``target``."""

    target: torch.Tensor
    dim: int
    start: int
    stop: int | None
    full_shape: list[int]


# --8<-- [start:copy_shard]
def copy_shard(file: str, name: str, checkpoint: Any, shard: Shard) -> None:
    """Read the rows (or columns) ``shard`` names of a stored tensor, and only those, into its target."""
    stored = checkpoint.get_slice(name)
    full = list(stored.get_shape())
    if len(full) != shard.target.dim() or len(full) <= shard.dim:
        raise ValueError(f"{file}: tensor {name!r} has shape {full}, but config.json makes it "
                         f"{shard.full_shape}: the weights and the config do not match")
    stop = full[shard.dim] if shard.stop is None else shard.stop
    tensor = stored[:, shard.start : stop] if shard.dim == 1 else stored[shard.start : stop]
    if full != shard.full_shape or tensor.shape != shard.target.shape:  # copy_ would broadcast [1, n] silently
        raise ValueError(f"{file}: tensor {name!r} has shape {full}, but config.json makes it "
                         f"{shard.full_shape}: the weights and the config do not match")
    if not tensor.is_floating_point():
        raise ValueError(f"{file}: tensor {name!r} is {tensor.dtype}; weights must be floating point "
                         "(float32, bfloat16 or float16)")
    shard.target.copy_(tensor)
# --8<-- [end:copy_shard]
