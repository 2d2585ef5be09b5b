"""Time the compiled decode-attention kernel on the same contexts with their blocks laid out in the pool three ways.

    python examples/block_layout_benchmark.py
    python examples/block_layout_benchmark.py --out docs/assets/benchmarks/block-layout.json
    python examples/block_layout_benchmark.py --baseline 0148813   # the kernel of a commit beside today's

A decode step of --requests requests, each with --context cached tokens, in SmolLM2's shapes
(9 query heads over 3 key/value heads of 64, blocks of 16), one call per layer over a pool
per layer as the engine keeps it ([kv_heads, blocks, block_size, dim]). Only the block tables
differ, and where the keys and values sit with them: every layout gives the same output (checked):

  contiguous   each request's blocks one after another: m2's slot, or m3 just after prefills
  interleaved  block j of request i is block j * requests + i: what m3's free list hands out
               when the requests grow side by side, a block each in turn
  shuffled     the blocks in a random order

The layouts take turns over --rounds rounds in each dtype; each reports the median round's
milliseconds a step (every layer once) and every round (the JSON). With --baseline REV the
kernel's source at git revision REV is built too, under an op namespace of its own, and takes
its turn after today's in every round: a change to the kernel is timed against the old one in
the same stretch of time, on the same pools (their outputs must be equal, or it raises). With
--huge-pages every pool is also copied into memory that asked Linux for 2 MiB pages (as the
engines' KV caches are, kernels.md) and the copies take their turn beside the 4 KiB ones.
"""

from __future__ import annotations

import argparse
import json
import mmap
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import HelpFormatter
from bench.report import machine_info

from milestones.kernels.build import compile_library
from milestones.kernels.decode_attention import FLAGS, SOURCE, DecodeKernel, load_decode_kernel
from milestones.kernels.huge_pages import move_to_huge_pages

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 9, 3, 64, 16
ROOT = Path(__file__).resolve().parent.parent


def kernel_at(revision: str) -> DecodeKernel:
    """decode_attention.cpp as it was at a git revision, built and registered under an op namespace of its own."""
    path = SOURCE.relative_to(ROOT).as_posix()
    shown = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--baseline {revision}: git cannot show {path} there ({shown.stderr.strip()})")
    namespace = "milestones_at_" + re.sub(r"[^0-9A-Za-z_]", "_", revision)
    text, renamed = re.subn(r"TORCH_LIBRARY(_FRAGMENT|_IMPL)?\(\s*milestones\s*,", rf"TORCH_LIBRARY\1({namespace},",
                            shown.stdout)
    if renamed == 0:
        raise SystemExit(f"--baseline {revision}: its {path} registers no op under 'milestones' to rename")
    with tempfile.TemporaryDirectory(prefix="block-layout-") as folder:  # the build reads the source at once
        source = Path(folder) / SOURCE.name
        source.write_text(text)
        compile_library(source, FLAGS)
    return getattr(torch.ops, namespace).decode_attention.default


