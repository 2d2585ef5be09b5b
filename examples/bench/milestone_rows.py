"""Milestone rows: each milestone through its own API, imported by name, so a new milestone needs no change here.

decode  ``LLM.generate`` on one prompt: one warm-up, then --runs timed runs, the median reported.
batch   the same with B prompts at once, a row per size B of --batch-sizes.
mixed,  the engine API itself: add every request, then ``step()`` until none is left. The clock runs
shared, only while the engine works: it stops after each step while ``kv_usage()`` is read. m7 with
small,  ``speculative_config`` (the ``@ngram`` and ``@draft`` rows) also reports the guesses it made and kept.
grounded,
open
host    a second engine on a tiny checkpoint, B requests decoding: milliseconds per step (host_rows.py).

m8's ``@tp2`` and ``@tp3`` rows run the model in that many ranks, this process and a worker process for each
other rank. A workload whose model the ranks cannot split (its attention heads, KV heads or MLP width; on CUDA,
a GPU per rank) is skipped with the reason printed: the bundled model's 9 heads take 3 ranks, not 2, and the
host workload's tiny checkpoint (4 heads) 2, not 3.

m9's ``@pd`` and ``@pd2x1`` rows run prefill/decode disaggregation: this process is the router, and each worker
(one prefill and one decode worker; two prefill and one decode) a process with an engine of its own. The workers
step on their own while the router waits for them, so a served workload's clock runs throughout and its KV peak
is not sampled; the rows add the keys and values the decode workers received (``kv_transfers``...). The host
workload, which times one engine's steps, is skipped for them.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from milestones.model_store import first_layers_copy

from .host_rows import host_checkpoint, host_engine, host_row
from .rows import (
    FRONT_END_OPTIONS,
    MB,
    Measurement,
    MilestoneRow,
    error_row,
    failed_measurement,
    inter_token_latency,
    mean,
    measure_each,
    median_of_runs,
    median_run,
    new_row,
    percentile,
)
from .workloads import Setup


def fast_paths(runner) -> dict[str, bool]:
    """Which CPU fast paths a model runner took: the compiled decode kernel, linear layers packed for oneDNN.

    The keys are the JSON's: ``packed_linear`` stays the name the published results use.
    """
    return {
        "decode_kernel": runner.attention.name in ("cpp", "triton"),
        "packed_linear": runner.packed_lm_head is not None,
    }


def engine_kwargs(mod: ModuleType, row: MilestoneRow, setup: Setup) -> dict:
    """The run's engine options that this milestone's EngineConfig accepts, then the row's own (which it must)."""
    args = setup.args
    accepted = {f.name for f in dataclasses.fields(mod.EngineConfig)}
    wanted = {"max_model_len": setup.max_model_len, "seed": args.seed,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.tight_kv:  # the same KV bytes for every milestone: slots for m2, a block pool for the paged ones
        if "kv_cache_memory_bytes" in accepted:
            wanted["kv_cache_memory_bytes"] = args.tight_kv * setup.max_model_len * setup.kv_bytes_per_token
        else:
            wanted["max_num_seqs"] = args.tight_kv
    for field in row.engine_options:
        if field not in accepted and field not in FRONT_END_OPTIONS:
            raise ValueError(f"{row.milestone} has no {field} option")
    own = dict(row.engine_options)
    speculative = own.get("speculative_config")
    if speculative is not None and speculative["method"] == "draft_model":  # m7@draft: a draft cut from the model
        own["speculative_config"] = speculative | {"model": str(first_layers_copy(args.model, args.draft_layers))}
    return {k: v for k, v in wanted.items() if v is not None and k in accepted} | own


def config_dict(config) -> dict:
    """An EngineConfig as JSON: numbers, booleans and None as they are, anything else (device, dtype) as text."""
    return {f.name: (v if isinstance(v, (int, float, bool, type(None))) else str(v))
            for f in dataclasses.fields(config) for v in [getattr(config, f.name)]}


def tensor_parallel_misfit(row: MilestoneRow, folder: Path, device: torch.device) -> str | None:
    """Why the row's ranks (m8@tp3) cannot split the model in ``folder`` on this machine, the engine's own rules;
    None if they can, or if the row runs in one rank."""
    size = row.engine_options.get("tensor_parallel_size", 1)
    if size == 1:
        return None
    config = json.loads((Path(folder) / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads, width = config.get("num_key_value_heads") or heads, config["intermediate_size"]
    if heads % size:
        return f"{size} ranks do not divide the model's {heads} attention heads"
    if kv_heads % size and size % kv_heads:
        return f"{size} ranks neither divide the model's {kv_heads} KV heads nor are a multiple of them"
    if width % size:
        return f"{size} ranks do not divide the model's MLP width ({width})"
    if device.type == "cuda" and size > torch.cuda.device_count():
        return f"{size} ranks need a GPU each; this machine has {torch.cuda.device_count()}"
    return None


def load_row(row: MilestoneRow, setup: Setup) -> list[Measurement]:
    """Load the milestone's engine once: a measurement per workload (a row that does not load, its error rows; a
    workload whose model the row's ranks cannot split, none)."""
    args, threads = setup.args, torch.get_num_threads()
    try:
        mod = importlib.import_module(f"milestones.{row.milestone}")
        kwargs = engine_kwargs(mod, row, setup)
        kwargs.setdefault("dtype", setup.dtype)  # a row's own dtype (m1@bf16) beats --dtype
        new_llm = functools.partial(mod.LLM, args.model, device=setup.device, **kwargs)
        served = [w for w in args.workloads if w != "host"]  # on the run's model; the host rows load a tiny one
        misfit = tensor_parallel_misfit(row, setup.model_path, setup.device) if served else None
        if misfit is not None:
            print(f"- {row.name}: {', '.join(served)} skipped ({misfit})", flush=True)
        start = time.perf_counter()
        llm = new_llm() if served and misfit is None else None
        load_s = time.perf_counter() - start
        extra = {"engine_kwargs": {k: v for k, v in kwargs.items() if k != "dtype"}, "load_s": load_s}
        if llm is not None:
            extra["engine_config"] = config_dict(llm.engine.config)
            if hasattr(llm.engine, "runner"):  # m9's router has none: each worker has its own
                extra |= fast_paths(llm.engine.runner)
        runs = workload_runs(row, mod, llm, new_llm, setup, kwargs)
    except Exception as err:  # a milestone that does not load yet must not sink the other rows
        return [failed_measurement(w, row.name, "milestone", err) for w in args.workloads]
    finally:  # m8 in several ranks shares the cores out, rank 0 (this process) included: the other rows get theirs
        row_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
    return [Measurement(row.name, workload, functools.partial(measure, row.name, extra, workload, run, row_threads))
            for workload, run in runs]


def measure(name: str, extra: dict, workload: str, run: Callable[[], dict], threads: int) -> dict:
    """One run of a row, with the threads its engine chose (m8's rank 0 its share of the cores), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run() | extra
    except Exception as err:
        return error_row(workload, name, "milestone", err)
    finally:
        torch.set_num_threads(before)


def run_milestone(row: MilestoneRow, setup: Setup) -> list[dict]:
    """Load the milestone once and measure it on every selected workload, then let its engine go."""
    rows = measure_each(load_row(row, setup))
    gc.collect()
    return rows


def workload_runs(row: MilestoneRow, mod: ModuleType, llm, new_llm: Callable[[], Any], setup: Setup,
                  kwargs: dict) -> list[tuple[str, Callable[[], dict]]]:
    """Each row to measure, as (its workload label, a call that measures it); the batch workload is one per size."""
    args, runs = setup.args, []
    unused = [llm]  # the loaded engine serves one pass of a served workload, the first; every other pass a new one
    for workload in args.workloads:
        if llm is None and workload != "host":  # its ranks cannot split the model: skipped (load_row said why)
            continue
        if workload == "decode":
            runs.append(("decode", functools.partial(decode_row, row, mod, llm, setup, [setup.workloads.decode_prompt],
                                                     "decode")))
        elif workload == "batch" and row.milestone == "m1":
            print(f"- {row.name}: batch skipped (m1 serves one request at a time)", flush=True)
        elif workload == "batch":
            runs += [(f"batch-{size}", functools.partial(decode_row, row, mod, llm, setup,
                                                         setup.workloads.batch_prompts[:size], f"batch-{size}"))
                     for size in args.batch_sizes]
        elif workload == "host" and is_disaggregated(row):
            print(f"- {row.name}: host skipped (it times one engine's steps; the router's only relay its workers' "
                  "messages)", flush=True)
        elif workload == "host" and (misfit := tensor_parallel_misfit(row, host_checkpoint(setup.model_path),
                                                                      setup.device)):
            print(f"- {row.name}: host skipped (on its tiny checkpoint, {misfit})", flush=True)
        elif workload == "host":
            host_llm, sizes = host_engine(mod, row, setup, kwargs)
            runs += [(f"host-{size}", functools.partial(host_row, row, mod, host_llm, setup, size)) for size in sizes]
        else:
            runs.append((workload, functools.partial(mixed_passes, row, mod, unused, new_llm, setup, workload)))
    return runs


def is_disaggregated(row: MilestoneRow) -> bool:
    """m9@pd, m9@pd2x1: prefill and decode workers, each a process, behind a router in this one."""
    return bool(row.engine_options.get("num_prefill_workers") or row.engine_options.get("num_decode_workers"))


def transfer_counts(engine) -> dict[str, float] | None:
    """m9 with workers: what its decode workers have received so far, added up; None for one engine."""
    if not hasattr(engine, "disaggregation_stats"):
        return None
    decode = [s for name, s in engine.disaggregation_stats().items() if name.startswith("decode")]
    return {key: sum(s[key] for s in decode)
            for key in ("transfers", "transfer_bytes", "transfer_seconds", "transferred_prompt_tokens")}


def transfer_fields(engine, before: dict[str, float] | None) -> dict:
    """The row's fields for the transfers since ``before`` (none for one engine): how many, the megabytes moved, and
    the milliseconds from a send to the blocks placed, per prompt token moved."""
    if before is None:
        return {}
    moved = {key: value - before[key] for key, value in transfer_counts(engine).items()}
    tokens = moved["transferred_prompt_tokens"]
    return {"kv_transfers": moved["transfers"], "kv_transfer_mb": moved["transfer_bytes"] / MB,
            "kv_transfer_ms_per_prompt_token": 1e3 * moved["transfer_seconds"] / tokens if tokens else None}


def transfer_note(fields: dict, note: str | None = None) -> str | None:
    """The table's note for a row with transfers (``transfer_fields``), before ``note`` if any."""
    if not fields:
        return note
    said = f"{fields['kv_transfers']} KV transfers, {fields['kv_transfer_mb']:.2f} MB"
    if fields["kv_transfer_ms_per_prompt_token"] is not None:
        said += f", {fields['kv_transfer_ms_per_prompt_token']:.3f} ms/prompt token"
    return said + (f"; {note}" if note else "")


def decode_row(row: MilestoneRow, mod: ModuleType, llm, setup: Setup, prompts: list[list[int]],
               workload: str) -> dict:
    """Every prompt at once, --decode-tokens forced tokens each: one warm-up, then --runs timed runs."""
    args = setup.args
    params = mod.SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    graphs_before, transfers_before = graph_stats(llm), transfer_counts(llm.engine)
    runs = []
    for _ in range(args.runs):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        n = sum(len(out.outputs[0].token_ids) for out in outs)
        runs.append({"wall_s": wall, "tokens_per_s": n / wall,
                     "ttft_s": mean([out.metrics.time_to_first_token for out in outs]),
                     "itl_s": mean([inter_token_latency(out.metrics.first_token_time, out.metrics.last_token_time,
                                                        len(out.outputs[0].token_ids)) for out in outs])})
    graphs = {"graph_stats": graph_stats(llm, since=graphs_before)} if graphs_before else {}
    transfers = transfer_fields(llm.engine, transfers_before)  # m9's workers: the timed runs' transfers
    return new_row(workload, row.name, "milestone", num_requests=len(prompts), output_tokens=n,
                   **median_of_runs(runs), runs=runs, batch_size=len(prompts), **graphs, **transfers,
                   note=transfer_note(transfers),
                   _tokens=[list(out.outputs[0].token_ids) for out in outs])


def graph_stats(llm, since: dict | None = None) -> dict | None:
    """m5 on: the engine's capture counters (None before m5), as counted since ``since`` if given."""
    if not hasattr(llm.engine, "graph_stats"):
        return None
    stats = llm.engine.graph_stats()
    for key in ("replays", "piecewise_replays", "eager_steps", "padded_rows", "padded_tokens") if since else ():
        stats[key] -= since[key]
    return stats


def mixed_passes(row: MilestoneRow, mod: ModuleType, unused: list, new_llm: Callable[[], Any], setup: Setup,
                 workload: str) -> dict:
    """Serve the workload --mixed-runs times, each pass on a new engine but the row's first (the loaded engine,
    while ``unused`` holds it): in this call, in later rounds' (--interleave) and in the other served workloads'.

    A new engine per pass keeps the passes alike: m4's prefix cache, for one,
    would otherwise start every pass after the first with the prompts cached.
    """
    def one_pass() -> dict:
        return mixed_row(row, mod, unused.pop() if unused else new_llm(), setup, workload)

    return median_run(one_pass, setup.args.mixed_runs)


def guess_counts(engine) -> tuple[int, int] | None:
    """m7 with speculation: the guesses made and kept so far (None for an engine that does not guess)."""
    if getattr(engine.config, "speculative_config", None) is None:
        return None
    stats = engine.spec_stats()
    return stats["num_draft_tokens"], stats["num_accepted_tokens"]


@dataclasses.dataclass(slots=True)
class KvPeaks:
    """The most KV memory in use and reserved, and the most requests running, over the steps of one pass."""

    used_bytes: int = 0
    reserved_bytes: int = 0
    most_running: int = 0
    last: dict = dataclasses.field(default_factory=dict)  # the latest kv_usage(): its counters as the pass ends

    def sample(self, engine) -> None:
        self.last = engine.kv_usage()
        self.used_bytes = max(self.used_bytes, self.last["used_bytes"])
        self.reserved_bytes = max(self.reserved_bytes, self.last["reserved_bytes"])
        self.most_running = max(self.most_running, len(engine.scheduler.running_seqs()))


def mixed_row(row: MilestoneRow, mod: ModuleType, llm, setup: Setup, workload: str) -> dict:
    """One timed pass: add every request, step until done; wall time counts the engine's work only."""
    engine, requests, note = llm.engine, setup.workloads.requests(workload), None
    if row.milestone == "m1" and 0 < setup.args.m1_requests < len(requests):
        requests = requests[: setup.args.m1_requests]
        note = f"first {len(requests)} of the requests only (m1 runs one at a time)"
    warm_up = mod.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([requests[0].prompt_ids[:8]], warm_up, use_tqdm=False)
    peaks, finished, steps_before = KvPeaks(), {}, engine.num_steps
    guesses_before, graphs_before, transfers_before = guess_counts(engine), graph_stats(llm), transfer_counts(engine)
    disaggregated = transfers_before is not None  # m9's workers step on their own, apart from this process
    wall = 0.0
    start = time.perf_counter()
    ids = [engine.add_request(r.prompt_ids, mod.SamplingParams(temperature=r.temperature, seed=r.seed,
                                                               max_tokens=r.max_tokens, ignore_eos=r.ignore_eos))
           for r in requests]
    tracer = getattr(engine, "tracer", None)  # m6: the share of host work hidden inside forwards, from its trace
    if tracer is not None:
        tracer.enabled, tracer.events = True, []
    seen: dict[str, tuple[int, float]] = {}  # request id -> (its output tokens, when the latest came)
    gaps: list[float] = []  # every output token's wait since the request's previous one
    while engine.has_unfinished_requests():
        outputs, now = engine.step(), time.perf_counter()
        for out in outputs:
            count, since = seen.get(out.request_id, (0, None))
            if len(out.outputs[0].token_ids) > count:
                new = len(out.outputs[0].token_ids) - count  # more than one when m7's guesses are kept
                if since is not None:
                    gaps += [(now - since) / new] * new
                seen[out.request_id] = (count + new, now)
            if out.finished:
                finished[out.request_id] = out
        if disaggregated:  # the workers compute meanwhile, so the clock runs on; asking each for its KV usage every
            continue  # step would hold up their steps, so the peak is not sampled
        if getattr(engine, "pending", None):  # m6: a step computes meanwhile, so the clock runs on
            peaks.sample(engine)
            continue
        wall += time.perf_counter() - start
        peaks.sample(engine)  # with the clock stopped: reading the KV usage is the benchmark's work, not the engine's
        start = time.perf_counter()
    wall += time.perf_counter() - start
    if disaggregated:  # the counters at the end, added up over the workers
        peaks.last = engine.kv_usage()
        peaks.reserved_bytes = peaks.last["reserved_bytes"]
    if tracer is not None:
        from milestones.trace import hidden_host_share
        overlap = {"hidden_host_share": hidden_host_share(tracer.events)}
        tracer.enabled = engine.config.trace_file is not None
    else:
        overlap = {}
    outs = [finished[i] for i in ids]
    guesses = {}
    if guesses_before is not None:  # m7: the guesses this pass made and kept
        drafted, accepted = (now - before for now, before in zip(guess_counts(engine), guesses_before))
        guesses = {"draft_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": accepted / max(1, drafted)}
        note = f"{accepted} of {drafted} guesses kept" + (f"; {note}" if note else "")
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    cached = sum(getattr(o, "num_cached_tokens", 0) for o in outs)  # only m4's outputs count cached prompt tokens
    itls = [inter_token_latency(o.metrics.first_token_time, o.metrics.last_token_time, len(o.outputs[0].token_ids))
            for o in outs]
    ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics.time_to_first_token is not None]
    refusals = {k.removeprefix("refused_"): v for k, v in peaks.last.items() if k.startswith("refused_")}
    graphs = {"graph_stats": graph_stats(llm, since=graphs_before)} if graphs_before else {}  # m5 on: steps replayed
    transfers = transfer_fields(engine, transfers_before)  # m9's workers: the keys and values moved
    return new_row(workload, row.name, "milestone", num_requests=len(outs), output_tokens=n_out, wall_s=wall,
                   prompt_tokens=prompt_tokens, prompt_tokens_computed=prompt_tokens - cached,
                   max_running=None if disaggregated else peaks.most_running,  # not sampled: unknown
                   num_preemptions=peaks.last.get("num_preemptions"),
                   num_preempted_tokens=peaks.last.get("num_preempted_tokens"), refusals=refusals or None,
                   ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
                   itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99),
                   prefix_hit_rate=peaks.last.get("prefix_hit_rate"), output_tokens_per_s=n_out / wall,
                   ttft_mean_s=mean([o.metrics.time_to_first_token for o in outs]), itl_mean_s=mean(itls),
                   kv_peak_mb=None if disaggregated else peaks.used_bytes / MB,
                   kv_reserved_mb=peaks.reserved_bytes / MB,
                   steps=engine.num_steps - steps_before, note=transfer_note(transfers, note), **overlap, **guesses,
                   **graphs, **transfers,
                   _tokens=[list(o.outputs[0].token_ids) for o in outs])
