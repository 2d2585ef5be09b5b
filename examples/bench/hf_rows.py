"""Hugging Face transformers' rows, the baseline: the same model, the same requests, greedy.

hf-generate     (decode) ``model.generate``, greedy, min_new_tokens = max_new_tokens.
hf-static-B     (mixed) ``model.generate`` on static batches of B (--hf-batch-size), left-padded;
                each batch runs to its longest wanted output, only wanted tokens count.
hf-continuous   (mixed) transformers' own continuous batching (paged cache, background thread).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, StoppingCriteriaList
from transformers.utils import logging as hf_logging

from .rows import (
    HF_CB_DEFAULTS,
    MB,
    ROW_DTYPES,
    Measurement,
    error_row,
    failed_measurement,
    inter_token_latency,
    mean,
    measure_each,
    median_of_runs,
    median_run,
    new_row,
)
from .workloads import Request, Setup

HF_CB_PAGE_SIZE = 32  # tokens per page of hf-continuous's paged KV cache


class StepTimer:
    """A stopping criterion that never stops: it only records when each new token came out."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one token across all layers, from a transformers model config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def weight_bytes_per_token(config, dtype: torch.dtype) -> int:
    """The weight bytes batch-1 decode reads per token: every matrix of every layer and the LM head.

    The embedding table is read one row at a time; with tied embeddings the LM head
    is that same table, read whole. Norm weights are too small to count.
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    params = config.num_hidden_layers * (attention + mlp) + config.vocab_size * hidden  # + the LM head
    return params * torch.empty(0, dtype=dtype).element_size()


def wanted_by_dtype(setup: Setup) -> dict[torch.dtype, list[tuple[str, str]]]:
    """The selected transformers rows (decode and mixed workloads only), as (workload, row name) by model dtype."""
    args = setup.args
    wanted: dict[torch.dtype, list[tuple[str, str]]] = {}  # in command-line order
    for name in args.hf_rows:
        base, _, option = name.partition("@")
        dtype = getattr(torch, ROW_DTYPES[option]) if option else setup.dtype
        workload = "decode" if base == "hf-generate" else "mixed"
        if workload in args.workloads:
            wanted.setdefault(dtype, []).append((workload, name))
    return wanted


def run_transformers(setup: Setup) -> list[dict]:
    """Measure the selected transformers rows in turn, one dtype's model loaded at a time."""
    rows = []
    for dtype, wanted in wanted_by_dtype(setup).items():
        rows += measure_each(load_in_dtype(dataclasses.replace(setup, dtype=dtype), wanted))
        gc.collect()  # this dtype's model, before the next loads
    return rows


def load_transformers(setup: Setup) -> list[Measurement]:
    """The selected transformers rows with every dtype's model loaded at once: to take turns with other rows."""
    return [measurement for dtype, wanted in wanted_by_dtype(setup).items()
            for measurement in load_in_dtype(dataclasses.replace(setup, dtype=dtype), wanted)]


@dataclasses.dataclass(slots=True)
class Loaded:
    """A transformers model in one dtype, with its tokenizer: what every row of that dtype measures."""

    model: torch.nn.Module
    tokenizer: object
    setup: Setup  # with the model's dtype
    load_s: float


