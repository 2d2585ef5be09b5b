"""Milestone 1 demo: generate with the single-request engine and show where the time goes.

Run from the repository root:

    python examples/m1_inference.py                       # three chat questions, bundled model
    python examples/m1_inference.py --stream              # print tokens as they are generated
    python examples/m1_inference.py --prompt "Tell me a joke" --temperature 0.8 --seed 1
    python examples/m1_inference.py --no-chat --prompt "The capital of France is"

m1 runs requests one at a time (prefill the prompt in one forward pass, then one
forward pass per generated token), so the per-request numbers printed at the end are
the baseline that the later milestones improve on.
"""

from __future__ import annotations

import argparse
import sys
import time

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import DEFAULT_CHAT_PROMPTS, HelpFormatter, fmt_seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate text with milestone 1 (single request, contiguous KV cache) and print timings.",
        epilog="Examples: `%(prog)s --stream`, `%(prog)s --prompt 'Why is the sea salty?' --max-tokens 100`, "
        "`%(prog)s --model Qwen/Qwen2.5-0.5B-Instruct` (a hub id needs network access).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default=None,
                   help="local folder in Hugging Face format or a hub id; default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt; repeat the flag for several (default: three short chat questions)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt as a user message with the tokenizer's chat template "
                        "(use --no-chat for raw completion)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (always the most likely token)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens with this much probability")
    p.add_argument("--top-k", type=int, default=-1, help="keep only the k most likely tokens; -1 keeps all")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (the same seed gives the same text)")
    p.add_argument("--device", default=None, help="cpu or cuda; default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and activations; default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output; default: the model's own limit")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads; default: torch's choice (on a busy machine, 1 is often much faster)")
    p.add_argument("--stream", action="store_true",
                   help="print tokens as they arrive, using the engine level (add_request, then step() in a loop)")
    return p.parse_args(argv)


def build_prompts(llm, args) -> list[list[int]]:
    """Token ids for each prompt, wrapped in the chat template when --chat is on (what ``LLM.chat`` does)."""
    texts = args.prompt or DEFAULT_CHAT_PROMPTS
    tokenizer = llm.tokenizer
    if not args.chat:
        return [tokenizer.encode(t) for t in texts]
    out = []
    for text in texts:
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        out.append(tokenizer.encode(templated, add_special_tokens=False))
    return out


def run_streaming(llm, prompts, params, texts) -> list:
    """The engine level: queue one request, then call step() and print what is new each time."""
    engine = llm.engine
    results = []
    for i, (prompt_ids, text) in enumerate(zip(prompts, texts, strict=True)):
        print(f"\n[{i}] prompt: {text}\n[{i}] completion: ", end="", flush=True)
        request_id = engine.add_request(prompt_ids, params)
        printed = 0
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():  # the outputs that changed; their text is cumulative
                if out.request_id != request_id:
                    continue
                new_text = out.outputs[0].text
                print(new_text[printed:], end="", flush=True)
                printed = len(new_text)
                if out.finished:
                    final = out
        print(f"\n[{i}] finish reason: {final.outputs[0].finish_reason}")
        results.append(final)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from milestones.m1 import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    kwargs = {"seed": args.seed}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    llm = LLM(args.model, device=args.device, dtype=args.dtype, **kwargs)
    load_s = time.perf_counter() - t0
    cfg = llm.engine.config
    print(f"loaded {args.model or 'the bundled SmolLM2-135M-Instruct'} on {cfg.device} "
          f"({str(cfg.dtype).replace('torch.', '')}) in {fmt_seconds(load_s)}")

    texts = args.prompt or DEFAULT_CHAT_PROMPTS
    prompts = build_prompts(llm, args)
    t1 = time.perf_counter()
    try:
        if args.stream:
            outputs = run_streaming(llm, prompts, params, texts)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for i, (text, out) in enumerate(zip(texts, outputs, strict=True)):
                print(f"\n[{i}] prompt: {text}")
                print(f"[{i}] completion: {out.outputs[0].text}")
                print(f"[{i}] finish reason: {out.outputs[0].finish_reason}")
    except ValueError as err:  # e.g. a prompt longer than max_model_len
        print(f"error: {err}", file=sys.stderr)
        return 2
    total_s = time.perf_counter() - t1

    print("\ntimings (m1 runs the requests one after another):")
    print(f"  model load: {fmt_seconds(load_s)}")
    for i, out in enumerate(outputs):
        m = out.metrics
        tps = m.decode_tokens_per_s
        queued = (m.first_scheduled_time or m.arrival_time) - m.arrival_time
        waited = f" ({fmt_seconds(queued)} of it queued behind earlier requests)" if queued >= 0.05 else ""
        print(f"  [{i}] {len(out.prompt_token_ids)} prompt tokens, {m.num_output_tokens} generated; "
              f"time to first token {fmt_seconds(m.time_to_first_token)}{waited}, "
              f"decode {'-' if tps is None else f'{tps:.1f} tokens/s'}")
    num_out = sum(o.metrics.num_output_tokens for o in outputs)
    print(f"  total: {num_out} tokens in {fmt_seconds(total_s)} ({num_out / total_s:.1f} tokens/s over all requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
