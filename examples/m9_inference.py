"""Milestone 9 demo: prefill/decode disaggregation, prompts computed on one worker and decoded on another.

    python examples/m9_inference.py                                  # a prefill worker and a decode worker
    python examples/m9_inference.py --compare                        # then m8 in one engine: the same tokens?
    python examples/m9_inference.py --prefill-workers 2 --decode-workers 1 --router-policy round_robin
    python examples/m9_inference.py --prefill-workers 0 --decode-workers 0   # no workers: m8 exactly

``LLM(num_prefill_workers=P, num_decode_workers=D)`` makes this process the router and spawns
P + D worker processes, each with m8's engine in a role and a KV pool of its own. The router
sends each request to a prefill worker (``--router-policy``: the one whose prefix cache
likely holds most of the prompt, or in turn) and to the least loaded decode worker at once;
the decode worker reserves blocks for the prompt, the prefill worker computes the prompt and
its first token, sends the prompt's blocks into the reserved ones (torch.distributed, gloo)
and lets its own go; the decode worker writes them in and decodes from there. The script
prints each worker's side of that hand-shake: the prompt tokens it computed, the transfers,
the bytes moved and the time from a send to the blocks placed, per prompt token moved.
``--compare`` runs the same requests through m8 (one engine) and checks the tokens.

The workers are spawned: they import this script, which therefore makes its LLM under
``if __name__ == "__main__":``. On a CPU the workers share the cores and every prompt's keys
and values are copied between two processes: disaggregated is slower than one engine here.
The lesson pays on GPUs under load, where long prefills no longer stall the decode steps of
the other requests (each kind of step on GPUs of its own), and each role can be scaled alone.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import DEFAULT_CHAT_PROMPTS, HelpFormatter, fmt_bytes, fmt_seconds, pick_threads
from m2_inference import _non_negative_int, add_arguments, build_requests, engine_kwargs, print_completions

ROUTER_POLICIES = ("cache_aware", "round_robin")  # milestones.m9.config's, written out so that --help needs no torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate with milestone 9 (prefill/decode disaggregation: prompts computed on prefill workers, "
                    "decoded on decode workers, each a process, the prompt's keys and values moved between them) "
                    "and report each worker's side of the hand-shake.",
        epilog="Examples: `%(prog)s --compare`, `%(prog)s --prefill-workers 2 --router-policy round_robin`, "
               "`%(prog)s --prefill-workers 0 --decode-workers 0` (one engine: m8 exactly).",
        formatter_class=HelpFormatter,
    )
    add_arguments(p, prompts="three short chat questions")
    p.set_defaults(max_tokens=48)
    g = p.add_argument_group("disaggregation")
    g.add_argument("--prefill-workers", type=_non_negative_int, default=1, metavar="N",
                   help="prefill workers, each a process that computes prompts and their first token (0 with "
                        "--decode-workers 0: one engine, m8 exactly)")
    g.add_argument("--decode-workers", type=_non_negative_int, default=1, metavar="N",
                   help="decode workers, each a process that takes a prompt's keys and values and decodes")
    g.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cache_aware",
                   help="which prefill worker a request goes to: where most of its prompt went before "
                        "(cache_aware), or in turn (round_robin)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="capture nothing on CUDA (on a CPU every run is eager: each worker would compile its own "
                        "captured steps, about a minute each on two cores; the m8 run of --compare is eager too, "
                        "so that the two compare)")
    g.add_argument("--compare", action="store_true",
                   help="run the same requests again with m8 (one engine) and compare tokens and speed")
    return p.parse_args(argv)


def label_of(workers: tuple[int, int] | None, policy: str) -> str:
    if workers is None:
        return "m8, one engine"
    prefill, decode = workers
    if prefill == decode == 0:
        return "m9, no workers: m8's engine"
    return (f"m9, {prefill} prefill worker{'s' if prefill > 1 else ''} + {decode} decode "
            f"worker{'s' if decode > 1 else ''}, router {policy}")


def run(milestone, args, workers: tuple[int, int] | None, show: int, threads: int) -> dict:
    """Load an engine (m9 with ``workers`` = (prefill, decode), or m8 for None), run every request, print it."""
    import torch

    torch.set_num_threads(threads)  # the router gave its share of the cores to an earlier m9 engine's workers
    kwargs = engine_kwargs(args) | {"enforce_eager": args.eager}
    if workers is not None:
        kwargs |= {"num_prefill_workers": workers[0], "num_decode_workers": workers[1],
                   "router_policy": args.router_policy}
    t0 = time.perf_counter()
    llm = milestone.LLM(args.model, device=args.device, dtype=args.dtype, **kwargs)
    load_s = time.perf_counter() - t0
    label = label_of(workers, args.router_policy)
    cfg = llm.engine.config
    disaggregated = hasattr(llm.engine, "disaggregation_stats")
    print(f"\n=== {label} ===")
    where = f"{cfg.device} ({str(cfg.dtype).replace('torch.', '')}"
    if cfg.device.type == "cpu" and disaggregated:
        each = max(1, threads // (workers[0] + workers[1]))  # the router's split of this process's threads
        where += f", {each} torch thread{'s' if each > 1 else ''} per worker)"
    elif cfg.device.type == "cpu":
        where += f", {threads} torch thread{'s' if threads > 1 else ''})"
    else:
        where += ")"
    print(f"loaded {args.model or 'the bundled SmolLM2-135M-Instruct'} on {where} in {fmt_seconds(load_s)}")
    with llm:
        texts, prompts, max_tokens = build_requests(llm, args, default_prompts=DEFAULT_CHAT_PROMPTS)
        params = [milestone.SamplingParams(temperature=args.temperature, max_tokens=m) for m in max_tokens]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall_s = time.perf_counter() - t0
        stats = llm.engine.disaggregation_stats() if disaggregated else None
        processes = [(llm.engine.name(w), p.pid) for w, p in enumerate(llm.engine.workers.processes)] \
            if disaggregated else []
    print_completions(texts, outputs, show)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    print(f"\nsummary ({label}; max_num_seqs={cfg.max_num_seqs}, {'eager' if cfg.enforce_eager else 'captured'}):")
    print(f"  requests:        {len(outputs)}")
    print(f"  wall time:       {fmt_seconds(wall_s)} (plus {fmt_seconds(load_s)} to load the model)")
    print(f"  output tokens:   {num_out} ({num_out / wall_s:.1f} tokens/s)")
    if ttfts:
        print(f"  first token:     {fmt_seconds(sum(ttfts) / len(ttfts))} after arrival, on average")
    if stats is not None:
        print(f"  workers:         {len(processes)} processes besides this one, the router: "
              + ", ".join(f"{name} (pid {pid})" for name, pid in processes))
        print_stats(stats)
    elif workers is not None:
        print("  workers:         none: one engine in this process, m8's (--prefill-workers N --decode-workers N "
              "starts them)")
    result = {"tokens_per_s": num_out / wall_s, "wall_s": wall_s, "outputs": outputs, "device": cfg.device,
              "stats": stats}
    del llm
    gc.collect()  # give the KV pool back before the next engine allocates its own
    return result


def print_stats(stats: dict[str, dict]) -> None:
    """Each worker's side of the hand-shake (``disaggregation_stats()``)."""
    width = max(len(name) for name in stats) + 2
    for name, s in stats.items():
        head = f"    {name + ':':{width}}"
        computed = f"{s['prompt_tokens'] - s['cached_tokens']} prompt tokens computed"
        if name.startswith("prefill"):
            print(f"{head}{computed} ({s['cached_tokens']} more found in its prefix cache); sent "
                  f"{s['transfers']} transfers, {fmt_bytes(s['transfer_bytes'])}")
            continue
        moved, seconds = s["transferred_prompt_tokens"], s["transfer_seconds"]
        print(f"{head}{computed}; received {s['transfers']} transfers, {fmt_bytes(s['transfer_bytes'])}: the keys "
              f"and values of {moved} prompt tokens")
        if moved:
            print(f"    {'':{width}}{fmt_seconds(seconds)} from send to placed, summed over the transfers: "
                  f"{1e3 * seconds / moved:.3f} ms per prompt token moved")