def load_in_dtype(setup: Setup, wanted: list[tuple[str, str]]) -> list[Measurement]:
    """The rows ``wanted``, (workload, row name), with the model loaded once in ``setup.dtype``."""
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of the report
    try:
        start = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(setup.model_path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(setup.model_path, dtype=setup.dtype).to(setup.device).eval()
        load_s = time.perf_counter() - start
    except Exception as err:
        return [failed_measurement(w, label(name, setup), "transformers", err) for w, name in wanted]
    loaded = Loaded(model, tokenizer, setup, load_s)
    return [Measurement(label(name, setup), workload, functools.partial(measure, loaded, name, workload))
            for workload, name in wanted]


def label(name: str, setup: Setup) -> str:
    """A row's label: hf-static with its batch size (hf-static-16), the dtype option kept."""
    engine, at, option = name.partition("@")
    return (f"hf-static-{setup.args.hf_batch_size}" if engine == "hf-static" else engine) + at + option


def measure(loaded: Loaded, name: str, workload: str) -> dict:
    """One measurement of the row ``name``: --runs runs of hf-generate, or --mixed-runs passes of the others."""
    args, model, tokenizer, setup = loaded.setup.args, loaded.model, loaded.tokenizer, loaded.setup
    engine, row_label = name.partition("@")[0], label(name, setup)
    torch.manual_seed(args.seed)
    try:
        with torch.inference_mode():
            if engine == "hf-generate":
                row = decode_row(model, tokenizer, setup)
            elif engine == "hf-static":  # generate keeps no state between calls: one model serves every pass
                row = median_run(functools.partial(static_batches_row, model, tokenizer, setup), args.mixed_runs)
            else:
                row = median_run(functools.partial(continuous_row, model, setup), args.mixed_runs)
        row.update(engine=row_label, load_s=loaded.load_s, dtype=str(setup.dtype).replace("torch.", ""))
    except Exception as err:
        row = error_row(workload, row_label, "transformers", err)
    return row


def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_new: int,
             pad_id: int) -> tuple[torch.Tensor, list[float]]:
    """Exactly ``n_new`` greedy tokens per row, and when each step's token came out."""
    timer = StepTimer()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([timer]))
    return out[:, input_ids.shape[1]:], timer.times


def decode_row(model, tokenizer, setup: Setup) -> dict:
    args = setup.args
    ids = torch.tensor([setup.workloads.decode_prompt], device=setup.device)
    mask = torch.ones_like(ids)
    generate(model, ids, mask, args.decode_tokens, tokenizer.pad_token_id)  # warm-up
    runs = []
    for _ in range(args.runs):
        start = time.perf_counter()
        out, times = generate(model, ids, mask, args.decode_tokens, tokenizer.pad_token_id)
        wall = time.perf_counter() - start
        n = out.shape[1]
        runs.append({"wall_s": wall, "tokens_per_s": n / wall, "ttft_s": times[0] - start,
                     "itl_s": inter_token_latency(times[0], times[-1], n)})
    return new_row("decode", "hf-generate", "transformers", num_requests=1, output_tokens=n, **median_of_runs(runs),
                   runs=runs, _tokens=[out[0].tolist()])