def block_tables(requests: int, blocks_each: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Each layout's [requests, blocks_each] table over a pool of requests * blocks_each blocks."""
    order = torch.arange(requests * blocks_each)
    return {
        "contiguous": order.view(requests, blocks_each),
        "interleaved": order.view(blocks_each, requests).T.contiguous(),
        "shuffled": torch.randperm(requests * blocks_each, generator=generator).view(requests, blocks_each),
    }


def placed(blocks: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A pool holding ``blocks`` (request i's block j at i * blocks_each + j) where ``table`` puts each."""
    pool = torch.empty_like(blocks)
    pool[:, :, table.flatten()] = blocks
    return pool


def time_step(kernel: DecodeKernel, q: torch.Tensor, k_pools: torch.Tensor, v_pools: torch.Tensor,
              table: torch.Tensor, context_lens: torch.Tensor) -> float:
    """Milliseconds for one call per layer, each layer with its own pool (as a decode step reads them)."""
    start = time.perf_counter()
    for k_pool, v_pool in zip(k_pools, v_pools):
        kernel(q, k_pool.transpose(0, 1), v_pool.transpose(0, 1), table, context_lens, DIM**-0.5)
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--requests", type=int, default=16, help="requests in the step")
    p.add_argument("--context", type=int, default=300, help="cached tokens of each request")
    p.add_argument("--layers", type=int, default=30, help="calls a step, each over its own pool (SmolLM2 has 30)")
    p.add_argument("--rounds", type=int, default=11, help="rounds the layouts take turns over")
    p.add_argument("--threads", type=int, default=None, help="torch threads; default: torch's choice")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also time the kernel of this git revision, taking turns with today's")
    p.add_argument("--huge-pages", action="store_true",
                   help="also time every layout with its pools in 2 MiB pages, taking turns with 4 KiB ones")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.huge_pages and not hasattr(mmap, "MADV_HUGEPAGE"):
        p.error("--huge-pages asks Linux for 2 MiB pages (madvise): not on this platform")
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = {"this tree": load_decode_kernel()}
    if args.baseline:
        kernels[args.baseline] = kernel_at(args.baseline)
    generator = torch.Generator().manual_seed(0)
    blocks_each = -(-args.context // BLOCK_SIZE)
    tables = block_tables(args.requests, blocks_each, generator)
    context_lens = torch.full((args.requests,), args.context, dtype=torch.long)
    pool_shape = (args.layers, KV_HEADS, args.requests * blocks_each, BLOCK_SIZE, DIM)
    page_kinds = ["4 KiB", "2 MiB"] if args.huge_pages else ["4 KiB"]
    # each layout's kernels and pages side by side
    runs = [(kernel_name, pages, name) for name in tables for pages in page_kinds for kernel_name in kernels]
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(args.requests, HEADS, DIM, generator=generator).to(dtype)
        k_blocks, v_blocks = (torch.randn(pool_shape, generator=generator).to(dtype) for _ in range(2))
        pools = {("4 KiB", name): (placed(k_blocks, table), placed(v_blocks, table)) for name, table in tables.items()}
        del k_blocks, v_blocks  # the pools hold every block: one copy per layout (two with --huge-pages), not more
        for name in tables if args.huge_pages else ():
            copies, advised = move_to_huge_pages(list(pools["4 KiB", name]))
            if not advised:
                raise SystemExit("--huge-pages: Linux refused madvise(MADV_HUGEPAGE) (transparent huge pages off?)")
            pools["2 MiB", name] = tuple(copies)
        outputs = [kernels[kernel_name](q, pools[pages, name][0][0].transpose(0, 1),
                                        pools[pages, name][1][0].transpose(0, 1), tables[name], context_lens, DIM**-0.5)
                   for kernel_name, pages, name in runs]
        if not all(torch.equal(outputs[0], out) for out in outputs):
            raise RuntimeError("the layouts (or the kernels) gave different outputs for the same keys and values")
        rounds: dict[tuple[str, str, str], list[float]] = {run: [] for run in runs}
        for _ in range(args.rounds):
            for kernel_name, pages, name in runs:
                k, v = pools[pages, name]
                rounds[kernel_name, pages, name].append(
                    time_step(kernels[kernel_name], q, k, v, tables[name], context_lens))
        for kernel_name, pages, name in runs:
            base = statistics.median(rounds[kernel_name, pages, "contiguous"])
            median = statistics.median(rounds[kernel_name, pages, name])
            results.append({"dtype": str(dtype).removeprefix("torch."), "kernel": kernel_name, "pages": pages,
                            "layout": name, "ms_per_step": median, "rounds_ms": rounds[kernel_name, pages, name]})
            print(f"{results[-1]['dtype']:9} {kernel_name:10} {pages:6} {name:12} {median:8.2f} ms/step"
                  f"   {median / base:5.2f}x contiguous")
    if args.out:
        command = " ".join(["examples/block_layout_benchmark.py", *(sys.argv[1:] if argv is None else argv)])
        record = {"command": command, "machine": machine_info(torch.device("cpu")),
                  "threads": torch.get_num_threads(), "requests": args.requests,
                  "context": args.context, "layers": args.layers, "rounds": args.rounds, "baseline": args.baseline,
                  "huge_pages": args.huge_pages, "torch": torch.__version__,
                  "results": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
