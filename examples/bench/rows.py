"""The rows a run can have, and the dict each one produces in the JSON.

A row is one engine on one workload. Rows stay plain dicts because they are the
JSON itself: ``new_row`` fixes the fields every row has, in the order the JSON
shows them, and each runner adds its own (``runs``, ``engine_config``, ...).
A field whose name starts with ``_`` is for the report only and never written.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MB = 1024 * 1024
HF_ROWS = ("hf-generate", "hf-static", "hf-continuous")  # transformers' rows; 'hf' on the command line = all three
ROW_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # hf-generate@bf16: a transformers row in its own dtype
# only when named; 'llama.cpp' on the command line = all four (llama_cpp_rows.py says what each runs)
LLAMA_CPP_ROWS = ("llama.cpp@f32", "llama.cpp@bf16", "llama.cpp@q4_1", "llama.cpp@q8_0")
HF_CB_DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 512}  # hf-continuous: the same budget as m2's defaults
# mK@OPTION[+OPTION]: a milestone row with these engine options: (EngineConfig field, value), or {field: value, ...}
ROW_OPTIONS = {
    "auto": ("attention_backend", "auto"),
    "torch": ("attention_backend", "torch"),
    "cpp": ("attention_backend", "cpp"),
    "batched": ("attention_backend", "batched"),  # every request of an eager step in one call (CUDA's auto)
    "triton": ("attention_backend", "triton"),  # CUDA: decodes, captured steps' too, in the Triton kernel
    "linear-auto": ("linear_backend", "auto"),
    "linear-torch": ("linear_backend", "torch"),
    "linear-onednn": ("linear_backend", "onednn"),
    "linear-cpp": ("linear_backend", "cpp"),  # the compiled panel kernel, float32 or bfloat16
    "unfused": ("fuse_layers", False),  # every layer as the lesson writes it (the default fuses decode steps' layers)
    "fused": ("fuse_layers", True),  # insist: an error where the layers cannot fuse
    "eager": ("enforce_eager", True),  # m5 on: never replay a captured decode step
    "sync": ("async_scheduling", False),  # m6: m5's loop, no overlap (the default on a CPU)
    "async": ("async_scheduling", True),  # m6: overlap (the default on CUDA)
    "ngram": ("speculative_config", {"method": "ngram", "num_speculative_tokens": 4}),  # m7: prompt lookup
    # m7: prompt lookup, but a step of 8 or more requests guesses nothing (speculative_config's disable_by_batch_size)
    "ngram-below8": ("speculative_config",
                     {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}),
    # m7: the first --draft-layers layers of the model as its draft (the copy is made once and cached)
    "draft": ("speculative_config", {"method": "draft_model", "num_speculative_tokens": 4}),
    # m8: tensor parallelism in 2 or 3 ranks, a process each (m8 alone is one rank). The bundled model's 9 heads
    # split in 3, not 2: a row whose ranks do not divide its model's heads is skipped, saying why
    "tp2": ("tensor_parallel_size", 2),
    "tp3": ("tensor_parallel_size", 3),
    # m9: prefill/decode disaggregation, each worker a process (m9 alone is one engine, m8's): a prefill worker and a
    # decode worker; or two prefill workers, between which the router chooses (cache-aware), and one decode worker
    "pd": {"num_prefill_workers": 1, "num_decode_workers": 1},
    "pd2x1": {"num_prefill_workers": 2, "num_decode_workers": 1},
    "bf16": ("dtype", "bfloat16"),  # this row in bfloat16, whatever --dtype says for the others
    "fp32": ("dtype", "float32"),
    "gguf": ("quantization", "gguf"),  # the bundled file's own Q4_1/Q8_0 blocks, kept (CPU, float32)
    "int8": ("quantization", "int8"),  # per-channel int8 weights, made at load (CPU, float32)
    "reserve": ("new_token_ratio", 0.7),  # m3 on: SGLang's reservation and retraction, from SGLang's first ratio
    "prefill-first": ("batch_shape", "prefill-first"),  # m2 on: SGLang's steps, the prefills alone while there are any
    # any milestone: the replay page's recorder on (milestones/recorder.py), its file thrown away: what recording costs
    "record": ("record_file", os.devnull),
}
FRONT_END_OPTIONS = {"record_file"}  # options of the LLM front end (milestones/serving/llm.py), not of EngineConfig
# The options a milestone before their lesson's cannot take, refused as the row is named: option -> (the first
# milestone that takes it, its lesson)
LATER_ROW_OPTIONS = {"pd": ("m9", "prefill/decode disaggregation"), "pd2x1": ("m9", "prefill/decode disaggregation")}


def option_fields(option: str) -> dict[str, object]:
    """The EngineConfig fields a row option sets, and their values."""
    value = ROW_OPTIONS[option]
    return dict(value) if isinstance(value, dict) else dict([value])


@dataclass(slots=True)
class Measurement:
    """One row on one workload, its engine already loaded: ``run`` measures it once and returns the row.

    ``run`` never raises: a failure comes back as an error row. A row whose engine did not load
    is a measurement too, one that returns its error row.
    """

    engine: str  # the row's label, as the table shows it
    workload: str
    run: Callable[[], dict]

    def __call__(self) -> dict:
        print(f"- {self.engine}: {self.workload} ...", flush=True)
        return self.run()


def measure_each(measurements: list[Measurement]) -> list[dict]:
    """Each measurement once, in turn: a row's every run back to back (the default, without --interleave)."""
    return [measurement() for measurement in measurements]


