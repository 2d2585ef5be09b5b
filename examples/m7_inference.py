"""Milestone 7 demo: speculative decoding with prompt lookup, on prompts whose answers copy their input.

    python examples/m7_inference.py                          # guess with ngram; print how many guesses were kept
    python examples/m7_inference.py --compare                # then again without guessing (m6), in the same process
    python examples/m7_inference.py --num-speculative-tokens 8 --prompt "Repeat after me: ..."
    python examples/m7_inference.py --draft-layers 8 --compare   # guess with the model's first 8 layers instead

The default prompts ask the model to copy, correct or reformat a text they contain, the
case prompt lookup is made for: the answer repeats the prompt, so the tokens that
followed the latest occurrence of the answer's last few tokens are good guesses. Every
step checks each request's guesses in one forward, a row per guess, and keeps them while
they equal the model's own picks: the text is m6's, token for token, whatever is guessed
(``--compare`` checks it). On a CPU a batch-1 step reads every weight once, whatever the
number of rows, so each kept guess is a token for almost nothing. ``--draft-layers N``
guesses with a draft model instead: the model's own first N layers (a copy made once),
which guesses on any text but costs N layers' worth of a forward pass per guess.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import HelpFormatter, fmt_seconds
from m2_inference import add_arguments, build_requests, load, print_completions

PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, it approved the new "
           "library, postponed the swimming pool, and asked the treasurer to publish the accounts by March.")
GROUNDED_PROMPTS = [
    f"Copy the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this text with every sentence on a line of its own:\n\n{PASSAGE}",
    "Fix the spelling in this sentence and repeat it: The comittee aproved the new libary and postponed the pool.",
    "Repeat this list, one item per line: apples, oranges, pears, plums, cherries, apricots, peaches, grapes.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate with milestone 7 (speculative decoding: guess each request's next tokens by prompt "
                    "lookup, check them all in one forward) and report how many guesses the model kept.",
        epilog="Examples: `%(prog)s --compare`, `%(prog)s --num-speculative-tokens 8`, "
               "`%(prog)s --prompt 'Write a poem'` (nothing to copy: few guesses, little gain).",
        formatter_class=HelpFormatter,
    )
    add_arguments(p, prompts="four prompts that ask to copy or edit a given text")
    p.set_defaults(max_num_seqs=1, max_tokens=64)  # one at a time: where a step costs one read of the weights
    g = p.add_argument_group("speculation")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="the most tokens guessed per step")
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="the shortest run of latest tokens looked up")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="the longest, tried first")
    g.add_argument("--draft-layers", type=int, default=0,
                   help="guess with a draft model made of the model's first this many layers (0: prompt lookup)")
    g.add_argument("--compare", action="store_true",
                   help="run the same requests again without speculation (m7 is then m6) and compare")
    return p.parse_args(argv)


def run(LLM, SamplingParams, args, speculative_config: dict | None, show: int) -> dict:
    """Load an engine with or without guessing, run every request, print what happened; return the numbers."""
    label = speculative_config["method"] if speculative_config else "no speculation"
    print(f"\n=== {label} ===")
    llm, load_s = load(lambda *a, **kw: LLM(*a, **kw, enforce_eager=True, speculative_config=speculative_config),
                       args)
    with llm:
        texts, prompts, max_tokens = build_requests(llm, args, default_prompts=GROUNDED_PROMPTS)
        params = [SamplingParams(temperature=args.temperature, max_tokens=m) for m in max_tokens]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall_s = time.perf_counter() - t0
        stats = llm.engine.spec_stats()
    print_completions(texts, outputs, show)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\nsummary (m7, {label}; max_num_seqs={llm.engine.config.max_num_seqs}):")
    print(f"  requests:        {len(outputs)}")
    print(f"  wall time:       {fmt_seconds(wall_s)} (plus {fmt_seconds(load_s)} to load the model)")
    print(f"  output tokens:   {num_out} ({num_out / wall_s:.1f} tokens/s)")
    if speculative_config:
        print(f"  guesses:         {stats['num_draft_tokens']} made, {stats['num_accepted_tokens']} kept "
              f"(acceptance rate {100 * stats['acceptance_rate']:.0f}%)")
        print(f"  tokens per step: {stats['mean_tokens_per_step']:.2f} on average for a request whose step checked "
              "guesses (1 without)")
        for i, out in enumerate(outputs[:show]):
            m = out.metrics
            print(f"    request {i}: {m.num_accepted_tokens} of {m.num_draft_tokens} guesses kept")
    result = {"tokens_per_s": num_out / wall_s, "wall_s": wall_s,
              "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    del llm, outputs
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from milestones.m7 import LLM, SamplingParams

    speculative_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                          "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    try:
        if args.draft_layers:  # the model's first layers, with its tokenizer: a draft that is often right
            from milestones.model_store import first_layers_copy

            draft = first_layers_copy(args.model, args.draft_layers)
            speculative_config = {"method": "draft_model", "model": str(draft),
                                  "num_speculative_tokens": args.num_speculative_tokens}
        guessing = run(LLM, SamplingParams, args, speculative_config, args.show)
        if args.compare:
            plain = run(LLM, SamplingParams, args, None, 0)
            print("\ncomparison (the same requests, one engine each):")
            print(f"  output tokens/s: {guessing['tokens_per_s']:.1f} with {speculative_config['method']}, "
                  f"{plain['tokens_per_s']:.1f} "
                  f"without: {guessing['tokens_per_s'] / plain['tokens_per_s']:.2f}x")
            same = sum(a == b for a, b in zip(guessing["tokens"], plain["tokens"], strict=True))
            print(f"  outputs: {same} of {len(plain['tokens'])} identical, token for token"
                  + ("" if same == len(plain["tokens"]) else ": speculation must not change a token, a bug"))
        else:
            print("\n(--compare runs the same requests again without speculation)")
    except ValueError as err:  # a bad option, or a prompt + max_tokens that does not fit
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
