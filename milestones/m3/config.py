"""Engine options (vLLM's names), checked and resolved once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from milestones import options
from milestones.kernels import check_platform

DEFAULT_MAX_MODEL_LEN = 2048  # modest: by default the KV cache holds max_num_seqs requests this long
BATCH_SHAPES = ("mixed", "prefill-first")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    device: str | torch.device | None = None  # None: CUDA if present, else CPU
    dtype: str | torch.dtype | None = None  # None: bfloat16 on CUDA, float32 on CPU
    max_model_len: int | None = None  # longest prompt + output; None: the model's limit, at most 2048
    seed: int = 0  # seeds the requests that bring no seed of their own
    linear_backend: str = "auto"  # "torch": F.linear (the reference); "onednn": packed; "cpp": CPU panel kernel; "auto"
    quantization: str | None = None  # "gguf": the bundled file's 4-bit blocks kept; "int8": made at load; CPU
    attention_backend: str = "auto"  # "torch": the reference; "cpp": compiled CPU decodes (fp32/bf16); "batched": one
    #                                  call for every request of a step; "auto": cpp on a CPU, batched on CUDA
    fuse_layers: bool | str = "auto"  # a decode step's layers in a few compiled calls each (kernels.fused_layers)
    max_num_seqs: int = 16  # requests running at once
    max_num_batched_tokens: int = 512  # tokens computed per step: decodes plus prefill chunks
    batch_shape: str = "mixed"  # "mixed": decodes and prefill chunks share a step (vLLM); "prefill-first": a step
    #                              of prefills whenever one can be formed, else the decodes (SGLang)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # blocks in the pool; None: as many as kv_cache_memory_bytes holds
    kv_cache_memory_bytes: int | None = None  # None: what m2 would reserve (max_num_seqs * max_model_len tokens)
    new_token_ratio: float | None = None  # None: a block of headroom per running request; a float (SGLang starts at
    #                                       0.7): SGLang's reservation of that share of each running request's output
    min_new_token_ratio: float = 0.1  # SGLang's reservation: the ratio decays to this while no request is retracted,
    new_token_ratio_decay: float = 0.001  # by this much a step

    def resolve(self, model_max_len: int) -> EngineConfig:
        """Fill in the defaults that depend on the machine and the model; reject nonsense."""
        device = options.resolve_device(self.device)
        dtype = options.resolve_dtype(self.dtype, device)
        max_len = min(model_max_len, DEFAULT_MAX_MODEL_LEN) if self.max_model_len is None else self.max_model_len
        if not isinstance(max_len, int) or not 1 < max_len <= model_max_len:
            raise ValueError(
                f"max_model_len must be an integer in [2, {model_max_len}] for this model, got {max_len!r}"
            )
        options.check(self, OPTIONS)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= max_num_seqs ({self.max_num_seqs}) so every running "
                f"request can decode each step, got {self.max_num_batched_tokens!r}"
            )
        if self.block_size > max_len:
            raise ValueError(f"block_size ({self.block_size}) is larger than max_model_len ({max_len}): no request "
                             "could ever fill a block; use a smaller block_size (16 is the default)")
        check_platform(self, device, dtype)  # the switches of the platform speed-ups (milestones.kernels)
        return replace(self, device=device, dtype=dtype, max_model_len=max_len)


# --8<-- [start:options]
OPTIONS = {  # what each option's value must be, checked by resolve: a line per option
    "seed": options.INTEGER,
    "max_num_seqs": options.POSITIVE,
    "max_num_batched_tokens": options.POSITIVE,  # and at least max_num_seqs
    "batch_shape": options.one_of(*BATCH_SHAPES),
    "block_size": options.POSITIVE,
    "num_kv_blocks": options.POSITIVE_OR_NONE,  # None: as many as kv_cache_memory_bytes holds
    "kv_cache_memory_bytes": options.POSITIVE_OR_NONE,
    "new_token_ratio": options.RATIO_OR_NONE,  # None: a block of headroom (admission.py)
    "min_new_token_ratio": options.FRACTION,
    "new_token_ratio_decay": options.FRACTION,
}
# --8<-- [end:options]

