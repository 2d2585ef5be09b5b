"""Milestone 2 demo: many requests batched into one engine, with continuous batching.

Run from the repository root (``make demo`` runs it with no flags):

    python examples/m2_inference.py                       # eight varied chat questions, bundled model
    python examples/m2_inference.py --num-prompts 32      # cycle them (with varied max_tokens): more batching
    python examples/m2_inference.py --max-num-seqs 2      # at most two requests at once: more steps
    python examples/m2_inference.py --prompt "Tell me a joke" --prompt "Name a colour" --temperature 0.8

Every request is queued at once; each engine step runs one forward pass over every
running request (a new token for those decoding, a chunk of prompt for the others),
and a request that finishes frees its place for the next one at once. The summary
shows what that buys over m1 (fewer forward passes than tokens) and what it costs:
m2 reserves a KV slot of ``max_model_len`` tokens per running request up front, most
of it never filled (milestone 3 fixes that).
"""

from __future__ import annotations

import argparse
import random
import sys
import textwrap
import time

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import DEMO_PROMPTS, EngineWatch, HelpFormatter, chat_token_ids, fmt_bytes, fmt_seconds, pick_threads

DEFAULT_MAX_MODEL_LEN = 1024  # each running request reserves KV for this many tokens: keep it modest


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser, prompts: str = "eight built-in questions of different kinds") -> None:
    """The flags shared by the m2 to m5 demos."""
    p.add_argument("--model", default=None,
                   help="local folder in Hugging Face format or a hub id; default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help=f"a user message; repeat the flag for several (default: {prompts})")
    p.add_argument("--num-prompts", type=_non_negative_int, default=None,
                   help="run this many requests, cycling through the prompts; the repeats get varied max_tokens "
                        "(default: one request per prompt)")
    p.add_argument("--max-tokens", type=int, default=80, help="most tokens to generate per request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (always the most likely token)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the engine (each request's sampling) and the varied max_tokens")
    p.add_argument("--device", default=None, help="cpu or cuda; default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and activations; default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help="longest prompt + output")
    p.add_argument("--max-num-seqs", type=int, default=8, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens computed in one step (decodes + prefill chunks); default: the engine's (512)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads; default: one per idle core (torch's own choice on an idle machine)")
    p.add_argument("--show", type=_non_negative_int, default=8,
                   help="print the completions of this many requests (0: none)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate for a batch of chat prompts with milestone 2 (continuous batching, chunked prefill) "
                    "and print what the engine did.",
        epilog="Examples: `%(prog)s --num-prompts 32`, `%(prog)s --max-num-seqs 2`, "
               "`%(prog)s --max-num-batched-tokens 16` (prompts are prefilled in chunks of 16 tokens).",
        formatter_class=HelpFormatter,
    )
    add_arguments(p)
    return p.parse_args(argv)


def build_requests(llm, args, system: str | None = None, default_prompts: list[str] | None = None):
    """The user messages, their chat-templated token ids (after ``system``, if any) and each request's max_tokens."""
    base = args.prompt or default_prompts or [text for _, text in DEMO_PROMPTS]
    n = args.num_prompts or len(base)
    rng = random.Random(args.seed)
    texts = [base[i % len(base)] for i in range(n)]
    # The first round uses --max-tokens; repeats vary, so that copies of a prompt do not finish in step.
    max_tokens = [args.max_tokens if i < len(base) else rng.randint(max(1, args.max_tokens // 4), args.max_tokens)
                  for i in range(n)]
    ids = {text: chat_token_ids(llm.tokenizer, text, system) for text in set(texts)}
    return texts, [ids[t] for t in texts], max_tokens


def engine_kwargs(args) -> dict:
    """LLM keyword arguments for the engine options the user set (the rest keep the engine's defaults)."""
    kwargs = {"seed": args.seed, "max_model_len": args.max_model_len}
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                 "enable_prefix_caching", "scheduling_policy", "enforce_eager", "cudagraph_capture_sizes",
                 "piecewise_capture_sizes"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "kv_cache_memory_mb", None) is not None:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_memory_mb * 2**20)
    return kwargs


def load(LLM, args):
    """Set the threads, load the model and print one line about it."""
    threads, why = pick_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, **engine_kwargs(args))
    load_s = time.perf_counter() - t0
    cfg = llm.engine.config
    where = f"{cfg.device} ({str(cfg.dtype).replace('torch.', '')}"
    where += f", {threads} torch thread{'s' if threads > 1 else ''}: {why})" if cfg.device.type == "cpu" else ")"
    print(f"loaded {args.model or 'the bundled SmolLM2-135M-Instruct'} on {where} in {fmt_seconds(load_s)}")
    return llm, load_s


def generate(llm, SamplingParams, args, prompts, max_tokens):
    """Queue every request at once and run the engine until all are done; return outputs, wall time, watch."""
    params = [SamplingParams(temperature=args.temperature, max_tokens=m) for m in max_tokens]
    watch = EngineWatch(llm.engine)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)  # a progress bar on stderr when there are several prompts
    return outputs, time.perf_counter() - t0, watch


