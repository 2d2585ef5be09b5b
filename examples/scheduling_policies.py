"""What each scheduling policy computes and how fast, on a workload where the order of admission matters.

The workload ("interleaved prefixes"): --groups groups of --per-group requests, each group's requests behind a
long prefix of their own (--prefix-len random tokens, like a system prompt or a document), each with a short
question of its own; they arrive interleaved, one of every group in turn, all at once. It runs on two pools:

* tight (--tight BLOCKS,SEQS: 36 blocks of 16 tokens, 2 requests at a time): the running requests and about two
  more prefixes. In arrival order (fcfs) the six groups take turns and evict each other's prefixes before they
  come round again; a cache-aware policy (lpm, dfs-weight) admits a group together while its prefix is cached;
* roomy (--roomy: 64 blocks, 4 at a time): every prefix stays cached, and what decides is how many requests of a
  group are admitted before its prefix is computed, each of which computes it again.

For every policy, one engine of milestone 4 (the first with a prefix cache), the same requests, greedy: the prompt
tokens computed (prompt tokens minus those found cached) and their ratio to fcfs's, preemptions, the time to first
token (median and longest: the price of reordering is paid by who waits), the wall time and output tokens per
second; and whether every policy gave fcfs's tokens (a policy orders the work, never changes it).

    python examples/scheduling_policies.py [--out FILE.json] [--markdown FILE.md]

``--markdown`` writes both tables as the snippet the m4 chapter includes (docs/assets/benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)

from milestones import m4
from milestones.m4.policies import POLICIES


def interleaved_prefixes(args) -> list[list[int]]:
    """Each group's prefix, then a question of 4-12 tokens: request i is of group i % groups."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, 49152) for _ in range(args.prefix_len)] for _ in range(args.groups)]
    return [prefixes[i % args.groups] + [rng.randrange(3, 49152) for _ in range(rng.randint(4, 12))]
            for i in range(args.groups * args.per_group)]


def machine() -> str:
    """The CPU's model name and core count (a Linux machine's), or what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        return f"{name}, {os.cpu_count()} cores"
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def pool(text: str) -> tuple[int, int]:
    """'BLOCKS,SEQS' -> (num_kv_blocks, max_num_seqs)."""
    blocks, seqs = (int(part) for part in text.split(","))
    return blocks, seqs


def run_policy(policy: str, prompts: list[list[int]], pool: tuple[int, int], args) -> dict:
    num_kv_blocks, max_num_seqs = pool
    llm = m4.LLM(args.model, device="cpu", scheduling_policy=policy, max_num_seqs=max_num_seqs,
                 num_kv_blocks=num_kv_blocks, max_model_len=args.prefix_len + 64, seed=args.seed)
    params = m4.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(out.num_cached_tokens for out in outs)
    llm.engine.check_integrity()
    ttft = sorted(out.metrics.time_to_first_token for out in outs)
    return {"policy": policy, "prompt_tokens": prompt_tokens, "computed_prompt_tokens": prompt_tokens - cached,
            "preemptions": llm.engine.kv_usage()["num_preemptions"], "wall_s": wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_max_s": ttft[-1],
            "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


COMMAND = "python examples/scheduling_policies.py"
POOL_NAMES = {"tight": ("tight", "紧张的池"), "roomy": ("roomy", "宽松的池")}  # English, then the zh page's


def write_markdown(args, tables: dict[str, list[dict]]) -> None:
    """Both tables, between the snippet markers the m4 chapter includes ("table", and "table_zh" for the zh page),
    with the machine and the command."""
    date, lines = time.strftime("%Y-%m-%d"), []
    for zh in (False, True):
        lines += [f"<!-- --8<-- [start:table{'_zh' if zh else ''}] -->",
                  f"`{COMMAND}`，运行于 {machine()}，{date}（时间取自一次运行，token 数每次运行都相同）：" if zh else
                  f"`{COMMAND}` on {machine()}, {date} (the times are one run's, the token counts the same on every "
                  "run):", ""]
        for name, rows in tables.items():
            blocks, at_once = args.tight if name == "tight" else args.roomy
            fcfs = next((r for r in rows if r["policy"] == "fcfs"), rows[0])
            lines.append(f"| {POOL_NAMES[name][1]}（{blocks} 个块，一次 {at_once} 个） | 计算的提示词 token "
                         "| 相对 fcfs | 抢占 | TTFT 中位数、最长（s） | 输出 tok/s |" if zh else
                         f"| {name} pool ({blocks} blocks, {at_once} at a time) | prompt tokens computed | vs fcfs "
                         "| preemptions | TTFT median, longest (s) | output tok/s |")
            lines.append("|---|---|---|---|---|---|")
            of = " / " if zh else " of "
            lines += [f"| `{r['policy']}` | {r['computed_prompt_tokens']}{of}{r['prompt_tokens']} | "
                      f"{r['computed_prompt_tokens'] / fcfs['computed_prompt_tokens']:.2f}x | {r['preemptions']} | "
                      f"{r['ttft_p50_s']:.2f}, {r['ttft_max_s']:.2f} | {r['output_tokens_per_s']:.1f} |" for r in rows]
            lines.append("")
        lines += [f"<!-- --8<-- [end:table{'_zh' if zh else ''}] -->", ""]
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--tight", type=pool, default="36,2", help="num_kv_blocks,max_num_seqs of the tight pool")
    p.add_argument("--roomy", type=pool, default="64,4", help="num_kv_blocks,max_num_seqs of the roomy pool")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--markdown", default=None,
                   help="write the tables as a docs snippet (sections 'table', 'table_zh') here")
    args = p.parse_args()
    prompts = interleaved_prefixes(args)
    print(f"interleaved prefixes: {args.groups} groups x {args.per_group} requests, prefixes of {args.prefix_len} "
          f"tokens; {machine()}")
    tables = {}
    for name, pool_of in (("tight", args.tight), ("roomy", args.roomy)):
        rows = tables[name] = [run_policy(policy, prompts, pool_of, args) for policy in args.policies.split(",")]
        fcfs = next((r for r in rows if r["policy"] == "fcfs"), rows[0])
        print(f"\n{name} pool: num_kv_blocks={pool_of[0]}, max_num_seqs={pool_of[1]}")
        print(f"{'policy':<12}{'prompt tokens computed':>24}{'vs ' + fcfs['policy']:>10}{'preemptions':>13}"
              f"{'TTFT p50 s':>12}{'max s':>8}{'wall s':>9}{'output tok/s':>14}  tokens")
        for r in rows:
            same = "same" if r["tokens"] == fcfs["tokens"] else "DIFFERENT"
            print(f"{r['policy']:<12}{r['computed_prompt_tokens']:>13} of {r['prompt_tokens']:<7}"
                  f"{r['computed_prompt_tokens'] / fcfs['computed_prompt_tokens']:>9.2f}x{r['preemptions']:>13}"
                  f"{r['ttft_p50_s']:>12.2f}{r['ttft_max_s']:>8.2f}{r['wall_s']:>9.2f}"
                  f"{r['output_tokens_per_s']:>14.1f}  {same}")
    if args.markdown:
        write_markdown(args, tables)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "machine": machine(),
                       "pools": {name: [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
                                 for name, rows in tables.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