def static_batches_row(model, tokenizer, setup: Setup) -> dict:
    """One pass of static batching: each batch of --hf-batch-size requests runs to its longest wanted output."""
    batch_size, pad_id, device = setup.args.hf_batch_size, tokenizer.pad_token_id, setup.device
    requests = setup.workloads.mixed

    def left_padded(batch: list[Request], length: int | None = None) -> dict[str, torch.Tensor]:
        ids = [r.prompt_ids[:length] for r in batch]
        return tokenizer.pad({"input_ids": ids}, padding=True, padding_side="left", return_tensors="pt")

    warm = left_padded(requests[:2], 8)
    generate(model, warm["input_ids"].to(device), warm["attention_mask"].to(device), 4, pad_id)  # warm-up
    per_token = kv_bytes_per_token(model.config, setup.dtype)
    ttfts, itls, tokens, peak = [], [], [], 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        enc = left_padded(batch)
        n_new = max(r.max_tokens for r in batch)
        out, times = generate(model, enc["input_ids"].to(device), enc["attention_mask"].to(device), n_new, pad_id)
        peak = max(peak, len(batch) * (enc["input_ids"].shape[1] + n_new) * per_token)  # the padded cache, largest
        print(f"    batch {i // batch_size + 1}/{-(-len(requests) // batch_size)} done after "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        for j, r in enumerate(batch):
            tokens.append(out[j, : r.max_tokens].tolist())
            ttfts.append(times[0] - start)
            itls.append(inter_token_latency(times[0], times[r.max_tokens - 1], r.max_tokens))
    wall = time.perf_counter() - start
    n_out = sum(r.max_tokens for r in requests)
    return new_row("mixed", f"hf-static-{batch_size}", "transformers", num_requests=len(requests), output_tokens=n_out,
                   wall_s=wall, output_tokens_per_s=n_out / wall, ttft_mean_s=mean(ttfts), itl_mean_s=mean(itls),
                   kv_peak_mb=peak / MB, kv_reserved_mb=peak / MB,
                   note="KV sizes computed from the padded batch shape (DynamicCache grows as it goes)", _tokens=tokens)


def continuous_row(model, setup: Setup) -> dict:
    """transformers' continuous batching (``generate_batch``'s machinery), with a cache sized for the workload."""
    # Imported here: a transformers without it makes this row an error row, not the whole run.
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    args, requests, page = setup.args, setup.workloads.mixed, HF_CB_PAGE_SIZE
    max_num_seqs = args.max_num_seqs or HF_CB_DEFAULTS["max_num_seqs"]
    max_batched = args.max_num_batched_tokens or HF_CB_DEFAULTS["max_num_batched_tokens"]
    blocks = sorted((-(-(len(r.prompt_ids) + r.max_tokens) // page) for r in requests), reverse=True)
    num_blocks = sum(blocks[:max_num_seqs]) + max_num_seqs  # room for the largest requests that can run at once
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=max_batched,
                                         max_requests_per_batch=max_num_seqs, allow_block_sharing=False)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests), eos_token_id=-1,
                                  pad_token_id=model.generation_config.pad_token_id)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.start()
    try:
        manager.add_request(requests[0].prompt_ids[:8], request_id="warm-up", max_new_tokens=4, eos_token_id=-1)
        collect_results(manager, 1)  # warm-up (also creates the paged cache)
        cache = manager.batch_processor.cache
        capacity = cache.num_sectors * cache.bytes_per_sector
        peak = 0

        def poll() -> None:
            nonlocal peak
            try:
                peak = max(peak, capacity - cache.compute_free_capacity(relative=False))
            except Exception:  # the background thread may be mid-update; the next poll will do
                pass

        start = time.perf_counter()
        ids = [manager.add_request(r.prompt_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                   record_timestamps=True, eos_token_id=-1) for i, r in enumerate(requests)]
        results = collect_results(manager, len(requests), poll)
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    outs = [results[i] for i in ids]
    n_out = sum(len(o.generated_tokens) for o in outs)
    ttfts = [o.timestamps[0] - o.created_time if o.timestamps else None for o in outs]
    itls = [inter_token_latency(o.timestamps[0], o.timestamps[-1], len(o.timestamps)) if o.timestamps else None
            for o in outs]
    reserved = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
    return new_row("mixed", "hf-continuous", "transformers", num_requests=len(outs), output_tokens=n_out, wall_s=wall,
                   output_tokens_per_s=n_out / wall, ttft_mean_s=mean(ttfts), itl_mean_s=mean(itls),
                   kv_peak_mb=peak / MB, kv_reserved_mb=reserved / MB,
                   cb_config={"page_size": page, "num_blocks": num_blocks, "max_batch_tokens": max_batched,
                              "max_requests_per_batch": max_num_seqs,
                              "attn_implementation": model.config._attn_implementation},
                   _tokens=[list(o.generated_tokens) for o in outs])


def collect_results(manager, n: int, on_poll: Callable[[], None] | None = None) -> dict:
    """Wait for ``n`` finished requests from the background thread; ``on_poll`` runs at every wake-up."""
    results = {}
    while len(results) < n:
        result = manager.get_result(timeout=0.05)
        if on_poll is not None:
            on_poll()
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped before finishing the requests")
            continue
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        if result.is_finished():
            results[result.request_id] = result
    return results
