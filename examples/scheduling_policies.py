"""What each scheduling policy computes and how fast, on a workload where the order of admission matters.

The workload ("interleaved prefixes"): --groups groups of --per-group requests, each group's requests behind a
long prefix of their own (--prefix-len random tokens, like a system prompt or a document), each with a short
question of its own; they arrive interleaved, one of every group in turn, all at once. It runs on two pools:

* tight (--tight BLOCKS,SEQS: 36 blocks of 16 tokens, 2 requests at a time): the running requests and about two
  more prefixes. In arrival order (fcfs) the six groups take turns and evict each other's prefixes before they
  come round again; a cache-aware policy (lpm, dfs-weight) admits a group together while its prefix is cached;
* roomy (--roomy: 64 blocks, 4 at a time): every prefix stays cached, and what decides is how many requests of a
  group are admitted before its prefix is computed, each of which computes it again.

A second workload ("long last"), where the order decides how long the whole run takes: --short-requests requests
of --output-len tokens, then one of --long-len, short prompts sharing nothing, on --long-pool (64 blocks, 2 at a
time). In arrival order the long request starts when the short ones are done and runs alone at the end; longest
output first (lof) starts it at once and lets the short ones take turns beside it: fewer steps, but the short
requests wait longer for their first token.

For every policy, one engine of milestone 4 (the first with a prefix cache), the same requests, greedy: the prompt
tokens computed (prompt tokens minus those found cached) and their ratio to fcfs's, preemptions, the engine's
steps, the time to first token (median and longest: the price of reordering is paid by who waits), the wall time
and output tokens per second; and whether every policy gave fcfs's tokens (a policy orders the work, never
changes it).

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
from dataclasses import dataclass

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)

from milestones import m4
from milestones.m4.policies import POLICIES


@dataclass(slots=True)
class Ask:
    """One request of a workload: its prompt, and how many tokens it generates (ignoring end-of-sequence)."""
    prompt: list[int]
    max_tokens: int


def interleaved_prefixes(args) -> list[Ask]:
    """Each group's prefix, then a question of 4-12 tokens: request i is of group i % groups."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, 49152) for _ in range(args.prefix_len)] for _ in range(args.groups)]
    return [Ask(prefixes[i % args.groups] + [rng.randrange(3, 49152) for _ in range(rng.randint(4, 12))],
                args.output_len) for i in range(args.groups * args.per_group)]


def long_last(args) -> list[Ask]:
    """--short-requests short answers, then one long one; prompts of 8-24 tokens that share nothing."""
    rng = random.Random(args.seed + 1)
    lengths = [args.output_len] * args.short_requests + [args.long_len]
    return [Ask([rng.randrange(3, 49152) for _ in range(rng.randint(8, 24))], n) for n in lengths]


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


