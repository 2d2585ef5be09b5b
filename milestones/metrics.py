"""The server's gauges and counters for Prometheus (``GET /metrics``), under vLLM's names where vLLM has one.

The engine loop's thread calls ``added``, ``delivered`` and ``finished`` as requests come and
go (it alone sees every output), so the counts and latencies need no lock of their own; the
gauges (requests running and waiting, the KV cache's use) are read at scrape time from a
snapshot the engine's thread takes between two steps. Each app has its own registry, so that
several servers in one process (the tests) do not share counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds: from a few milliseconds (a GPU's step) to a minute (a long prompt queued behind others on a CPU).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class Progress:
    """Where a request stood at its last output: for its time to first token and the time between tokens."""

    arrived: float
    tokens: list[int] = field(default_factory=list)  # each sample's tokens so far (n > 1: several)
    last: float = 0.0


@dataclass(slots=True)
class Snapshot:
    """The engine's state between two steps, taken on its own thread."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # blocks in use over the pool (m3 on), else bytes holding tokens over bytes reserved
    spec: dict[str, float] = field(default_factory=dict)  # m7: guesses made and kept


def snapshot(engine: Any) -> Snapshot:
    """Read on the engine's thread only (between steps)."""
    scheduler = engine.scheduler
    usage = engine.kv_usage()
    if "blocks_in_use" in usage:
        total = usage["blocks_in_use"] + usage.get("blocks_cached", 0) + usage["blocks_free"]
        share = usage["blocks_in_use"] / total if total else 0.0
    else:
        share = usage["used_bytes"] / usage["reserved_bytes"] if usage["reserved_bytes"] else 0.0
    spec = engine.spec_stats() if getattr(engine.config, "speculative_config", None) is not None else {}
    return Snapshot(len(scheduler.running_seqs()), len(scheduler.waiting), share, spec)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry, self.model_name = CollectorRegistry(), model_name
        self.state = Snapshot()  # the gauges' values: set from the engine's thread before each scrape
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests served", **labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", **labels)
        self.requests_finished = Counter("vllm:request_success", "Requests finished, by reason",
                                         labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, **labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=ITL_BUCKETS, **labels)
        self.registry.register(self)  # the gauges, read at scrape time (``collect``)
        self.progress: dict[str, Progress] = {}

    def added(self, request_id: str, arrived: float) -> None:
        """A request the engine took, which came in at ``arrived`` (time.monotonic(): its HTTP request's arrival, so
        that its time to first token counts its tokenizing and its wait for the engine's thread, as vLLM's does)."""
        self.progress[request_id] = Progress(arrived)

    def delivered(self, output: Any) -> None:
        """An output of a request: the tokens it gained since the last, and when."""
        progress = self.progress.get(output.request_id)
        if progress is None:
            return
        now, tokens = time.monotonic(), [len(completion.token_ids) for completion in output.outputs]
        before = progress.tokens + [0] * (len(tokens) - len(progress.tokens))
        gained = [count - old for count, old in zip(tokens, before)]
        if max(gained, default=0) > 0:
            if not any(before):
                self.ttft.labels(self.model_name).observe(now - progress.arrived)
                self.prompt_tokens.labels(self.model_name).inc(len(output.prompt_token_ids))
            else:  # per token of a sample: a step that kept m7's guesses gave one sample several
                self.itl.labels(self.model_name).observe((now - progress.last) / max(gained))
            self.generation_tokens.labels(self.model_name).inc(sum(gained))
            progress.tokens, progress.last = tokens, now
        if output.finished:
            del self.progress[output.request_id]
            for completion in output.outputs:  # one count per sample, as vLLM counts each of n's requests
                self.requests_finished.labels(self.model_name, completion.finish_reason or "abort").inc()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = self.state
        for name, text, value in (("vllm:num_requests_running", "Requests in the running batch", state.running),
                                  ("vllm:num_requests_waiting", "Requests waiting to be scheduled", state.waiting),
                                  ("vllm:kv_cache_usage_perc", "Share of the KV cache in use, 0 to 1",
                                   state.kv_cache_usage)):
            gauge = GaugeMetricFamily(name, text, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        for key, value in state.spec.items():  # m7: the two counts under vLLM's names, the ratios under ours
            counted = key in ("num_draft_tokens", "num_accepted_tokens")
            family = (CounterMetricFamily if counted else GaugeMetricFamily)(
                f"{'vllm' if counted else 'milestones'}:spec_decode_{key}", f"Speculative decoding: {key}",
                labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
