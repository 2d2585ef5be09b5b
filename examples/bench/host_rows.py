"""The host workload: the engine's own work per decode step, with almost no model to run.

A step of the bundled model is mostly the model's arithmetic on a CPU, and mostly the
engine's Python on a GPU (a replayed step of the 135M shape: ~5 ms of host time against
~0.07 ms of device time). To see and guard the engine's share on any machine, each
milestone row loads a second engine on a tiny seeded checkpoint (2 layers, hidden 64,
a vocabulary of 256: its forward and its LM head cost microseconds) and times
``engine.step()`` one step at a time while B requests decode, for each B of
``--host-batch-sizes``: scheduling, building the step's inputs, copying them, the
replay or the eager forward's dispatch, sampling, the stop rules and the outputs.

A row per batch size (``host-B``) reports the median milliseconds per step; the rows of
one engine also get ``host_us_per_row``: what one more decoding request adds to a
step, the slope between its smallest and largest batch.

Even this model is not free at batch 256 on a CPU (its attention reads every row's
context), and on a GPU that arithmetic is the device's, not the host's. So each row
also times the model's own calls (the eager forward or the replay of a captured step, and the LM head)
in the step's thread: ``host_model_ms`` per step, ``host_engine_ms`` (the step without
them) and its slope ``host_engine_us_per_row``. Only on a CPU: on CUDA those calls only
launch kernels, host work that stays in the step, and where the forward runs on another
thread (m6's worker, overlapping the host's work) the two are not separable; both are
left out.
"""

from __future__ import annotations

import random
import shutil
import statistics
import threading
import time
from pathlib import Path
from types import ModuleType

from milestones.model_store import cache_dir, first_layers_copy

from .rows import MilestoneRow, new_row
from .workloads import Setup

HOST_PROMPT_LEN = 16
HOST_WARM_UP_STEPS = 4  # decode steps after the prompts, before the clock starts
HOST_VOCAB = 256  # token ids the bundled tokenizer knows, so outputs detokenize as usual
HOST_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def host_checkpoint(tokenizer_from: Path) -> Path:
    """The tiny seeded Llama the host rows run, made once (a second) and cached beside the bundled model, with the
    tokenizer of the run's model (``tokenizer_from``): a GPU machine has a seeded checkpoint, not the bundled one."""
    folder = cache_dir() / "host-tiny-llama"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=HOST_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(partial)
    for name in HOST_TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, partial / name)
    partial.rename(folder)  # whole or absent: a run stopped midway leaves no half checkpoint behind
    return folder


def text_token_ids(tokenizer) -> list[int]:
    """The host vocabulary's ids that decode to text on their own (ASCII, in the bundled tokenizer): prompts that read
    as text, as real prompts do. Random ids would mostly be lone bytes, and a prompt ending inside a character sends
    the detokenizer to its Python rule (milestones/serving/text_stream.py), which real traffic hardly meets."""
    decoded = {i: tokenizer.decode([i], skip_special_tokens=True) for i in range(3, HOST_VOCAB)}
    return [i for i, text in decoded.items() if text and "\ufffd" not in text]


def host_engine(mod: ModuleType, row: MilestoneRow, setup: Setup, kwargs: dict) -> tuple[object, list[int]]:
    """The row's milestone, with the row's options (``kwargs``), on the tiny checkpoint, and the batch sizes it runs:
    every size decoding at once and captured (m5 on); m1, which serves one request at a time, batch 1 only."""
    args, sizes = setup.args, setup.args.host_batch_sizes
    accepted = set(mod.EngineConfig.__dataclass_fields__)
    if "max_num_seqs" not in accepted and sizes != [1]:
        print(f"- {row.name}: host at batch 1 only (it serves one request at a time)", flush=True)
        sizes = [1]
    options = dict(kwargs, max_model_len=HOST_PROMPT_LEN + HOST_WARM_UP_STEPS + args.host_steps + 16)
    if "max_num_seqs" in accepted:
        options.update(max_num_seqs=max(sizes), max_num_batched_tokens=max(512, max(sizes) * HOST_PROMPT_LEN))
    if "cudagraph_capture_sizes" in accepted:
        options["cudagraph_capture_sizes"] = sizes
    options.pop("kv_cache_memory_bytes", None)  # --tight-kv sizes the main model's pool, not this one's
    speculative = options.get("speculative_config")
    if speculative is not None and speculative["method"] == "draft_model":  # a draft of the tiny model's own
        draft = first_layers_copy(host_checkpoint(setup.model_path), 1)
        options["speculative_config"] = speculative | {"model": str(draft)}
    return mod.LLM(str(host_checkpoint(setup.model_path)), device=setup.device, **options), sizes


