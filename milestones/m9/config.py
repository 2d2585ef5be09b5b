"""Engine options (vLLM's names), checked and resolved once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from milestones import options
from milestones.kernels import check_platform
from milestones.runtime.torchrun import torchrun_world_size
from milestones.speculative_config import SPECULATIVE_CONFIG, SpeculativeConfig

from .policies import POLICIES

DEFAULT_MAX_MODEL_LEN = 2048  # modest: by default the KV cache holds max_num_seqs requests this long
BATCH_SHAPES = ("mixed", "prefill-first")
DISAGGREGATION_MODES = ("null", "prefill", "decode")  # SGLang's names: one engine, or a worker of one role
ROUTER_POLICIES = ("cache_aware", "round_robin")  # SGLang's router's names


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
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    scheduling_policy: str = "fcfs"  # "fcfs": arrival order; "lpm", "dfs-weight", "lof", "random": policies.py
    enforce_eager: bool = False  # True: never capture, every step runs eagerly as in m4
    cudagraph_capture_sizes: list[int] | None = None  # decode batch sizes to capture; None: default_capture_sizes
    piecewise_capture_sizes: list[int] | None = None  # token counts of steps with prefill captured in pieces (CUDA);
    #                                                   None: default_piecewise_sizes; []: none, such steps eager
    async_scheduling: bool | str = "auto"  # overlap: schedule the next step while this one computes; "auto": on CUDA
    trace_file: str | None = None  # write a Chrome trace (schedule / forward / process per step) here on close
    # {"method": "ngram", "num_speculative_tokens": k, ...}: guess k tokens a step and check them at once; None: m6
    speculative_config: dict | SpeculativeConfig | None = None
    tensor_parallel_size: int = 1  # m8: ranks that each hold a shard of the model; more than 1 starts worker processes
    # m9: with both at least 1, prompts are computed by prefill workers and decoded by decode workers, each a process
    # with its own KV pool; the prompt's KV moves between them (torch.distributed). 0 and 0: one engine, m8 exactly
    num_prefill_workers: int = 0
    num_decode_workers: int = 0
    router_policy: str = "cache_aware"  # m9: which prefill worker a request goes to: "cache_aware" or "round_robin"
    disaggregation_mode: str = "null"  # m9: a worker's role, set by the router: "prefill" or "decode"; "null": neither

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
        speculative = self.speculative_config
        if speculative is not None:
            speculative = SpeculativeConfig.from_dict(speculative)
        # m7: a checking step is replayed as a decode step with a row per token, 1 + k rows a request
        rows_per_seq = 1 + (speculative.num_speculative_tokens if speculative is not None else 0)
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            sizes = default_capture_sizes(device, self.max_num_seqs, rows_per_seq)
        largest = self.max_num_seqs * rows_per_seq  # m7: rows, not requests
        options.check_sizes(sizes, "cudagraph_capture_sizes", largest,
                            f"row counts in [1, max_num_seqs * (1 + num_speculative_tokens) = {largest}]")
        tokens = self.piecewise_capture_sizes
        if tokens is None:
            tokens = default_piecewise_sizes(device, self.max_num_batched_tokens)
        if tokens != []:
            options.check_sizes(tokens, "piecewise_capture_sizes", self.max_num_batched_tokens,
                                f"token counts in [1, max_num_batched_tokens={self.max_num_batched_tokens}], or []")
        # On a CPU the forward worker's thread gets an OpenMP team of its own beside the caller's: more threads than
        # cores, so every parallel region pays to wake its sleeping threads, and the overlap runs slower than m5's loop.
        overlap = device.type == "cuda" if self.async_scheduling == "auto" else self.async_scheduling
        if speculative is not None and self.async_scheduling is True:  # "auto": the engine's step() waits instead
            raise ValueError("async_scheduling=True cannot overlap speculative steps: the proposer needs each "
                             "request's latest token on the host; pass async_scheduling=False or 'auto'")
        # m8: gloo's collectives cannot be compiled into a CPU "graph" (torch.compile): several ranks run eagerly
        ranks = self.tensor_parallel_size > 1 or torchrun_world_size() == 1  # torchrun's job of one joins a group
        if ranks and self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} runs in one process: each rank would need its own "
                             "slice of the blocks; use tensor_parallel_size=1 or quantization=None")
        eager = self.enforce_eager or (ranks and device.type == "cpu")
        check_disaggregation(self, speculative, overlap)
        return replace(self, device=device, dtype=dtype, max_model_len=max_len,
                       cudagraph_capture_sizes=sorted(set(sizes)), piecewise_capture_sizes=sorted(set(tokens)),
                       async_scheduling=overlap,
                       speculative_config=speculative, enforce_eager=eager)


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
    "enable_prefix_caching": options.FLAG,
    "scheduling_policy": options.one_of(*POLICIES),
    "enforce_eager": options.FLAG,
    "async_scheduling": options.FLAG_OR_AUTO,  # "auto": True on CUDA, False on a CPU (see resolve)
    "trace_file": options.PATH_OR_NONE,
    "speculative_config": SPECULATIVE_CONFIG,
    "tensor_parallel_size": options.POSITIVE,  # and one the model's heads and MLP width split into (options.py)
    "num_prefill_workers": options.NON_NEGATIVE,  # and num_decode_workers: both 0, or both at least 1
    "num_decode_workers": options.NON_NEGATIVE,
    "router_policy": options.one_of(*ROUTER_POLICIES),
    "disaggregation_mode": options.one_of(*DISAGGREGATION_MODES),
}
# --8<-- [end:options]


# --8<-- [start:check_disaggregation]
def check_disaggregation(config: EngineConfig, speculative: SpeculativeConfig | None, overlap: bool) -> None:
    """m9: refuse what a disaggregated engine cannot run, before any worker starts."""
    workers = (config.num_prefill_workers, config.num_decode_workers)
    if min(workers) == 0 < max(workers):
        raise ValueError(f"num_prefill_workers={workers[0]} and num_decode_workers={workers[1]}: a disaggregated "
                         "engine needs at least one of each (or 0 and 0 for one engine)")
    if min(workers) == 0 and config.disaggregation_mode == "null":
        return
    if config.tensor_parallel_size != 1 or torchrun_world_size() is not None:
        raise ValueError("m9's workers are one process each: pass tensor_parallel_size=1 and start it without "
                         "torchrun")
    if speculative is not None and speculative.method == "draft_model":
        raise ValueError("a draft model would need the prompt's keys and values of the draft too, which m9 does not "
                         "move: use speculative_config={'method': 'ngram', ...} or None with disaggregation")
    if config.disaggregation_mode == "prefill" and (speculative is not None or overlap):
        raise ValueError("a prefill worker computes prompts and their first token: it neither guesses nor overlaps "
                         "(the router sets speculative_config=None and async_scheduling=False for it)")
    if config.trace_file is not None:
        raise ValueError("trace_file traces one engine's steps; a disaggregated engine's workers have one each: pass "
                         "trace_file=None")
# --8<-- [end:check_disaggregation]


# --8<-- [start:default_capture_sizes]
def default_capture_sizes(device: torch.device, max_num_seqs: int, rows_per_seq: int = 1) -> list[int]:
    """The decode batch sizes captured when none are given, capped at ``max_num_seqs`` (m7: rows, see below).

    On CUDA, as nano-vllm does: 1, 2, 4, 8, then every 16. On a CPU each size is a torch.compile
    of the whole model, about a minute on two cores and still several seconds from inductor's
    cache (dynamo traces the model again), so only two: 1, the interactive case, and 4, which
    batches of 2 and 3 pad up to. A CPU step streams every weight once whatever the batch, so a
    few padding rows cost little.

    m7: a size counts rows, and a checking step has ``rows_per_seq`` (1 + k) of them a request. On
    CUDA the sizes go up to ``max_num_seqs`` such requests; a CPU adds one size, one request's
    checking step (batch 1, the case where speculation pays most).
    """
    if device.type == "cuda":
        base, largest = [1, 2, 4, 8, *range(16, 513, 16)], max_num_seqs * rows_per_seq
    else:
        base, largest = [1, rows_per_seq], min(max_num_seqs, 4)
    return sorted({size for size in base if size < largest or size == rows_per_seq} | {largest})
# --8<-- [end:default_capture_sizes]


# --8<-- [start:default_piecewise_sizes]
def default_piecewise_sizes(device: torch.device, max_num_batched_tokens: int) -> list[int]:
    """The token counts a step with prefill is captured in pieces for: on CUDA 8 to 128 in powers of two, then every
    256, and ``max_num_batched_tokens`` (always the largest); none on a CPU, which has no graphs to split."""
    if device.type != "cuda":
        return []
    base = [8, 16, 32, 64, 128, *range(256, max_num_batched_tokens, 256)]
    return sorted({size for size in base if size < max_num_batched_tokens} | {max_num_batched_tokens})
# --8<-- [end:default_piecewise_sizes]
