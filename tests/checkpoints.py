"""Seeded random checkpoints written to disk: no download and no bundled model needed.

They use the real SmolLM2 tokenizer (shipped in ``tests/assets/smollm2-135m`` with the
model's config, without its weights), so prompts are real text. Their embeddings and
projections are scaled up so that logits are *peaked*: a random model with flat logits has
near-ties that a change of summation order (batching, another device, bfloat16) can flip,
which would make token-for-token comparisons flaky for reasons unrelated to bugs.

Three families:

* tiny models (``llama``, ``llama3_rope``, ``qwen2``, ``qwen3``): two layers, fast enough
  for every test;
* ``smollm2-135m``: SmolLM2-135M-Instruct's exact shape, for the GPU check. It reads as
  many weight bytes per token as the real model, so it runs at the same speed.
* ``llama3.1-8b``: Llama-3.1-8B's shape (``--layers`` fewer), where a GPU's step is as much
  the device's as the host's. 16 GB: no float32 transformers model (32 GB, minutes), the
  tensors are drawn in bfloat16 on the device they are made on and written a layer per file.
  ``llama3.1-8b-tiny`` is its CPU rehearsal: the same vocabulary and head grouping, 64 wide.

From the command line (the GPU runbook's preflight makes one the same way):

    python -m tests.checkpoints smollm2-135m /tmp/smollm2-random
    python -m tests.checkpoints llama3.1-8b /tmp/llama-8b-random --layers 16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

ASSETS = Path(__file__).parent / "assets" / "smollm2-135m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_KINDS = ("llama", "llama3_rope", "qwen2", "qwen3")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """A Llama's sizes, for a checkpoint written tensor by tensor (``write_llama``)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


LLAMA_SHAPES = {
    "llama3.1-8b": LlamaShape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    # Its CPU rehearsal: the 8B's vocabulary (ids the SmolLM2 tokenizer does not have) and four query heads per KV head.
    "llama3.1-8b-tiny": LlamaShape(layers=2, hidden=64, heads=4, kv_heads=1, intermediate=224, vocab=128256),
}
KINDS = (*TINY_KINDS, "smollm2-135m", *LLAMA_SHAPES)
INDEX = "model.safetensors.index.json"  # written last by ``write_llama``: its checkpoint is whole once it is there


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
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    raise ValueError(f"unknown checkpoint kind {kind!r}; choose from {', '.join(KINDS)}")


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole checkpoint (one written in parts has its index once every part is there)."""
    return (folder / "model.safetensors").is_file() or (folder / INDEX).is_file()


def make_checkpoint(kind: str, folder: Path, layers: int | None = None, device: str = "cpu") -> Path:
    """Write a seeded random checkpoint of ``kind`` into ``folder`` (safetensors, config, tokenizer); ``layers`` and
    ``device`` (where its tensors are drawn) only for the Llama shapes."""
    if kind in LLAMA_SHAPES:
        shape = LLAMA_SHAPES[kind]
        return write_llama(shape if layers is None else replace(shape, layers=layers), Path(folder), device)
    if layers is not None or device != "cpu":
        raise ValueError(f"layers and device are for the Llama shapes ({', '.join(LLAMA_SHAPES)}), not {kind!r}")
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


def write_llama(shape: LlamaShape, folder: Path, device: str = "cpu") -> Path:
    """A seeded random Llama of ``shape`` in bfloat16, scaled as ``make_checkpoint`` scales its models: drawn on
    ``device`` a layer at a time, each layer a file of its own written while the next is drawn (a few layers in host
    memory at once, not 16 GB), the index last."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device).manual_seed(1234)
    head_dim, proj_std = shape.hidden // shape.heads, 0.1 * (64 / shape.hidden) ** 0.5

    def normal(std: float, *size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.bfloat16, device=device).normal_(0, std, generator=generator)

    def layer(i: int) -> dict[str, torch.Tensor]:
        q, kv, h, m = shape.heads * head_dim, shape.kv_heads * head_dim, shape.hidden, shape.intermediate
        sizes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (m, h), "mlp.up_proj": (m, h), "mlp.down_proj": (h, m)}
        ones = {f"model.layers.{i}.{norm}.weight": torch.ones(h, dtype=torch.bfloat16)
                for norm in ("input_layernorm", "post_attention_layernorm")}
        return {f"model.layers.{i}.{name}.weight": normal(proj_std, *size) for name, size in sizes.items()} | ones

    def outer() -> dict[str, torch.Tensor]:  # peaked logits, as make_checkpoint's: large embeddings and head
        return {"model.embed_tokens.weight": normal(1.0, shape.vocab, shape.hidden),
                "model.norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
                "lm_head.weight": normal(2.0, shape.vocab, shape.hidden)}

    weight_map: dict[str, str] = {}
    total = 0
    # safetensors writes without the GIL: the next layer is drawn and copied to the host while the last ones write.
    with ThreadPoolExecutor(max_workers=4) as writers:
        written = []
        for number, make in enumerate([outer, *(partial(layer, i) for i in range(shape.layers))], start=1):
            name = f"model-{number:05d}-of-{shape.layers + 1:05d}.safetensors"
            tensors = {key: tensor.cpu() for key, tensor in make().items()}
            written.append(writers.submit(save_file, tensors, folder / name, metadata={"format": "pt"}))
            weight_map |= dict.fromkeys(tensors, name)
            total += sum(tensor.nbytes for tensor in tensors.values())
        for future in written:
            future.result()  # a failed write raises here
    LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE | {"original_max_position_embeddings": 8192},
                dtype="bfloat16").save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    for file in TOKENIZER_FILES:
        shutil.copy(ASSETS / file, folder / file)
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}) + "\n")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a seeded random checkpoint.")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=None, help=f"fewer layers ({', '.join(LLAMA_SHAPES)})")
    parser.add_argument("--device", default="cpu", help=f"where the tensors are drawn ({', '.join(LLAMA_SHAPES)})")
    args = parser.parse_args(argv)
    if args.kind not in LLAMA_SHAPES and (args.layers is not None or args.device != "cpu"):
        parser.error(f"--layers and --device are for the Llama shapes ({', '.join(LLAMA_SHAPES)}) only")
    # Loaded before the clock starts (seconds on a busy machine): the figure is the drawing and writing alone.
    import safetensors.torch  # noqa: F401
    from transformers import GenerationConfig, LlamaConfig  # noqa: F401

    start = time.perf_counter()
    folder = make_checkpoint(args.kind, args.folder, args.layers, args.device)
    seconds = time.perf_counter() - start
    size = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    print(f"wrote {folder}: {size / 1e9:.2f} GB in {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s, drawn on "
          f"{args.device})", flush=True)


if __name__ == "__main__":
    main()
