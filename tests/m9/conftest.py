"""m9's tools: run a workload through a disaggregated engine, checking every worker's books after every step."""

from __future__ import annotations

from milestones import m9
from tests.chain import Completion, completions

PD = dict(num_prefill_workers=1, num_decode_workers=1)  # the smallest disaggregated engine: a worker of each role


def run_disaggregated(llm: m9.LLM, prompts: list, settings: list[dict], check_every: int = 1) -> list[Completion]:
    """``generate`` by hand: every request added, then steps until all have finished, every worker's integrity
    checked after every ``check_every``-th step (a query to each worker) and once all have finished."""
    engine = llm.engine
    ids = [engine.add_request(p, m9.SamplingParams(**s)) for p, s in zip(prompts, settings)]
    finished, steps = {}, 0
    while len(finished) < len(ids):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < 20_000, "the requests never finished: a hand-shake or a transfer is stuck"
        if steps % check_every == 0:
            engine.check_integrity()
    engine.check_integrity()
    return completions([finished[i] for i in ids])
