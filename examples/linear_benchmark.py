"""Time one linear layer the ways this CPU can run it, at the row counts a serving step has.

    python examples/linear_benchmark.py                  # SmolLM2-135M's shapes, 1 to 256 rows
    python examples/linear_benchmark.py --out docs/assets/benchmarks/linear_layers.json

For each weight shape ([out, in]) and number of rows it times, in one process:

  fp32-cpp      the compiled panel kernel in float32 (linear_backend="cpp", float32's default)
  fp32-onednn   float32 weights packed for oneDNN (linear_backend="onednn")
  fp32-torch    float32 F.linear (linear_backend="torch")
  bf16-torch    bfloat16 F.linear: torch's own bfloat16 product
  bf16-onednn   bfloat16 weights packed for oneDNN, where this CPU has bfloat16 instructions
  bf16-cpp      the compiled panel kernel in bfloat16 (linear_backend="cpp", bfloat16's default without them)

and reports the median of --reps calls after a warm-up. A row that cannot run here
(no oneDNN bfloat16, no compiler) is left out, with the reason.

With --stream-layers N it then reads a whole model's weights the way a decode step does:
the shapes N times over (the layers) and the last shape once more (the head), --stream-rows
rows through each (1: batch-1 decode; 16: a step of 16 requests), in float32 and bfloat16
through the compiled kernel, from ordinary memory and from memory backed by 2 MiB pages
(``milestones/kernels/huge_pages.py``), the rounds interleaved: the median pass, the
bandwidth it reaches and its GFLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _common import HelpFormatter

SHAPES = "1536x576,576x1536,576x576,960x576,49152x576"  # SmolLM2-135M: gate/up, down, o, qkv, the LM head
LAYER_SHAPES = "960x576,576x576,1536x576,1536x576,576x1536,49152x576"  # qkv o gate up down, head


def shape_list(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(out), int(in_)) for out, in_ in (shape.split("x") for shape in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected OUTxIN[,OUTxIN...], got {text!r}") from None


def row_list(text: str) -> list[int]:
    """Comma-separated row counts, each at least 1, e.g. --rows 1,4,16."""
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if min(rows) < 1:
        raise argparse.ArgumentTypeError(f"every row count must be >= 1, got {text!r}")
    return rows


def median_ms(call: Callable[[], object], reps: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--shapes", type=shape_list, default=SHAPES, help="weight shapes OUTxIN, comma-separated")
    p.add_argument("--rows", type=row_list, default="1,4,16,64,256",
                   help="rows per call (tokens in a step), comma-separated")
    p.add_argument("--reps", type=int, default=20, help="timed calls per measurement; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's choice")
    p.add_argument("--stream-layers", type=int, default=0,
                   help="also stream --stream-shapes this many times over, then the last shape once")
    p.add_argument("--stream-rows", type=row_list, default="1",
                   help="rows through each streamed weight, comma-separated")
    p.add_argument("--stream-shapes", type=shape_list, default=LAYER_SHAPES,
                   help="one layer's weights in the order a step reads them, the LM head last")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    rows = args.rows

    import torch
    import torch.nn.functional as F
    from bench.report import machine_info
    from torch import nn

    from milestones.kernels import PackedLinear, onednn_available
    from milestones.kernels.panel_linear import PanelLinear, load_panel_linear

    if args.threads:
        torch.set_num_threads(args.threads)
    skipped = {}
    if not onednn_available(torch.float32):
        skipped["fp32-onednn"] = "this torch build has no oneDNN"
    if not onednn_available(torch.bfloat16):
        skipped["bf16-onednn"] = "oneDNN packs bfloat16 only on a CPU with AVX-512 BF16, AMX or AVX-NE-CONVERT"
    try:
        load_panel_linear()
    except Exception as error:  # no compiler, say
        skipped["fp32-cpp"] = skipped["bf16-cpp"] = f"the kernel did not build: {error}"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; left out: {skipped or 'nothing'}")
    results = []
    torch.manual_seed(0)
    for out_features, in_features in args.shapes:
        fp32 = nn.Linear(in_features, out_features, bias=False)
        bf16 = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
        bf16.weight.data.copy_(fp32.weight.data)
        ways: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype]] = {
            "fp32-torch": (lambda x, w=fp32.weight: F.linear(x, w), torch.float32),
            "bf16-torch": (lambda x, w=bf16.weight: F.linear(x, w), torch.bfloat16),
        }
        if "fp32-onednn" not in skipped:
            ways["fp32-onednn"] = (PackedLinear(fp32), torch.float32)
        if "bf16-onednn" not in skipped:
            ways["bf16-onednn"] = (PackedLinear(bf16), torch.bfloat16)
        if "bf16-cpp" not in skipped:
            ways["fp32-cpp"] = (PanelLinear(fp32), torch.float32)
            ways["bf16-cpp"] = (PanelLinear(bf16), torch.bfloat16)
        for m in rows:
            inputs = {dtype: torch.randn(m, in_features).to(dtype) for dtype in (torch.float32, torch.bfloat16)}
            with torch.inference_mode():
                timings = {name: median_ms(functools.partial(f, inputs[dtype]), args.reps)
                           for name, (f, dtype) in sorted(ways.items())}
            results.append({"out_features": out_features, "in_features": in_features, "rows": m, "ms": timings})
            line = "  ".join(f"{name} {ms:8.3f}" for name, ms in timings.items())
            print(f"{out_features:6d}x{in_features:<5d} rows {m:4d}  ms: {line}", flush=True)
    stream = []
    if args.stream_layers and "fp32-cpp" not in skipped:
        stream = stream_model(args.stream_shapes, args.stream_layers, args.stream_rows, args.reps)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["examples/linear_benchmark.py", *(sys.argv[1:] if argv is None else argv)])
        record = {"command": command, "machine": machine_info(torch.device("cpu")), "left_out": skipped,
                  "results": results, "stream": stream}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def stream_model(shapes: list[tuple[int, int]], layers: int, row_counts: list[int], reps: int) -> list[dict]:
    """One pass over a model's packed weights per row count, from ordinary pages and from 2 MiB pages, interleaved."""
    import torch

    from milestones.kernels.huge_pages import move_to_huge_pages
    from milestones.kernels.panel_linear import pack_weight

    sequence = shapes[:-1] * layers + shapes[-1:]
    op = torch.ops.milestones.panel_linear
    rows = []
    for dtype, name in ((torch.float32, "fp32-cpp"), (torch.bfloat16, "bf16-cpp")):
        ordinary = [pack_weight(torch.randn(out, in_).to(dtype)) for out, in_ in sequence]
        huge, advised = move_to_huge_pages(ordinary)
        num_bytes = sum(w.numel() * w.element_size() for w in ordinary)
        flops_per_row = sum(2 * out * in_ for out, in_ in sequence)
        for m in row_counts:
            inputs = {in_: torch.randn(m, in_).to(dtype) for _, in_ in sequence}

            def one_pass(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor] = inputs) -> None:
                for (out, in_), weight in zip(sequence, weights):
                    op(inputs[in_], weight, None, out)

            times: dict[str, list[float]] = {"4 KiB pages": [], "2 MiB pages": []}
            with torch.inference_mode():
                for _ in range(reps + 1):  # rounds interleaved; the first is a warm-up
                    for pages, weights in (("4 KiB pages", ordinary), ("2 MiB pages", huge)):
                        times[pages].append(median_ms(functools.partial(one_pass, weights), 1))
            for pages, ms in times.items():
                median = statistics.median(ms[1:])
                gb_per_s, gflop_per_s = num_bytes / median / 1e6, flops_per_row * m / median / 1e6
                rows.append({"way": name, "pages": pages, "advised": advised, "rows": m, "calls": len(sequence),
                             "megabytes": num_bytes / 1e6, "ms": median, "gb_per_s": gb_per_s,
                             "gflop_per_s": gflop_per_s})
                print(f"stream {name} {len(sequence)} calls x {m} rows, {num_bytes / 1e6:.0f} MB from {pages}: "
                      f"{median:7.2f} ms, {gb_per_s:5.1f} GB/s, {gflop_per_s:5.1f} GFLOP/s", flush=True)
        del ordinary, huge
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
