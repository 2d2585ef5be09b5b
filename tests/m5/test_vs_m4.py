"""m5 against m4 token for token, with the decode step captured and with it eager, plus the traps of replay.

On a CPU a capture is a torch.compile per batch size (tens of seconds each on two cores), so
these tests capture few sizes, chosen so that batches both fit a bucket exactly and need padding.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from milestones import m4, m5
from tests.chain import LIMITS, assert_same_outputs, mixed_workload, run
from tests.conftest import needs_compiler
from tests.m4.test_vs_m3 import shared_prefix_workload

pytestmark = needs_compiler  # torch.compile on a CPU builds C++
SIZES = [1, 2, 4]  # a batch of 3 is padded to 4; a batch of 5 runs eagerly

# SGLang's admission (admission.py), its ratio low and decaying fast, so that requests are retracted
SGLANG = dict(new_token_ratio=0.2, min_new_token_ratio=0.01, new_token_ratio_decay=0.05)


@pytest.fixture(scope="module")
def captured(tiny_model_path):
    return m5.LLM(tiny_model_path, cudagraph_capture_sizes=SIZES, **LIMITS)


@pytest.fixture(scope="module")
def mixed():
    return mixed_workload(16, seed=3, max_prompt=90, max_output=40)


def checked(llm):
    llm.engine.check_integrity()
    return llm


def test_m5_matches_m4_on_a_mixed_workload(tiny_model_path, captured, mixed):
    reference = run(m4, m4.LLM(tiny_model_path, **LIMITS), *mixed)
    before = captured.engine.graph_stats()
    assert_same_outputs(run(m5, checked(captured), *mixed), reference)
    stats = captured.engine.graph_stats()
    assert stats["captured_sizes"] == SIZES
    assert stats["replays"] > before["replays"] and stats["eager_steps"] > before["eager_steps"]
    # a CPU's steps with prefill, and decode steps of more requests than the largest bucket, run eagerly, each counted
    assert set(stats["eager_reasons"]) == {
        "a step with prefill on a CPU: no graphs to cut around attention",
        "a decode step of 5 rows (5 requests): more than the largest captured batch (4)"}, stats
    assert stats["piecewise_sizes"] == [] and stats["piecewise_replays"] == 0
    eager = m5.LLM(tiny_model_path, enforce_eager=True, **LIMITS)
    assert_same_outputs(run(m5, eager, *mixed), reference)
    stats = eager.engine.graph_stats()
    assert stats["replays"] == 0 and list(stats["eager_reasons"]) == ["enforce_eager=True"], stats
    checked(captured)


@pytest.mark.parametrize("admission", [{}, SGLANG, {"batch_shape": "prefill-first"}],
                         ids=["headroom", "sglang", "prefill-first"])
def test_m5_matches_m4_with_preemption_and_prefix_hits(tiny_model_path, admission):
    prompts, settings = shared_prefix_workload(10, prefix_len=40, seed=5)
    settings = [dict(s, max_tokens=30) for s in settings]  # long decodes, so steps of decodes alone happen
    tight = dict(LIMITS, num_kv_blocks=30, block_size=8, **admission)  # too few blocks for everyone: preemption
    reference = run(m4, m4.LLM(tiny_model_path, **tight), prompts, settings)
    llm = m5.LLM(tiny_model_path, cudagraph_capture_sizes=SIZES, **tight)
    assert_same_outputs(run(m5, llm, prompts, settings), reference)
    usage = llm.engine.kv_usage()
    assert usage["num_preemptions"] > 0 and usage["prefix_hit_rate"] > 0
    stats = llm.engine.graph_stats()
    assert stats["replays"] > 0, stats
    # the headroom's schedule has decode steps between the captured sizes, replayed padded; the reservation's decodes
    # only at captured sizes or above the largest (eager), so it pads nothing
    assert stats["padded_rows"] > 0 or admission, stats
    checked(llm)


def test_a_padded_replay_writes_only_the_real_requests_blocks(captured):
    engine = captured.engine
    params = m5.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(["One request", "Two requests here", "And a third one"]):
        engine.add_request(prompt, params, request_id=f"pad{i}")
    engine.step()  # the three prompts
    runner, before = engine.runner, engine.graph_stats()
    k_before, v_before = runner.k_cache.clone(), runner.v_cache.clone()
    tables = {r: list(t) for r, t in engine.scheduler.block_manager.block_tables.items()}
    engine.step()  # three decodes, replayed as a batch of four
    after = engine.graph_stats()
    assert after["replays"] == before["replays"] + 1 and after["padded_rows"] == before["padded_rows"] + 1
    touched = {b for t in tables.values() for b in t} | {runner.graph_runner.scratch_block}
    untouched = [b for b in range(runner.k_cache.shape[2]) if b not in touched]
    assert torch.equal(runner.k_cache[:, :, untouched], k_before[:, :, untouched])
    assert torch.equal(runner.v_cache[:, :, untouched], v_before[:, :, untouched])
    while engine.has_unfinished_requests():
        engine.step()
    checked(captured)


def test_a_small_batch_after_a_large_one_decodes_as_it_does_alone(tiny_model_path, captured):
    params = m5.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["A long story begins here and goes on", "Second", "Third one", "Fourth and last"]
    reference = m4.LLM(tiny_model_path, **LIMITS)
    alone = reference.generate("Alone", m4.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    captured.generate(prompts, params, use_tqdm=False)  # fills the static block tables of four rows
    assert captured.generate("Alone", params, use_tqdm=False)[0].outputs[0].token_ids == alone
    two = captured.generate(["Alone", "Second"], params, use_tqdm=False)  # bucket 2 after bucket 4
    assert two[0].outputs[0].token_ids == alone
    checked(captured)


def test_replaying_never_recompiles(captured):
    from torch._dynamo.utils import counters

    params = m5.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    captured.generate(["Warm", "up", "all", "sizes"], params, use_tqdm=False)
    graphs_before = counters["stats"]["unique_graphs"]
    replays_before = captured.engine.graph_stats()["replays"]
    captured.generate(["One", "two", "three"], params, use_tqdm=False)
    captured.generate("Just one", params, use_tqdm=False)
    assert captured.engine.graph_stats()["replays"] > replays_before
    assert counters["stats"]["unique_graphs"] == graphs_before, "a replay compiled a new graph"


def test_a_replay_leaves_guard_checks_on_for_the_rest_of_the_process(captured):
    """A replay skips the guards that cannot fail (milestones/kernels/cpu_graphs.py) through a process-wide stance: it
    must be back to checking every guard once the replay returns, or other compiled code would run unchecked."""
    from torch._dynamo import eval_frame

    if not hasattr(eval_frame, "_stance"):
        pytest.skip(f"torch {torch.__version__} keeps dynamo's stance elsewhere: nothing to read it from")
    params = m5.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    replays_before = captured.engine.graph_stats()["replays"]
    captured.generate(["Guards", "back"], params, use_tqdm=False)
    assert captured.engine.graph_stats()["replays"] > replays_before
    assert eval_frame._stance.skip_guard_eval_unsafe is False


def test_each_engine_replays_its_own_capture(tiny_model_path, captured, tmp_path):
    """Two engines in one process, on two models alike in every shape and weight but one constant (RMSNorm's
    epsilon, which the compiled step holds as a number): each replays what it captured. A runner keeps no guards
    on its model, so if the two shared compiled entries, the second would replay the first's step."""
    other = tmp_path / "other-eps"
    shutil.copytree(tiny_model_path, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (other / "config.json").write_text(json.dumps(config))

    def tokens(mod, llm) -> list[int]:
        params = mod.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return llm.generate([[5, 17, 29, 3, 11]], params, use_tqdm=False)[0].outputs[0].token_ids

    assert captured.engine.graph_stats()["captured_sizes"] == SIZES  # the first engine's entries exist
    want = tokens(m4, m4.LLM(other, **LIMITS))
    assert want != tokens(m4, m4.LLM(tiny_model_path, **LIMITS)), "epsilon must change the tokens, or this is no test"
    second = m5.LLM(other, cudagraph_capture_sizes=[1], **LIMITS)
    assert tokens(m5, second) == want
    assert second.engine.graph_stats()["replays"] > 0


def test_a_weight_changed_in_place_after_capture_is_read(tiny_model_path):
    """Capture freezes the weights into the compiled step as constants: they must stay the model's own tensors, not
    copies. Every token's embedding moves to the next token id, in place, after capture, in m4 and in m5 alike: a
    replay that still read a copy would decode from the old embeddings."""
    def tokens(mod, llm) -> list[int]:
        params = mod.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return llm.generate([[5, 17, 29, 3, 11]], params, use_tqdm=False)[0].outputs[0].token_ids

    def shift_embeddings(llm) -> None:
        weight = llm.engine.runner.model.model.embed_tokens.weight
        with torch.no_grad():
            weight.copy_(weight.roll(1, dims=0))

    eager, captured = m4.LLM(tiny_model_path, **LIMITS), m5.LLM(tiny_model_path, cudagraph_capture_sizes=[1], **LIMITS)
    before = tokens(m4, eager)
    assert tokens(m5, captured) == before
    shift_embeddings(eager)
    shift_embeddings(captured)
    want = tokens(m4, eager)
    assert want != before, "the shifted embeddings must change the tokens, or this is no test"
    replays = captured.engine.graph_stats()["replays"]
    assert tokens(m5, captured) == want
    assert captured.engine.graph_stats()["replays"] > replays


@pytest.mark.parametrize("sizes", [[0], [6], [], "4", [True]])
def test_capture_sizes_are_checked(tiny_model_path, sizes):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        m5.LLM(tiny_model_path, cudagraph_capture_sizes=sizes, **LIMITS)


@pytest.mark.real_model
def test_m5_matches_m4_on_the_bundled_model(bundled_model_path):
    prompts, settings = mixed_workload(6, seed=11, max_prompt=40, max_output=24)
    limits = dict(device="cpu", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64)
    reference = run(m4, m4.LLM(bundled_model_path, **limits), prompts, settings)
    llm = m5.LLM(bundled_model_path, cudagraph_capture_sizes=[2], **limits)  # one capture: a batch of 1 is padded
    assert_same_outputs(run(m5, llm, prompts, settings), reference)
    stats = llm.engine.graph_stats()
    assert stats["replays"] > 0 and stats["padded_rows"] > 0
    checked(llm)
