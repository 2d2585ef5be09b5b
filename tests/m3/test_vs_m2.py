"""m3 against m2 token for token: block sizes 1 and 16, and a pool so small that preemption happens often."""

from __future__ import annotations

import pytest

from milestones import m2, m3
from tests.chain import LIMITS, assert_same_outputs, mixed_workload, run
from tests.conftest import needs_compiler


@pytest.fixture(scope="module")
def workload():
    # Prompt lengths from 1 to 120: most are not multiples of any block size.
    return mixed_workload(20, seed=3, max_prompt=120, max_output=48)


@pytest.fixture(scope="module")
def reference(tiny_model_path, workload):
    return run(m2, m2.LLM(tiny_model_path, **LIMITS), *workload)


@pytest.mark.parametrize("block_size", [1, 16])
def test_m3_matches_m2(tiny_model_path, workload, reference, block_size):
    llm = m3.LLM(tiny_model_path, block_size=block_size, **LIMITS)
    assert_same_outputs(run(m3, llm, *workload), reference)
    assert llm.engine.kv_usage()["blocks_in_use"] == 0
    llm.engine.scheduler.block_manager.check_integrity()


@pytest.mark.parametrize("block_size, num_blocks", [(16, 12), (1, 170), (7, 25)])
def test_m3_matches_m2_under_heavy_preemption(tiny_model_path, workload, reference, block_size, num_blocks):
    llm = m3.LLM(tiny_model_path, block_size=block_size, num_kv_blocks=num_blocks, **LIMITS)
    assert_same_outputs(run(m3, llm, *workload), reference)
    usage = llm.engine.kv_usage()
    assert usage["num_preemptions"] >= 10, usage
    assert usage["blocks_free"] == num_blocks
    llm.engine.scheduler.block_manager.check_integrity()


@pytest.mark.parametrize("block_size, num_blocks", [(16, 12), (7, 25)])
def test_m3_with_sglangs_reservation_matches_m2(tiny_model_path, workload, reference, block_size, num_blocks):
    """SGLang's admission changes when requests run, never their tokens: a low ratio that decays fast, so the pool
    runs short and requests are retracted before steps (admission.py)."""
    llm = m3.LLM(tiny_model_path, block_size=block_size, num_kv_blocks=num_blocks, new_token_ratio=0.2,
                 min_new_token_ratio=0.01, new_token_ratio_decay=0.05, **LIMITS)
    assert_same_outputs(run(m3, llm, *workload), reference)
    usage = llm.engine.kv_usage()
    assert usage["num_preemptions"] >= 2 and usage["refused_blocks"] > 0, usage
    assert usage["blocks_free"] == num_blocks
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("num_blocks", [None, 12])
def test_m3_with_prefill_first_steps_matches_m2(tiny_model_path, workload, reference, num_blocks):
    """SGLang's batch shape changes which step a request's tokens go in, never the tokens; in a tight pool too, where
    a prefill chunk that finds no block preempts a prefilling request, not a held-back decode."""
    llm = m3.LLM(tiny_model_path, block_size=16, num_kv_blocks=num_blocks, batch_shape="prefill-first", **LIMITS)
    assert_same_outputs(run(m3, llm, *workload), reference)
    assert (llm.engine.kv_usage()["num_preemptions"] > 0) == (num_blocks is not None)
    llm.engine.scheduler.check_integrity()


@needs_compiler
def test_m3_with_the_compiled_kernel_matches_m2(tiny_model_path, workload, reference):
    """Decodes read their blocks in place through padded block tables, under preemption and an odd block size."""
    llm = m3.LLM(tiny_model_path, block_size=7, num_kv_blocks=25, attention_backend="cpp", **LIMITS)
    backend, calls = llm.engine.runner.attention, []
    kernel = backend.kernel
    backend.kernel = lambda *args: calls.append(len(args[0])) or kernel(*args)
    assert_same_outputs(run(m3, llm, *workload), reference)
    assert llm.engine.kv_usage()["num_preemptions"] >= 10
    assert len(calls) > 100 and max(calls) > 1, "the decodes did not go to the kernel"


