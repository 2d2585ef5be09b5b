"""Benchmark the milestones against each other and against Hugging Face transformers.

Everything runs in one process, on the same seeded workloads, so the rows are
comparable (and share the machine's noise). Run from the repository root:

    python examples/benchmark.py                         # every milestone + transformers, both workloads
    python examples/benchmark.py --engines m1,hf --workloads decode --runs 5
    python examples/benchmark.py --docs                  # write the JSON and plot shown in docs/benchmarks.md

Workloads
  decode  batch-1 decode: one prompt, --decode-tokens forced tokens (ignore_eos, greedy),
          one warm-up then --runs timed runs; the median is reported, and the ratio to
          transformers' ``model.generate`` on the same prompt.
  mixed   --num-requests requests with prompt lengths uniform in --prompt-len-range and
          output lengths uniform in --output-len-range (forced with ignore_eos, greedy,
          seeded), prompts cut from real English text. All requests arrive at once.
          --mixed-runs N serves it N times per row (milestones on a new engine each
          time) and reports the pass with the median throughput, the slower middle one
          for an even N; every pass's tok/s and wall time stay in the JSON. On a noisy
          machine one pass per row can be 20% off. Mixed rows show their ratio to
          hf-static (m1, which serves only some of the requests, gets none).

Rows
  mK              milestone K through its engine API (add every request, then step() until
                  done), peak and reserved KV bytes from ``engine.kv_usage()``.
                  mK@OPTION[+OPTION] (m2 on): the same with CPU fast paths chosen, to see what
                  each buys; plain mK uses the defaults ("auto" for both). Options: torch / cpp
                  (attention_backend: plain-torch or compiled decode attention), linear-torch /
                  linear-onednn (linear_backend: F.linear or weights packed for oneDNN).
                  m2@torch+linear-torch is m2 with neither.
                  m1 runs requests one at a time; on the mixed workload it runs only the first
                  --m1-requests of them (output tokens/s stays comparable, the totals do not).
  hf-generate     (decode) transformers ``model.generate``, greedy, min_new_tokens = max_new_tokens.
  hf-static-B     (mixed) ``model.generate`` on static batches of B (--hf-batch-size), left-padded;
                  each batch runs to its longest wanted output, only wanted tokens count.
  hf-continuous   (mixed) transformers' own continuous batching (paged cache, background thread).

Metrics: output tokens/s = useful generated tokens / wall time; time to first token is
measured from the moment a request is submitted (queueing included); inter-token
latency is a request's (last token - first token) / (tokens - 1), averaged over requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import REPO_ROOT, HelpFormatter, text_token_ids

DOCS_DIR = REPO_ROOT / "docs" / "assets" / "benchmarks"
HF_ENGINES = ("hf-generate", "hf-static", "hf-continuous")
ROW_OPTIONS = {  # mK@OPTION[+OPTION]: a milestone row with these engine options
    "auto": ("attention_backend", "auto"), "torch": ("attention_backend", "torch"), "cpp": ("attention_backend", "cpp"),
    "linear-auto": ("linear_backend", "auto"), "linear-torch": ("linear_backend", "torch"), "linear-onednn": ("linear_backend", "onednn"),
}
WORKLOADS = ("decode", "mixed", "shared")
HF_CB_DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 512}  # the same budget as m2's defaults
MB = 1024 * 1024


# ----------------------------------------------------------------------------- arguments


def _int_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers LO,HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from milestones import MILESTONES

    p = argparse.ArgumentParser(
        description="Benchmark the milestones against each other and against transformers, in one process.",
        epilog=f"Milestones available: {', '.join(MILESTONES)}. Rows for transformers: {', '.join(HF_ENGINES)} ('hf' = all three).",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--engines", default="all",
                   help="comma-separated rows: milestone names (m1,m2,...), 'hf' or hf-generate/hf-static/hf-continuous; 'all' = every milestone + hf")
    g.add_argument("--workloads", default="decode,mixed", help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    g.add_argument("--model", default=None, help="local folder or hub id; default: the bundled SmolLM2-135M-Instruct")
    g.add_argument("--device", default=None, help="cpu or cuda; default: cuda if available, else cpu")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="for every row; default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the whole run; default: torch's choice")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the engines")

    g = p.add_argument_group("decode workload")
    g.add_argument("--decode-tokens", type=int, default=128, help="forced output tokens per run")
    g.add_argument("--decode-prompt-len", type=int, default=32, help="prompt length in tokens")
    g.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")

    g = p.add_argument_group("mixed workload")
    g.add_argument("--num-requests", type=int, default=64, help="requests, all submitted at once")
    g.add_argument("--prompt-len-range", type=_int_range, default="16,256", metavar="LO,HI", help="prompt tokens, uniform")
    g.add_argument("--output-len-range", type=_int_range, default="32,256", metavar="LO,HI", help="output tokens, uniform")
    g.add_argument("--m1-requests", type=int, default=16,
                   help="m1 runs only this prefix of the requests (it runs one at a time, so a full run is slow); 0 = all")
    g.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf-static row")
    g.add_argument("--mixed-runs", type=int, default=1,
                   help="timed runs of the mixed and shared workloads per row; the run with the median throughput is reported")

    g = p.add_argument_group("shared-prefix workload (milestone rows only)")
    g.add_argument("--shared-prefix-len", type=int, default=600, help="tokens of the system prompt every request shares")
    g.add_argument("--shared-output-len-range", type=_int_range, default="32,128", metavar="LO,HI", help="output tokens, uniform")

    g = p.add_argument_group("engine options (passed only to milestones whose EngineConfig has them)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"requests running at once; default: the milestone's own (hf-continuous: {HF_CB_DEFAULTS['max_num_seqs']})")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per step; default: the milestone's own (hf-continuous: {HF_CB_DEFAULTS['max_num_batched_tokens']})")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the smallest that fits the selected workloads (max prompt + max output)")
    g.add_argument("--tight-kv", type=int, default=None, metavar="N",
                   help="a tight KV memory budget of N * max_model_len tokens: m2 gets N slots (max_num_seqs=N), "
                        "paged milestones get the same bytes as a block pool (kv_cache_memory_bytes) and --max-num-seqs")

    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("bench_results/benchmark.json"), help="JSON results file")
    g.add_argument("--plot", action="store_true", help="also write a bar chart next to the JSON (same name, .png)")
    g.add_argument("--docs", action="store_true", help=f"write JSON and plot into {DOCS_DIR.relative_to(REPO_ROOT)}/ for the docs")
    args = p.parse_args(argv)

    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        p.error(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)}")
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    engines: list[str] = []
    for name in names:
        expanded = [*MILESTONES, *HF_ENGINES] if name == "all" else HF_ENGINES if name == "hf" else [name]
        for e in expanded:
            milestone, _, options = e.partition("@")
            chosen = options.split("+") if "@" in e else []
            if e not in HF_ENGINES and (milestone not in MILESTONES or not set(chosen) <= set(ROW_OPTIONS)):
                p.error(f"unknown engine {e!r}; choose from {', '.join([*MILESTONES, 'hf', *HF_ENGINES])}; a milestone may "
                        f"take options after '@', joined by '+' ({', '.join(ROW_OPTIONS)}), e.g. m2@torch+linear-torch")
            fields = [ROW_OPTIONS[option][0] for option in chosen]
            if len(set(fields)) < len(fields):
                p.error(f"engine {e!r} sets one option twice; name at most one value each for {', '.join(sorted(set(fields)))}")
            if e not in engines:
                engines.append(e)
    args.milestones = [e for e in engines if e not in HF_ENGINES]
    args.hf_rows = [e for e in engines if e in HF_ENGINES]
    for flag in ("decode_tokens", "decode_prompt_len", "runs", "num_requests", "hf_batch_size", "mixed_runs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.docs:
        args.out, args.plot = DOCS_DIR / "benchmark.json", True
    return args


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


def make_decode_prompt(tokenizer, length: int) -> list[int]:
    return text_token_ids(tokenizer, length)[:length]


def make_shared_workload(tokenizer, n: int, prefix_len: int, output_range, seed: int) -> list[Request]:
    """One long system prompt shared by every request, each followed by its own short question."""
    rng = random.Random(seed + 1)
    text = text_token_ids(tokenizer, prefix_len + 512)
    prefix = text[:prefix_len]
    requests = []
    for _ in range(n):
        start, length = rng.randrange(prefix_len, len(text) - 40), rng.randint(8, 32)
        requests.append(Request(prefix + text[start : start + length], rng.randint(*output_range)))
    return requests


def make_mixed_workload(tokenizer, n: int, prompt_range, output_range, seed: int) -> list[Request]:
    """Seeded requests whose prompts are slices of real text at varying offsets."""
    rng = random.Random(seed)
    lengths = [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(n)]
    text = text_token_ids(tokenizer, prompt_range[1] + 256)
    requests = []
    for plen, olen in lengths:
        start = rng.randrange(0, len(text) - plen + 1)
        requests.append(Request(text[start : start + plen], olen))
    return requests


# ----------------------------------------------------------------------------- helpers


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _itl(first: float | None, last: float | None, n: int) -> float | None:
    return None if first is None or last is None or n < 2 else (last - first) / (n - 1)


def median_run(run, n: int) -> dict:
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
    row = sorted(rows, key=lambda r: r["output_tokens_per_s"])[(n - 1) // 2]
    row["runs"] = [{"wall_s": r["wall_s"], "tokens_per_s": r["output_tokens_per_s"],
                    **({"prompt_tokens_computed": r["prompt_tokens_computed"]} if "prompt_tokens_computed" in r else {})} for r in rows]
    row["runs_same_tokens"] = all(r.get("_tokens") == rows[0].get("_tokens") for r in rows)  # greedy: they must agree
    return row


def _row(workload: str, engine: str, kind: str, **fields) -> dict:
    row = {
        "workload": workload, "engine": engine, "kind": kind, "status": "ok", "error": None,
        "num_requests": None, "output_tokens": None, "wall_s": None, "output_tokens_per_s": None,
        "ttft_mean_s": None, "itl_mean_s": None, "kv_peak_mb": None, "kv_reserved_mb": None, "note": None,
    }
    row.update(fields)
    return row


def _error_row(workload: str, engine: str, kind: str, err: BaseException) -> dict:
    print(f"  !! {engine} on {workload} failed: {type(err).__name__}: {err}", flush=True)
    return _row(workload, engine, kind, status="error", error=f"{type(err).__name__}: {err}")


def _token_agreement(rows: list[dict]) -> None:
    """Compare each row's tokens with the first row of its workload (greedy, so they should agree)."""
    reference: dict[str, dict] = {}
    for row in rows:
        tokens = row.pop("_tokens", None)
        if tokens is None:
            continue
        ref = reference.setdefault(row["workload"], {"engine": row["engine"], "tokens": tokens})
        if ref["engine"] != row["engine"]:
            same = sum(a == b for a, b in zip(tokens, ref["tokens"], strict=False))
            row[f"same_tokens_as_{ref['engine']}"] = f"{same}/{min(len(tokens), len(ref['tokens']))} requests"


