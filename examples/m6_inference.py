"""Milestone 6 demo: overlap scheduling, the host one step ahead of the device.

Run from the repository root:

    python examples/m6_inference.py                          # overlap on: print the hidden share of host work
    python examples/m6_inference.py --compare                # then again without overlap, in the same process
    python examples/m6_inference.py --trace trace.json       # also write the run's timeline (Chrome trace JSON)
    python examples/m6_inference.py --no-async               # m5's loop: schedule, launch, wait, process
    python examples/m6_inference.py --enforce-eager          # no capture: start at once, every step eager

With ``async_scheduling`` (on in this demo; the engine's default turns it on on CUDA only,
since on a CPU the worker's threads compete with the caller's) the engine launches step N+1 on its forward
worker before it processes step N's tokens: the scheduler's work and the stop rules,
detokenizing and freeing run on the host while the worker computes. The tokens that
step N+1 needs from step N are not known on the host when it is launched; they are
resolved on the device. With greedy sampling the text must not change.

The engine records a timeline of every step (``schedule`` and ``process`` on the host,
``forward`` on the worker). The script always turns it on, to report the *hidden host
share*: the part of the host's schedule + process time that ran while a forward was
computing (0% without overlap). ``--trace FILE`` keeps it: open the file in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import HelpFormatter, fmt_seconds
from m2_inference import add_arguments, build_requests, load, print_completions
from m5_inference import batch_sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate for a batch of chat prompts with milestone 6 (overlap scheduling: the host schedules "
                    "the next step and processes the last one while the device computes) and show how much of the "
                    "host's work was hidden behind the forward passes.",
        epilog="Examples: `%(prog)s --compare`, `%(prog)s --trace trace.json` (open it in https://ui.perfetto.dev), "
               "`%(prog)s --compare --trace trace.json --enforce-eager`.",
        formatter_class=HelpFormatter,
    )
    add_arguments(p)
    # Four at a time: on a CPU the default captured sizes are 1 and 4, so every decode step fits one.
    p.set_defaults(max_num_seqs=4)
    g = p.add_argument_group("overlap")
    g.add_argument("--no-async", dest="async_scheduling", action="store_false",
                   help="turn overlap off (async_scheduling=False): every step is scheduled, launched, waited for "
                        "and processed before the next one, as in m5")
    g.add_argument("--compare", action="store_true",
                   help="run the same requests again with overlap the other way (off, or on), then compare speeds, "
                        "hidden host shares and tokens")
    g.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="write the run's timeline here as Chrome trace JSON; with --compare, two files: FILE with "
                        "-overlap and -sync before its suffix")
    g = p.add_argument_group("capture (as in m5)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="capture nothing: every step runs operator by operator (on a CPU, no minute of compiling)")
    g.add_argument("--cudagraph-capture-sizes", type=batch_sizes, default=None, metavar="N,N,...",
                   help="decode batch sizes to capture, each at most --max-num-seqs (default: the engine's)")
    return p.parse_args(argv)


def label_of(async_scheduling: bool) -> str:
    return "overlap" if async_scheduling else "sync"


def trace_path(args, async_scheduling: bool, scratch: Path) -> Path:
    """Where this run's trace goes: the user's file (labelled when there are two runs), else a temporary one."""
    label = label_of(async_scheduling)
    if args.trace is None:
        return scratch / f"trace-{label}.json"
    if not args.compare:
        return args.trace
    return args.trace.with_name(f"{args.trace.stem}-{label}{args.trace.suffix or '.json'}")


def step_times(events: list[dict]) -> dict[str, float]:
    """Mean duration in seconds of each kind of event in the trace, and how many forwards ran."""
    means = {}
    for name in ("schedule", "forward", "process"):
        durations = [e["dur"] / 1e6 for e in events if e.get("name") == name]
        means[name] = statistics.fmean(durations) if durations else 0.0
    means["forwards"] = sum(e.get("name") == "forward" for e in events)
    return means


def run(LLM, SamplingParams, hidden_host_share, args, async_scheduling: bool, show: int, trace: Path) -> dict:
    """Load an engine with overlap on or off, run every request, print what happened; return the numbers."""
    label = label_of(async_scheduling)
    print(f"\n=== {label} (async_scheduling={async_scheduling}) ===")
    # The engine records its timeline only when it has a trace file to write: always give it one.
    llm, load_s = load(functools.partial(LLM, async_scheduling=async_scheduling, trace_file=str(trace)), args)
    with llm:  # on leaving: the step still in flight is processed, the worker stops, the trace is written
        stats = llm.engine.graph_stats()
        if stats["captured_sizes"]:
            print(f"decode step captured for batch sizes {stats['captured_sizes']} in "
                  f"{fmt_seconds(stats['capture_seconds'])} (part of the load time)")
        texts, prompts, max_tokens = build_requests(llm, args)
        params = [SamplingParams(temperature=args.temperature, max_tokens=m) for m in max_tokens]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall_s = time.perf_counter() - t0  # with overlap, one step may still be in flight: close() processes it
    print_completions(texts, outputs, show)

    events = llm.engine.tracer.events
    share = hidden_host_share(events)
    times = step_times(events)
    cfg = llm.engine.config
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    speeds = [s for o in outputs if (s := o.metrics.decode_tokens_per_s) is not None]
    decode = statistics.fmean(speeds) if speeds else 0.0
    host_ms = 1000 * (times["schedule"] + times["process"])
    print(f"\nsummary (m6, {label}; max_num_seqs={cfg.max_num_seqs}, "
          f"{'eager' if not stats['captured_sizes'] else 'captured sizes ' + str(stats['captured_sizes'])}):")
    print(f"  requests:          {len(outputs)}")
    print(f"  wall time:         {fmt_seconds(wall_s)} (plus {fmt_seconds(load_s)} to load the model)")
    print(f"  output tokens:     {num_out} ({num_out / wall_s:.1f} tokens/s)")
    print(f"  decode speed:      {decode:.1f} tokens/s per request (mean over requests, first token to last)")
    print(f"  engine steps:      {times['forwards']} forward passes")
    print(f"  per step (mean):   schedule {1000 * times['schedule']:.2f} ms, forward {1000 * times['forward']:.2f} ms, "
          f"process {1000 * times['process']:.2f} ms")
    print(f"  hidden host share: {100 * share:.0f}% of the host's schedule + process time ran while a forward "
          "computed" + ("" if async_scheduling else " (none can: the host waits for every step)"))
    if args.trace is not None:
        print(f"  trace:             {trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    result = {"async": async_scheduling, "wall_s": wall_s, "tokens_per_s": num_out / wall_s, "decode": decode,
              "steps": times["forwards"], "host_ms": host_ms, "forward_ms": 1000 * times["forward"],
              "hidden_share": share, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    del llm, outputs
    gc.collect()  # give the KV pool back before the next engine allocates its own
    return result


def compare(overlap: dict, sync: dict, greedy: bool) -> None:
    print("\ncomparison (the same requests, one engine each):")
    print(f"  {'':32}{'overlap':>12}{'sync':>12}")
    for name, key, fmt in [("wall time", "wall_s", fmt_seconds),
                           ("output tokens/s", "tokens_per_s", "{:.1f}".format),
                           ("decode tokens/s per request", "decode", "{:.1f}".format),
                           ("forward passes", "steps", str),
                           ("host ms per step", "host_ms", "{:.2f}".format),
                           ("forward ms per step", "forward_ms", "{:.2f}".format),
                           ("hidden host share", "hidden_share", lambda x: f"{100 * x:.0f}%")]:
        print(f"  {name:32}{fmt(overlap[key]):>12}{fmt(sync[key]):>12}")
    if sync["tokens_per_s"]:
        print(f"  output tokens/s, overlap / sync: {overlap['tokens_per_s'] / sync['tokens_per_s']:.2f}x")
    same = [a == b for a, b in zip(overlap["tokens"], sync["tokens"], strict=True)]
    if not greedy:
        print(f"  outputs: {sum(same)} of {len(same)} identical (sampling with temperature > 0 need not repeat itself)")
    elif all(same):
        print(f"  outputs: identical, token for token, for all {len(same)} requests (greedy)")
    else:
        bad = [str(i) for i, s in enumerate(same) if not s]
        print(f"  outputs: requests {', '.join(bad)} differ; overlap must not change a greedy token: "
              "this is a bug worth reporting")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trace is not None and not args.trace.parent.is_dir():
        print(f"error: --trace {args.trace}: the folder {args.trace.parent} does not exist", file=sys.stderr)
        return 2
    from milestones.m6 import LLM, SamplingParams
    from milestones.trace import hidden_host_share

    try:
        with tempfile.TemporaryDirectory(prefix="m6-trace-") as scratch:
            first = run(LLM, SamplingParams, hidden_host_share, args, args.async_scheduling, args.show,
                        trace_path(args, args.async_scheduling, Path(scratch)))
            if args.compare:  # the texts are compared token for token below, so they are not printed again
                other = not args.async_scheduling
                second = run(LLM, SamplingParams, hidden_host_share, args, other, 0,
                             trace_path(args, other, Path(scratch)))
                overlap, sync = (first, second) if first["async"] else (second, first)
                compare(overlap, sync, args.temperature == 0)
            else:
                print(f"\n(--compare runs the same requests again {'without' if first['async'] else 'with'} "
                      "overlap; --trace FILE keeps the timeline)")
    except ValueError as err:  # a bad option, or a prompt + max_tokens that does not fit
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
