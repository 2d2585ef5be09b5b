"""Random hostile callers (hypothesis): random prompts, sampling values and engine calls, checked after every call.

A state machine drives one small engine per milestone (a short context and, where the
milestone has them, few KV blocks, so preemption happens) with ``add_request``, ``step``,
``abort_request``, ``generate`` and ``generate`` from two threads at once, mixing good and
bad values. After every call: either a ``ValueError`` with a message came back, or the
outputs obey the request's rules (and a greedy or seeded prompt gets the tokens it gets
alone); the engine's integrity checks pass. At the end of every case the engine is
drained and the reference prompt still gets its reference tokens.

``HOSTILE_EXAMPLES`` sets the number of cases per milestone (default 50); the count tried
is printed in the test summary.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from .test_hostile_callers import REFERENCE_PROMPT

NUM_EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "50"))
MAX_MODEL_LEN = 64
GOOD_PROMPTS = ["Once upon a time", "1, 2, 3,", "Hello, my name is", "The sea is", REFERENCE_PROMPT]
UNKNOWN_ID = "never-added"
THREAD_TIMEOUT = 300  # seconds for two generate calls that take turns: a few on an idle machine, far more when loaded

VOCAB = 49152
prompts = st.one_of(
    st.sampled_from(GOOD_PROMPTS),
    st.text(max_size=24),
    st.builds(lambda a, b: a + "\ud800" + b, st.text(max_size=4), st.text(max_size=4)),  # not valid UTF-8
    st.lists(st.integers(-3, VOCAB + 3), max_size=12),
    st.sampled_from([None, 5, 2.5, b"bytes", {"a": 1}, [True, 1], [[1, 2]], (7, 8), [1.0, 2.0]]),
)
sampling_values = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.one_of(st.floats(-1, 3), st.sampled_from([0, 1e-45, float("nan"), float("inf"), True, "1"])),
        "top_p": st.one_of(st.floats(-0.5, 1.5), st.sampled_from([1.0, float("nan"), True])),
        "top_k": st.one_of(st.integers(-3, 60), st.sampled_from([True, 2.5, None, 2**63, 10**30])),
        "max_tokens": st.one_of(st.integers(-1, 10), st.sampled_from([None, 2.5, True, MAX_MODEL_LEN])),
        "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2), st.just(5)),
        "stop_token_ids": st.one_of(st.lists(st.integers(-1, 300), max_size=2), st.just(5)),
        "ignore_eos": st.sampled_from([True, False, 1, "yes"]),
        "seed": st.one_of(st.none(), st.integers(-(2**64), 2**65)),
        "presence_penalty": st.one_of(st.floats(-3, 3), st.sampled_from([float("nan"), float("inf"), True])),
        "frequency_penalty": st.one_of(st.floats(-3, 3), st.sampled_from([float("nan"), "1"])),
        "repetition_penalty": st.one_of(st.floats(-1, 3), st.sampled_from([0, float("nan"), True])),
        "logprobs": st.one_of(st.none(), st.integers(-2, 25), st.sampled_from([True, 2.5])),
        "prompt_logprobs": st.one_of(st.none(), st.integers(-2, 25), st.sampled_from([True, 2.5])),
        "n": st.one_of(st.integers(-1, 3), st.sampled_from([True, 2.5, "2"])),
        "structured_outputs": st.sampled_from([None, {"regex": "[0-9]{2}"}, {"choice": ["a", "b c"]},
                                               {"json_object": True}, {"json": {"type": "frob"}}, {"regex": ""},
                                               {"regex": "(unclosed"}, {"rgx": "a"}, "json", {}]),
    },
)
request_ids = st.one_of(st.none(), st.sampled_from(["0", "1", "2", "mine", UNKNOWN_ID]))


def small_engine_options(mod) -> dict:
    """A short context, few running requests and, from m3 on, a pool small enough that requests get preempted."""
    wanted = {"max_num_seqs": 4, "max_num_batched_tokens": 24, "block_size": 4, "num_kv_blocks": 20}
    accepted = {f.name for f in dataclasses.fields(mod.EngineConfig)}
    return {name: value for name, value in wanted.items() if name in accepted}


@pytest.fixture(scope="module")
def small_llm(mod, tiny_model_path, lesson_options):
    return mod.LLM(tiny_model_path, device="cpu", max_model_len=MAX_MODEL_LEN, **small_engine_options(mod),
                   **lesson_options)


def unfinished_request_ids(engine) -> list[str]:
    """Every request still in the engine: each request with n > 1 samples (aborting it aborts its samples, those held
    back too), then each waiting and running sequence (m1 runs one at a time, the others a list)."""
    running = engine.scheduler.running
    running = running if isinstance(running, list) else [running] if running is not None else []
    return [*engine.parents.by_id, *(seq.request_id for seq in [*running, *engine.scheduler.waiting])]


def refused_clearly(err: ValueError) -> bool:
    return len(str(err)) > 15


def check_final(llm, out, params) -> None:
    """A finished output obeys every stop rule of its request."""
    completion, engine = out.outputs[0], llm.engine
    ids, text = completion.token_ids, completion.text
    assert out.finished and completion.finish_reason in ("stop", "length"), completion
    assert ids and len(out.prompt_token_ids) + len(ids) <= MAX_MODEL_LEN
    assert params.max_tokens is None or len(ids) <= params.max_tokens
    if completion.finish_reason == "length":
        assert len(ids) == params.max_tokens or len(out.prompt_token_ids) + len(ids) == MAX_MODEL_LEN
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.eos_token_ids)
    assert not stop_ids & set(ids[:-1]), "generation went on past a stop token"
    assert not any(s in text for s in params.stop), "a stop string was left in the text"


class HostileCaller(RuleBasedStateMachine):
    """One case: a random sequence of calls on a shared engine, checked after each."""

    llm = mod = None  # set by the test before the machine runs
    reference: list[int] = []  # the reference prompt's greedy tokens
    references: dict[str, list[int]] = {}  # every good prompt's greedy tokens
    counts = {"cases": 0, "calls": 0, "refused": 0}

    def __init__(self) -> None:
        super().__init__()
        self.engine = self.llm.engine
        self.live: dict[str, object] = {}  # request id -> its SamplingParams, for requests added with add_request
        self.threads: list[threading.Thread] = []  # generate_from_two_threads' callers: none may outlive the case
        self.counts["cases"] += 1

    @initialize()
    def start_clean(self) -> None:
        assert not self.engine.has_unfinished_requests()

    def params(self, values: dict):
        """The SamplingParams, or None when they were (clearly) refused."""
        self.counts["calls"] += 1
        try:
            return self.mod.SamplingParams(**values)
        except ValueError as err:
            assert refused_clearly(err), err
            self.counts["refused"] += 1
            return None

    def forget_finished(self) -> None:
        """Requests of ours that a generate call ran to the end (generate steps the whole engine).

        A request with n > 1 samples is known to the scheduler by its children's ids only: its own id stays in use,
        with the engine's parents, until its last sample finishes.
        """
        unfinished = [r for r in self.live if self.engine.scheduler.find(r) is not None or self.engine.parents.uses(r)]
        self.live = {r: self.live[r] for r in unfinished}

    @rule(prompt=prompts, values=sampling_values, request_id=request_ids)
    def add_request(self, prompt, values, request_id) -> None:
        params = self.params(values)
        if params is None:
            return
        try:
            added = self.engine.add_request(prompt, params, request_id=request_id)
        except ValueError as err:
            assert refused_clearly(err), err
            self.counts["refused"] += 1
            return
        self.live[added] = params

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule()
    def step(self) -> None:
        self.counts["calls"] += 1
        for out in self.engine.step():
            params = self.live[out.request_id]
            assert params.max_tokens is None or len(out.outputs[0].token_ids) <= params.max_tokens
            if out.finished:
                check_final(self.llm, out, params)
                del self.live[out.request_id]

    @rule(data=st.data())
    def abort(self, data) -> None:
        self.counts["calls"] += 1
        request_id = data.draw(st.sampled_from(sorted(self.live) + [UNKNOWN_ID]))
        out = self.engine.abort_request(request_id)
        if request_id in self.live:
            assert out.finished and out.outputs[0].finish_reason == "abort"
            del self.live[request_id]
        else:
            assert out is None
        assert self.engine.scheduler.find(request_id) is None

    @rule(batch=st.lists(prompts, min_size=1, max_size=3), values=sampling_values)
    def generate(self, batch, values) -> None:
        params = self.params(values)
        if params is None:
            return
        try:
            outs = self.llm.generate(batch, params, use_tqdm=False)
        except ValueError as err:  # refused before any step ran, never a step that failed
            assert refused_clearly(err) and str(err).startswith(("prompt ", "prompts ", "got ")), err
            self.counts["refused"] += 1
            self.forget_finished()
            return
        self.forget_finished()
        assert len(outs) == len(batch)
        for out in outs:
            check_final(self.llm, out, params)
        if params.greedy or params.seed is not None:  # deterministic: the same tokens as the prompt alone
            # The first prompt as the engine read it: a batch like [5] is one prompt of token ids, not the prompt 5.
            alone = self.llm.generate(outs[0].prompt_token_ids, params, use_tqdm=False)[0]
            assert alone.outputs[0].token_ids == outs[0].outputs[0].token_ids
            self.forget_finished()

    @rule(messages=st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 5]),
                                        "content": st.one_of(st.text(max_size=12), st.none())}), max_size=3),
        st.sampled_from(["hello", None, [["user"]], [{"role": "user", "content": "bad \ud800"}]]),
    ))
    def chat(self, messages) -> None:
        self.counts["calls"] += 1
        params = self.mod.SamplingParams(temperature=0, max_tokens=4)
        try:
            outs = self.llm.chat(messages, params, use_tqdm=False)
        except ValueError as err:
            assert refused_clearly(err), err
            self.counts["refused"] += 1
        else:
            check_final(self.llm, outs[0], params)
        self.forget_finished()

    @rule(first=st.lists(st.sampled_from(GOOD_PROMPTS), min_size=1, max_size=3),
          second=st.lists(st.sampled_from(GOOD_PROMPTS), min_size=1, max_size=3))
    def generate_from_two_threads(self, first, second) -> None:
        self.counts["calls"] += 2
        params = self.mod.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        results, errors = {}, []

        def call(name, batch):
            try:
                results[name] = [o.outputs[0].token_ids for o in self.llm.generate(batch, params, use_tqdm=False)]
            except BaseException as err:  # re-raised on the test's thread below
                errors.append(err)

        threads = [threading.Thread(target=call, args=item) for item in (("first", first), ("second", second))]
        self.threads += threads
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=THREAD_TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), (
            f"a generate call did not return within {THREAD_TIMEOUT} s (the calls take turns on the engine's lock)")
        assert not errors, errors
        self.forget_finished()
        for name, batch in (("first", first), ("second", second)):
            assert results[name] == [self.references[p] for p in batch]

    @invariant()
    def integrity_holds(self) -> None:
        self.engine.check_integrity()

    def teardown(self) -> None:
        # A caller still running (its case failed while it waited for the lock) would add its requests after the
        # aborts below, into the next case: the cause of a flake that found another case's requests in the engine.
        for thread in self.threads:
            thread.join(timeout=THREAD_TIMEOUT)
        assert not any(thread.is_alive() for thread in self.threads), "a generate call never returned"
        for request_id in list(self.live):
            self.engine.abort_request(request_id)
        # Whatever this case did, the next one gets a clean engine: a request left behind here would fail the next
        # case's start instead, and hypothesis, replaying this case, would report its draws as inconsistent rather
        # than this case's own error.
        left = unfinished_request_ids(self.engine)
        for request_id in left:
            self.engine.abort_request(request_id)
        assert not left, f"requests still in the engine that the case does not know as live: {left}"
        greedy = self.mod.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        assert self.llm.generate(REFERENCE_PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids == self.reference
        self.engine.check_integrity()


def hostile_caller_for(mod, small_llm) -> type[HostileCaller]:
    """The state machine bound to this milestone's engine, with every good prompt's greedy tokens."""
    greedy = mod.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    references = {p: small_llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in GOOD_PROMPTS}
    return type("HostileCaller", (HostileCaller,), {
        "llm": small_llm, "mod": mod, "reference": references[REFERENCE_PROMPT], "references": references,
        "counts": {"cases": 0, "calls": 0, "refused": 0},
    })


def test_a_request_with_several_samples_stays_live_through_a_generate_call(mod, small_llm):
    """The case a random run once found: a request with n = 2 added, a generate call, then steps to its end."""
    case = hostile_caller_for(mod, small_llm)()
    case.start_clean()
    case.add_request("Once upon a time", {"n": 2, "max_tokens": 8, "ignore_eos": True}, "mine")
    case.generate(["The sea is"], {"temperature": 0, "max_tokens": 1})
    # m1 runs one request at a time, so "mine" has finished before the generate call's prompt began; the others batch.
    assert ("mine" in case.live) == case.engine.parents.uses("mine") == (mod.__name__ != "milestones.m1")
    while case.engine.has_unfinished_requests():
        case.step()
    assert "mine" not in case.live
    case.teardown()


def test_random_hostile_callers_never_poison_the_engine(mod, small_llm, report):
    machine = hostile_caller_for(mod, small_llm)
    # No example database: a stored case replays its draws, and how many it draws depends on the tokens the engine
    # made then; once a kernel changes the last bits, hypothesis calls the replay inconsistent (FlakyStrategy...).
    run_settings = settings(max_examples=NUM_EXAMPLES, stateful_step_count=12, deadline=None, database=None,
                            derandomize=bool(os.environ.get("CI")),
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    run_state_machine_as_test(machine, settings=run_settings)
    counts = machine.counts
    report(f"{mod.__name__}: hostile-caller property test tried {counts['cases']} cases, {counts['calls']} calls "
           f"({counts['refused']} refused with a clear error)")
    assert counts["cases"] >= NUM_EXAMPLES
