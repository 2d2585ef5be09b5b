"""MkDocs hook: the benchmarks page's results tables, made from the JSON runs at build time, never typed.

A marker line ``<!-- results cpu -->`` (or ``gpu``) becomes a table: for each milestone, what its idea buys on the
workload that shows it, as the ratio of two rows of one JSON run (``docs/assets/benchmarks/...``), with both
figures, then the list of those runs: when, on what machine, and the command that reproduces each. The page's
language (``.zh.md``) picks the words; the figures are the same in both editions.

A claim whose file, workload or row is missing raises ``PluginError``, so ``mkdocs build --strict`` fails rather
than showing a stale or empty cell. Change a claim by pointing it at a newer run of the same command.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^[ \t]*<!--[ \t]*results[ \t]+(\w+)[ \t]*-->[ \t]*$", re.MULTILINE)
RUNS = "docs/assets/benchmarks"


@dataclass(frozen=True, slots=True)
class Claim:
    """One cell: ``row`` against ``baseline`` on ``workload`` of one run, by ``metric`` (higher is better)."""

    milestone: str
    idea: tuple[str, str]  # (English, Chinese): what the idea buys, in a few words
    run: str  # a JSON file under docs/assets/benchmarks/
    workload: str
    row: str
    baseline: str
    metric: str = "output_tokens_per_s"
    lower_is_better: bool = False
    baseline_workload: str | None = None  # when the baseline serves the same requests as another workload


@dataclass(frozen=True, slots=True)
class Missing:
    """A milestone with no run on this kind of machine yet: said so, never guessed."""

    milestone: str
    idea: tuple[str, str]
    why: tuple[str, str]


CPU = (
    Claim("m1", ("batch-1 decode, float32, against llama.cpp F32", "batch 1 解码（float32），对比 llama.cpp F32"),
          "cpu-speed-f32-561d828.json", "decode", "m1", "llama.cpp@f32"),
    Claim("m1", ("batch-1 decode, bfloat16, against llama.cpp BF16", "batch 1 解码（bfloat16），对比 llama.cpp BF16"),
          "cpu-speed-bf16-561d828-c.json", "decode", "m1", "llama.cpp@bf16"),
    Claim("m2", ("continuous batching against transformers' static batches",
                 "连续批处理，对比 transformers 的静态批处理"),
          "cpu-speed-mixed-561d828.json", "mixed", "m2", "hf-static-16"),
    Claim("m3", ("paged attention: requests running at once in the same KV memory",
                 "分页注意力：同样的 KV 内存里同时运行的请求数"),
          "tight_kv.json", "mixed", "m3", "m2", metric="max_running"),
    Claim("m3", ("paged attention: throughput in the same KV memory", "分页注意力：同样 KV 内存下的吞吐量"),
          "tight_kv.json", "mixed", "m3", "m2"),
    Claim("m4", ("prefix caching: prompt tokens computed, one shared system prompt",
                 "前缀缓存：共享系统提示词时实际计算的提示词 token 数"),
          "prefix.json", "shared", "m4", "m3", metric="prompt_tokens_computed", lower_is_better=True),
    Claim("m4", ("prefix caching: throughput, one shared system prompt", "前缀缓存：共享系统提示词时的吞吐量"),
          "prefix.json", "shared", "m4", "m3"),
    Claim("m5", ("the captured step against eager, batch 4", "捕获的步对比 eager，batch 4"),
          "cpu-speed-capture-561d828.json", "batch-4", "m5", "m5@eager"),
    Claim("m5", ("batch-1 decode against llama.cpp F32", "batch 1 解码，对比 llama.cpp F32"),
          "cpu-speed-f32-561d828.json", "decode", "m5", "llama.cpp@f32"),
    Claim("m6", ("overlap against synchronous steps: nothing to hide on a CPU, so m6 runs synchronously there",
                 "重叠对比同步执行：CPU 上没有可以隐藏的时间，所以 m6 在 CPU 上默认同步执行"),
          "m6.json", "small", "m6", "m6@sync"),
    Claim("m6", ("batch-1 decode against llama.cpp F32", "batch 1 解码，对比 llama.cpp F32"),
          "cpu-speed-f32-561d828.json", "decode", "m6", "llama.cpp@f32"),
    Claim("m6", ("batch-1 decode against llama.cpp BF16", "batch 1 解码，对比 llama.cpp BF16"),
          "cpu-speed-bf16-561d828-c.json", "decode", "m6", "llama.cpp@bf16"),
    Claim("m6", ("quantized weights (the bundled file's Q4_1) against llama.cpp on the same file",
                 "量化权重（随附文件自带的 Q4_1），对比 llama.cpp 跑同一个文件"),
          "quantized-decode.json", "decode", "m6@gguf", "llama.cpp@q4_1"),
    Claim("m7", ("prompt lookup on grounded text (answers that copy the prompt), batch 1",
                 "提示词查找，grounded 文本（回答抄写提示词），batch 1"),
          "m7-batch1.json", "grounded", "m7@ngram", "m6"),
    Claim("m7", ("prompt lookup on open text, batch 1", "提示词查找，开放文本，batch 1"),
          "m7-batch1.json", "open", "m7@ngram", "m6"),
    Claim("m7", ("a draft model (8 layers of the same model) on grounded text",
                 "草稿模型（同一模型的前 8 层），grounded 文本"),
          "m7-batch1.json", "grounded", "m7@draft", "m6"),
    Claim("m8", ("3 ranks against 1: a third of the weights a rank, paid for in all-reduces over gloo",
                 "3 个 rank 对比 1 个：每个 rank 只存三分之一的权重，代价是 gloo 上的 all-reduce"),
          "tp-costs-smollm2.json", "decode", "m8@tp3", "m8@tp1"),
    Claim("m9", ("disaggregation: decoding requests' p99 inter-token latency while long prompts arrive (lower is "
                 "better)", "PD 分离：长提示词陆续到达时，解码请求的 p99 token 间延迟（越低越好）"),
          "m9-pd.json", "interference", "m9@pd", "m8", metric="itl_p99_ms", lower_is_better=True),
    Claim("m9", ("cache-aware routing: prompt tokens two prefill workers compute, against round robin",
                 "缓存感知路由：两个预填充 worker 实际计算的提示词 token 数，对比轮询"),
          "m9-pd.json", "routing", "m9@cache_aware", "m9@round_robin", metric="prompt_tokens_computed",
          lower_is_better=True),
)

GPU = (
    Claim("m2", ("continuous batching: 8 requests in each step, against m1, which serves one at a time",
                 "连续批处理：每步 8 个请求，对比一次只服务一个请求的 m1"),
          "gpu/bench-eager.json", "batch-8", "m2", "m1", baseline_workload="decode"),
    Missing("m3", ("paged attention: requests at once in the same KV memory",
                   "分页注意力：同样 KV 内存下同时运行的请求数"),
            ("not measured on a GPU yet", "尚未在 GPU 上测量")),
    Missing("m4", ("prefix caching, one shared system prompt", "前缀缓存，共享系统提示词"),
            ("not measured on a GPU yet", "尚未在 GPU 上测量")),
    Claim("m5", ("the captured step against eager, batch-1 decode", "捕获的步对比 eager，batch 1 解码"),
          "gpu/bench-graphs.json", "decode", "m5", "m5@eager"),
    Claim("m5", ("the engine's own work a step (host ms, lower is better), batch 1",
                 "每步引擎自身的主机端耗时（毫秒，越低越好），batch 1"),
          "gpu/bench-host.json", "host-1", "m5", "m1", metric="host_step_ms", lower_is_better=True),
    Claim("m6", ("overlap against synchronous steps, batch-1 decode", "重叠调度对比同步执行，batch 1 解码"),
          "gpu/bench-graphs.json", "decode", "m6", "m6@sync"),
    Claim("m6", ("overlap against synchronous steps, 8B-shaped model, mixed",
                 "重叠调度对比同步执行，8B 规模模型，混合负载"),
          "gpu/bench-8b.json", "mixed", "m6", "m6@sync"),
    Claim("m6", ("the whole engine against transformers' static batches, mixed workload",
                 "整个引擎对比 transformers 的静态批处理，混合负载"),
          "gpu/bench-hf.json", "mixed", "m6", "hf-static-16"),
    Claim("m6", ("the whole engine against transformers' generate, batch-1 decode",
                 "整个引擎对比 transformers 的 generate，batch 1 解码"),
          "gpu/bench-hf.json", "decode", "m6", "hf-generate"),
    Claim("m7", ("prompt lookup on grounded text, batch 1", "提示词查找，grounded 文本，batch 1"),
          "gpu/bench-speculative.json", "grounded", "m7@ngram", "m6"),
    Claim("m7", ("prompt lookup on open text, batch 1", "提示词查找，开放文本，batch 1"),
          "gpu/bench-speculative.json", "open", "m7@ngram", "m6"),
    Missing("m8", ("tensor parallelism over NCCL", "基于 NCCL 的张量并行"),
            ("not measured: the loans so far had one GPU", "尚未测量：目前借到的机器只有一块 GPU")),
    Missing("m9", ("prefill/decode disaggregation on GPUs", "GPU 上的 PD 分离"),
            ("not measured on a GPU yet", "尚未在 GPU 上测量")),
)

TABLES = {"cpu": CPU, "gpu": GPU}
WORDS = {
    "en": {"head": "| milestone | what its idea buys | measured | the two rows | run |", "times": "×",
           "vs": "against", "runs": "The runs behind the table:", "machine": "machine: {}", "threads": "torch threads",
           "cpus": "{} CPUs", "model": "model: {}", "unmeasured": "unmeasured", "and": ", ", "colon": ": "},
    "zh": {"head": "| 里程碑 | 它的思想带来什么 | 测量结果 | 对比的两行 | 运行 |", "times": "×",
           "vs": "对比", "runs": "表中数字来自以下运行：", "machine": "机器：{}", "threads": "torch 线程数",
           "cpus": "{} 个 CPU", "model": "模型：{}", "unmeasured": "未测量", "and": "，", "colon": "："},
}
UNITS = {"output_tokens_per_s": "tok/s", "max_running": "", "prompt_tokens_computed": "", "host_step_ms": "ms",
         "itl_p99_ms": "ms"}


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = Path(config.config_file_path).resolve().parent
    language = "zh" if page.file.src_uri.endswith(".zh.md") else "en"

    def replace(match: re.Match) -> str:
        kind = match.group(1)
        if kind not in TABLES:
            raise PluginError(f"{page.file.src_uri}: unknown results table {kind!r}; expected one of {sorted(TABLES)}")
        return results_table(root, TABLES[kind], language)

    return MARKER.sub(replace, markdown)


def load_run(root: Path, name: str) -> dict:
    """A benchmark JSON, with the tensor-parallel costs file's rank counts turned into rows m8@tp1, m8@tp3, and the
    disaggregation benchmark's medians into rows of workloads "interference" and "routing"."""
    path = root / RUNS / name
    if not path.is_file():
        raise PluginError(f"results: {RUNS}/{name} does not exist")
    run = json.loads(path.read_text())
    if isinstance(run.get("results"), dict):  # examples/tensor_parallel_costs.py's format: rank count -> figures
        run["results"] = [{"workload": "decode", "engine": f"m8@tp{n}", "output_tokens_per_s": r.get("tokens_per_s")}
                          for n, r in run["results"].items()]
    if "interference" in run:  # examples/pd_benchmark.py's format: each part's medians, by row
        medians = run["interference"]["medians"]
        run["results"] = [{"workload": "interference", "engine": name, **figures}
                          for name, figures in medians.items() if isinstance(figures, dict)]
        run["results"] += [{"workload": "routing", "engine": f"m9@{policy}",
                            "prompt_tokens_computed": run["routing"][policy]["computed_prompt_tokens"]}
                           for policy in ("round_robin", "cache_aware")]
    return run