def print_completions(texts, outputs, show: int, notes: list[str] | None = None) -> None:
    """Each prompt and completion (continuation lines indented), then a line of numbers and any note."""
    for i, (text, out) in enumerate(zip(texts[:show], outputs[:show], strict=True)):
        completion = out.outputs[0]
        body = textwrap.indent(completion.text.strip(), " " * 4).lstrip()
        note = f"; {notes[i]}" if notes and notes[i] else ""
        print(f"\n[{i}] prompt: {text}")
        print(f"[{i}] completion: {body}")
        print(f"[{i}] {len(out.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
              f"finish reason: {completion.finish_reason}, "
              f"time to first token {fmt_seconds(out.metrics.time_to_first_token)}{note}")
    if 0 < show < len(outputs):
        print(f"\n... and {len(outputs) - show} more requests (--show N prints more)")


def print_totals(outputs, wall_s: float, watch, load_s: float) -> None:
    """The lines every batched demo prints: tokens, time, steps, batch size."""
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"  requests:          {len(outputs)}")
    print(f"  wall time:         {fmt_seconds(wall_s)} (plus {fmt_seconds(load_s)} to load the model)")
    print(f"  prompt tokens:     {num_prompt}")
    print(f"  output tokens:     {num_out}")
    print(f"  output tokens/s:   {num_out / wall_s:.1f}")
    print(f"  engine steps:      {watch.steps} forward passes (m1, one request at a time, would need {num_out}: "
          "one per generated token)")
    print(f"  largest batch:     {watch.max_batch} request{'s' if watch.max_batch != 1 else ''} in one step")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from milestones.m2 import LLM, SamplingParams

    try:
        llm, load_s = load(LLM, args)
        texts, prompts, max_tokens = build_requests(llm, args)
        outputs, wall_s, watch = generate(llm, SamplingParams, args, prompts, max_tokens)
    except ValueError as err:  # a bad option, or a prompt + max_tokens longer than max_model_len
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_completions(texts, outputs, args.show)

    cfg = llm.engine.config
    print(f"\nsummary (m2: continuous batching; max_num_seqs={cfg.max_num_seqs}, "
          f"max_num_batched_tokens={cfg.max_num_batched_tokens}, max_model_len={cfg.max_model_len}):")
    print_totals(outputs, wall_s, watch, load_s)
    reserved, peak = watch.high["reserved_bytes"], watch.high["used_bytes"]
    print(f"  KV cache:          {fmt_bytes(reserved)} reserved, at most {fmt_bytes(peak)} used "
          f"({100 * peak / reserved:.1f}%): each of the {cfg.max_num_seqs} slots holds {cfg.max_model_len} tokens, "
          "filled or not (m3 pages it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
