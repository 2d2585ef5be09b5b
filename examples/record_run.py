"""Record a run of any milestone, step by step, for the replay page (milestones/recorder.py).

The workload is the one each chapter's replay shows: --num-requests requests, every --share-every-th behind one
shared prefix of --prefix-len tokens (what m4's tree keeps), the others with prompts of their own, all arriving at
once and decoding --max-tokens tokens each, greedy; --num-kv-blocks small enough (m3 on) and the pool fills up, so
requests are preempted. It writes the recording (``LLM(record_file=...)``) and prints what it holds.

    python examples/record_run.py --milestone m3 --out run.json [--num-kv-blocks 24] [--ngram 3 (m7)] [--overlap (m6)]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
from pathlib import Path

from _common import text_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--milestone", default="m3")
    parser.add_argument("--out", type=Path, required=True, help="the recording's JSON")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=48)
    parser.add_argument("--share-every", type=int, default=2, help="every k-th request starts with the prefix")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="m3 on: the pool's size in blocks")
    parser.add_argument("--ngram", type=int, default=None, metavar="K",
                        help="m7 on: guess K tokens a step by prompt lookup (speculative_config's ngram)")
    parser.add_argument("--overlap", action="store_true",
                        help="m6 on: overlap scheduling, its trace on, so that the recording holds each step's spans")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a Hugging Face folder; default: the bundled SmolLM2-135M")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    mod = importlib.import_module(f"milestones.{args.milestone}")
    accepted = set(mod.EngineConfig.__dataclass_fields__)
    options = {k: v for k, v in {"max_num_seqs": args.max_num_seqs, "num_kv_blocks": args.num_kv_blocks,
                                 "max_num_batched_tokens": args.max_num_batched_tokens}.items()
               if k in accepted and v is not None}
    if args.ngram is not None:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram}
    if args.overlap:
        options.update(async_scheduling=True, trace_file=os.devnull)  # the spans are kept in the recording
    if "enforce_eager" in accepted:
        options["enforce_eager"] = True  # the recording is of the schedule: no capture to wait for
    llm = mod.LLM(args.model, device=args.device, max_model_len=256, seed=args.seed, record_file=str(args.out),
                  **options)
    rng = random.Random(args.seed)
    text = text_token_ids(llm.tokenizer, 4 * args.prefix_len + 200)
    prefix = text[: args.prefix_len]
    prompts = []  # cut from the sample text at random places: prompts of their own, after the prefix or not
    for i in range(args.num_requests):
        start, length = rng.randrange(args.prefix_len, len(text) - 40), rng.randint(8, 40)
        prompts.append((prefix if i % args.share_every == 0 else []) + text[start : start + length])
    with llm:
        llm.generate(prompts, mod.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                     use_tqdm=False)
    record = json.loads(args.out.read_text())
    steps = record["steps"]
    print(f"{args.milestone}: {len(steps)} steps of {len(record['requests'])} requests, "
          f"{args.out.stat().st_size / 1024:.1f} KB in {args.out}")
    print(f"  largest batch {max(len(s['batch']) for s in steps)} requests, "
          f"{max(sum(entry[2] for entry in s['batch']) for s in steps)} tokens; "
          f"preemptions {steps[-1]['preemptions']}")
    if record["num_blocks"] is not None:
        print(f"  pool: {record['num_blocks']} blocks of {record['block_size']}, fewest free "
              f"{min(s['free'] for s in steps)}")
    if "tree" in steps[-1]:
        print(f"  tree: at most {max(len(s['tree']) for s in steps)} nodes")
    if record["spans"]:
        print(f"  spans: {len(record['spans'])} (schedule, forward, process) over {len(steps)} steps")
    checks = [entry for s in steps for entry in s["batch"] if entry[3]]
    if checks:
        print(f"  guesses checked: {sum(e[3] for e in checks)}, kept: {sum(e[4] for e in checks if len(e) > 4)}")


if __name__ == "__main__":
    main()