def compare(apart: dict, whole: dict, label: str) -> None:
    """The m9 run's tokens against m8's, and the two speeds."""
    print(f"\ncomparison (the same requests; {label}, m8 in one engine):")
    ratio = apart["tokens_per_s"] / whole["tokens_per_s"]
    print(f"  output tokens/s: {apart['tokens_per_s']:.1f} with m9, {whole['tokens_per_s']:.1f} with m8: "
          f"{ratio:.2f}x")
    differ = []
    for index, (ours, theirs) in enumerate(zip(apart["outputs"], whole["outputs"], strict=True)):
        tokens, expected = ours.outputs[0].token_ids, theirs.outputs[0].token_ids
        if tokens != expected:
            at = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                      min(len(tokens), len(expected)))
            differ.append(f"request {index} from token {at} on")
    if not differ:
        print(f"  outputs: identical, token for token, for all {len(whole['outputs'])} requests")
    else:
        print(f"  outputs: {len(whole['outputs']) - len(differ)} of {len(whole['outputs'])} identical; differ: "
              + "; ".join(differ))
        print("  (the decode worker gets the very keys and values the prefill worker computed and samples each "
              "token by m8's rule and seed: a difference is a bug)")
    if apart["stats"] is not None and ratio < 1 and apart["device"].type == "cpu":
        print("  (on a CPU the workers share the cores, and every prompt's keys and values are copied between two\n"
              "  processes: one engine is faster; disaggregation pays on GPUs under load, where long prefills stop\n"
              "  stalling the other requests' decode steps)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    import milestones.m8 as m8
    import milestones.m9 as m9

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        args.eager = args.enforce_eager or device.type == "cpu"
        threads, _ = pick_threads(args.threads)
        workers = (args.prefill_workers, args.decode_workers)
        apart = run(m9, args, workers, args.show, threads)
        if args.compare:  # the texts are compared token for token below, so they are not printed again
            compare(apart, run(m8, args, None, 0, threads), label_of(workers, args.router_policy))
        else:
            print("\n(--compare runs the same requests with m8, one engine in this process, and compares)")
    except ValueError as err:  # a bad option (a prefill worker without a decode worker), or a prompt that does not fit
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # required: each worker is spawned, and imports this script
    sys.exit(main())