def measure_in_rounds(measurements: list[Measurement], rounds: int) -> list[dict]:
    """``rounds`` rounds in which every measurement runs once, in order, then each one's median round.

    Rows that take turns (milestones, transformers and llama.cpp alike) share the machine's
    drifts (heat, other processes): a ratio between two of them is read from one stretch of time.
    """
    passes: list[list[dict]] = [[] for _ in measurements]
    for number in range(rounds):
        print(f"round {number + 1}/{rounds}", flush=True)
        for done, measurement in zip(passes, measurements):
            done.append(measurement())
    results = []
    for done in passes:
        failed = [p for p in done if p["status"] != "ok"]
        results.append(failed[0] if failed else median_pass(done) | {"interleaved_rounds": rounds})
    return results


@dataclass(slots=True)
class MilestoneRow:
    """A milestone row as named on the command line: ``m2``, or ``m2@torch+linear-torch`` with engine options."""

    name: str  # the label in the table and the JSON
    milestone: str  # the package under milestones/, e.g. "m2"
    engine_options: dict[str, object]  # EngineConfig field -> value, from the options after '@'

    @classmethod
    def parse(cls, name: str, milestones: Sequence[str]) -> MilestoneRow:
        """Raise ValueError, with the message the command line shows, for an unknown name or option."""
        milestone, at, options = name.partition("@")
        chosen = options.split("+") if at else []
        if milestone not in milestones or not set(chosen) <= set(ROW_OPTIONS):
            raise ValueError(f"unknown engine {name!r}; choose from {', '.join([*milestones, 'hf', *HF_ROWS])}, "
                             f"'llama.cpp' or {', '.join(LLAMA_CPP_ROWS)}; a milestone may take options after '@', "
                             f"joined by '+' ({', '.join(ROW_OPTIONS)}), e.g. m2@torch+linear-torch; a transformers "
                             "row a dtype, e.g. hf-generate@bf16")
        for option in chosen:
            first, lesson = LATER_ROW_OPTIONS.get(option, (milestone, None))
            if int(milestone[1:]) < int(first[1:]):
                raise ValueError(f"engine {name!r}: @{option} needs {first} or later ({lesson} is {first}'s "
                                 f"lesson); {milestone} has no such option")
        fields = [field for option in chosen for field in option_fields(option)]
        if len(set(fields)) < len(fields):
            raise ValueError(f"engine {name!r} sets one option twice; name at most one value each for "
                             f"{', '.join(sorted(set(fields)))}")
        return cls(name, milestone, {f: v for option in chosen for f, v in option_fields(option).items()})


