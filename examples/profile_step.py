"""Where a decode step's time goes, per milestone: linear layers, attention, other operators, Python.

    python examples/profile_step.py                              # m1..m6, batch 1 and 16, the bundled model
    python examples/profile_step.py --milestones m1,m5 --batch-sizes 1 --out profile.json
    python examples/profile_step.py --dtype bfloat16 --batch-sizes 1

For each milestone and batch size it puts B requests past their prompts, then:

1. times --steps decode steps without a profiler (the median step is the figure);
2. runs as many under torch.profiler with Python stacks, and sorts every operator's own
   time by where it was called from: a linear layer (``nn.Linear``, the packed oneDNN or
   bfloat16 layers, the LM head), attention (the milestone's ``attention.py``, its backend or the
   compiled decode kernel), or anything else (norms, rotary, activations, copies,
   sampling). The operators' total comes from a lighter profile without stacks; what
   the unprofiled step holds beyond it is Python and dispatch (the profiler's own cost
   lands in the operators, so that share is a lower bound);
3. counts the bytes a step must read (every weight once, and each request's keys and
   values) and the bandwidth that reaches, against the machine's own: a STREAM-style copy
   of a 256 MiB tensor with the same threads (read plus write bytes per second).

With m5's and m6's captured step (``torch.compile`` on a CPU) the operators are
inductor's: the generated kernels count as "other", the external linear and attention
calls keep their names. m6 overlaps its host work with the forward pass, so there the
Python share is what was not hidden.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _common import HelpFormatter, pick_threads

LINEAR_FILES = ("torch/nn/modules/linear.py", "kernels/packed_linear.py", "kernels/panel_linear.py")
# F.linear's ops are found by their caller; these by name (in m5's captured step inductor's code calls them)
LINEAR_OPS = ("mkldnn::_linear_pointwise", "milestones::panel_linear", "milestones::panel_silu_mul")
ATTENTION_OPS = ("milestones::decode_attention", "scaled_dot_product")
CATEGORIES = ("linear", "attention", "other ops", "python")


@dataclass(slots=True)
class StepProfile:
    milestone: str
    batch_size: int
    step_ms: float  # median decode step, no profiler
    tokens_per_s: float
    shares: dict[str, float]  # of the step's wall time, per category; they add up to 1
    bytes_per_step: int  # weights once, plus every request's keys and values
    gb_per_s: float  # bytes_per_step / step time
    fraction_of_copy_bandwidth: float


def copy_bandwidth(mib: int = 256, reps: int = 7) -> float:
    """Bytes per second of a large tensor copy with torch's threads: read and write both counted."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times[1:])


def weight_bytes(cfg, element_size: int) -> int:
    """Every weight a decode step reads once: the layers' projections and norms, the final norm and the LM head."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attention = h * hd * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * hd * h
    mlp = 3 * h * cfg.intermediate_size
    return element_size * (cfg.num_layers * (attention + mlp + 2 * h) + h + cfg.vocab_size * h)


PYTHON_EVENT = re.compile(r"^(.*\.py\(\d+\): |<built-in )")  # what torch.profiler names a Python call


def category(event, milestone_dir: str) -> str:
    """Which part of the model an operator belongs to: by its name, else by the Python calls around it."""
    if any(op in event.name for op in ATTENTION_OPS):
        return "attention"
    if event.name in LINEAR_OPS:
        return "linear"
    while event is not None:
        if f"{milestone_dir}/attention.py" in event.name or "kernels/attention_backends.py" in event.name:
            return "attention"
        if event.name in LINEAR_OPS or any(path in event.name for path in LINEAR_FILES) or \
                "compute_logits" in event.name:
            return "linear"
        event = event.cpu_parent
    return "other ops"


def op_seconds(events, milestone_dir: str | None) -> dict[str, float]:
    """The operators' own time, by category (all under "other ops" when ``milestone_dir`` is None: no stacks)."""
    totals = dict.fromkeys(CATEGORIES[:3], 0.0)
    for event in events:
        if not PYTHON_EVENT.match(event.name):
            totals["other ops" if milestone_dir is None else category(event, milestone_dir)] += (
                event.self_cpu_time_total / 1e6)
    return totals


