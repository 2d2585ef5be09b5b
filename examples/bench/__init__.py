"""The benchmark behind examples/benchmark.py: the milestones against each other and against transformers.

Everything runs in one process (but m8's @tp2 and @tp3 rows' other ranks, and
m9's @pd and @pd2x1 rows' workers, a worker process each), on the same seeded workloads, so the rows are comparable
(and share the machine's noise). docs/benchmarks.md explains the
workloads, rows and metrics and shows the results. Read in this order:

cli.py             the flags; main() builds the workloads once, runs every row, reports
workloads.py       decode, mixed, shared, small and the chat ones: the requests every row serves
rows.py            the row names (mK, mK@OPTION+OPTION such as m7@ngram or m8@tp3, hf-...), the row dict the
                   JSON holds, the median pass, a Measurement (one loaded row on one workload) and the rounds
                   that take turns (--interleave)
milestone_rows.py  each milestone through its own engine API
hf_rows.py         transformers' generate, static batches and continuous batching
llama_cpp_rows.py  llama.cpp's batch-1 decode in F32 and BF16 (only when named)
report.py          the JSON's header, ratios to transformers, token agreement, the table
plots.py           the bar chart (--plot)

Metrics: output tokens/s = useful generated tokens / wall time; time to first token is
measured from the moment a request is submitted (queueing included); inter-token
latency is a request's (last token - first token) / (tokens - 1), averaged over requests.
"""