class ModelClock:
    """Seconds the step's thread spends inside the model: every eager forward, every replay of a captured step and
    the LM head, timed by wrapping the runner's ``model``, ``compute_logits`` and its graph runner's replays (the
    engine's code is left as it is)."""

    def __init__(self, engine) -> None:
        self.seconds, self.elsewhere, self.thread = 0.0, False, threading.get_ident()
        runner = engine.runner
        runner.model = _Timed(runner.model, self)
        if hasattr(runner, "compute_logits"):
            runner.compute_logits = _Timed(runner.compute_logits, self)
        graphs = getattr(runner, "graph_runner", None)
        if graphs is not None:
            graphs.replays = {size: _Timed(replay, self) for size, replay in graphs.replays.items()}

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.elsewhere |= threading.get_ident() != self.thread


class _Timed:
    """A callable that adds the time of each call to a clock; every other attribute is the wrapped object's."""

    def __init__(self, wrapped, clock: ModelClock) -> None:
        self._wrapped, self._clock = wrapped, clock

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._wrapped(*args, **kwargs)
        finally:
            self._clock.add(time.perf_counter() - start)

    def __getattr__(self, name: str):
        return getattr(self._wrapped, name)


def host_row(row: MilestoneRow, mod: ModuleType, llm, setup: Setup, size: int) -> dict:
    """``size`` requests past their prompts, then --host-steps decode steps timed one by one; the median step."""
    engine, args = llm.engine, setup.args
    rng = random.Random(args.seed + size)
    params = mod.SamplingParams(temperature=0, ignore_eos=True,
                                max_tokens=HOST_WARM_UP_STEPS + args.host_steps + 4)  # room for m6's step in flight
    text_ids = text_token_ids(engine.tokenizer)
    ids = [engine.add_request([rng.choice(text_ids) for _ in range(HOST_PROMPT_LEN)], params) for _ in range(size)]
    started: set[str] = set()
    while len(started) < size:  # the prompts, until every request has its first token
        started.update(out.request_id for out in engine.step())
    for _ in range(HOST_WARM_UP_STEPS):
        engine.step()
    graphs_before = engine.graph_stats() if hasattr(engine, "graph_stats") else None
    clock = ModelClock(engine)
    times, model_times = [], []
    for _ in range(args.host_steps):
        clock.seconds, start = 0.0, time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        model_times.append(clock.seconds)
    extra = {}
    if setup.device.type == "cpu" and not clock.elsewhere:  # on CUDA the calls only launch kernels: host work
        extra.update(host_model_ms=1e3 * statistics.median(model_times),
                     host_engine_ms=1e3 * statistics.median(t - m for t, m in zip(times, model_times)))
    if graphs_before is not None:
        after = engine.graph_stats()
        extra["replays"] = after["replays"] - graphs_before["replays"]
        extra["eager_steps"] = after["eager_steps"] - graphs_before["eager_steps"]
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():  # m6: the step still in flight
        engine.step()
    step_s = statistics.median(times)
    return new_row(f"host-{size}", row.name, "milestone", num_requests=size, output_tokens=size * len(times),
                   wall_s=sum(times), output_tokens_per_s=size / step_s, host_step_ms=1e3 * step_s,
                   host_step_ms_quartiles=[1e3 * q for q in statistics.quantiles(times, n=4)], batch_size=size,
                   note=f"{1e3 * step_s:.3f} ms/step", **extra)


def add_host_per_row(rows: list[dict]) -> None:
    """Each engine's host rows get the slope between its smallest and largest batch: microseconds per request."""
    by_engine: dict[str, list[dict]] = {}
    for r in rows:
        if r["workload"].startswith("host-") and r["status"] == "ok":
            by_engine.setdefault(r["engine"], []).append(r)
    for found in by_engine.values():
        small, large = min(found, key=lambda r: r["batch_size"]), max(found, key=lambda r: r["batch_size"])
        if large["batch_size"] == small["batch_size"]:
            continue
        rows_apart = large["batch_size"] - small["batch_size"]
        slope = (large["host_step_ms"] - small["host_step_ms"]) / rows_apart
        engine_slope = None
        if "host_engine_ms" in small and "host_engine_ms" in large:
            engine_slope = (large["host_engine_ms"] - small["host_engine_ms"]) / rows_apart
        for r in found:
            r["host_us_per_row"] = 1e3 * slope
            r["note"] = f"{r['host_step_ms']:.3f} ms/step, {1e3 * slope:.1f} us/row"
            if engine_slope is not None:
                r["host_engine_us_per_row"] = 1e3 * engine_slope
                r["note"] += f" ({1e3 * engine_slope:.1f} without the model)"