def machine_info(device) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


# ----------------------------------------------------------------------------- milestones


def engine_kwargs(mod, args, max_model_len: int, kv_bytes_per_token: int) -> dict:
    """The engine options this milestone accepts (checked against its EngineConfig fields)."""
    accepted = {f.name for f in dataclasses.fields(mod.EngineConfig)}
    wanted = {"max_model_len": max_model_len, "seed": args.seed,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.tight_kv:  # the same KV bytes for every milestone: slots for m2, a block pool for the paged ones
        if "kv_cache_memory_bytes" in accepted:
            wanted["kv_cache_memory_bytes"] = args.tight_kv * max_model_len * kv_bytes_per_token
        else:
            wanted["max_num_seqs"] = args.tight_kv
    return {k: v for k, v in wanted.items() if v is not None and k in accepted}


def _config_dict(config) -> dict:
    return {f.name: (v if isinstance(v, (int, float, bool, type(None))) else str(v))
            for f in dataclasses.fields(config) for v in [getattr(config, f.name)]}


def bench_decode_milestone(name, llm, sp_cls, prompt, args) -> dict:
    params = sp_cls(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m, n = out.metrics, len(out.outputs[0].token_ids)
        runs.append({"wall_s": wall, "tokens_per_s": n / wall, "ttft_s": m.time_to_first_token,
                     "itl_s": _itl(m.first_token_time, m.last_token_time, n)})
    return _row("decode", name, "milestone", num_requests=1, output_tokens=n,
                wall_s=_median([r["wall_s"] for r in runs]), output_tokens_per_s=_median([r["tokens_per_s"] for r in runs]),
                ttft_mean_s=_median([r["ttft_s"] for r in runs]), itl_mean_s=_median([r["itl_s"] for r in runs]),
                runs=runs, _tokens=[list(out.outputs[0].token_ids)])


def bench_mixed_milestone(name, llm, sp_cls, requests, args, workload: str = "mixed") -> dict:
    engine = llm.engine
    note = None
    if name.startswith("m1") and 0 < args.m1_requests < len(requests):
        requests = requests[: args.m1_requests]
        note = f"first {len(requests)} of the requests only (m1 runs one at a time)"
    llm.generate([requests[0].prompt_ids[:8]], sp_cls(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    peak = reserved = most_running = 0
    finished = {}
    t0 = time.perf_counter()
    ids = [engine.add_request(r.prompt_ids, sp_cls(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)) for r in requests]
    steps0 = getattr(engine, "num_steps", 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        usage = engine.kv_usage()
        peak, reserved = max(peak, usage["used_bytes"]), max(reserved, usage["reserved_bytes"])
        most_running = max(most_running, len(engine.scheduler.running_seqs()))
    wall = time.perf_counter() - t0
    outs = [finished[i] for i in ids]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    cached = sum(getattr(o, "num_cached_tokens", 0) for o in outs)
    return _row(workload, name, "milestone", num_requests=len(outs), output_tokens=n_out, wall_s=wall,
                prompt_tokens=prompt_tokens, prompt_tokens_computed=prompt_tokens - cached, max_running=most_running,
                num_preemptions=usage.get("num_preemptions"), prefix_hit_rate=usage.get("prefix_hit_rate"),
                output_tokens_per_s=n_out / wall,
                ttft_mean_s=_mean([o.metrics.time_to_first_token for o in outs]),
                itl_mean_s=_mean([_itl(o.metrics.first_token_time, o.metrics.last_token_time, len(o.outputs[0].token_ids)) for o in outs]),
                kv_peak_mb=peak / MB, kv_reserved_mb=reserved / MB, steps=getattr(engine, "num_steps", 0) - steps0, note=note,
                _tokens=[list(o.outputs[0].token_ids) for o in outs])


def mixed_passes(name, mod, llm, new_llm, requests, args, workload: str) -> dict:
    """Serve the workload --mixed-runs times: the first pass on ``llm``, every later one on a new engine.

    A new engine per pass keeps the passes alike: m4's prefix cache, for one,
    would otherwise start every pass after the first with the prompts cached.
    """
    engines = [llm]

    def one_pass() -> dict:
        engine = engines.pop() if engines else new_llm()
        return bench_mixed_milestone(name, engine, mod.SamplingParams, requests, args, workload)

    return median_run(one_pass, args.mixed_runs)


def run_milestone(name, args, model, device, dtype, max_model_len, decode_prompt, requests, shared, kv_bytes_per_token) -> list[dict]:
    rows = []
    try:
        milestone, _, options = name.partition("@")
        mod = importlib.import_module(f"milestones.{milestone}")
        kwargs = engine_kwargs(mod, args, max_model_len, kv_bytes_per_token)
        for option in filter(None, options.split("+")):
            field, value = ROW_OPTIONS[option]
            if field not in {f.name for f in dataclasses.fields(mod.EngineConfig)}:
                raise ValueError(f"{milestone} has no {field} option")
            kwargs[field] = value
        t0 = time.perf_counter()
        llm = mod.LLM(model, device=device, dtype=dtype, **kwargs)
        load_s = time.perf_counter() - t0
    except Exception as err:  # a milestone that does not load yet must not sink the other rows
        return [_error_row(w, name, "milestone", err) for w in args.workloads]
    extra = {"engine_kwargs": kwargs, "engine_config": _config_dict(llm.engine.config), "load_s": load_s,
             "decode_kernel": getattr(llm.engine.runner, "decode_kernel", None) is not None,
             "packed_linear": getattr(llm.engine.runner, "packed_linear", False)}
    for workload in args.workloads:
        print(f"- {name}: {workload} ...", flush=True)
        try:
            if workload == "decode":
                row = bench_decode_milestone(name, llm, mod.SamplingParams, decode_prompt, args)
            else:
                new_llm = functools.partial(mod.LLM, model, device=device, dtype=dtype, **kwargs)
                row = mixed_passes(name, mod, llm, new_llm, shared if workload == "shared" else requests, args, workload)
            row.update(extra)
        except Exception as err:
            row = _error_row(workload, name, "milestone", err)
        rows.append(row)
    del llm
    gc.collect()
    return rows


# ----------------------------------------------------------------------------- transformers


class _StepTimer:
    """A stopping criterion that never stops: it only records when each new token came out."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _kv_bytes_per_token(config, dtype) -> int:
    import torch

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def _hf_generate(model, input_ids, attention_mask, n_new: int, pad_id: int):
    from transformers import StoppingCriteriaList

    timer = _StepTimer()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([timer]))
    return out[:, input_ids.shape[1]:], timer.times


def bench_decode_hf(model, tokenizer, prompt, args, device) -> dict:
    import torch

    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)
    _hf_generate(model, ids, mask, args.decode_tokens, tokenizer.pad_token_id)  # warm-up
    runs = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        out, times = _hf_generate(model, ids, mask, args.decode_tokens, tokenizer.pad_token_id)
        wall = time.perf_counter() - t0
        n = out.shape[1]
        runs.append({"wall_s": wall, "tokens_per_s": n / wall, "ttft_s": times[0] - t0, "itl_s": _itl(times[0], times[-1], n)})
    return _row("decode", "hf-generate", "transformers", num_requests=1, output_tokens=n,
                wall_s=_median([r["wall_s"] for r in runs]), output_tokens_per_s=_median([r["tokens_per_s"] for r in runs]),
                ttft_mean_s=_median([r["ttft_s"] for r in runs]), itl_mean_s=_median([r["itl_s"] for r in runs]),
                runs=runs, _tokens=[out[0].tolist()])


def bench_mixed_hf_static(model, tokenizer, requests, args, device, dtype) -> dict:
    bs = args.hf_batch_size
    pad_id = tokenizer.pad_token_id
    warm = tokenizer.pad({"input_ids": [r.prompt_ids[:8] for r in requests[:2]]}, padding=True, padding_side="left", return_tensors="pt")
    _hf_generate(model, warm["input_ids"].to(device), warm["attention_mask"].to(device), 4, pad_id)  # warm-up
    per_token = _kv_bytes_per_token(model.config, dtype)
    ttfts, itls, tokens, peak = [], [], [], 0
    t0 = time.perf_counter()
    for i in range(0, len(requests), bs):
        batch = requests[i : i + bs]
        enc = tokenizer.pad({"input_ids": [r.prompt_ids for r in batch]}, padding=True, padding_side="left", return_tensors="pt")
        n_new = max(r.max_tokens for r in batch)
        out, times = _hf_generate(model, enc["input_ids"].to(device), enc["attention_mask"].to(device), n_new, pad_id)
        peak = max(peak, len(batch) * (enc["input_ids"].shape[1] + n_new) * per_token)  # the padded cache at its largest
        print(f"    batch {i // bs + 1}/{-(-len(requests) // bs)} done after {time.perf_counter() - t0:.1f} s", flush=True)
        for j, r in enumerate(batch):
            tokens.append(out[j, : r.max_tokens].tolist())
            ttfts.append(times[0] - t0)
            itls.append(_itl(times[0], times[r.max_tokens - 1], r.max_tokens))
    wall = time.perf_counter() - t0
    n_out = sum(r.max_tokens for r in requests)
    return _row("mixed", f"hf-static-{bs}", "transformers", num_requests=len(requests), output_tokens=n_out, wall_s=wall,
                output_tokens_per_s=n_out / wall, ttft_mean_s=_mean(ttfts), itl_mean_s=_mean(itls),
                kv_peak_mb=peak / MB, kv_reserved_mb=peak / MB,
                note="KV sizes computed from the padded batch shape (DynamicCache grows as it goes)", _tokens=tokens)


def bench_mixed_hf_continuous(model, requests, args) -> dict:
    """transformers' continuous batching (``generate_batch``'s machinery), with a cache sized for the workload."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 32
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
        def collect(n: int, on_poll=None) -> dict:
            results = {}
            while len(results) < n:
                res = manager.get_result(timeout=0.05)
                if on_poll is not None:
                    on_poll()
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped before finishing the requests")
                    continue
                if res.error is not None:
                    raise RuntimeError(f"request {res.request_id} failed: {res.error}")
                if res.is_finished():
                    results[res.request_id] = res
            return results

        manager.add_request(requests[0].prompt_ids[:8], request_id="warm-up", max_new_tokens=4, eos_token_id=-1)
        collect(1)  # warm-up (also creates the paged cache)
        cache = manager.batch_processor.cache
        capacity = cache.num_sectors * cache.bytes_per_sector
        peak = [0]

        def poll():
            try:
                peak[0] = max(peak[0], capacity - cache.compute_free_capacity(relative=False))
            except Exception:  # the background thread may be mid-update; the next poll will do
                pass

        t0 = time.perf_counter()
        ids = [manager.add_request(r.prompt_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                   record_timestamps=True, eos_token_id=-1) for i, r in enumerate(requests)]
        results = collect(len(requests), poll)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    outs = [results[i] for i in ids]
    n_out = sum(len(o.generated_tokens) for o in outs)
    ttfts = [o.timestamps[0] - o.created_time if o.timestamps else None for o in outs]
    itls = [_itl(o.timestamps[0], o.timestamps[-1], len(o.timestamps)) if o.timestamps else None for o in outs]
    return _row("mixed", "hf-continuous", "transformers", num_requests=len(outs), output_tokens=n_out, wall_s=wall,
                output_tokens_per_s=n_out / wall, ttft_mean_s=_mean(ttfts), itl_mean_s=_mean(itls),
                kv_peak_mb=peak[0] / MB, kv_reserved_mb=cache.cache_tensor.numel() * cache.cache_tensor.element_size() / MB,
                cb_config={"page_size": page, "num_blocks": num_blocks, "max_batch_tokens": max_batched,
                           "max_requests_per_batch": max_num_seqs, "attn_implementation": model.config._attn_implementation},
                _tokens=[list(o.generated_tokens) for o in outs])


def run_transformers(args, model_path, device, dtype, decode_prompt, requests) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wanted = []
    if "decode" in args.workloads and "hf-generate" in args.hf_rows:
        wanted.append(("decode", "hf-generate"))
    if "mixed" in args.workloads:
        wanted += [("mixed", e) for e in ("hf-static", "hf-continuous") if e in args.hf_rows]
    if not wanted:
        return []
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of the report
    try:
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        load_s = time.perf_counter() - t0
    except Exception as err:
        return [_error_row(w, e, "transformers", err) for w, e in wanted]
    rows = []
    for workload, engine in wanted:
        label = f"hf-static-{args.hf_batch_size}" if engine == "hf-static" else engine
        print(f"- {label}: {workload} ...", flush=True)
        torch.manual_seed(args.seed)
        try:
            with torch.inference_mode():
                if engine == "hf-generate":
                    row = bench_decode_hf(model, tokenizer, decode_prompt, args, device)
                elif engine == "hf-static":  # generate keeps no state between calls: one model serves every pass
                    row = median_run(functools.partial(bench_mixed_hf_static, model, tokenizer, requests, args, device, dtype), args.mixed_runs)
                else:
                    row = median_run(functools.partial(bench_mixed_hf_continuous, model, requests, args), args.mixed_runs)
            row["load_s"] = load_s
        except Exception as err:
            row = _error_row(workload, label, "transformers", err)
        rows.append(row)
    del model
    gc.collect()
    return rows


# ----------------------------------------------------------------------------- report


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def print_table(rows: list[dict]) -> None:
    header = ["workload", "engine", "tok/s", "runs", "vs hf", "TTFT ms", "ITL ms", "KV peak MB", "KV resv MB", "max run", "prompt computed", "wall s", "reqs", "note"]
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append([r["workload"], r["engine"], "error", "", "", "", "", "", "", "", "", "", "", (r["error"] or "")[:60]])
            continue
        runs = [x["tokens_per_s"] for x in r.get("runs", [])]
        spread = f"{len(runs)}: {min(runs):.1f}-{max(runs):.1f}" if len(runs) > 1 else ""
        lines.append([r["workload"], r["engine"], _fmt(r["output_tokens_per_s"], ".1f"), spread, _fmt(r.get("ratio_to_hf"), ".2f"),
                      _fmt(r["ttft_mean_s"], ".0f", 1000), _fmt(r["itl_mean_s"], ".1f", 1000), _fmt(r["kv_peak_mb"], ".1f"),
                      _fmt(r["kv_reserved_mb"], ".1f"), _fmt(r.get("max_running"), ".0f"), _fmt(r.get("prompt_tokens_computed"), ".0f"),
                      _fmt(r["wall_s"], ".1f"), str(r["num_requests"]), r.get("note") or ""])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    for i, line in enumerate([header, *lines]):
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if any(r["workload"] == w and r["status"] == "ok" for r in results["results"])]
    if not workloads:
        return
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        rows = [r for r in results["results"] if r["workload"] == workload and r["status"] == "ok"]
        names = [r["engine"] + (f"\n(first {r['num_requests']})" if r.get("note", "") and r["engine"] == "m1" and workload == "mixed" else "")
                 for r in rows]
        values = [r["output_tokens_per_s"] for r in rows]
        colors = ["tab:blue" if r["kind"] == "milestone" else "tab:gray" for r in rows]
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], padding=2, fontsize=9)
        ax.set_title({"decode": f"decode: batch 1, {results['config']['decode_tokens']} tokens",
                      "mixed": f"mixed: {results['config']['num_requests']} requests",
                      "shared": f"shared prefix: {results['config']['num_requests']} requests, "
                                f"{results['config']['shared_prefix_len']}-token system prompt"}[workload])
        ax.set_ylabel("output tokens/s (higher is better)")
        ax.set_ylim(0, max(values) * 1.18)
        ax.tick_params(axis="x", labelrotation=15)
    m = results["machine"]
    threads = m["torch_threads"]
    fig.suptitle(f"{results['config']['model']}, {results['config']['dtype']} on {m['device']} "
                 f"({m['cpu_count']} CPUs, {threads} torch thread{'s' * (threads != 1)}, torch {m['torch']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from milestones.model_store import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    decode_prompt = make_decode_prompt(tokenizer, args.decode_prompt_len)
    requests = make_mixed_workload(tokenizer, args.num_requests, args.prompt_len_range, args.output_len_range, args.seed)
    shared = make_shared_workload(tokenizer, args.num_requests, args.shared_prefix_len, args.shared_output_len_range, args.seed)
    max_model_len = args.max_model_len or max(
        [args.decode_prompt_len + args.decode_tokens] * ("decode" in args.workloads)
        + [args.prompt_len_range[1] + args.output_len_range[1]] * ("mixed" in args.workloads)
        + [max(len(r.prompt_ids) for r in shared) + args.shared_output_len_range[1]] * ("shared" in args.workloads))
    from transformers import AutoConfig

    kv_bytes_per_token = _kv_bytes_per_token(AutoConfig.from_pretrained(model_path), dtype)

    results = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(["examples/benchmark.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(device),
        "config": {"model": args.model or "SmolLM2-135M-Instruct (bundled)", "dtype": str(dtype).replace("torch.", ""),
                   "workloads": args.workloads, "milestones": args.milestones, "hf_rows": args.hf_rows, "seed": args.seed,
                   "decode_tokens": args.decode_tokens, "decode_prompt_len": args.decode_prompt_len, "runs": args.runs,
                   "num_requests": args.num_requests, "prompt_len_range": list(args.prompt_len_range),
                   "output_len_range": list(args.output_len_range), "m1_requests": args.m1_requests,
                   "hf_batch_size": args.hf_batch_size, "mixed_runs": args.mixed_runs, "max_model_len": max_model_len,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "tight_kv": args.tight_kv, "shared_prefix_len": args.shared_prefix_len,
                   "shared_output_len_range": list(args.shared_output_len_range)},
        "results": [],
    }
    print(f"benchmark: {results['config']['model']} on {device} ({results['config']['dtype']}), "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}; workloads {', '.join(args.workloads)}; "
          f"rows {', '.join(args.milestones + args.hf_rows)}", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 1.0 and device.type == "cpu":
        print(f"note: the machine is busy (load average {load:.1f} on {os.cpu_count()} CPUs): CPU numbers will be noisy; "
              "with other processes competing, --threads 1 is often much faster than torch's default", flush=True)
    if "mixed" in args.workloads:
        total = sum(r.max_tokens for r in requests)
        print(f"mixed workload: {len(requests)} requests, {sum(len(r.prompt_ids) for r in requests)} prompt tokens, {total} output tokens"
              + (f"; m1 runs the first {args.m1_requests} only" if "m1" in args.milestones and 0 < args.m1_requests < len(requests) else ""),
              flush=True)

    rows = []
    for name in args.milestones:
        rows += run_milestone(name, args, args.model, device, dtype, max_model_len, decode_prompt, requests, shared, kv_bytes_per_token)
    rows += run_transformers(args, model_path, device, dtype, decode_prompt, requests)

    # Ratios to transformers (decode: hf-generate; mixed: static batching), and token agreement per workload.
    for workload, engine in (("decode", "hf-generate"), ("mixed", f"hf-static-{args.hf_batch_size}")):
        ref = next((r for r in rows if r["workload"] == workload and r["engine"] == engine and r["status"] == "ok"), None)
        for r in rows:  # m1 serves only the first --m1-requests of the mixed workload: no ratio for it
            if ref and r["workload"] == workload and r["status"] == "ok" and r["num_requests"] == ref["num_requests"]:
                r["ratio_to_hf"], r["ratio_to_hf_engine"] = r["output_tokens_per_s"] / ref["output_tokens_per_s"], engine
    _token_agreement(rows)
    if hasattr(os, "getloadavg"):
        results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["results"] = rows

    print()
    print_table(rows)
    print("vs hf: decode rows against hf-generate, mixed rows against hf-static; runs: how many timed passes, slowest-fastest tok/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    if args.plot:
        png = args.out.with_suffix(".png")
        write_plot(results, png)
        print(f"wrote {png}")
    failed = [r["engine"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"note: some rows failed and were skipped ({', '.join(failed)}); their errors are in the JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
