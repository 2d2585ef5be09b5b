"""Milestone 4 demo: eight questions behind one long system prompt, its KV computed once and shared.

Run from the repository root:

    python examples/m4_inference.py                       # prefix cache on
    python examples/m4_inference.py --compare             # then again with the cache off, in the same process
    python examples/m4_inference.py --scheduling-policy lpm --num-prompts 24
    python examples/m4_inference.py --system "You are a pirate." --prompt "Where is the treasure?"

Every request starts with the same ~200-token system prompt. Once one request has
computed those tokens' KV blocks, the radix tree keeps them, and a later request whose
prompt starts with the same tokens takes the blocks as they are and prefills only the
rest (its ``num_cached_tokens`` says how many it was spared). Requests admitted in the
same step as the first one find nothing cached yet: the blocks go into the tree only
after they have been computed. With greedy sampling the text must not change.

(The bundled model has 135M parameters: its answers show the engine at work, not a
careful reading of the system prompt. Try a larger one with --model.)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import HelpFormatter, fmt_seconds
from m2_inference import add_arguments, build_requests, generate, load, print_completions, print_totals
from m3_inference import add_paging_arguments

from milestones.m4.policies import POLICIES

# Written for this project (~150 words): the long prefix that every request shares.
SYSTEM_PROMPT = """\
You are the help desk assistant of the Harbour Light Museum, a small maritime museum in the old \
lighthouse keeper's cottage on Gull Point. The museum is open from ten in the morning to five in the \
afternoon, Tuesday to Sunday, and it is closed on Mondays. Tickets cost eight euros for adults, four \
euros for students, and nothing for children under twelve. The ground floor shows ship models, sea maps \
and the keeper's weather ledgers from 1890 to 1950. The upper floor has a room about the great lens, \
which visitors can see lit every Friday at dusk. Guided tours in English start at eleven and at three \
and last forty minutes. The café serves fish soup, bread and tea, and the shop sells postcards, books \
and honey from the village. Dogs on a lead are welcome in the garden but not inside. Answer each \
visitor's question briefly and politely, in one or two sentences, using only these facts."""

QUESTIONS = [
    "When is the museum open?",
    "How much does a student ticket cost?",
    "Can I bring my dog?",
    "What can I see on the ground floor?",
    "When can I see the great lens lit?",
    "Are there guided tours in English?",
    "Is there somewhere to eat?",
    "Is the museum open on Mondays?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate for questions that share a long system prompt with milestone 4 (radix prefix cache) "
                    "and show what the cache saved.",
        epilog="Examples: `%(prog)s --compare`, `%(prog)s --scheduling-policy lpm --num-prompts 24`, "
               "`%(prog)s --no-prefix-caching`.",
        formatter_class=HelpFormatter,
    )
    add_arguments(p, prompts="eight questions about the museum that the system prompt describes")
    p.set_defaults(max_tokens=48)
    g = p.add_argument_group("prefix caching")
    g.add_argument("--system", default=SYSTEM_PROMPT, metavar="TEXT",
                   help="the system prompt that every request starts with (default: ~150 words about a museum)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn the prefix cache off (every prompt is computed in full, as in m3)")
    g.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                   help="fcfs: admit in arrival order; lpm: the waiting request with the longest cached prefix first; "
                        "dfs-weight, lof, random: milestones/m4/policies.py (examples/scheduling_policies.py compares "
                        "them)")
    g.add_argument("--compare", action="store_true",
                   help="run the same requests again with the prefix cache off, then compare time, work and text")
    add_paging_arguments(p, "as many as m2 would reserve (max_num_seqs x max_model_len tokens)")
    return p.parse_args(argv)


