"""m6 against m5 token for token, with async scheduling on and off, plus the traps of the one-step lag.

m6 launches step N+1 before it has processed step N, so a request that finishes at step N
is already in step N+1: these tests check that its extra token never shows, that its blocks
and locks are given back exactly once, and that failures and aborts in flight leave the
engine consistent.
"""

from __future__ import annotations

import gc
import json
import threading

import pytest
import torch

from milestones import m5, m6
from milestones.trace import hidden_host_share
from tests.chain import LIMITS, assert_same_outputs, completions, mixed_workload, run, stepped, stop_rules_from
from tests.conftest import needs_compiler
from tests.m4.test_vs_m3 import shared_prefix_workload

EAGER = dict(LIMITS, enforce_eager=True)

# SGLang's admission (admission.py), its ratio low and decaying fast, so that requests are retracted
SGLANG = dict(new_token_ratio=0.2, min_new_token_ratio=0.01, new_token_ratio_decay=0.05)


@pytest.fixture(scope="module")
def mixed():
    return mixed_workload(16, seed=3, max_prompt=90, max_output=40)


@pytest.fixture(scope="module")
def mixed_reference(tiny_model_path, mixed):
    return run(m5, m5.LLM(tiny_model_path, **EAGER), *mixed)


def assert_all_blocks_returned(llm):
    usage = llm.engine.kv_usage()
    assert usage["blocks_in_use"] == 0
    assert usage["blocks_free"] + usage["blocks_cached"] == llm.engine.scheduler.block_manager.num_blocks
    tree = llm.engine.scheduler.tree
    assert tree is None or tree.root.lock_ref == 1, "a radix lock was never released"


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_m6_matches_m5_on_a_mixed_workload(tiny_model_path, mixed, mixed_reference, async_scheduling):
    with m6.LLM(tiny_model_path, async_scheduling=async_scheduling, **EAGER) as llm:
        assert_same_outputs(stepped(llm.engine, m6.SamplingParams, *mixed).completions, mixed_reference)
        assert_all_blocks_returned(llm)
        assert_same_outputs(run(m6, llm, *mixed), mixed_reference)  # and through generate, on a warm engine


@needs_compiler
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_m6_matches_m5_with_the_decode_step_captured(tiny_model_path, mixed, mixed_reference, async_scheduling):
    sizes = [1, 4]  # batches of 2 and 3 are padded to 4, batches of 5 run eagerly
    with m6.LLM(tiny_model_path, async_scheduling=async_scheduling, cudagraph_capture_sizes=sizes, **LIMITS) as llm:
        assert_same_outputs(stepped(llm.engine, m6.SamplingParams, *mixed).completions, mixed_reference)
        stats = llm.engine.graph_stats()
        assert stats["replays"] > 0 and stats["padded_rows"] > 0 and stats["eager_steps"] > 0, stats