def is_hf_row(name: str) -> bool:
    """``hf-generate``, or with a dtype of its own: ``hf-generate@bf16``."""
    base, at, option = name.partition("@")
    return base in HF_ROWS and (not at or option in ROW_DTYPES)


def new_row(workload: str, engine: str, kind: str, **fields) -> dict:
    """A row with every common field present (None where it does not apply), then ``fields``."""
    row = {
        "workload": workload, "engine": engine, "kind": kind, "status": "ok", "error": None,
        "num_requests": None, "output_tokens": None, "wall_s": None, "output_tokens_per_s": None,
        "ttft_mean_s": None, "itl_mean_s": None, "kv_peak_mb": None, "kv_reserved_mb": None, "note": None,
    }
    row.update(fields)
    return row


def error_row(workload: str, engine: str, kind: str, err: BaseException) -> dict:
    """A row that failed: reported and kept in the JSON, so one broken engine does not sink the others."""
    print(f"  !! {engine} on {workload} failed: {type(err).__name__}: {err}", flush=True)
    return new_row(workload, engine, kind, status="error", error=f"{type(err).__name__}: {err}")


def failed_measurement(workload: str, engine: str, kind: str, err: BaseException) -> Measurement:
    """A row whose engine did not load: reported once, then the same error row each time it is measured."""
    row = error_row(workload, engine, kind, err)
    return Measurement(engine, workload, lambda: row)


def mean(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are known (a request with one token has no inter-token latency)."""
    known = [x for x in values if x is not None]
    return statistics.fmean(known) if known else None


def median(values: Sequence[float | None]) -> float | None:
    known = [x for x in values if x is not None]
    return statistics.median(known) if known else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of the values, nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]


def inter_token_latency(first: float | None, last: float | None, num_tokens: int) -> float | None:
    """(last token time - first token time) / (tokens - 1); None with fewer than two tokens."""
    return None if first is None or last is None or num_tokens < 2 else (last - first) / (num_tokens - 1)


def median_of_runs(runs: list[dict]) -> dict:
    """A decode row's figures: the median of each over its timed runs (``wall_s``, ``tokens_per_s``, ...)."""
    return {"wall_s": median([r["wall_s"] for r in runs]),
            "output_tokens_per_s": median([r["tokens_per_s"] for r in runs]),
            "ttft_mean_s": median([r["ttft_s"] for r in runs]),
            "itl_mean_s": median([r["itl_s"] for r in runs])}


def median_run(run: Callable[[], dict], n: int) -> dict:
    """Call ``run`` (one timed pass over a workload, returning its row) n times; keep the median pass.

    The row reported is the pass with the median output tokens/s (the lower
    middle one for an even n), so all its figures come from one real pass; the
    throughput of every pass is kept under ``runs``.
    """
    rows = []
    for i in range(n):
        rows.append(run())
        if n > 1:
            print(f"    run {i + 1}/{n}: {rows[-1]['output_tokens_per_s']:.1f} tok/s", flush=True)
    return median_pass(rows)


def median_pass(rows: list[dict]) -> dict:
    """The pass with the median output tokens/s (the lower middle one), with every pass's summary under ``runs``."""
    row = sorted(rows, key=lambda r: r["output_tokens_per_s"])[(len(rows) - 1) // 2]
    row["runs"] = [pass_summary(r) for r in rows]
    row["runs_same_tokens"] = all(r.get("_tokens") == rows[0].get("_tokens") for r in rows)  # greedy: they must agree
    return row


def pass_summary(row: dict) -> dict:
    """What ``runs`` keeps of each pass: its time and throughput, and the prompt tokens it computed if known."""
    summary = {"wall_s": row["wall_s"], "tokens_per_s": row["output_tokens_per_s"]}
    if "prompt_tokens_computed" in row:
        summary["prompt_tokens_computed"] = row["prompt_tokens_computed"]
    return summary
