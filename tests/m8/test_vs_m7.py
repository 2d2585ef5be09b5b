"""m8 == m7: the ranks' engine gives m7's tokens, greedy and seeded, with every earlier lesson switched on.

One rank is m7 exactly (the contract suite and the chain run m8 with one). Several ranks add
each product's partial sums in another order, so their logits differ from one rank's by
rounding (test_sharding.py bounds it at 1e-4): the tiny models' peaked logits keep every token,
and their log-probabilities agree to the chain's tolerance. Where a token of the bundled model
differs, the test prints m7's margin between its two likeliest tokens at that position.
"""

from __future__ import annotations

import socket

import pytest

from milestones import m7, m8
from tests.chain import LIMITS, assert_same_outputs, completions, mixed_workload, run
from tests.contract.test_generate import PROMPTS
from tests.m7.test_vs_m6 import speculating


@pytest.fixture(scope="module")
def workload():
    return mixed_workload(12, seed=8, max_prompt=60, max_output=24)


@pytest.fixture(scope="module")
def reference(tiny_model_path, workload):
    with m7.LLM(tiny_model_path, **LIMITS) as llm:
        return run(m7, llm, *workload)


def test_one_rank_is_m7(tiny_model_path, workload, reference):
    """tensor_parallel_size=1: no process, no group, every collective a no-op; m7's tokens and log-probabilities."""
    with m8.LLM(tiny_model_path, **LIMITS) as llm:
        assert llm.engine.workers is None and llm.engine.runner.tp.compute is None
        assert_same_outputs(run(m8, llm, *workload), reference, workload[1])


@pytest.mark.parametrize("batch_shape", ["mixed", "prefill-first"])
def test_two_ranks_overlapped_match_m7(tiny_model_path, workload, reference, batch_shape):
    """Two ranks, the step after next scheduled while one computes (m6), prompts in chunks, n > 1 sharing a prompt's
    blocks, structured outputs, penalties, log-probabilities; with either batch shape."""
    with m8.LLM(tiny_model_path, **LIMITS, tensor_parallel_size=2, async_scheduling=True,
                batch_shape=batch_shape) as llm:
        assert llm.engine.config.async_scheduling
        assert_same_outputs(run(m8, llm, *workload), reference, workload[1])


def test_four_ranks_sharing_kv_heads_speculating_and_preempted_match_m7(tiny_model_path, workload, reference):
    """Four ranks over two KV heads (each held twice), guesses checked a row each (m7, guesses from m7's own output,
    every third one wrong), and a KV pool so small that requests are preempted and recomputed (m3)."""
    prompts, settings = workload
    options = dict(LIMITS, tensor_parallel_size=4, num_kv_blocks=24, block_size=4,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with speculating(m8.LLM(tiny_model_path, **options), prompts, reference) as llm:
        assert_same_outputs(run(m8, llm, prompts, settings), reference, settings)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.spec_stats()["num_accepted_tokens"] > 0


@pytest.mark.real_model
def test_bundled_model_in_three_ranks_matches_m7(bundled_model_path, report):
    """SmolLM2-135M (9 query heads, 3 KV heads) in three ranks: m7's greedy and seeded tokens on the chain's prompts."""
    settings = [dict(temperature=0, max_tokens=24, logprobs=2),
                dict(temperature=0.8, seed=5, max_tokens=24, logprobs=2)]
    prompts = [prompt for prompt in PROMPTS for _ in settings]
    settings = settings * len(PROMPTS)
    limits = dict(device="cpu", max_model_len=256, max_num_seqs=8)
    with m7.LLM(bundled_model_path, **limits) as llm:
        want = completions(llm.generate(prompts, [m7.SamplingParams(**s) for s in settings], use_tqdm=False))
    with m8.LLM(bundled_model_path, **limits, tensor_parallel_size=3) as llm:
        got = completions(llm.generate(prompts, [m8.SamplingParams(**s) for s in settings], use_tqdm=False))
    for index, (ours, theirs) in enumerate(zip(got, want)):
        tokens, expected = ours.token_ids, theirs.token_ids
        if tokens != expected:
            at = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
            top = sorted(theirs.logprobs[at].values(), key=lambda lp: -lp.logprob)[:2]
            margin = top[0].logprob - top[1].logprob
            pytest.fail(f"request {index} ({settings[index]}): token {at} is {tokens[at]}, m7 gives {expected[at]}; "
                        f"m7's top-2 margin there is {margin:.3g} nats")
    assert_same_outputs(got, want, settings)
    report(f"m8: SmolLM2-135M in 3 ranks, {len(prompts)} requests (greedy and seeded), m7's tokens")


def test_one_rank_in_a_group_of_its_own_matches_m7(tiny_model_path, workload, reference, monkeypatch):
    """Under torchrun's environment even one rank joins a group, and its collectives run (the CUDA tests do this over
    NCCL, tests/cuda): a group of one is m7 exactly too."""
    with socket.socket() as probe:  # a free port for the group's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    with m8.LLM(tiny_model_path, **LIMITS) as llm:
        assert llm.engine.workers.tp.compute is not None and not llm.engine.workers.processes
        assert_same_outputs(run(m8, llm, *workload), reference, workload[1])