def run_policy(policy: str, asks: list[Ask], pool: tuple[int, int], args) -> dict:
    num_kv_blocks, max_num_seqs = pool
    llm = m4.LLM(args.model, device="cpu", scheduling_policy=policy, max_num_seqs=max_num_seqs,
                 num_kv_blocks=num_kv_blocks, max_model_len=max(len(a.prompt) + a.max_tokens for a in asks),
                 seed=args.seed)
    params = [m4.SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True) for a in asks]
    start = time.perf_counter()
    outs = llm.generate([a.prompt for a in asks], params, use_tqdm=False)
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(a.prompt) for a in asks)
    cached = sum(out.num_cached_tokens for out in outs)
    llm.engine.check_integrity()
    ttft = sorted(out.metrics.time_to_first_token for out in outs)
    return {"policy": policy, "prompt_tokens": prompt_tokens, "computed_prompt_tokens": prompt_tokens - cached,
            "preemptions": llm.engine.kv_usage()["num_preemptions"], "steps": llm.engine.num_steps, "wall_s": wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_max_s": ttft[-1],
            "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


COMMAND = "python examples/scheduling_policies.py"
TABLES = {  # table name: its workload, its pool's option, its title in English and on the zh page
    "tight": (interleaved_prefixes, "tight", "interleaved prefixes, tight pool", "交错前缀，紧张的池"),
    "roomy": (interleaved_prefixes, "roomy", "interleaved prefixes, roomy pool", "交错前缀，宽松的池"),
    "long-last": (long_last, "long_pool", "long last", "长请求最后到"),
}


def write_markdown(args, tables: dict[str, list[dict]]) -> None:
    """The tables, between the snippet markers the m4 chapter includes ("table", and "table_zh" for the zh page),
    with the machine and the command."""
    date, lines = time.strftime("%Y-%m-%d"), []
    for zh in (False, True):
        lines += [f"<!-- --8<-- [start:table{'_zh' if zh else ''}] -->",
                  f"`{COMMAND}`，运行于 {machine()}，{date}（时间取自一次运行，token 数每次运行都相同）：" if zh else
                  f"`{COMMAND}` on {machine()}, {date} (the times are one run's, the token counts the same on every "
                  "run):", ""]
        for name, rows in tables.items():
            _, option, title, title_zh = TABLES[name]
            blocks, at_once = getattr(args, option)
            fcfs = next((r for r in rows if r["policy"] == "fcfs"), rows[0])
            lines.append(f"| {title_zh}（{blocks} 个块，一次 {at_once} 个） | 计算的提示词 token "
                         "| 相对 fcfs | 抢占 | 步数 | TTFT 中位数、最长（s） | 输出 tok/s |" if zh else
                         f"| {title} ({blocks} blocks, {at_once} at a time) | prompt tokens computed | vs fcfs "
                         "| preemptions | steps | TTFT median, longest (s) | output tok/s |")
            lines.append("|---|---|---|---|---|---|---|")
            of = " / " if zh else " of "
            lines += [f"| `{r['policy']}` | {r['computed_prompt_tokens']}{of}{r['prompt_tokens']} | "
                      f"{r['computed_prompt_tokens'] / fcfs['computed_prompt_tokens']:.2f}x | {r['preemptions']} | "
                      f"{r['steps']} | {r['ttft_p50_s']:.2f}, {r['ttft_max_s']:.2f} | "
                      f"{r['output_tokens_per_s']:.1f} |" for r in rows]
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
    p.add_argument("--short-requests", type=int, default=11, help="long last: the short requests before the long one")
    p.add_argument("--long-len", type=int, default=128, help="long last: the long request's output tokens")
    p.add_argument("--long-pool", type=pool, default="64,2", help="num_kv_blocks,max_num_seqs for long last")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--markdown", default=None,
                   help="write the tables as a docs snippet (sections 'table', 'table_zh') here")
    args = p.parse_args()
    print(f"interleaved prefixes: {args.groups} groups x {args.per_group} requests, prefixes of {args.prefix_len} "
          f"tokens; long last: {args.short_requests} requests of {args.output_len} tokens, then one of "
          f"{args.long_len}; {machine()}")
    tables = {}
    for name, (workload, option, title, _) in TABLES.items():
        pool_of, asks = getattr(args, option), workload(args)
        rows = tables[name] = [run_policy(policy, asks, pool_of, args) for policy in args.policies.split(",")]
        fcfs = next((r for r in rows if r["policy"] == "fcfs"), rows[0])
        print(f"\n{name} pool ({title}): num_kv_blocks={pool_of[0]}, max_num_seqs={pool_of[1]}")
        print(f"{'policy':<12}{'prompt tokens computed':>24}{'vs ' + fcfs['policy']:>10}{'preemptions':>13}"
              f"{'steps':>7}{'TTFT p50 s':>12}{'max s':>8}{'wall s':>9}{'output tok/s':>14}  tokens")
        for r in rows:
            same = "same" if r["tokens"] == fcfs["tokens"] else "DIFFERENT"
            print(f"{r['policy']:<12}{r['computed_prompt_tokens']:>13} of {r['prompt_tokens']:<7}"
                  f"{r['computed_prompt_tokens'] / fcfs['computed_prompt_tokens']:>9.2f}x{r['preemptions']:>13}"
                  f"{r['steps']:>7}{r['ttft_p50_s']:>12.2f}{r['ttft_max_s']:>8.2f}{r['wall_s']:>9.2f}"
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
