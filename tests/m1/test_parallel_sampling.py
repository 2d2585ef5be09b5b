"""n samples of one prompt (``SamplingParams.n``): a child request per sample, gathered into one output.

vLLM's rule for seeds: sample i of a request seeded with s is what the request alone gives with seed s + i, so a
sample can be reproduced on its own. The chain then holds every later milestone to m1's samples.
"""

from __future__ import annotations

import pytest

from milestones.m1 import LLM, SamplingParams
from milestones.serving.parallel_sampling import ParentRequest
from milestones.serving.sampling_params import SEED_RANGE

PROMPT = [5, 17, 300, 42, 9, 1000, 77]


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, device="cpu", max_model_len=128)


def test_sample_i_is_the_request_alone_with_seed_plus_i(llm):
    settings = dict(temperature=2.0, top_k=50, max_tokens=10, ignore_eos=True)  # the tiny model is peaked
    (parent,) = llm.generate(PROMPT, SamplingParams(n=4, seed=40, **settings), use_tqdm=False)
    assert [c.index for c in parent.outputs] == [0, 1, 2, 3] and parent.finished
    for index, completion in enumerate(parent.outputs):
        alone = llm.generate(PROMPT, SamplingParams(seed=40 + index, **settings), use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == alone.token_ids, f"sample {index} is not the request alone, seed {40 + index}"
    assert len({tuple(c.token_ids) for c in parent.outputs}) > 1, "four seeds gave one answer: the seeds are not moved"


def test_unseeded_samples_differ_and_greedy_ones_agree(llm):
    (sampled,) = llm.generate(PROMPT, SamplingParams(n=3, temperature=2.0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1, "three unseeded samples were identical"
    (greedy,) = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_the_seed_of_the_last_samples_wraps_within_64_bits():
    params = SamplingParams(n=3, seed=SEED_RANGE[1] - 2)
    assert [ParentRequest.child_params(params, i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert all(ParentRequest.child_params(params, i).n == 1 for i in range(3))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_n_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=bad)


def test_aborting_the_parent_aborts_every_sample_and_frees_its_ids(llm):
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=20, ignore_eos=True), request_id="p")
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT, SamplingParams(), request_id="1_p")  # a sample's own id
    aborted = engine.abort_request("p")
    assert aborted.request_id == "p" and aborted.finished
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests() and engine.abort_request("p") is None
    engine.check_integrity()
    engine.add_request(PROMPT, SamplingParams(max_tokens=1), request_id="1_p")  # free again
    while engine.has_unfinished_requests():
        engine.step()


def test_a_parent_gives_one_output_per_step_with_every_sample(llm):
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=3, ignore_eos=True), request_id="q")
    seen = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        assert all(out.request_id == "q" for out in outputs) and len(outputs) <= 1
        seen += outputs
    assert seen[-1].finished and all(len(c.token_ids) == 3 for c in seen[-1].outputs)
    assert not any(out.finished for out in seen[:-1]), "the parent finished before its last sample"
    metrics = seen[-1].metrics
    assert metrics.num_output_tokens == 6, "the parent's metrics count every sample's tokens"
    assert metrics.finished_time is not None and metrics.first_token_time <= metrics.last_token_time
    assert seen[0].metrics.finished_time is None