def run(LLM, SamplingParams, args, enable_prefix_caching: bool, show: int) -> dict:
    """Load an engine with the cache on or off, run every request, print what happened; return the numbers."""
    label = "prefix cache on" if enable_prefix_caching else "prefix cache off"
    print(f"\n=== {label} ===")
    args.enable_prefix_caching = enable_prefix_caching
    llm, load_s = load(LLM, args)
    texts, prompts, max_tokens = build_requests(llm, args, args.system, QUESTIONS)
    shared = _common_prefix_len(prompts)
    block_size = llm.engine.config.block_size
    print(f"{len(prompts)} requests; their prompts start with the same {shared} tokens (the system prompt in the chat "
          f"template): {shared // block_size} full blocks of {block_size} tokens that can be shared")
    outputs, wall_s, watch = generate(llm, SamplingParams, args, prompts, max_tokens)
    notes = [f"{o.num_cached_tokens} prompt tokens from the cache" for o in outputs]
    print_completions(texts, outputs, show, notes)

    cfg = llm.engine.config
    usage = llm.engine.kv_usage()
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_cached = sum(o.num_cached_tokens for o in outputs)
    misses = [i for i, o in enumerate(outputs) if o.num_cached_tokens == 0]
    print(f"\nsummary (m4, {label}; scheduling_policy={cfg.scheduling_policy}, {cfg.num_kv_blocks} blocks of "
          f"{cfg.block_size} tokens, max_num_seqs={cfg.max_num_seqs}, "
          f"max_num_batched_tokens={cfg.max_num_batched_tokens}):")
    print_totals(outputs, wall_s, watch, load_s)
    print(f"  prompt computed:   {num_prompt - num_cached} of {num_prompt} prompt tokens "
          f"({num_cached} taken from the prefix cache)")
    if enable_prefix_caching:
        print(f"  hit rate:          {usage['prefix_hit_rate']:.0%} of the prompt tokens admitted were found "
              "in the cache")
        start = min(o.metrics.first_scheduled_time for o in outputs)
        first_step = [str(i) for i in misses if outputs[i].metrics.first_scheduled_time == start]
        if first_step and len(misses) < len(outputs):
            print(f"                     requests {', '.join(first_step)} were admitted in the first step, before "
                  "anything had been computed, so they found nothing cached")
        print(f"  blocks cached:     {usage['blocks_cached']} blocks stay in the tree after the run, "
              "for whichever request comes next")
    print(f"  preemptions:       {usage['num_preemptions']}")
    result = {"enabled": enable_prefix_caching, "wall_s": wall_s, "computed": num_prompt - num_cached,
              "prompt": num_prompt, "hit_rate": usage["prefix_hit_rate"],
              "ttft": statistics.mean(o.metrics.time_to_first_token for o in outputs),
              "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    del llm, outputs, watch
    gc.collect()  # give the KV pool back before the next engine allocates its own
    return result


def compare(on: dict, off: dict, greedy: bool) -> None:
    print("\ncomparison (the same requests, one engine each):")
    print(f"  {'':26}{'prefix cache on':>18}{'prefix cache off':>18}")
    for name, key, fmt in [("wall time", "wall_s", fmt_seconds), ("mean time to first token", "ttft", fmt_seconds),
                           ("prompt tokens computed", "computed", str),
                           ("prefix hit rate", "hit_rate", "{:.0%}".format)]:
        print(f"  {name:26}{fmt(on[key]):>18}{fmt(off[key]):>18}")
    print(f"  the cache spared {1 - on['computed'] / off['computed']:.0%} of the prefill work "
          f"({off['computed'] - on['computed']} of {off['computed']} prompt tokens)")
    same = [a == b for a, b in zip(on["tokens"], off["tokens"], strict=True)]
    if not greedy:
        print(f"  outputs: {sum(same)} of {len(same)} identical (sampling with temperature > 0 need not repeat itself)")
    elif all(same):
        print(f"  outputs: identical, token for token, for all {len(same)} requests (greedy): reused KV is the same KV")
    else:
        bad = [str(i) for i, s in enumerate(same) if not s]
        print(f"  outputs: requests {', '.join(bad)} differ; with greedy sampling only a floating-point near-tie "
              "between the two runs' batch shapes could explain it")


def _common_prefix_len(prompts: list[list[int]]) -> int:
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], p, strict=False)) if a != b), min(n, len(p)))
    return n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from milestones.m4 import LLM, SamplingParams

    try:
        first = run(LLM, SamplingParams, args, args.enable_prefix_caching, args.show)
        if args.compare:  # the texts are compared token for token below, so they are not printed again
            second = run(LLM, SamplingParams, args, not first["enabled"], show=0)
            on, off = (first, second) if first["enabled"] else (second, first)
            compare(on, off, args.temperature == 0)
        else:
            other = "off" if first["enabled"] else "on"
            print(f"\n(--compare runs the same requests again with the prefix cache {other})")
    except ValueError as err:  # a bad option, or a prompt + max_tokens that does not fit
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