def value(run: dict, name: str, claim: Claim, workload: str) -> float:
    rows = [row for row in run["results"] if row["workload"] == workload and row["engine"] == name]
    if len(rows) != 1:
        raise PluginError(f"results: {claim.run} has {len(rows)} rows {name!r} on workload {workload!r}, not one")
    if rows[0].get(claim.metric) is None:
        raise PluginError(f"results: {claim.run} row {name} on {workload} has no {claim.metric}")
    return float(rows[0][claim.metric])


def figure(number: float, metric: str) -> str:
    unit = UNITS[metric]
    whole = number >= 1000 or (metric != "output_tokens_per_s" and number == int(number))  # counts, thousands
    text = f"{number:,.0f}" if whole else f"{number:.2f}" if number < 10 else f"{number:.1f}"
    return f"{text} {unit}".strip()


def results_table(root: Path, claims: tuple, language: str) -> str:
    words = WORDS[language]
    side = 1 if language == "zh" else 0
    lines = [words["head"], "|---|---|---:|---|---|"]
    used: list[str] = []
    for claim in claims:
        if isinstance(claim, Missing):
            lines.append(f"| {claim.milestone} | {claim.idea[side]} | {words['unmeasured']} | {claim.why[side]} | |")
            continue
        run = load_run(root, claim.run)
        row = value(run, claim.row, claim, claim.workload)
        baseline = value(run, claim.baseline, claim, claim.baseline_workload or claim.workload)
        ratio = baseline / row if claim.lower_is_better else row / baseline
        if claim.run not in used:
            used.append(claim.run)
        lines.append(f"| {claim.milestone} | {claim.idea[side]} | **{ratio:.2f}{words['times']}** | "
                     f"`{claim.row}` {figure(row, claim.metric)} {words['vs']} `{claim.baseline}` "
                     f"{figure(baseline, claim.metric)} | [{used.index(claim.run) + 1}](#run-{slug(claim.run)}) |")
    lines += ["", words["runs"], ""]
    for number, name in enumerate(used, 1):
        run = load_run(root, name)
        anchor = f'<span id="run-{slug(name)}"></span>'
        lines.append(f"{number}. {anchor}[`{name}`](assets/benchmarks/{name}){words['colon']}{describe(run, words)}")
        if run.get("command"):
            lines.append(f"    `{run['command']}`")
    return "\n".join(lines) + "\n"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.removesuffix(".json").lower())


def describe(run: dict, words: dict) -> str:
    machine = run.get("machine") or {}
    cpus = words["cpus"].format(machine.get("cpu_count", "?"))
    if machine.get("gpu"):
        where = f"{machine['gpu']} ({cpus})"
    else:
        where = f"{machine.get('cpu', '?')}{words['and']}{cpus}{words['and']}{words['threads']} " \
                f"{machine.get('torch_threads', '?')}"
    config = run.get("config") or {}
    model = config.get("model") or run.get("model") or "?"
    parts = (run.get("created", "")[:10], words["machine"].format(where), machine.get("torch", ""),
             words["model"].format(model), config.get("dtype", ""))
    return words["and"].join(part for part in parts if part)
