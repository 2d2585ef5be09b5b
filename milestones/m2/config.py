"""Engine options (vLLM's names), checked and resolved once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from milestones import options
from milestones.kernels import check_attention_backend, check_linear_backend, check_quantization

DEFAULT_MAX_MODEL_LEN = 2048  # each request's KV slot is this long, so keep the default modest


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
    max_num_seqs: int = 16  # requests running at once (each owns a KV slot of max_model_len)
    max_num_batched_tokens: int = 512  # tokens computed per step: decodes plus prefill chunks

    def resolve(self, model_max_len: int) -> EngineConfig:
        """Fill in the defaults that depend on the machine and the model; reject nonsense."""
        device = _resolve_device(self.device)
        dtype = self.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"dtype {dtype!r} is not a torch dtype; use 'float32', 'bfloat16' or 'float16'")
            dtype = getattr(torch, dtype)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
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
        check_linear_backend(self.linear_backend, device, dtype)  # a platform speed-up (milestones.kernels)
        check_quantization(self.quantization, device, dtype, self.linear_backend)  # another one
        check_attention_backend(self.attention_backend, device, dtype)  # another one
        return replace(self, device=device, dtype=dtype, max_model_len=max_len)


# --8<-- [start:options]
OPTIONS = {  # what each option's value must be, checked by resolve: a line per option
    "seed": options.INTEGER,
    "max_num_seqs": options.POSITIVE,
    "max_num_batched_tokens": options.POSITIVE,  # and at least max_num_seqs
}
# --8<-- [end:options]


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """The CPU or a CUDA GPU that is really there; anything else is refused now rather than failing later."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported: use 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available; use device='cpu'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return device
