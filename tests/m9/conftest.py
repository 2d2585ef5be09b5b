"""m9's tools: run a workload through a disaggregated engine, checking every worker's books after every step."""

from __future__ import annotations

import time

from milestones import m9
from tests.chain import Completion, completions

PD = dict(num_prefill_workers=1, num_decode_workers=1)  # the smallest disaggregated engine: a worker of each role


def run_disaggregated(llm: m9.LLM, prompts: list, settings: list[dict], check_every: int = 1) -> list[Completion]:
    """``generate`` by hand: every request added, then steps until all have finished, every worker's integrity
    checked after every ``check_every``-th step (a query to each worker) and once all have finished. Each output's
    times are the request's own: its first token's is the prefill worker's, at or before the router passed it on."""
    engine = llm.engine
    ids = [engine.add_request(p, m9.SamplingParams(**s)) for p, s in zip(prompts, settings)]
    finished, steps, first_seen = {}, 0, {}
    while len(finished) < len(ids):
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_seen.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < 20_000, "the requests never finished: a hand-shake or a transfer is stuck"
        if steps % check_every == 0:
            engine.check_integrity()
    engine.check_integrity()
    for request_id, out in finished.items():  # n > 1: a merged output's times are its samples' earliest
        metrics = out.metrics
        assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time, metrics
        assert metrics.first_token_time <= first_seen[request_id], (
            f"request {request_id!r}: its first token is dated {metrics.first_token_time}, after the router passed it "
            f"on at {first_seen[request_id]}: the decode worker's time, not the prefill worker's")
    return completions([finished[i] for i in ids])
