"""LLMEngine._process on a few requests, one call of step() at a time, with the one-step lag on.

test_vs_m5 runs whole workloads, where a step left uncounted, a token kept after a request finished or a step
that raised and was not undone surfaces as a different token or an integrity message much later. Here each
rule of _process is checked right after the call that breaks it, with a message that names it.
"""

from __future__ import annotations

import pytest

from milestones import m6

LIMITS = dict(device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=True,
              async_scheduling=True)
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture
def llm(tiny_model_path):
    with m6.LLM(tiny_model_path, **LIMITS) as llm:
        yield llm


def test_each_processed_step_is_counted_and_traced(llm, monkeypatch):
    engine, recorded = llm.engine, []
    real_record = engine.tracer.record
    monkeypatch.setattr(engine.tracer, "record", lambda name, *args: (recorded.append((name, args[1])),
                                                                       real_record(name, *args)))
    engine.add_request([5, 6, 7, 8], m6.SamplingParams(max_tokens=4, **GREEDY))
    calls = 0
    while engine.has_unfinished_requests() or engine.pending:
        engine.step()
        calls += 1
        processed = [number for name, number in recorded if name == "process"]
        assert engine.num_steps == calls - 1 == len(processed) or not engine.pending, (
            f"after {calls} calls of step(), one step in flight, num_steps is {engine.num_steps} and the trace has "
            f"{len(processed)} 'process' events: _process counts every step it processes (self.num_steps += 1) and "
            "records it (self.tracer.record('process', start, launched.number, len(launched.seqs)))"
        )
    processed = [number for name, number in recorded if name == "process"]
    assert processed == list(range(1, engine.num_steps + 1)), (
        f"'process' events for steps {processed}: one per step, with its number, launched.number"
    )


def step_past_a_stop(engine) -> list:
    """engine.step(), where an IndexError means a token went to a request that had already stopped."""
    try:
        return engine.step()
    except IndexError as error:
        raise AssertionError(
            f"engine.step() raised IndexError ({error}): a step in flight when a request stopped brought it one more "
            "token, and its place in token_ids is gone (drop_pending_tokens): _process skips a sample_seq that is "
            "already finished, and drops its token"
        ) from error


def test_a_request_that_stops_leaves_at_once_without_the_token_in_flight(llm):
    """A stop token is seen only when its step is processed, with the next step already launched for the request:
    the token that step computes is dropped, and the request's place and blocks come back at once."""
    engine, prompt = llm.engine, [5, 6, 7, 8]
    alone = llm.generate(prompt, m6.SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i in range(1, 6) if alone[i] not in alone[:i])  # the first token that ends it there
    short = engine.add_request(prompt, m6.SamplingParams(max_tokens=6, stop_token_ids=[alone[stop_at]], **GREEDY))
    engine.add_request([9, 10, 11], m6.SamplingParams(max_tokens=8, **GREEDY))
    seq = engine.scheduler.find(short)
    for _ in range(10):
        outputs = {out.request_id: out for out in step_past_a_stop(engine)}
        for out in outputs.values():
            assert all(t >= 0 for t in out.outputs[0].token_ids), (
                f"request {out.request_id}'s output holds a future id: _accept_token puts each token in place of "
                "its future id, and a request that finishes drops the tokens of the step still in flight "
                "(drop_pending_tokens(seq))"
            )
        if short in outputs and outputs[short].finished:
            break
    else:
        raise AssertionError("the request never stopped: _accept_token applies the stop rules")
    want = alone[: stop_at + 1]
    assert seq.output_token_ids == want and outputs[short].outputs[0].token_ids == want, (
        f"the stopped request holds {seq.output_token_ids}, expected {want}: up to its stop token, not the token "
        "its next step, already launched, computes (drop_pending_tokens(seq))"
    )
    assert seq.num_pending_tokens == 0, (
        f"the stopped request still counts {seq.num_pending_tokens} pending tokens: a request that finishes in "
        "_process has the tokens of its steps in flight dropped (drop_pending_tokens(seq))"
    )
    assert seq not in engine.scheduler.running and short not in engine.scheduler.block_manager.block_tables, (
        "a request that finishes in _process gives its place and blocks back at once: self.scheduler.finish(seq)"
    )
    engine.check_integrity()
    in_flight = engine.pending
    assert in_flight is not None and seq in [row.seq for row in in_flight.rows], "the step in flight has it"
    outputs = step_past_a_stop(engine)  # processes the step that still computed a token for the finished request
    assert all(out.request_id != short for out in outputs) and seq.output_token_ids == want, (
        "the step in flight when the request stopped brought it one more token, which must be dropped: "
        "_process skips a sample_seq that is already finished"
    )


class Halt(BaseException):
    """Not an Exception: what a wait interrupted by Ctrl-C raises."""


def test_a_step_whose_result_raises_is_undone_and_the_error_reaches_the_caller(llm, monkeypatch):
    engine = llm.engine
    request_id = engine.add_request([5, 6, 7, 8], m6.SamplingParams(max_tokens=6, **GREEDY))
    engine.step()
    engine.step()
    seq = engine.scheduler.find(request_id)
    before = (list(seq.token_ids), seq.num_computed_tokens)
    real_result = engine.worker.result

    def interrupted(step_number):
        real_result(step_number)  # the step is computed; the wait for its tokens is what fails
        raise Halt

    monkeypatch.setattr(engine.worker, "result", interrupted)
    with pytest.raises(Halt):
        engine.step()
    monkeypatch.setattr(engine.worker, "result", real_result)
    assert engine.pending is None and seq.num_pending_tokens == 0 and all(t >= 0 for t in seq.token_ids), (
        f"after the failed wait the request holds {seq.token_ids} with {seq.num_pending_tokens} pending tokens "
        "and a step pending: when self.worker.result raises anything (a BaseException too), _process calls "
        "roll_back(launched, self.pending), which undoes that step and the one launched after it, then raises again"
    )
    assert seq.token_ids == before[0][: len(seq.token_ids)] and seq.num_computed_tokens <= before[1], (
        "the rolled-back steps' tokens and computed tokens are gone"
    )
    engine.check_integrity()
    while engine.has_unfinished_requests() or engine.pending:
        engine.step()
    assert seq.is_finished and len(seq.output_token_ids) == 6, "the engine goes on after a step is undone"


def test_a_request_preempted_while_its_step_computes_gets_no_processed_tokens(llm, monkeypatch):
    """The next schedule() preempts a request whose step is in flight and schedules nothing (as when a request short
    of blocks preempts itself): when that step is processed, the request's blocks are gone, so nothing of it counts
    as written for the prefix cache."""
    engine = llm.engine
    request_id = engine.add_request(list(range(40, 52)), m6.SamplingParams(max_tokens=3, **GREEDY))
    engine.step()  # the prefill is launched, not processed
    seq, schedule = engine.scheduler.find(request_id), engine.scheduler.schedule

    def preempting():
        engine.scheduler._preempt(seq)
        return None

    monkeypatch.setattr(engine.scheduler, "schedule", preempting)
    engine.step()
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    assert seq.num_processed_tokens == 0, (
        f"the preempted request has num_processed_tokens={seq.num_processed_tokens} after its step was processed, "
        "expected 0: _process sets num_processed_tokens only for the launched requests still RUNNING (a preempted "
        "or finished one's blocks are no longer its own, and the prefix cache would take blocks it never wrote)"
    )
    engine.check_integrity()
    while engine.has_unfinished_requests() or engine.pending:
        engine.step()
    assert seq.is_finished and len(seq.output_token_ids) == 3, "the preempted request is recomputed and finishes"
