"""Quick start: the same prompts through m1 (one request at a time) and m2 (continuous batching).

Both engines load the same model and generate exactly 32 greedy tokens for each of the same
eight prompts; the script prints each one's output tokens per second and whether the two chose
the same tokens. Loading and a one-prompt warm-up are not timed. This is one short run: for the
real measurement (more workloads, repeated runs, transformers as a baseline, memory and latency,
JSON and plots) use examples/benchmark.py, described in docs/benchmarks.md.

    python examples/bench_quickstart.py [MODEL]    # MODEL: a model folder; default: the bundled SmolLM2
"""

import sys
import time

from _common import pick_threads  # importing _common also makes `milestones` importable from a plain checkout

from milestones import m1, m2

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "Explain what a CPU does.", "Once upon a time,", "The best way to learn is", "2 + 2 =", "Dear diary,"]
model = sys.argv[1] if len(sys.argv) > 1 else None
threads, _ = pick_threads(None)  # one per idle core: on a busy CPU, torch's default can be several times slower
print(f"torch threads: {threads}")

tokens = {}
for name, milestone in (("m1", m1), ("m2", m2)):
    llm = milestone.LLM(model, max_model_len=256)  # prompts and outputs are short: no need for a longer KV cache
    params = milestone.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)  # greedy, exactly 32 tokens
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # warm-up: first-call costs are not what we compare
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens[name] = [list(out.outputs[0].token_ids) for out in outputs]
    count = sum(len(t) for t in tokens[name])
    print(f"{name}: {count} output tokens in {seconds:.2f} s = {count / seconds:.1f} tokens/s")

same = sum(a == b for a, b in zip(tokens["m1"], tokens["m2"], strict=True))
print(f"same tokens in m1 and m2: {same} of {len(PROMPTS)} prompts")
