"""Serving benchmark: requests arrive at a Poisson rate over HTTP; throughput and latency per milestone.

Run from the repository root:

    python examples/serve_benchmark.py                                 # m1, m2, m4, m6 on the bundled model
    python examples/serve_benchmark.py --milestones m2,m4 --rate 2 --num-requests 48
    python examples/serve_benchmark.py --docs     # write docs/assets/benchmarks/serve.{json,png}

For each milestone it starts the OpenAI-compatible server (milestones/server/) in this
process, warms it up, then sends the same seeded workload: chat requests that share a
system prompt (so a prefix cache has something to find), each with its own question and
output length, at exponentially distributed gaps (a Poisson process). Every request is
streamed; the client records when it was sent, when each chunk of text arrived and when
it ended. Reported per milestone: output tokens per second over the whole run, time to
first token (TTFT), the gap between chunks (ITL; a chunk is usually one token) and the
end-to-end latency, as percentiles. Like vLLM's serving benchmark, rows are comparable
inside one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _common  # noqa: F401  (first: makes `milestones` importable from a plain checkout)
import httpx

from milestones.server.app import create_app
from milestones.server.limits import Limits
from milestones.server.listen import running

SYSTEM = ("You are a patient teacher. Answer in plain words, in two or three sentences, and give one example "
          "from everyday life. Never use jargon without explaining it first.")
QUESTIONS = ["Why is the sky blue?", "How does a fridge keep food cold?", "What is a prime number?",
             "Why do we have seasons?", "How do plants make food?", "What makes a rainbow?",
             "Why does ice float?", "How does a bicycle stay upright?", "What is gravity?",
             "Why do cats purr?", "How do vaccines work?", "What is an atom?"]
DOCS_ASSETS = Path(__file__).resolve().parents[1] / "docs" / "assets" / "benchmarks"


@dataclass(slots=True)
class Arrival:
    at: float  # seconds after the start of the run
    question: str
    max_tokens: int


@dataclass(slots=True)
class Timing:
    sent: float
    chunks: list[float] = field(default_factory=list)
    ended: float = 0.0
    completion_tokens: int = 0


def workload(num_requests: int, rate: float, seed: int, max_tokens: tuple[int, int]) -> list[Arrival]:
    rng, now, arrivals = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        arrivals.append(Arrival(now, rng.choice(QUESTIONS), rng.randint(*max_tokens)))
    return arrivals


async def send(client: httpx.AsyncClient, url: str, arrival: Arrival, start: float) -> Timing:
    await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": arrival.question}],
            "max_tokens": arrival.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    timing = Timing(time.perf_counter())
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                timing.completion_tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                timing.chunks.append(time.perf_counter())
    timing.ended = time.perf_counter()
    return timing


async def drive(url: str, arrivals: list[Arrival]) -> tuple[list[Timing], float]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        await send(client, url, Arrival(0.0, QUESTIONS[0], 8), time.perf_counter())  # warm-up, not timed
        start = time.perf_counter()
        timings = await asyncio.gather(*(send(client, url, a, start) for a in arrivals))
    return list(timings), start


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and the mean (NaN for all of them when there is no value, e.g. no gap between chunks)."""
    if not values:
        return dict.fromkeys(("p50", "p90", "p99", "mean"), float("nan"))
    ordered = sorted(values)

    def nearest_rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": statistics.median(ordered), "p90": nearest_rank(0.90), "p99": nearest_rank(0.99),
            "mean": statistics.fmean(ordered)}


def summarise(milestone: str, timings: list[Timing], start: float) -> dict:
    duration = max(t.ended for t in timings) - start
    tokens = sum(t.completion_tokens for t in timings)
    return {
        "milestone": milestone,
        "duration_s": duration,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / duration,
        "requests_per_s": len(timings) / duration,
        "ttft_s": percentiles([t.chunks[0] - t.sent for t in timings if t.chunks]),
        "itl_s": percentiles([b - a for t in timings for a, b in zip(t.chunks, t.chunks[1:])]),
        "e2e_s": percentiles([t.ended - t.sent for t in timings]),
    }


def run_one(milestone: str, args, arrivals: list[Arrival]) -> dict:
    mod = importlib.import_module(f"milestones.{milestone}")
    llm = mod.LLM(args.model, device=args.device)
    with running(create_app(llm, "bench", Limits(max_requests=10_000))) as url:
        timings, start = asyncio.run(drive(url, arrivals))
    return summarise(milestone, timings, start)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["milestone"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, [row["output_tok_per_s"] for row in rows], color="#5c6bc0")
    left.set_ylabel("output tokens / s")
    left.set_title("throughput")
    for offset, key, colour in ((-0.2, "p50", "#26a69a"), (0.2, "p90", "#ef5350")):
        right.bar([i + offset for i in range(len(rows))], [row["ttft_s"][key] for row in rows], width=0.4,
                  label=f"TTFT {key}", color=colour)
    right.set_xticks(range(len(rows)), names)
    right.set_ylabel("seconds")
    right.set_yscale("log")
    right.set_title("time to first token")
    right.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--milestones", default="m1,m2,m4,m6")
    parser.add_argument("--model", help="a checkpoint folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 48), metavar=("LOW", "HIGH"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows to this file")
    parser.add_argument("--docs", action="store_true", help="write docs/assets/benchmarks/serve.json and .png")
    args = parser.parse_args(argv)
    arrivals = workload(args.num_requests, args.rate, args.seed, tuple(args.max_tokens))
    rows = []
    print(f"{args.num_requests} requests at {args.rate}/s (Poisson, seed {args.seed}), "
          f"{args.max_tokens[0]}-{args.max_tokens[1]} output tokens each")
    print(f"{'milestone':10} {'tok/s':>7} {'req/s':>6} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
          f"{'ITL p50':>8} {'p90':>7} {'E2E p50':>8}")
    for milestone in args.milestones.split(","):
        row = run_one(milestone, args, arrivals)
        rows.append(row)
        ttft, itl, e2e = row["ttft_s"], row["itl_s"], row["e2e_s"]
        print(f"{milestone:10} {row['output_tok_per_s']:7.1f} {row['requests_per_s']:6.2f} {ttft['p50']:9.2f} "
              f"{ttft['p90']:7.2f} {ttft['p99']:7.2f} {itl['p50']:8.3f} {itl['p90']:7.3f} {e2e['p50']:8.2f}",
              flush=True)
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "docs")},
              "arrivals": [asdict(a) for a in arrivals], "rows": rows}
    result["settings"]["max_tokens"] = list(args.max_tokens)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.docs:
        (DOCS_ASSETS / "serve.json").write_text(json.dumps(result, indent=1))
        plot(rows, DOCS_ASSETS / "serve.png",
             f"{args.num_requests} chat requests at {args.rate}/s, {args.max_tokens[0]}-{args.max_tokens[1]} "
             "tokens each, streamed over HTTP")
    return 0


if __name__ == "__main__":
    sys.exit(main())