def decoding_engine(mod, batch_size: int, args: argparse.Namespace):
    """An engine with ``batch_size`` requests past their prompts, each with room for warm-up and timed steps."""
    llm = mod.LLM(model=args.model, max_model_len=args.prompt_len + 4 * args.steps + 16, seed=0, dtype=args.dtype,
                  **({"max_num_seqs": batch_size} if batch_size > 1 else {}))
    engine = llm.engine
    params = mod.SamplingParams(max_tokens=4 * args.steps + 8, ignore_eos=True, temperature=0)  # greedy, as benchmarked
    for i in range(batch_size):
        engine.add_request([1 + (7 * i + j) % 100 for j in range(args.prompt_len)], params, f"r{i}")
    for _ in range(args.steps // 2 + 2):  # the prompts, and a few decode steps to warm up
        engine.step()
    return llm, engine


def profile(milestone: str, batch_size: int, args: argparse.Namespace, bandwidth: float) -> StepProfile:
    mod = importlib.import_module(f"milestones.{milestone}")
    llm, engine = decoding_engine(mod, batch_size, args)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    # The operators' time from a light profile; how it splits, from one with Python calls (slower, but the split holds).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as light:
        for _ in range(args.steps):
            engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as traced:
        for _ in range(args.steps):
            engine.step()
    ops = sum(op_seconds(light.events(), None).values()) / args.steps
    split = op_seconds(traced.events(), f"milestones/{milestone}")
    whole = max(step, ops)  # the profiler's own cost may push the operators past the unprofiled step
    shares = {name: ops / whole * seconds / sum(split.values()) for name, seconds in split.items()}
    shares["python"] = 1 - ops / whole
    runner = engine.runner
    cfg = runner.model.config
    context = args.prompt_len + args.steps  # about where the unprofiled steps are
    num_bytes = weight_bytes(cfg, runner.k_cache.element_size()) + batch_size * context * runner.kv_bytes_per_token
    llm.close()
    return StepProfile(milestone, batch_size, 1e3 * step, batch_size / step, shares, num_bytes, num_bytes / step / 1e9,
                       num_bytes / step / bandwidth)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--milestones", default="m1,m2,m3,m4,m5,m6", help="comma-separated")
    parser.add_argument("--batch-sizes", default="1,16", help="requests decoding at once, comma-separated")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed, and as many profiled")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--model", default=None, help="local folder; default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=None, help="torch threads; default: torch's choice")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="the weights' dtype; default: the engine's (float32 on a CPU, bfloat16 on CUDA)")
    parser.add_argument("--out", type=Path, default=None, help="write the profiles here as JSON")
    args = parser.parse_args()
    threads, why = pick_threads(args.threads)
    bandwidth = copy_bandwidth()
    print(f"{threads} threads ({why}); copy bandwidth {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    rows = []
    print(f"{'row':<8}{'step ms':>9}{'tok/s':>8}" + "".join(f"{c:>11}" for c in CATEGORIES) + f"{'MB/step':>9}"
          f"{'GB/s':>7}{'of copy':>9}")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        for milestone in args.milestones.split(","):
            if batch_size > 1 and not hasattr(importlib.import_module(f"milestones.{milestone}.config").EngineConfig,
                                              "max_num_seqs"):
                print(f"{milestone}@{batch_size}: left out, {milestone} runs one request at a time", file=sys.stderr)
                continue
            row = profile(milestone, batch_size, args, bandwidth)
            rows.append(row)
            print(f"{milestone}@{batch_size:<5}{row.step_ms:>9.1f}{row.tokens_per_s:>8.1f}"
                  + "".join(f"{row.shares[c]:>11.0%}" for c in CATEGORIES)
                  + f"{row.bytes_per_step / 1e6:>9.0f}{row.gb_per_s:>7.1f}{row.fraction_of_copy_bandwidth:>9.0%}")
    if args.out is not None:
        args.out.write_text(json.dumps({"threads": threads, "copy_bandwidth_gb_per_s": bandwidth / 1e9,
                                        "args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": [asdict(row) for row in rows]}, indent=1))


if __name__ == "__main__":
    main()
