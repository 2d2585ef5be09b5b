"""Milestone 5 demo: the decode step captured once per batch size, then replayed.

Run from the repository root:

    python examples/m5_inference.py                                  # capture (or compile), then generate
    python examples/m5_inference.py --compare                        # then again eagerly, in the same process
    python examples/m5_inference.py --enforce-eager                  # no capture: every step as in m4
    python examples/m5_inference.py --cudagraph-capture-sizes 1,2    # capture only these batch sizes
    python examples/m5_inference.py --piecewise-capture-sizes 64,512 # CUDA: steps with prefill, these token counts

A step in which every running request decodes one token, and whose batch fits a
captured size, is not run operator by operator: its inputs are copied into static
buffers and the captured step is replayed (a CUDA graph on a GPU; on a CPU, code that
torch.compile generated for that batch size). A batch is padded up to the smallest
captured size that holds it. On CUDA a step with a prompt chunk in it is replayed in
pieces, everything but attention, padded to a captured token count; on a CPU it runs
eagerly, as in m4, and so does every step too large for any capture. The summary says
why each eager step was eager. With greedy sampling the text must not change.

On a CPU each captured size is a compilation of about a minute on two cores the first
time; torch.compile keeps what it built on disk, so the next start-up is quicker.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import HelpFormatter, fmt_seconds
from m2_inference import add_arguments, build_requests, load, print_completions


def batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes separated by commas (1,2,4), got {text!r}") from None
    if not sizes:
        raise argparse.ArgumentTypeError("expected at least one batch size")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate for a batch of chat prompts with milestone 5 (the decode step captured per batch size "
                    "and replayed) and show how many steps were replayed, padded or run eagerly.",
        epilog="Examples: `%(prog)s --compare`, `%(prog)s --enforce-eager`, "
               "`%(prog)s --cudagraph-capture-sizes 1,2,4,8 --max-num-seqs 8`.",
        formatter_class=HelpFormatter,
    )
    add_arguments(p)
    # Four at a time: on a CPU the default captured sizes are 1 and 4, so every decode step fits one.
    p.set_defaults(max_num_seqs=4)
    g = p.add_argument_group("capture")
    g.add_argument("--enforce-eager", action="store_true",
                   help="capture nothing: every step runs operator by operator, as in m4")
    g.add_argument("--cudagraph-capture-sizes", type=batch_sizes, default=None, metavar="N,N,...",
                   help="decode batch sizes to capture, each at most --max-num-seqs (default: the engine's: 1, 2, 4, "
                        "8, then every 16 on CUDA; 1 and 4 on a CPU, where each size is a compilation)")
    g.add_argument("--piecewise-capture-sizes", type=batch_sizes, default=None, metavar="N,N,...",
                   help="token counts steps with prefill are captured in pieces for, each at most "
                        "--max-num-batched-tokens (CUDA only; default: 8 to 128 in powers of two, then every 256)")
    g.add_argument("--compare", action="store_true",
                   help="run the same requests again with the other setting (eager, or captured), then compare")
    return p.parse_args(argv)


def run(LLM, SamplingParams, args, enforce_eager: bool, show: int) -> dict:
    """Load an engine that captures or not, run every request, print what happened; return the numbers."""
    label = "eager" if enforce_eager else "captured"
    print(f"\n=== {label} ===")
    args.enforce_eager = enforce_eager
    llm, load_s = load(LLM, args)
    stats = llm.engine.graph_stats()
    if stats["captured_sizes"]:
        print(f"decode step captured for batch sizes {stats['captured_sizes']} in "
              f"{fmt_seconds(stats['capture_seconds'])} (part of the load time)")
    elif not enforce_eager:
        print("nothing captured (see the warning above): every step runs eagerly")
    texts, prompts, max_tokens = build_requests(llm, args)
    steps_before = llm.engine.num_steps
    params = [SamplingParams(temperature=args.temperature, max_tokens=m) for m in max_tokens]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)  # unwatched (no EngineWatch): host time per step is what m5 cuts
    wall_s = time.perf_counter() - t0
    print_completions(texts, outputs, show)

    stats = llm.engine.graph_stats()
    cfg = llm.engine.config
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    speeds = [s for o in outputs if (s := o.metrics.decode_tokens_per_s) is not None]
    decode = sum(speeds) / len(speeds) if speeds else 0.0
    steps = llm.engine.num_steps - steps_before
    print(f"\nsummary (m5, {label}; max_num_seqs={cfg.max_num_seqs}, "
          f"captured sizes {stats['captured_sizes'] or 'none'}):")
    print(f"  requests:          {len(outputs)}")
    print(f"  wall time:         {fmt_seconds(wall_s)} (plus {fmt_seconds(load_s)} to load the model, "
          f"{fmt_seconds(stats['capture_seconds'])} of it capturing)")
    print(f"  output tokens:     {num_out} ({num_out / wall_s:.1f} tokens/s)")
    print(f"  decode speed:      {decode:.1f} tokens/s per request (mean over requests, first token to last)")
    print(f"  engine steps:      {steps}: {stats['replays']} replayed, {stats['piecewise_replays']} replayed in "
          f"pieces, {stats['eager_steps']} eager")
    for reason, count in stats["eager_reasons"].items():
        print(f"    eager, {count:>4}:  {reason}")
    print(f"  padded rows:       {stats['padded_rows']} (rows added to reach a captured size; they write only "
          "the scratch block)")
    result = {"eager": enforce_eager, "wall_s": wall_s, "tokens_per_s": num_out / wall_s, "decode": decode,
              "replays": stats["replays"], "eager_steps": stats["eager_steps"],
              "capture_s": stats["capture_seconds"], "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    del llm, outputs
    gc.collect()  # give the KV pool back before the next engine allocates its own
    return result


def compare(captured: dict, eager: dict, greedy: bool) -> None:
    print("\ncomparison (the same requests, one engine each):")
    print(f"  {'':28}{'captured':>14}{'eager':>14}")
    for name, key, fmt in [("capture time", "capture_s", fmt_seconds), ("wall time", "wall_s", fmt_seconds),
                           ("output tokens/s", "tokens_per_s", "{:.1f}".format),
                           ("decode tokens/s per request", "decode", "{:.1f}".format),
                           ("steps replayed", "replays", str), ("steps run eagerly", "eager_steps", str)]:
        print(f"  {name:28}{fmt(captured[key]):>14}{fmt(eager[key]):>14}")
    if eager["decode"]:
        print(f"  decode speed, captured / eager: {captured['decode'] / eager['decode']:.2f}x")
    same = [a == b for a, b in zip(captured["tokens"], eager["tokens"], strict=True)]
    if not greedy:
        print(f"  outputs: {sum(same)} of {len(same)} identical (sampling with temperature > 0 need not repeat itself)")
    elif all(same):
        print(f"  outputs: identical, token for token, for all {len(same)} requests (greedy)")
    else:
        bad = [str(i) for i, s in enumerate(same) if not s]
        print(f"  outputs: requests {', '.join(bad)} differ; with greedy sampling only a floating-point near-tie "
              "(the compiled step sums in another order) could explain it")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from milestones.m5 import LLM, SamplingParams

    try:
        first = run(LLM, SamplingParams, args, args.enforce_eager, args.show)
        if args.compare:  # the texts are compared token for token below, so they are not printed again
            second = run(LLM, SamplingParams, args, not first["eager"], show=0)
            captured, eager = (second, first) if first["eager"] else (first, second)
            compare(captured, eager, args.temperature == 0)
        else:
            print(f"\n(--compare runs the same requests again {'captured' if first['eager'] else 'eagerly'})")
    except ValueError as err:  # a bad option, or a prompt + max_tokens that does not fit
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