@pytest.mark.parametrize("admission", [{}, SGLANG, {"batch_shape": "prefill-first"}],
                         ids=["headroom", "sglang", "prefill-first"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_m6_matches_m5_with_preemption_and_prefix_hits(tiny_model_path, async_scheduling, admission):
    prompts, settings = shared_prefix_workload(10, prefix_len=40, seed=5)
    settings = [dict(s, max_tokens=30) for s in settings]
    tight = dict(EAGER, num_kv_blocks=30, block_size=8, **admission)  # too few blocks for everyone: preemption
    reference = run(m5, m5.LLM(tiny_model_path, **tight), prompts, settings)
    with m6.LLM(tiny_model_path, async_scheduling=async_scheduling, **tight) as llm:
        assert_same_outputs(stepped(llm.engine, m6.SamplingParams, prompts, settings).completions, reference)
        usage = llm.engine.kv_usage()
        assert usage["num_preemptions"] > 0 and usage["prefix_hit_rate"] > 0
        assert_all_blocks_returned(llm)


def test_trap_every_request_finishes_at_a_different_step(tiny_model_path):
    """Requests end one step apart (by length, by EOS-like stop tokens, by stop strings): each drops its lag token."""
    prompts = [f"Request number {i} tells a story about" for i in range(8)]
    greedy = [dict(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(8)]
    small_blocks = dict(EAGER, block_size=4)  # so that many lag tokens would complete a block
    reference = run(m5, m5.LLM(tiny_model_path, **small_blocks), prompts, greedy)
    settings = stop_rules_from(reference, greedy)  # a token, and a string, from the middle of what each generates
    reference_llm = m5.LLM(tiny_model_path, **small_blocks)  # a fresh cache, to compare with m6's at the end
    reference = run(m5, reference_llm, prompts, settings)
    assert {done.finish_reason for done in reference} == {"stop", "length"}
    with m6.LLM(tiny_model_path, async_scheduling=True, **small_blocks) as llm:
        ours = stepped(llm.engine, m6.SamplingParams, prompts, settings).completions
        assert_same_outputs(ours, reference)
        # A finished request caches what m5 would: not the token its lag step was computing.
        assert llm.engine.kv_usage()["blocks_cached"] == reference_llm.engine.kv_usage()["blocks_cached"]
        for (tokens, *_), s in zip(ours, settings):
            assert len(tokens) <= s["max_tokens"]
            stops = set(s.get("stop_token_ids", []))
            assert not stops & set(tokens[:-1]), "a token came after a stop token"
        assert_all_blocks_returned(llm)


def test_a_request_finishing_by_length_gives_up_its_place_at_once(tiny_model_path):
    """Requests that all end by max_tokens: m6 knows at launch which step samples their last token, so a waiting
    request takes the place in the very next step, as in m5, and the run takes no more steps than m5's."""
    prompts = [f"Tell me about the number {i}." for i in range(12)]
    settings = [dict(temperature=0, max_tokens=2 + i % 5, ignore_eos=True) for i in range(12)]
    few_places = dict(EAGER, max_num_seqs=3)
    reference_llm = m5.LLM(tiny_model_path, **few_places)
    reference = run(m5, reference_llm, prompts, settings)
    with m6.LLM(tiny_model_path, async_scheduling=True, **few_places) as llm:
        assert_same_outputs(stepped(llm.engine, m6.SamplingParams, prompts, settings).completions, reference)
        assert llm.engine.num_steps == reference_llm.engine.num_steps, (
            f"{llm.engine.num_steps} steps where m5 took {reference_llm.engine.num_steps}: a request that reaches "
            "max_tokens gives its place back when the step that samples its last token is processed "
            "(self.scheduler.finish in _process), and every processed step counts once (self.num_steps += 1)"
        )


def test_a_step_is_in_flight_between_calls(tiny_model_path):
    with m6.LLM(tiny_model_path, async_scheduling=True, **EAGER) as llm:
        engine = llm.engine
        engine.add_request("Hello there", m6.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert engine.step() == []  # the prefill computes while the caller gets on
        assert engine.pending is not None
        outputs = engine.step()  # the first decode launched, the prefill's token processed
        assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 1
        engine.check_integrity()


def test_abort_while_a_step_is_in_flight(tiny_model_path, mixed, mixed_reference):
    prompts, settings = mixed
    with m6.LLM(tiny_model_path, async_scheduling=True, **EAGER) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, m6.SamplingParams(**s)) for p, s in zip(prompts, settings)]
        victim = None
        finished = {}
        while engine.has_unfinished_requests() or engine.pending:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            running = [s for s in engine.scheduler.running if s.num_pending_tokens and s.request_id not in finished]
            if victim is None and engine.pending and running:
                victim = running[0].request_id
                aborted = engine.abort_request(victim)
                assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
                assert all(t >= 0 for t in aborted.outputs[0].token_ids)
            engine.check_integrity()
        assert victim is not None and victim not in finished
        for request_id, expected in zip(ids, mixed_reference):
            if request_id != victim:
                assert_same_outputs(completions([finished[request_id]]), [expected])
        assert_all_blocks_returned(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_exception_in_the_forward_reaches_the_caller_and_the_engine_stays_usable(
    tiny_model_path, mixed, mixed_reference, async_scheduling
):
    with m6.LLM(tiny_model_path, async_scheduling=async_scheduling, **EAGER) as llm:
        calls, real_run = [], llm.engine.runner.execute

        def failing_run(inputs):
            calls.append(1)
            if len(calls) == 6:
                raise RuntimeError("injected failure in the forward")
            return real_run(inputs)

        llm.engine.runner.execute = failing_run  # what the worker calls to compute a step
        with pytest.raises(RuntimeError, match="injected failure") as caught:
            llm.generate(*mixed_as_params(mixed), use_tqdm=False)
        frames = [entry.name for entry in caught.traceback]
        assert "failing_run" in frames, "the worker's traceback was lost"
        llm.engine.check_integrity()
        assert not llm.engine.has_unfinished_requests() and not llm.engine.pending
        assert_all_blocks_returned(llm)
        assert_same_outputs(run(m6, llm, *mixed), mixed_reference)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failed_step_is_undone_so_stepping_on_gives_m5s_tokens(tiny_model_path, mixed, mixed_reference,
                                                                  async_scheduling):
    with m6.LLM(tiny_model_path, async_scheduling=async_scheduling, **EAGER) as llm:
        engine, calls = llm.engine, []
        real_run = engine.runner.execute

        def fails_once(inputs):
            calls.append(1)
            if len(calls) == 9:
                raise RuntimeError("injected failure in the forward")
            return real_run(inputs)

        engine.runner.execute = fails_once
        ours, failures = stepped(engine, m6.SamplingParams, *mixed, tolerated=(RuntimeError,))
        assert failures == 1
        assert_same_outputs(ours, mixed_reference)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_blocks_a_failed_step_was_to_fill_never_reach_the_prefix_cache(tiny_model_path, async_scheduling):
    """A request aborted while its step is in flight, and that step fails: the blocks it never wrote are not shared
    (a request with the same prompt would read them as its cached prefix)."""
    prompt = [[100 + (7 * i) % 900 for i in range(60)]]  # 60 tokens: a first chunk of 24 fills three blocks of 8
    params = [dict(temperature=0, max_tokens=8, ignore_eos=True)]
    small_blocks = dict(EAGER, block_size=8)
    reference = run(m5, m5.LLM(tiny_model_path, **small_blocks), prompt, params)
    with m6.LLM(tiny_model_path, async_scheduling=async_scheduling, **small_blocks) as llm:
        engine, real_run = llm.engine, llm.engine.runner.execute

        def fails(inputs):
            raise RuntimeError("injected failure in the forward")

        engine.runner.execute = fails
        request_id = engine.add_request(prompt[0], m6.SamplingParams(**params[0]))
        failures = 0
        for action in (engine.step, lambda: engine.abort_request(request_id), engine.step):
            try:
                action()  # with async scheduling the first step fails one call later, after the abort
            except RuntimeError:
                failures += 1
            engine.check_integrity()
        assert failures == 1 and not engine.pending
        assert engine.kv_usage()["blocks_cached"] == 0, "the prefix cache holds blocks that no step wrote"
        engine.runner.execute = real_run
        assert_same_outputs(run(m6, llm, prompt, params), reference)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_interrupted_wait_loses_no_step(tiny_model_path, mixed, mixed_reference, async_scheduling):
    """Ctrl-C while the host waits for a step's tokens: that step is undone, and the results of later steps are
    not mistaken for it (its result still arrives, late)."""
    with m6.LLM(tiny_model_path, async_scheduling=async_scheduling, **EAGER) as llm:
        engine = llm.engine
        engine.worker.steps.results = InterruptedOnce(engine.worker.steps.results, at_wait=7)
        ours, interruptions = stepped(engine, m6.SamplingParams, *mixed, tolerated=(KeyboardInterrupt,))
        assert interruptions == 1
        assert_same_outputs(ours, mixed_reference)


class InterruptedOnce:
    """A result queue whose n-th wait raises KeyboardInterrupt, as Ctrl-C does in the waiting thread."""

    def __init__(self, results, at_wait: int) -> None:
        self.results, self.at_wait, self.waits = results, at_wait, 0

    def put(self, item) -> None:
        self.results.put(item)

    def get(self, *args, **kwargs):
        self.waits += 1
        if self.waits == self.at_wait:
            raise KeyboardInterrupt  # before the result is taken: it stays in the queue
        return self.results.get(*args, **kwargs)


class Halt(BaseException):
    """Not an Exception: what a forward could raise that a plain ``except Exception`` would miss."""


def test_a_base_exception_in_the_forward_reaches_the_caller(tiny_model_path, mixed, mixed_reference):
    with m6.LLM(tiny_model_path, async_scheduling=True, **EAGER) as llm:
        real_run = llm.engine.runner.execute

        def halts(inputs):
            raise Halt("injected")

        llm.engine.runner.execute = halts
        with pytest.raises(Halt):
            llm.generate(*mixed_as_params(mixed), use_tqdm=False)
        llm.engine.check_integrity()
        assert llm.engine.worker.steps.thread.is_alive()
        llm.engine.runner.execute = real_run
        assert_same_outputs(run(m6, llm, *mixed), mixed_reference)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_dead_worker_is_reported_not_waited_for(tiny_model_path):
    llm = m6.LLM(tiny_model_path, async_scheduling=True, **EAGER)

    def dies(step_number, inputs):
        raise SystemExit  # ends the worker's thread without a result

    llm.engine.worker._compute = dies
    errors = []

    def generate():
        try:
            llm.generate("Hello", m6.SamplingParams(max_tokens=3), use_tqdm=False)
        except RuntimeError as error:
            errors.append(error)

    caller = threading.Thread(target=generate, daemon=True)  # so that a hang fails the test instead of stalling it
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive(), "the host waits forever for a worker that has died"
    assert len(errors) == 1 and "forward worker has stopped" in str(errors[0])
    llm.engine.check_integrity()
    llm.close()


def mixed_as_params(mixed):
    prompts, settings = mixed
    return prompts, [m6.SamplingParams(**s) for s in settings]


def test_no_thread_is_left_behind(tiny_model_path):
    before = set(threading.enumerate())
    llm = m6.LLM(tiny_model_path, async_scheduling=True, **EAGER)
    worker_thread = llm.engine.worker.steps.thread
    assert worker_thread.is_alive()
    llm.generate("Hello", m6.SamplingParams(max_tokens=3), use_tqdm=False)
    llm.close()
    assert not worker_thread.is_alive()
    llm.close()  # twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hello", m6.SamplingParams(max_tokens=3), use_tqdm=False)  # refused, not a hang
    llm.engine.check_integrity()
    with m6.LLM(tiny_model_path, async_scheduling=True, **EAGER) as llm:
        second = llm.engine.worker.steps.thread
    assert not second.is_alive()
    forgotten = m6.LLM(tiny_model_path, async_scheduling=True, **EAGER).engine.worker.steps.thread
    gc.collect()
    forgotten.join(timeout=10)
    assert not forgotten.is_alive(), "an engine nobody holds kept its thread"
    assert set(threading.enumerate()) <= before
    sync = m6.LLM(tiny_model_path, async_scheduling=False, **EAGER)
    assert sync.engine.worker.steps.thread is None  # m5's loop: the caller's thread computes


def test_close_stops_the_worker_even_when_the_step_in_flight_failed(tiny_model_path, tmp_path):
    trace = tmp_path / "trace.json"
    llm = m6.LLM(tiny_model_path, async_scheduling=True, trace_file=str(trace), **EAGER)
    engine, thread = llm.engine, llm.engine.worker.steps.thread

    def fails(inputs):
        raise RuntimeError("injected failure in the forward")

    engine.runner.execute = fails
    engine.add_request("Hello there", m6.SamplingParams(max_tokens=4))
    assert engine.step() == [] and engine.pending  # launched: it fails on the worker, unseen until processed
    with pytest.raises(RuntimeError, match="injected"):
        llm.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and trace.exists()
    engine.check_integrity()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_trace_has_one_event_of_each_kind_per_step(tiny_model_path, tmp_path, async_scheduling):
    path = tmp_path / "trace.json"
    prompts, settings = mixed_workload(6, seed=2, max_prompt=30, max_output=12)
    with m6.LLM(tiny_model_path, async_scheduling=async_scheduling, trace_file=str(path), **EAGER) as llm:
        run(m6, llm, prompts, settings)
    num_steps = llm.engine.num_steps  # closing processed the step still in flight
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    for name in ("schedule", "forward", "process"):
        mine = [e for e in complete if e["name"] == name]
        assert sorted(e["args"]["step"] for e in mine) == list(range(1, num_steps + 1)), (
            f"the trace's {name!r} events are for steps {sorted(e['args']['step'] for e in mine)}, expected one for "
            f"each of steps 1..{num_steps} (_process records 'process' with launched.number once per step)"
        )
        assert len({e["tid"] for e in mine}) == 1 and all(e["args"]["batch_size"] >= 1 for e in mine)
        assert all(e["dur"] >= 0 for e in mine)
    assert len({e["tid"] for e in complete}) == 3
    share = hidden_host_share(complete)
    assert 0.0 <= share <= 1.0
    if not async_scheduling:
        assert share == 0.0, "without overlap no host work can lie inside a forward"


def test_the_trace_counts_the_refusals_after_each_schedule(tiny_model_path, tmp_path):
    path = tmp_path / "trace.json"
    prompts, settings = mixed_workload(8, seed=4, max_prompt=40, max_output=10)
    limits = dict(EAGER, max_num_seqs=2, num_kv_blocks=8)  # requests wait for a place and for blocks
    with m6.LLM(tiny_model_path, async_scheduling=True, trace_file=str(path), **limits) as llm:
        run(m6, llm, prompts, settings)
        usage = llm.engine.kv_usage()
    events = json.loads(path.read_text())["traceEvents"]
    schedules = [e for e in events if e["name"] == "schedule"]
    counts = [e["args"] for e in events if e["name"] == "refused" and e["ph"] == "C"]
    assert len(counts) == len(schedules), f"{len(counts)} counter events for {len(schedules)} schedule events"
    assert all(all(later[k] >= earlier[k] for k in earlier) for earlier, later in zip(counts, counts[1:])), (
        "the refusals are a running count: no reason's count may fall from one schedule to the next")
    assert counts[-1]["max_num_seqs"] > 0, counts[-1]
    # the last schedule may have come before a final, empty one: the trace's count is at most kv_usage()'s
    assert all(counts[-1][reason] <= usage[f"refused_{reason}"] for reason in counts[-1]), (counts[-1], usage)


def test_hidden_host_share_measures_overlap():
    def event(name, start, end):
        return {"name": name, "ph": "X", "ts": start, "dur": end - start}
    events = [event("forward", 0, 10), event("schedule", 2, 4), event("process", 8, 12), event("forward", 20, 30)]
    assert hidden_host_share(events) == pytest.approx((2 + 2) / (2 + 4))


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_async_scheduling_is_checked(tiny_model_path, value):
    with pytest.raises(ValueError, match="async_scheduling"):
        m6.LLM(tiny_model_path, async_scheduling=value, **EAGER)


def test_auto_overlaps_on_cuda_only():
    """On a CPU the worker's OpenMP team competes with the caller's for the cores (see the m6 page's benchmark)."""
    assert m6.EngineConfig(device="cpu").resolve(model_max_len=64).async_scheduling is False
    assert m6.EngineConfig(device="cpu", async_scheduling=True).resolve(model_max_len=64).async_scheduling is True
    if torch.cuda.is_available():
        assert m6.EngineConfig(device="cuda").resolve(model_max_len=64).async_scheduling is True
