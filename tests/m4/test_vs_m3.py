"""m4 against m3 token for token, cache on and off, plus each known prefix-cache trap as its own test."""

from __future__ import annotations

import random

import pytest

from milestones import m3, m4
from tests.chain import LIMITS, assert_same_outputs, completions, mixed_workload, run

# SGLang's admission (admission.py), its ratio low and decaying fast, so that requests are retracted
SGLANG = dict(new_token_ratio=0.2, min_new_token_ratio=0.01, new_token_ratio_decay=0.05)


def shared_prefix_workload(num_requests: int, prefix_len: int, seed: int):
    """One long 'system prompt' followed by a different short question per request; mixed sampling."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 49152) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 20))] for _ in range(num_requests)]
    settings = [
        dict(max_tokens=rng.randint(1, 30), ignore_eos=True, seed=i,
             **({"temperature": 0} if i % 2 else {"temperature": 0.9, "top_p": 0.9}))
        for i in range(num_requests)
    ]
    return prompts, settings


def checked(llm):
    llm.engine.scheduler.check_integrity()
    return llm


@pytest.fixture(scope="module")
def mixed():
    return mixed_workload(20, seed=3, max_prompt=120, max_output=48)


@pytest.fixture(scope="module")
def mixed_reference(tiny_model_path, mixed):
    return run(m3, m3.LLM(tiny_model_path, **LIMITS), *mixed)


@pytest.mark.parametrize(
    "options", [{}, {"enable_prefix_caching": False}, {"scheduling_policy": "lpm"}, {"block_size": 1},
                {"scheduling_policy": "dfs-weight"}, {"scheduling_policy": "lof"}, {"scheduling_policy": "random"},
                {"batch_shape": "prefill-first"}, {"batch_shape": "prefill-first", "num_kv_blocks": 12}]
)
def test_m4_matches_m3_on_the_mixed_workload(tiny_model_path, mixed, mixed_reference, options):
    llm = m4.LLM(tiny_model_path, **LIMITS, **options)
    assert_same_outputs(run(m4, llm, *mixed), mixed_reference)
    checked(llm)


@pytest.mark.parametrize("options", [{}, {"block_size": 4, "scheduling_policy": "lpm"}, {"block_size": 1}])
def test_shared_system_prompt_is_computed_once(tiny_model_path, options):
    prompts, settings = shared_prefix_workload(12, prefix_len=70, seed=1)
    reference = run(m3, m3.LLM(tiny_model_path, **LIMITS), prompts, settings)
    llm = m4.LLM(tiny_model_path, **LIMITS, **options)
    outs = llm.generate(prompts, [m4.SamplingParams(**s) for s in settings], use_tqdm=False)
    assert_same_outputs(completions(outs), reference)
    block = llm.engine.config.block_size
    # The first requests are admitted before anything is cached; the rest must hit the whole system prompt.
    hits = [o.num_cached_tokens for o in outs]
    assert hits[0] == 0 and all(h >= 70 // block * block for h in hits[5:]), hits
    assert llm.engine.kv_usage()["prefix_hit_rate"] > 0.5
    checked(llm)


def test_multi_turn_chat_reuses_every_previous_turn(tiny_model_path):
    rng = random.Random(4)
    ref_llm, llm = m3.LLM(tiny_model_path, **LIMITS), m4.LLM(tiny_model_path, **LIMITS)
    params = dict(temperature=0, max_tokens=12, ignore_eos=True)
    conversation = [rng.randrange(3, 49152) for _ in range(30)]
    previous_len = 0
    for turn in range(5):
        ref = ref_llm.generate(conversation, m3.SamplingParams(**params), use_tqdm=False)[0]
        out = llm.generate(conversation, m4.SamplingParams(**params), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        if turn:  # everything before this turn's new message was computed in the previous turn
            assert out.num_cached_tokens >= (previous_len - 1) // 16 * 16, (turn, out.num_cached_tokens)
        previous_len = len(conversation) + len(out.outputs[0].token_ids)
        next_message = [rng.randrange(3, 49152) for _ in range(rng.randint(5, 15))]
        conversation = conversation + out.outputs[0].token_ids + next_message
    checked(llm)


def test_trap_fully_cached_prompt_still_computes_its_last_token(tiny_model_path):
    llm = m4.LLM(tiny_model_path, **LIMITS)
    prompt = list(range(1000, 1032))  # exactly two blocks of 16
    params = m4.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 16  # the last block is recomputed: its last token's logits are needed
    checked(llm)


def test_trap_preempted_request_readmitted_with_a_cache_hit(tiny_model_path):
    prompts, settings = shared_prefix_workload(10, prefix_len=40, seed=2)
    for s in settings:
        s["max_tokens"] = 40  # long enough that the running requests outgrow the pool after admission
    reference = run(m3, m3.LLM(tiny_model_path, **LIMITS), prompts, settings)
    llm = m4.LLM(tiny_model_path, **LIMITS, block_size=8, num_kv_blocks=16)
    outs = llm.generate(prompts, [m4.SamplingParams(**s) for s in settings], use_tqdm=False)
    assert_same_outputs(completions(outs), reference)
    usage = llm.engine.kv_usage()
    assert usage["num_preemptions"] > 0 and usage["prefix_hit_rate"] > 0
    checked(llm)


def test_trap_same_prefix_inserted_by_two_running_requests(tiny_model_path):
    llm = m4.LLM(tiny_model_path, **{**LIMITS, "max_num_batched_tokens": 128})  # room to admit both in one step
    engine, scheduler = llm.engine, llm.engine.scheduler
    prompt = list(range(2000, 2040))
    params = m4.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request(prompt, params, request_id="a")
    engine.add_request(prompt, params, request_id="b")  # admitted in the same step: no hit, both compute it
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        checked(llm)
    greedy = dict(temperature=0, max_tokens=20, ignore_eos=True)
    reference = run(m3, m3.LLM(tiny_model_path, **LIMITS), [prompt], [greedy])
    assert outputs["a"].outputs[0].token_ids == outputs["b"].outputs[0].token_ids == reference[0][0]
    assert outputs["a"].num_cached_tokens == outputs["b"].num_cached_tokens == 0
    block_manager = scheduler.block_manager
    assert block_manager.num_free_blocks + len(scheduler.tree.cached_blocks()) == block_manager.num_blocks


def test_trap_a_prompt_computed_again_is_held_once_in_a_tight_pool(tiny_model_path):
    """A request asking for its prompt's log-probabilities computes a prompt the cache holds (10 blocks of 4), in
    chunks, in a pool of 16. It must switch to the cache's blocks as it inserts its own copies: holding both, it
    outgrows the pool, preempts itself, matches nothing again and recomputes, until ``run``'s step cap."""
    rng = random.Random(7)
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    first = dict(temperature=0, max_tokens=8, ignore_eos=True)
    second = dict(first, prompt_logprobs=1)
    reference = run(m3, m3.LLM(tiny_model_path, **LIMITS), [prompt, prompt], [first, second])
    llm = m4.LLM(tiny_model_path, **LIMITS, block_size=4, num_kv_blocks=16)
    ours = run(m4, llm, [prompt], [first]) + run(m4, llm, [prompt], [second])
    assert_same_outputs(ours, reference)
    assert llm.engine.kv_usage()["num_preemptions"] == 0
    checked(llm)


