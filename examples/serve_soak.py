"""Soak the server: many clients at its capacity for minutes, some killed mid-stream, hostile bodies mixed in.

Run from the repository root:

    python examples/serve_soak.py                          # m4 on the bundled model, 10 minutes, 16 clients
    python examples/serve_soak.py --minutes 1 --model PATH --milestone m6 --clients 8
    python examples/serve_soak.py --out docs/assets/benchmarks/serve-soak.json

It starts the OpenAI-compatible server (milestones/server/) in this process with ``--max-requests``
equal to the engine's ``max_num_seqs`` (the capacity), computes each prompt's greedy answer with
``LLM.generate`` first, then runs ``--clients`` threads until the time is up. Each loops over:
a greedy completion, checked against its answer (batched with the others, so a near-tie may
differ: counted, not fatal); a stream that the client closes after a few chunks (its request must be
aborted); and a hostile body (n above the limit, a body too large, JSON nested too deep, a lone
surrogate, a bad parameter), which must get its 4xx at once. Every 10 s it scrapes ``/metrics``
and reads the process's resident memory. At the end, once idle: KV blocks in use must be 0, the
engine's integrity check must pass, and memory is reported per minute (flat is what a leak-free
server shows once its caches are warm). Exit status 1 on a wrong status code, a lost block or a
failed integrity check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import _common  # noqa: F401  (first: makes `milestones` importable from a plain checkout)
import httpx

from milestones.server.app import create_app
from milestones.server.limits import Limits
from milestones.server.listen import running

PROMPTS = ["The capital of France is", "Count: one, two, three,", "def fibonacci(n):", "Once upon a time",
           "The best way to learn is", "Water boils at", "A list of fruits: apple,", "In 1969, the first"]
MAX_TOKENS = 24
HOSTILE = {  # name -> (body as bytes, the status it must get)
    "n-too-large": (json.dumps({"prompt": "hi", "n": 100_000, "max_tokens": 1}).encode(), 400),
    "body-too-large": (json.dumps({"prompt": "x" * (5 << 20)}).encode(), 413),
    "nested-too-deep": (b"[" * 100_000 + b"]" * 100_000, 400),
    "lone-surrogate": (b'{"prompt": "a \\ud800 b", "max_tokens": 1}', 400),
    "bad-temperature": (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400),
}


def resident_mib() -> float:
    """This process's resident memory (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    def __init__(self, url: str, answers: dict[str, str], seed: int) -> None:
        self.url, self.answers, self.rng_seed = url, answers, seed
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def note(self, key: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if problem is not None and len(self.problems) < 50:
                self.problems.append(problem)

    def client(self, index: int, until: float) -> None:
        rng, http = random.Random(self.rng_seed + index), httpx.Client(timeout=120)
        while time.monotonic() < until:
            kind = rng.choices(["greedy", "killed", "hostile"], weights=[5, 3, 2])[0]
            prompt = rng.choice(PROMPTS)
            try:
                if kind == "greedy":
                    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                    response = http.post(f"{self.url}/v1/completions", json=body)
                    if response.status_code == 503:
                        self.note("busy (503)")
                    elif response.status_code != 200:
                        self.note("wrong status", f"greedy: {response.status_code} {response.text[:200]}")
                    else:
                        same = response.json()["choices"][0]["text"] == self.answers[prompt]
                        self.note("greedy, same text" if same else "greedy, other text (a near-tie in a batch)")
                elif kind == "killed":
                    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
                    with http.stream("POST", f"{self.url}/v1/completions", json=body) as stream:
                        lines = stream.iter_lines()
                        for _ in range(rng.randint(1, 6)):
                            if next(lines, None) is None:
                                break
                    self.note("stream killed" if stream.status_code == 200 else f"stream {stream.status_code}")
                else:
                    name = rng.choice(sorted(HOSTILE))
                    content, status = HOSTILE[name]
                    response = http.post(f"{self.url}/v1/completions", content=content,
                                         headers={"content-type": "application/json"})
                    ok = response.status_code == status
                    self.note(f"hostile {name}" + ("" if ok else ", WRONG STATUS"),
                              None if ok else f"{name}: {response.status_code}, expected {status}")
            except httpx.HTTPError as err:
                self.note("client error", f"{kind}: {err!r}")
        http.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--milestone", default="m4")
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the bundled model)")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the engine's batch: the server's capacity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the summary as JSON")
    args = parser.parse_args(argv)
    mod = importlib.import_module(f"milestones.{args.milestone}")
    llm = mod.LLM(args.model, max_model_len=512, max_num_seqs=args.max_num_seqs)
    params = mod.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    answers = {p: out.outputs[0].text for p, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}
    app = create_app(llm, "soak", limits=Limits(max_requests=args.max_num_seqs))
    samples, began = [], time.monotonic()
    with running(app, shutdown_grace=5) as url:
        soak = Soak(url, answers, args.seed)
        until = began + 60 * args.minutes
        threads = [threading.Thread(target=soak.client, args=(i, until)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            text = httpx.get(f"{url}/metrics", timeout=60).text
            gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(("vllm:num_requests", "vllm:kv_cache_usage_perc"))}
            samples.append({"seconds": round(time.monotonic() - began, 1), "rss_mib": round(resident_mib(), 1),
                            **gauges})
            print(json.dumps(samples[-1]), flush=True)
            time.sleep(10)
        for thread in threads:
            thread.join()
        deadline = time.monotonic() + 60
        while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.1)
        usage = llm.engine.kv_usage()
    llm.engine.check_integrity()
    blocks = usage.get("blocks_in_use", 0)
    per_minute = [s["rss_mib"] for s in samples[::6]]
    summary = {"milestone": args.milestone, "minutes": args.minutes, "clients": args.clients,
               "max_num_seqs": args.max_num_seqs, "counts": dict(sorted(soak.counts.items())),
               "problems": soak.problems, "blocks_in_use_at_end": blocks, "rss_mib_per_minute": per_minute,
               "samples": samples}
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    wrong = [p for p in soak.problems if "expected" in p or p.startswith("greedy:")]
    return 1 if wrong or blocks else 0


if __name__ == "__main__":
    raise SystemExit(main())
