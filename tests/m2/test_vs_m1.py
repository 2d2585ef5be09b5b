"""m2 against m1 on a mixed workload, token for token: greedy and seeded sampling, queueing and chunked prefill."""

from __future__ import annotations

import pytest

from milestones import m1, m2
from tests.chain import assert_same_outputs, mixed_workload, run


@pytest.mark.parametrize(("kind", "batch_shape"), [("llama", "mixed"), ("qwen2", "mixed"), ("qwen3", "mixed"),
                                                   ("llama", "prefill-first")])
def test_m2_matches_m1_on_a_mixed_workload(tiny_model_factory, kind, batch_shape):
    path = tiny_model_factory(kind)
    prompts, settings = mixed_workload(20, seed=3, max_prompt=120, max_output=48)
    # m1 with the lesson's attention: m2's decodes go to the compiled kernel by default, checked here against it too
    reference = run(m1, m1.LLM(path, device="cpu", max_model_len=256, attention_backend="torch"), prompts, settings)
    # Few slots, so requests queue and join mid-flight; a small budget, so prompts are chunked.
    llm = m2.LLM(path, device="cpu", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=24,
                 batch_shape=batch_shape)
    ours = run(m2, llm, prompts, settings)
    assert_same_outputs(ours, reference, settings)
    assert llm.engine.num_steps < sum(len(c.token_ids) for c in reference) + len(prompts), "no batching happened"


def test_every_step_respects_the_limits(tiny_model_path):
    llm = m2.LLM(tiny_model_path, device="cpu", max_model_len=256, max_num_seqs=3, max_num_batched_tokens=16)
    engine, scheduler = llm.engine, llm.engine.scheduler
    prompts, settings = mixed_workload(8, seed=5, max_prompt=60, max_output=20)
    for prompt, s in zip(prompts, settings):
        engine.add_request(prompt, m2.SamplingParams(**s))
    largest, chunked = 0, False
    original = scheduler.schedule

    def checked_schedule():
        nonlocal largest, chunked
        batch = original()
        if batch is not None:
            assert sum(batch.num_new_tokens) <= 16 and len(batch.seqs) <= 3
            largest = max(largest, len(batch.seqs))
            chunked |= any(
                n > 1 and s.num_computed_tokens + n < s.num_prompt_tokens
                for s, n in zip(batch.seqs, batch.num_new_tokens)
            )
        return batch

    scheduler.schedule = checked_schedule
    while engine.has_unfinished_requests():
        engine.step()
    assert largest == 3 and chunked


def test_kv_memory_reserved_per_slot(tiny_model_path):
    llm = m2.LLM(tiny_model_path, device="cpu", max_model_len=128, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.kv_cache_bytes == 4 * 128 * runner.kv_bytes_per_token


@pytest.mark.real_model
def test_m2_matches_m1_on_the_bundled_model():
    prompts, settings = mixed_workload(16, seed=11, max_prompt=90, max_output=40)
    tokenizer_text = [
        "Tell me about the ocean.", "What is 12 times 7?", "Write a limerick about a cat.", "Name three planets."
    ]
    prompts[:4] = tokenizer_text
    reference = run(m1, m1.LLM(device="cpu", max_model_len=256, attention_backend="torch"), prompts, settings)
    for batch_shape in ("mixed", "prefill-first"):
        batched = m2.LLM(device="cpu", max_model_len=256, max_num_seqs=6, max_num_batched_tokens=48,
                         batch_shape=batch_shape)
        ours = run(m2, batched, prompts, settings)
        assert_same_outputs(ours, reference, settings)
