"""The hand-shake and the transfer: the keys and values that arrive are bit for bit those the prefill worker
computed, and a request aborted in any state gives its blocks back on both sides."""

from __future__ import annotations

import pytest
import torch

from milestones import m9
from tests.chain import LIMITS
from tests.m9.conftest import PD

PREFILL, DECODE = 0, 1  # the workers' numbers: prefill workers first


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    # chunks of 8 tokens: a 200-token prompt takes 25 steps to prefill, long enough to be seen prefilling
    with m9.LLM(tiny_model_path, **(LIMITS | dict(max_num_batched_tokens=8)), **PD, num_kv_blocks=80,
                block_size=4, enforce_eager=True) as llm:
        yield llm


def queues(llm) -> dict[str, dict]:
    return {name: stats["queues"] for name, stats in llm.engine.disaggregation_stats().items()}


def step_until(llm, done, limit: int = 2_000) -> list:
    """Step until ``done(outputs so far)``; every worker's books checked after each step."""
    outputs = []
    for _ in range(limit):
        outputs += llm.engine.step()
        llm.engine.check_integrity()
        if done(outputs):
            return outputs
    raise AssertionError(f"not done after {limit} steps; the queues: {queues(llm)}")


def all_blocks_back(llm) -> None:
    usage = llm.engine.kv_usage()
    assert usage["blocks_in_use"] == 0, f"blocks are still held: {usage}, the queues: {queues(llm)}"
    assert not llm.engine.has_unfinished_requests()


def test_the_blocks_that_arrive_are_those_the_prefill_worker_computed(llm):
    prompt = [7 + (i * 31) % 4000 for i in range(48)]  # 12 whole blocks of 4: all of them stay in its prefix cache
    request = llm.engine.add_request(prompt, m9.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    step_until(llm, lambda outs: any(o.request_id == request and o.finished for o in outs))  # decoded over there
    # Each worker's prefix cache keeps the prompt's 12 blocks: the prefill worker's as it computed them, the decode
    # worker's as they arrived in the blocks it reserved (its tree took them from the request's table)
    sent, arrived = llm.engine.prompt_kv(PREFILL, prompt), llm.engine.prompt_kv(DECODE, prompt)
    assert sent.shape == arrived.shape and sent.shape[3] == 12, (sent.shape, arrived.shape)
    assert torch.equal(sent, arrived), f"the keys and values differ by up to {(sent - arrived).abs().max():.3g}"
    assert arrived.abs().sum() > 0, "nothing was written"
    stats = llm.engine.disaggregation_stats()["decode worker 0"]
    assert stats["transfer_bytes"] == sent.numel() * sent.element_size(), "what was sent, received once"
    all_blocks_back(llm)


def test_a_request_waiting_for_blocks_on_the_decode_side_is_aborted(llm):
    """A decode pool full of a long request: the next waits in prealloc (its prefill never starts) until aborted."""
    big = llm.engine.add_request(list(range(3, 203)), m9.SamplingParams(temperature=0, max_tokens=48,
                                                                         ignore_eos=True))
    step_until(llm, lambda outs: any(o.request_id == big and len(o.outputs[0].token_ids) >= 2 for o in outs))
    blocked = llm.engine.add_request(list(range(300, 428)), m9.SamplingParams(max_tokens=8))
    step_until(llm, lambda outs: blocked in queues(llm)["decode worker 0"]["prealloc"], limit=50)
    assert blocked in queues(llm)["prefill worker 0"]["bootstrap"], "no prefill before its blocks are reserved"
    out = llm.engine.abort_request(blocked)
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    step_until(llm, lambda outs: any(o.request_id == big and o.finished for o in outs))
    assert not any(queues(llm)[w][q] for w, q in [("decode worker 0", "prealloc"), ("prefill worker 0", "bootstrap")])
    all_blocks_back(llm)


def caught_prefilling(llm, victim: str) -> bool:
    """Relay the victim's reservation (a router step), then ask the prefill worker, as fast as the pipes answer,
    until it holds the victim in its scheduler (True) or has handed it off (False: it raced ahead)."""
    step_until(llm, lambda outs: victim not in queues(llm)["prefill worker 0"]["bootstrap"], limit=50)
    while victim not in (now := queues(llm))["prefill worker 0"]["prefilling"]:
        if victim in now["decode worker 0"]["transfer"] + now["decode worker 0"]["decoding"]:
            return False
    return True


@pytest.mark.parametrize("when", ["prefilling", "just handed off", "decoding"])
def test_a_request_aborted_on_either_side_gives_its_blocks_back(llm, when):
    """Aborted while its prompt is computed in chunks, as soon as its first token is out (its blocks in transfer, or
    just arrived), or while it decodes: both workers let it go, and a request beside it is unharmed. The prefill
    worker computes on its own once the router relays the reservation, so a victim that raced past its prefill before
    the test could look is aborted all the same (whatever state it is in, its blocks must come back) and another one
    tried, up to five."""
    params = m9.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    other = llm.engine.add_request(list(range(500, 520)), m9.SamplingParams(temperature=0, max_tokens=200,
                                                                             ignore_eos=True))  # outlives each victim
    seen: list = []
    for attempt in range(5):
        victim = llm.engine.add_request(list(range(600 + attempt, 800 + attempt)), params)  # 25 chunks of 8
        if when == "prefilling":
            caught = caught_prefilling(llm, victim)
        else:
            first = 1 if when == "just handed off" else 4
            seen += step_until(llm, lambda outs, v=victim, f=first: any(o.request_id == v and
                                                                        len(o.outputs[0].token_ids) >= f for o in outs))
            caught = True
        out = llm.engine.abort_request(victim)
        assert out.finished and out.outputs[0].finish_reason == "abort"
        after = step_until(llm, lambda outs: not queues(llm)["decode worker 0"]["transfer"], limit=200)
        assert all(o.request_id != victim for o in after), "an aborted request's outputs stop"
        seen += after
        if caught:
            break
    else:
        pytest.fail(f"five victims raced past their prefill before the test saw them: {queues(llm)}")
    if not any(o.request_id == other and o.finished for o in seen):
        step_until(llm, lambda outs: any(o.request_id == other and o.finished for o in outs))
    all_blocks_back(llm)