def test_trap_eviction_never_touches_locked_paths(tiny_model_path):
    llm = m4.LLM(tiny_model_path, **LIMITS, block_size=4, num_kv_blocks=30)
    engine, scheduler = llm.engine, llm.engine.scheduler
    long_runner = list(range(3000, 3040))
    engine.add_request(long_runner, m4.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), request_id="long")
    for _ in range(3):
        engine.step()
    rng = random.Random(5)
    for _ in range(12):  # a stream of one-off prompts fills the cache and forces eviction
        one_off = [rng.randrange(3, 49152) for _ in range(12)]
        engine.add_request(one_off, m4.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        checked(llm)
        if "long" in scheduler.locked:  # its cached prefix is locked: every block of it must still be in the tree
            cached, node = set(scheduler.tree.cached_blocks()), scheduler.locked["long"]
            while node is not scheduler.tree.root:
                assert node.lock_ref > 0 and set(node.blocks) <= cached, "a block of a locked path was evicted"
                assert node.parent.children.get(node.tokens[: scheduler.tree.block_size]) is node, (
                    "a locked node was cut out of the tree"
                )
                node = node.parent
    reference = m3.LLM(tiny_model_path, **LIMITS).generate(
        long_runner, m3.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False
    )
    rerun = llm.generate(long_runner, m4.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert rerun[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_trap_tiny_pool_interleaves_eviction_and_preemption(tiny_model_path, mixed, mixed_reference):
    llm = m4.LLM(tiny_model_path, **LIMITS, block_size=16, num_kv_blocks=12)
    assert_same_outputs(run(m4, llm, *mixed), mixed_reference)
    usage = llm.engine.kv_usage()
    assert usage["num_preemptions"] >= 5 and usage["prefix_hit_rate"] > 0
    checked(llm)


def test_sglangs_reservation_retracts_evicts_and_matches_m3(tiny_model_path, mixed, mixed_reference):
    """SGLang's admission (admission.py) in a tiny pool: the cached blocks no request locks count as room, evicted
    as they are needed, and requests are retracted before steps; the order of work changes, never a token."""
    llm = m4.LLM(tiny_model_path, **LIMITS, block_size=16, num_kv_blocks=12, **SGLANG)
    assert_same_outputs(run(m4, llm, *mixed), mixed_reference)
    usage = llm.engine.kv_usage()
    assert usage["num_preemptions"] >= 2 and usage["prefix_hit_rate"] > 0 and usage["refused_blocks"] > 0, usage
    checked(llm)


def test_cache_off_reports_no_hits(tiny_model_path):
    prompts, settings = shared_prefix_workload(6, prefix_len=40, seed=3)
    llm = m4.LLM(tiny_model_path, **LIMITS, enable_prefix_caching=False)
    outs = llm.generate(prompts, [m4.SamplingParams(**s) for s in settings], use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in outs) and llm.engine.kv_usage()["prefix_hit_rate"] == 0


def test_unknown_scheduling_policy_is_refused(tiny_model_path):
    with pytest.raises(ValueError, match="scheduling_policy"):
        m4.LLM(tiny_model_path, scheduling_policy="priority", **LIMITS)  # vLLM's, not one of these


@pytest.mark.real_model
def test_m4_matches_m3_on_the_bundled_model_with_a_shared_system_prompt():
    limits = dict(device="cpu", max_model_len=320, max_num_seqs=6, max_num_batched_tokens=64)
    ref_llm, llm = m3.LLM(**limits), m4.LLM(**limits)
    system = "You are a careful assistant. Answer in one short sentence, and never use lists. " * 3
    questions = ["What is the capital of Italy?", "Why is the sky blue?", "What is 7 times 8?",
                 "Name a large mammal.", "What do bees make?", "How many legs has a spider?"]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    params = [dict(temperature=0, max_tokens=24), dict(temperature=0.7, seed=3, max_tokens=24)] * 3
    ref = ref_llm.chat(chats, [m3.SamplingParams(**p) for p in params], use_tqdm=False)
    ours = llm.chat(chats, [m4.SamplingParams(**p) for p in params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.num_cached_tokens for o in ours) > 0
    checked(llm)


def test_a_request_asking_for_its_prompts_logprobs_computes_the_prompt_the_cache_holds(tiny_model_path):
    """vLLM's rule: prompt_logprobs skip the prefix cache, so a cached prompt still has every token scored (a hit
    would leave the cached tokens without a score); the prompt it computed then serves the requests after it."""
    prompts, settings = shared_prefix_workload(3, prefix_len=70, seed=2)
    settings[1]["prompt_logprobs"] = 2
    reference = run(m3, m3.LLM(tiny_model_path, **LIMITS), prompts, settings)
    llm = m4.LLM(tiny_model_path, **LIMITS)
    outs = [llm.generate(prompt, m4.SamplingParams(**s), use_tqdm=False)[0] for prompt, s in zip(prompts, settings)]
    assert_same_outputs(completions(outs), reference)
    block = llm.engine.config.block_size
    cached = [out.num_cached_tokens for out in outs]
    assert cached[1] == 0, f"the request asking for its prompt's log-probabilities took {cached[1]} cached tokens"
    assert cached[2] >= 70 // block * block, f"the request after it took {cached[2]} of the 70 shared tokens"
    checked(llm)


def test_the_samples_of_one_prompt_share_it_through_the_cache(tiny_model_path):
    """n samples of a 70-token prompt: the first computes it, the others wait for it and find it cached."""
    prompts, settings = shared_prefix_workload(1, prefix_len=70, seed=3)
    settings[0].update(n=4, temperature=1.0)
    reference = run(m3, m3.LLM(tiny_model_path, **LIMITS), prompts, settings)
    llm = m4.LLM(tiny_model_path, **LIMITS)
    assert_same_outputs(run(m4, llm, prompts, settings), reference)
    block = llm.engine.config.block_size
    cached = llm.engine.scheduler.num_cached_tokens
    assert cached >= 3 * ((len(prompts[0]) - 1) // block * block), (
        f"the 3 samples after the first found {cached} prompt tokens cached in all: each should find the whole "
        "prompt but its last token, which the first sample computed")
    checked(llm)
