"""Time one request's decode attention the ways plain torch can write it, as a decode step calls it.

    python examples/attention_benchmark.py
    python examples/attention_benchmark.py --out docs/assets/benchmarks/decode-attention.json

For each dtype it times, in one process, SmolLM2's shapes (9 query heads over 3 key/value
heads of 64) against a cache filled to each context length in turn, as many calls per
length as the model has layers:

  float32-sums   m1's ``decode_attention`` as it is: scores, softmax and sum in float32
  dtype-products the same two batched products in the cache's own dtype (the lessons' form until
                 they summed in float32), the softmax in float32
  sdpa           ``F.scaled_dot_product_attention`` with 4-D inputs and ``enable_gqa``

float32-sums and sdpa take turns over --rounds rounds, then dtype-products runs its rounds (in
bfloat16 torch hands its products to oneDNN, after which the other rows ran more slowly in some
runs). Each row reports the median round's microseconds a call, every round (the JSON), and the
largest difference from a float64 reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import HelpFormatter

from milestones.m1.attention import decode_attention

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q [1, heads, dim], keys, values


def dtype_products(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The products in the cache's dtype, only the softmax in float32."""
    num_kv_heads, _, dim = keys.shape
    scores = torch.bmm(q.view(num_kv_heads, -1, dim), keys.transpose(1, 2)) * dim**-0.5
    return torch.bmm(scores.float().softmax(dim=-1).to(values.dtype), values).view(1, -1, dim)


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """torch's fused attention; a batch of one, so that the CPU's flash kernel takes it."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], enable_gqa=True)
    return out[0].transpose(0, 1)


WAYS: dict[str, Attention] = {"float32-sums": decode_attention, "dtype-products": dtype_products, "sdpa": sdpa}
TAKING_TURNS, LAST = ("float32-sums", "sdpa"), ("dtype-products",)  # oneDNN last: see the docstring


def time_pass(way: Attention, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: range,
              layers: int) -> float:
    """Microseconds a call over every context length, ``layers`` calls each, as decode steps make them."""
    start, calls = time.perf_counter(), 0
    for length in lengths:
        keys, values = k_cache[:length].transpose(0, 1), v_cache[:length].transpose(0, 1)
        for _ in range(layers):
            way(q, keys, values)
            calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--contexts", default="32,160", help="first and last context length, as FIRST,LAST")
    p.add_argument("--layers", type=int, default=30, help="calls per context length (SmolLM2 has 30 layers)")
    p.add_argument("--rounds", type=int, default=5, help="rounds the rows take turns over")
    p.add_argument("--threads", type=int, default=None, help="torch threads; default: torch's choice")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    first, last = (int(n) for n in args.contexts.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, heads, dim, generator=generator).to(dtype)
        k_cache, v_cache = (torch.randn(last, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
        rounds: dict[str, list[float]] = {name: [] for name in WAYS}
        for names in (TAKING_TURNS, LAST):
            for _ in range(args.rounds):
                for name in names:
                    rounds[name].append(time_pass(WAYS[name], q, k_cache, v_cache, range(first, last + 1), args.layers))
        keys, values = k_cache.transpose(0, 1), v_cache.transpose(0, 1)
        truth = sdpa(q.double(), keys.double(), values.double())  # the yardstick: every step in float64
        for name, way in WAYS.items():
            error = (way(q, keys, values).double() - truth).abs().max().item()
            results.append({"dtype": str(dtype).removeprefix("torch."), "way": name,
                            "us_per_call": statistics.median(rounds[name]), "rounds_us": rounds[name],
                            "max_error": error})
            print(f"{results[-1]['dtype']:9} {name:15} {results[-1]['us_per_call']:8.1f} us/call"
                  f"   max error {error:.2e}")
    if args.out:
        command = " ".join(["examples/attention_benchmark.py", *(sys.argv[1:] if argv is None else argv)])
        record = {"command": command, "threads": torch.get_num_threads(), "contexts": [first, last],
                  "layers": args.layers, "rounds": args.rounds, "torch": torch.__version__, "results": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
