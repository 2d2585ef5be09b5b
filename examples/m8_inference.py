"""Milestone 8 demo: tensor parallelism, every layer split over several processes (ranks).

    python examples/m8_inference.py                              # 3 ranks (SmolLM2's 9 heads and 3 KV heads split)
    python examples/m8_inference.py --compare                    # then m7 in one process: the same tokens?
    python examples/m8_inference.py --tensor-parallel-size 1     # one rank: m7 exactly
    torchrun --nproc-per-node 2 examples/m8_inference.py --model MODEL --tensor-parallel-size 2

``LLM(tensor_parallel_size=N)`` makes this process rank 0 and spawns N - 1 worker
processes. Each rank loads only its shard of every layer (its attention heads, its part of
the MLP's width and of the vocabulary) and computes it; the ranks add up their partial
sums twice a layer (an all-reduce: gloo on a CPU, NCCL on GPUs). Rank 0 alone schedules
and samples. The script prints what each rank holds and how fast the tokens came;
``--compare`` runs the same requests through m7 (one process, the whole model) and checks
the tokens. Under ``torchrun`` every rank runs this script, the ranks after 0 serve steps
inside ``LLM(...)``, and only rank 0 gets past it. The workers are spawned: they import
this script, which therefore makes its LLM under ``if __name__ == "__main__":``.

On a CPU the ranks share the cores and meet over gloo dozens of times a step, each meeting
a millisecond or more: several ranks are slower than one. The lesson pays on GPUs, where
each one reads only its shard of the weights and an all-reduce over NVLink takes
microseconds.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import DEFAULT_CHAT_PROMPTS, HelpFormatter, fmt_bytes, fmt_seconds, pick_threads
from m2_inference import add_arguments, build_requests, engine_kwargs, print_completions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate with milestone 8 (tensor parallelism: every rank, a process, holds a shard of each "
                    "layer) and report what each rank holds and how fast the tokens came.",
        epilog="Examples: `%(prog)s --compare`, `%(prog)s --tensor-parallel-size 1`, "
               "`torchrun --nproc-per-node 2 %(prog)s --model MODEL --tensor-parallel-size 2` (a model whose heads "
               "split in two).",
        formatter_class=HelpFormatter,
    )
    add_arguments(p, prompts="three short chat questions")
    p.set_defaults(max_tokens=48)
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="ranks, each a process with a shard of the model (default: under torchrun, its number of "
                        "processes; on CUDA the GPU count if the model splits into it, else 1; on a CPU 3 if the "
                        "model splits into 3 (the bundled SmolLM2: 9 heads, 3 KV heads), else 2, else 1)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="capture nothing on CUDA (on a CPU every run is eager by default: gloo's collectives cannot "
                        "be compiled, and the m7 run of --compare is eager too, so that the two compare)")
    g.add_argument("--compare", action="store_true",
                   help="run the same requests again with m7 (one process, the whole model) and compare tokens "
                        "and speed")
    return p.parse_args(argv)


def default_size(model_config, device) -> int:
    """The --tensor-parallel-size when none is given (see its help)."""
    from milestones.options import check_tensor_parallel
    from milestones.runtime.torchrun import torchrun_world_size

    if (world_size := torchrun_world_size()) is not None:
        return world_size
    import torch

    for size in [torch.cuda.device_count()] if device.type == "cuda" else [3, 2]:
        try:
            check_tensor_parallel(size, model_config, device)
            return size
        except ValueError:
            continue
    return 1


def weight_bytes(model_config, size: int, dtype) -> list[int]:
    """The weight bytes each of ``size`` ranks holds, counted as on a loaded model, on a model built on the meta
    device (no memory, no checkpoint): rank r's parameters are those of ``CausalLM(..., TensorParallel(r, size))``."""
    import torch

    from milestones.m8.distributed import TensorParallel
    from milestones.m8.model import CausalLM

    element_size = torch.empty((), dtype=dtype).element_size()
    counts = []
    for rank in range(size):
        with torch.device("meta"):
            model = CausalLM(model_config, 1, TensorParallel(rank, size))
        counts.append(sum(p.numel() for p in model.parameters()) * element_size)  # a tied head counts once
    return counts


