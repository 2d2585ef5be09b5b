"""m9 == m8: the tokens of one engine whether prompts and decodes run in it or on two workers apart.

With no workers asked for (the default) m9 is m8's engine exactly. With a prefill and a decode
worker, each token is sampled by the same rule from the same seed and position, over keys and
values that are bit for bit those the prefill worker computed (test_transfer.py): m8's tokens and
log-probabilities, greedy and seeded, with the chain's whole mix (prefix caching, n > 1,
structured outputs, penalties, prompt log-probabilities, chunked prefill).
"""

from __future__ import annotations

import pytest

from milestones import m8, m9
from milestones.m9.pd_engine import DisaggregatedEngine
from tests.chain import LIMITS, assert_same_outputs, mixed_workload, run
from tests.m9.conftest import PD, run_disaggregated


@pytest.fixture(scope="module")
def workload():
    return mixed_workload(12, seed=9, max_prompt=60, max_output=24)


@pytest.fixture(scope="module")
def reference(tiny_model_path, workload):
    with m8.LLM(tiny_model_path, **LIMITS) as llm:
        return run(m8, llm, *workload)


def test_without_workers_m9_is_m8(tiny_model_path, workload, reference):
    """num_prefill_workers=0 and num_decode_workers=0: m8's engine, no process, no router."""
    with m9.LLM(tiny_model_path, **LIMITS) as llm:
        assert isinstance(llm.engine, m9.LLMEngine) and llm.engine.workers is None
        assert_same_outputs(run(m9, llm, *workload), reference, workload[1])


def test_a_prefill_and_a_decode_worker_give_m8s_tokens(tiny_model_path, workload, reference):
    """One worker of each role: every prompt computed on one, decoded on the other (its decode steps replayed, m5),
    every output m8's. (The other tests with workers run them eagerly: a worker's capture is m8's, tested there.)"""
    with m9.LLM(tiny_model_path, **LIMITS, **PD) as llm:
        assert isinstance(llm.engine, DisaggregatedEngine)
        assert_same_outputs(run_disaggregated(llm, *workload), reference, workload[1])
        stats = llm.engine.disaggregation_stats()
        prefill, decode = stats["prefill worker 0"], stats["decode worker 0"]
        assert prefill["transfers"] == decode["transfers"] > 0, stats
        assert prefill["transfer_bytes"] == decode["transfer_bytes"], "every byte sent arrived"
        assert decode["prompt_tokens"] == 0, "the decode worker computed no prompt: none was preempted there"
        usage = llm.engine.kv_usage()
        assert usage["blocks_in_use"] == 0, usage


def test_guessing_on_the_decode_side_and_preempting_on_both(tiny_model_path, workload, reference):
    """Prompt lookup on the decode worker (m7), and pools so small that both workers preempt: a prefill worker
    recomputes a prompt, a decode worker recomputes a request itself (its KV is gone, so it prefills it)."""
    options = dict(LIMITS, **PD, num_kv_blocks=24, block_size=4, async_scheduling=False, enforce_eager=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with m9.LLM(tiny_model_path, **options) as llm:
        assert_same_outputs(run_disaggregated(llm, *workload), reference, workload[1])
        stats = llm.engine.disaggregation_stats()
        assert llm.engine.kv_usage()["num_preemptions"] > 0, stats
        # and the decode worker guessed (the same tokens either way): a prompt of one token repeated, which a penalty
        # below 1 makes the tiny random model repeat, has a bigram to look up from its first output token on
        params = m9.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=0.1)
        repeated = llm.generate([[5] * 16], params, use_tqdm=False)[0]
        assert repeated.metrics.num_draft_tokens > 0, (
            f"no guess was checked for {repeated.outputs[0].token_ids}: does start_decoding set the lookahead?")
        assert llm.engine.spec_stats()["num_draft_tokens"] >= repeated.metrics.num_draft_tokens, (
            "the router adds up its decode workers' guesses")


def test_two_prefill_and_two_decode_workers_give_m8s_tokens(tiny_model_path, workload, reference):
    """Four workers, the router's cache-aware choice among two of each role."""
    with m9.LLM(tiny_model_path, **LIMITS, num_prefill_workers=2, num_decode_workers=2, enforce_eager=True) as llm:
        assert_same_outputs(run_disaggregated(llm, *workload, check_every=5), reference, workload[1])
        stats = llm.engine.disaggregation_stats()
        assert all(s["transfers"] > 0 for s in stats.values()), stats