def test_m3_with_plain_torch_attention_matches_m2(tiny_model_path, workload, reference):
    """The reference path (gather every block table, per-request torch attention), preempting as well."""
    llm = m3.LLM(tiny_model_path, block_size=16, num_kv_blocks=12, attention_backend="torch", **LIMITS)
    assert llm.engine.runner.attention.name == "torch"
    assert_same_outputs(run(m3, llm, *workload), reference)
    assert llm.engine.kv_usage()["num_preemptions"] >= 10


def test_request_that_can_never_fit_is_refused_and_others_still_run(tiny_model_path):
    llm = m3.LLM(tiny_model_path, block_size=4, num_kv_blocks=10, **LIMITS)
    params = m3.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        llm.generate(list(range(100, 140)), params, use_tqdm=False)  # 50 tokens > 40 slots in the pool
    with pytest.raises(ValueError, match="lower max_tokens"):
        llm.generate([5, 6, 7], m3.SamplingParams(max_tokens=None), use_tqdm=False)  # could grow to 256 tokens
    out = llm.generate(list(range(100, 120)), params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10


def test_pool_is_sized_from_the_memory_budget(tiny_model_path):
    default = m3.LLM(tiny_model_path, **LIMITS).engine
    per_token = default.runner.kv_bytes_per_token
    assert default.config.num_kv_blocks == 5 * 256 // 16  # what m2 reserves: max_num_seqs * max_model_len
    assert default.runner.kv_cache_bytes == default.config.num_kv_blocks * 16 * per_token
    budget = m3.LLM(tiny_model_path, kv_cache_memory_bytes=64 * 16 * per_token, **LIMITS).engine
    assert budget.config.num_kv_blocks == 64


def test_kv_report_counts_blocks(tiny_model_path):
    engine = m3.LLM(tiny_model_path, block_size=4, **LIMITS).engine
    request_id = engine.add_request(list(range(100, 110)),
                                    m3.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    usage = engine.kv_usage()
    assert usage["blocks_in_use"] == 3 and usage["used_bytes"] == 10 * engine.runner.kv_bytes_per_token
    block_manager = engine.scheduler.block_manager
    table, free = block_manager.block_tables[request_id], set(block_manager.free_blocks)
    assert len(table) == 3 and not free & set(table), "a block of a running request's table is also on the free list"
    assert usage["blocks_free"] == len(free) == engine.config.num_kv_blocks - 3


@pytest.mark.real_model
def test_m3_matches_m2_on_the_bundled_model():
    prompts, settings = mixed_workload(12, seed=11, max_prompt=90, max_output=32)
    prompts[:3] = ["Tell me about the ocean.", "What is 12 times 7?", "Write a limerick about a cat."]
    limits = dict(device="cpu", max_model_len=192, max_num_seqs=6, max_num_batched_tokens=48)
    reference = run(m2, m2.LLM(**limits), prompts, settings)
    llm = m3.LLM(block_size=16, num_kv_blocks=10, **limits)  # the longest request needs 8 blocks: some wait
    assert_same_outputs(run(m3, llm, prompts, settings), reference)
    assert llm.engine.kv_usage()["num_preemptions"] > 0


def test_the_victim_is_the_latest_admitted_request_not_yet_scheduled(tiny_model_path):
    """The m3 notebook's run: at step 5 B needs a third block and the pool is empty. The victim rule picks C, admitted
    after B and not yet scheduled in that step, not B itself (which would also give the right tokens, later)."""
    llm = m3.LLM(tiny_model_path, device="cpu", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                 block_size=4, num_kv_blocks=8)
    engine, scheduler = llm.engine, llm.engine.scheduler
    preempted, preempt = [], scheduler._preempt

    def recording_preempt(seq):
        preempted.append((engine.num_steps + 1, seq.request_id))
        preempt(seq)

    scheduler._preempt = recording_preempt
    for request_id, (prompt_len, max_tokens) in {"A": (6, 8), "B": (5, 8), "C": (9, 4), "D": (3, 6)}.items():
        params = m3.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(list(range(1000, 1000 + prompt_len)), params, request_id=request_id)
    while engine.has_unfinished_requests():
        engine.step()
        scheduler.check_integrity()
    assert preempted == [(5, "C")]