def held_bytes(model) -> int:
    """The weight bytes a loaded model holds: its parameters and, on a CPU, the copies of its linear layers' weights
    that the platform's kernels packed (``packed_weight``, which replace those parameters; RoPE's tables are not
    weights). Each tensor counted once, as a tied head is."""
    import torch

    tensors = {id(t): t for t in model.parameters()}
    for module in model.modules():
        if isinstance(packed := getattr(module, "packed_weight", None), torch.Tensor):
            tensors[id(packed)] = packed
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run(milestone, args, size: int | None, show: int, threads: int) -> dict:
    """Load an engine (m8 with ``size`` ranks, or m7 for None), run every request, print what happened."""
    import torch

    torch.set_num_threads(threads)  # the ranks of an earlier m8 engine took their share of the cores
    kwargs = engine_kwargs(args) | {"enforce_eager": args.eager}
    if size is not None:
        kwargs["tensor_parallel_size"] = size
    t0 = time.perf_counter()
    llm = milestone.LLM(args.model, device=args.device, dtype=args.dtype, **kwargs)  # torchrun: ranks > 0 stay here
    load_s = time.perf_counter() - t0
    label = "m7, one process" if size is None else f"m8, {size} rank{'s' if size > 1 else ''}"
    cfg = llm.engine.config
    print(f"\n=== {label} ===")
    where = f"{cfg.device} ({str(cfg.dtype).replace('torch.', '')}"
    threads = torch.get_num_threads()
    each = " per process" if size and size > 1 else ""
    where += f", {threads} torch thread{'s' if threads > 1 else ''}{each})" if cfg.device.type == "cpu" else ")"
    print(f"loaded {args.model or 'the bundled SmolLM2-135M-Instruct'} on {where} in {fmt_seconds(load_s)}")
    with llm:
        texts, prompts, max_tokens = build_requests(llm, args, default_prompts=DEFAULT_CHAT_PROMPTS)
        # with --compare each token's two likeliest: where m8's tokens part from m7's, how close a call it was
        params = [milestone.SamplingParams(temperature=args.temperature, max_tokens=m,
                                           logprobs=2 if args.compare else None) for m in max_tokens]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall_s = time.perf_counter() - t0
        runner = llm.engine.runner
        rank0_bytes = held_bytes(runner.model)
        kv_bytes = runner.k_cache.numel() * runner.k_cache.element_size() * 2
        kv_heads = runner.k_cache.shape[1]
    print_completions(texts, outputs, show)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\nsummary ({label}; max_num_seqs={cfg.max_num_seqs}, {'eager' if cfg.enforce_eager else 'captured'}):")
    print(f"  requests:        {len(outputs)}")
    print(f"  wall time:       {fmt_seconds(wall_s)} (plus {fmt_seconds(load_s)} to load the model)")
    print(f"  output tokens:   {num_out} ({num_out / wall_s:.1f} tokens/s)")
    if size == 1:
        print(f"  weights:         {fmt_bytes(rank0_bytes)}, all in the one rank (m7 exactly; "
              "--tensor-parallel-size N splits them)")
    elif size is not None:
        per_rank = weight_bytes(llm.engine.model_config, size, cfg.dtype)
        whole = weight_bytes(llm.engine.model_config, 1, cfg.dtype)[0]
        total_kv = llm.engine.model_config.num_kv_heads
        print(f"  weights:         {fmt_bytes(whole)} in one rank; each of {size} holds its shard:")
        for rank, held in enumerate(per_rank):
            how = "its model's parameters, counted on the meta device"
            if rank == 0:  # what the process holds; the same count unless packing for the CPU padded a weight
                held, how = rank0_bytes, "counted on its loaded model" + (
                    "" if rank0_bytes == held else f"; {fmt_bytes(held)} unpacked")
            print(f"    rank {rank}: {fmt_bytes(held)} ({held / whole:.2f} of one rank's; {how})")
        print(f"  KV pool:         {fmt_bytes(kv_bytes)} on each rank, for its {kv_heads} of the model's {total_kv} "
              "KV heads")
    result = {"tokens_per_s": num_out / wall_s, "wall_s": wall_s, "outputs": outputs, "device": cfg.device}
    del llm
    gc.collect()  # give the KV pool back before the next engine allocates its own
    return result


def compare(sharded: dict, whole: dict, size: int) -> None:
    """The m8 run's tokens against m7's, and the two speeds."""
    print(f"\ncomparison (the same requests; m8 in {size} rank{'s' if size > 1 else ''}, m7 in one process):")
    ratio = sharded["tokens_per_s"] / whole["tokens_per_s"]
    print(f"  output tokens/s: {sharded['tokens_per_s']:.1f} with m8, {whole['tokens_per_s']:.1f} with m7: "
          f"{ratio:.2f}x")
    differ = []
    for index, (ours, theirs) in enumerate(zip(sharded["outputs"], whole["outputs"], strict=True)):
        tokens, expected = ours.outputs[0].token_ids, theirs.outputs[0].token_ids
        if tokens == expected:
            continue
        at = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
        note = f"request {index} from token {at} on"
        if at < len(expected) and theirs.outputs[0].logprobs:
            top = sorted(theirs.outputs[0].logprobs[at].values(), key=lambda lp: -lp.logprob)[:2]
            if len(top) == 2:
                note += f" (m7's two likeliest tokens there are {top[0].logprob - top[1].logprob:.2g} nats apart)"
        differ.append(note)
    if not differ:
        print(f"  outputs: identical, token for token, for all {len(whole['outputs'])} requests")
    else:
        print(f"  outputs: {len(whole['outputs']) - len(differ)} of {len(whole['outputs'])} identical; differ: "
              + "; ".join(differ))
        print("  (the ranks add each product's partial sums in another order: a near-tie can flip, and the texts "
              "part from there on; a wide margin would be a bug)")
    if size > 1 and ratio < 1 and sharded["device"].type == "cpu":
        print("  (on a CPU the ranks share the cores and wait for each other at every all-reduce, twice a layer:\n"
              "  several ranks are slower than one; GPUs with NVLink all-reduce in microseconds)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoConfig

    import milestones.m7 as m7
    import milestones.m8 as m8
    from milestones.m8.model import ModelConfig
    from milestones.model_store import resolve_model

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model(args.model)))
        size = args.tensor_parallel_size or default_size(model_config, device)
        args.eager = args.enforce_eager or device.type == "cpu"
        threads, _ = pick_threads(args.threads)
        sharded = run(m8, args, size, args.show, threads)  # under torchrun, only rank 0 returns
        if args.compare:  # the texts are compared token for token below, so they are not printed again
            compare(sharded, run(m7, args, None, 0, threads), size)
        else:
            print("\n(--compare runs the same requests with m7, the whole model in one process, and compares)")
    except ValueError as err:  # a bad option (a size the heads do not split into), or a prompt that does not fit
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # required: each worker rank is spawned, and imports this script
    sys.exit(main())
