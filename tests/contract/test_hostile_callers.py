"""Hostile and careless callers: whatever they do, they get a clear error and the engine keeps serving.

Each test does one thing a caller should not do (or may do by accident), then checks the
same three things: the error names what to change, the engine is left as it was found
(nothing queued, integrity checks pass), and the next good request returns the reference
tokens.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

REFERENCE_PROMPT = "The capital of France is"


def greedy(mod, max_tokens=8, **kw):
    return mod.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(mod, tiny_llm) -> list[int]:
    """The reference prompt's greedy tokens, taken before any test could have disturbed the engine."""
    return tiny_llm.generate(REFERENCE_PROMPT, greedy(mod), use_tqdm=False)[0].outputs[0].token_ids


def assert_still_serves(mod, llm, reference: list[int]) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "work was left behind in the engine"
    engine.check_integrity()
    assert llm.generate(REFERENCE_PROMPT, greedy(mod), use_tqdm=False)[0].outputs[0].token_ids == reference
    engine.check_integrity()


def run_to_completion(engine) -> dict:
    finals = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return finals
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    raise AssertionError("the engine did not finish")


# 1. Seeds must fit the 64 bits a random generator takes.
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_beyond_64_bits_is_refused(mod, tiny_llm, reference, seed):
    with pytest.raises(ValueError, match="seed"):
        tiny_llm.generate("hi", mod.SamplingParams(seed=seed, max_tokens=2), use_tqdm=False)
    assert_still_serves(mod, tiny_llm, reference)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), np.int64(7)])
def test_the_extreme_seeds_still_sample(mod, tiny_llm, reference, seed):
    params = mod.SamplingParams(temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True)
    first, again = (tiny_llm.generate("hi", params, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2))
    assert len(first) == 4 and first == again
    assert_still_serves(mod, tiny_llm, reference)


# 2. Threads: calls on one engine take turns, and the integrity checks see the sequences too.
def test_generate_from_two_threads_takes_turns(mod, tiny_llm, reference):
    prompts = {"a": ["Once upon a time", "1, 2, 3,"], "b": ["Hello, my name is", "The sea is", "Why?"]}
    params = greedy(mod, 12)
    expected = {name: [o.outputs[0].token_ids for o in tiny_llm.generate(p, params, use_tqdm=False)]
                for name, p in prompts.items()}
    results: dict[str, list] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            for _ in range(3):
                outs = tiny_llm.generate(prompts[name], params, use_tqdm=False)
                results[name].append([o.outputs[0].token_ids for o in outs])
        except BaseException as err:  # reported below, on the test's thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(name,)) for name in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a generate call never returned"
    assert not errors, errors
    assert results == {name: [expected[name]] * 3 for name in prompts}
    assert_still_serves(mod, tiny_llm, reference)


def test_engine_calls_from_another_thread_wait_for_generate(mod, tiny_llm, reference, monkeypatch):
    engine, params = tiny_llm.engine, greedy(mod, 6)
    expected = tiny_llm.generate(["Good morning", "Good night"], params, use_tqdm=False)
    real_execute, events = engine.runner.execute, []

    def slow_execute(batch):  # every step takes a while, so the other thread calls while generate runs
        events.append("step")
        time.sleep(0.05)
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    outs = []
    generating = threading.Thread(target=lambda: outs.extend(tiny_llm.generate("Good morning", params,
                                                                               use_tqdm=False)))
    generating.start()
    while not events:
        time.sleep(0.005)
    engine.add_request("Good night", params, request_id="side")  # must wait until generate has returned
    events.append("added")
    generating.join(timeout=60)
    monkeypatch.undo()
    assert events[-1] == "added" and events.count("step") == 6, events
    finals = run_to_completion(engine)
    assert outs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert finals["side"].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert_still_serves(mod, tiny_llm, reference)


@pytest.mark.parametrize("corruption", ["computed beyond the tokens", "running and waiting at once", "wrong status"])
def test_integrity_checks_see_sequence_state(mod, tiny_llm, reference, corruption):
    engine = tiny_llm.engine
    engine.add_request("First request", greedy(mod), request_id="first")
    engine.add_request("Second request", greedy(mod), request_id="second")
    engine.step()
    engine.check_integrity()
    seq = engine.scheduler.find("first")
    saved = (seq.num_computed_tokens, seq.status)
    if corruption == "computed beyond the tokens":
        seq.num_computed_tokens = seq.num_tokens + 3
    elif corruption == "running and waiting at once":
        engine.scheduler.waiting.append(seq)
    else:
        seq.status = type(seq.status).FINISHED
    with pytest.raises(AssertionError):
        engine.check_integrity()
    seq.num_computed_tokens, seq.status = saved
    if corruption == "running and waiting at once":
        engine.scheduler.waiting.pop()
    engine.check_integrity()
    run_to_completion(engine)
    assert_still_serves(mod, tiny_llm, reference)


# 3. generate leaves the engine as it found it, whatever goes wrong inside.
def test_a_bad_prompt_in_a_list_queues_nothing(mod, tiny_llm, reference):
    with pytest.raises(ValueError, match=r"prompt 1: .*surrogate"):
        tiny_llm.generate([REFERENCE_PROMPT, "bad \ud800"], greedy(mod), use_tqdm=False)
    assert_still_serves(mod, tiny_llm, reference)


class InjectedFault(RuntimeError):
    pass


def test_a_request_with_samples_refused_by_its_format_leaves_no_trace(mod, tiny_llm, reference):
    """n > 1 with a format the grammar compiler refuses: every sample is checked before any is queued, so the refused
    request's id stays free (a random hostile caller once found such a request's id held by nobody's samples)."""
    engine = tiny_llm.engine
    bad = mod.SamplingParams(n=3, max_tokens=4, structured_outputs={"regex": "(unclosed"})
    with pytest.raises(ValueError, match="structured_outputs"):
        engine.add_request("Once upon a time", bad, request_id="samples")
    assert not engine.parents.by_id and not engine.has_unfinished_requests()
    engine.add_request("Once upon a time", greedy(mod, max_tokens=4, n=2), request_id="samples")  # the id is free
    assert len(run_to_completion(engine)["samples"].outputs) == 2 and not engine.parents.by_id
    assert_still_serves(mod, tiny_llm, reference)


def test_a_failing_step_inside_generate_leaves_nothing_behind(mod, tiny_llm, reference, monkeypatch):
    runner = tiny_llm.engine.runner
    real_execute, calls = runner.execute, []

    def fail_on_the_third_step(batch):
        calls.append(1)
        if len(calls) == 3:
            raise InjectedFault("the device fell over")
        return real_execute(batch)

    monkeypatch.setattr(runner, "execute", fail_on_the_third_step)
    with pytest.raises(InjectedFault):
        tiny_llm.generate(["Once upon a time", "The sea is"], greedy(mod, 10), use_tqdm=False)
    monkeypatch.undo()
    assert_still_serves(mod, tiny_llm, reference)


# 4. Temperatures that break the arithmetic.
@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_temperature_is_refused(mod, temperature):
    with pytest.raises(ValueError, match="temperature"):
        mod.SamplingParams(temperature=temperature)


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 5e-6])
def test_a_vanishing_temperature_is_greedy(mod, tiny_llm, reference, temperature):
    params = mod.SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=3)
    assert tiny_llm.generate(REFERENCE_PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == reference


# 5. SamplingParams cannot be changed after it was checked.
@pytest.mark.parametrize(
    "field, value, invalid", [("top_k", 0, 0), ("stop", "Paris", [""]), ("max_tokens", 0, 0), ("temperature", -1, -1)]
)
def test_sampling_params_are_immutable(mod, field, value, invalid):
    params = mod.SamplingParams(stop=["x"], stop_token_ids=[5])
    with pytest.raises(AttributeError):
        setattr(params, field, value)
    with pytest.raises(AttributeError):
        params.stop.append("Paris")
    with pytest.raises(AttributeError):
        params.stop_token_ids.append(0)
    assert dataclasses.replace(params, stop="Paris").stop == ("Paris",)  # a changed copy is normalised ...
    with pytest.raises(ValueError, match=field):  # ... and checked again
        dataclasses.replace(params, **{field: invalid})


# 6. Automatic request ids never collide with a caller's own.
def test_automatic_ids_skip_the_callers_ids(mod, tiny_llm, reference):
    engine = tiny_llm.engine
    probe = engine.add_request("probe", greedy(mod))
    engine.abort_request(probe)
    taken = [str(int(probe) + i) for i in (1, 2)] if probe.isdigit() else [probe]
    for request_id in taken:
        engine.add_request("Mine, not yours", greedy(mod), request_id=request_id)
    out = tiny_llm.generate(REFERENCE_PROMPT, greedy(mod), use_tqdm=False)[0]
    assert out.request_id not in taken and out.outputs[0].token_ids == reference
    run_to_completion(engine)
    assert_still_serves(mod, tiny_llm, reference)


# 7. A checkpoint that does not match its config is refused, naming the tensor.
@pytest.mark.parametrize(
    "make_bad, message",
    [
        (lambda t: t[:1].clone(), r"up_proj.*\[1, 64\].*\[128, 64\]"),  # broadcasts: used to load silently
        (lambda t: torch.zeros(3, 7), r"up_proj.*\[3, 7\]"),
        (lambda t: t.to(torch.int32), r"up_proj.*int32"),
    ],
    ids=["broadcasting", "wrong-shape", "integer"],
)
def test_a_checkpoint_tensor_that_does_not_fit_is_named(mod, tiny_model_path, tmp_path, make_bad, message):
    folder = tmp_path / "bad-checkpoint"
    shutil.copytree(tiny_model_path, folder)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors = load_file(folder / "model.safetensors")
    tensors[name] = make_bad(tensors[name])
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        mod.LLM(folder, device="cpu", max_model_len=64)


@pytest.mark.parametrize("broken", ["k_proj-broadcasts", "v_proj-missing"])
def test_a_projection_stacked_into_qkv_proj_is_checked_on_its_own(mod, tiny_model_path, tmp_path, broken):
    """q, k and v load into rows of one qkv_proj: a k that would broadcast into its rows, or a v that is missing,
    is refused by its own checkpoint name, not loaded silently."""
    folder = tmp_path / "bad-checkpoint"
    shutil.copytree(tiny_model_path, folder)
    tensors = load_file(folder / "model.safetensors")
    if broken == "k_proj-broadcasts":
        name = "model.layers.1.self_attn.k_proj.weight"
        tensors[name] = tensors[name][:1].clone()
        message = r"k_proj.*\[1, 64\]"
    else:
        del tensors["model.layers.1.self_attn.v_proj.weight"]
        message = r"lacks 1 tensors.*layers\.1\.self_attn\.v_proj"
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        mod.LLM(folder, device="cpu", max_model_len=64)


# 8. A block size the pool or the context cannot hold.
@pytest.mark.parametrize(
    "options, message",
    [({"block_size": 65536}, "block_size"), ({"block_size": None}, "block_size"),
     ({"block_size": 16, "kv_cache_memory_bytes": 1000}, "kv_cache_memory")],
)
def test_a_block_the_budget_cannot_hold_is_refused(mod, tiny_model_path, options, message):
    if "block_size" not in {f.name for f in dataclasses.fields(mod.EngineConfig)}:
        pytest.skip(f"{mod.__name__} has no KV blocks")
    with pytest.raises(ValueError, match=message):
        mod.LLM(tiny_model_path, device="cpu", max_model_len=512, **options)


# 9. A step that fails leaves every request as it was, random stream included.
def test_a_failed_step_does_not_advance_a_seeded_request(mod, tiny_llm, reference, monkeypatch):
    engine = tiny_llm.engine
    params = mod.SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    clean = tiny_llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("Once upon a time", params, request_id="seeded")
    for _ in range(4):
        engine.step()
    real_sampler = engine.runner.sampler

    class SampleThenFail:  # the sampler in every other respect (m6's runner masks logits with it first)
        def __getattr__(self, name):
            return getattr(real_sampler, name)

        def __call__(self, *args, **kwargs):
            real_sampler(*args, **kwargs)  # the random numbers are drawn ...
            raise InjectedFault("... and then the device reports an error")

    monkeypatch.setattr(engine.runner, "sampler", SampleThenFail())
    with pytest.raises(InjectedFault):
        # With overlap (m6 on) the step in flight may have sampled before the sampler was swapped, on a busy machine:
        # its results come back whole, and the step launched next is the one that fails.
        for _ in range(2):
            engine.step()
    monkeypatch.undo()
    engine.check_integrity()
    assert run_to_completion(engine)["seeded"].outputs[0].token_ids == clean
    assert_still_serves(mod, tiny_llm, reference)


# 10. Wrong types get a message that says what to pass.
@pytest.mark.parametrize(
    "prompts, message",
    [(None, "prompt"), (5, "prompt"), ({"text": "hi"}, "prompt"), ([[1, 2], 5], "prompt 1"), ([1.5, 2], "prompt")],
)
def test_prompts_of_the_wrong_type_are_refused(mod, tiny_llm, reference, prompts, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(prompts, greedy(mod), use_tqdm=False)
    assert_still_serves(mod, tiny_llm, reference)


def test_numpy_prompts_and_ids_are_accepted(mod, tiny_llm, reference):
    ids = tiny_llm.tokenizer.encode(REFERENCE_PROMPT)
    as_list = tiny_llm.generate(ids, greedy(mod), use_tqdm=False)[0].outputs[0].token_ids
    as_array = tiny_llm.generate(np.array(ids), greedy(mod), use_tqdm=False)
    as_numpy_ints = tiny_llm.generate([np.int64(t) for t in ids], greedy(mod), use_tqdm=False)
    as_rows = tiny_llm.generate(np.array([ids, ids]), greedy(mod), use_tqdm=False)
    as_arrays = tiny_llm.generate([np.array(ids), torch.tensor(ids)], greedy(mod), use_tqdm=False)  # two prompts
    assert as_list == reference
    assert [o.outputs[0].token_ids for o in [*as_array, *as_numpy_ints, *as_rows, *as_arrays]] == [reference] * 6
    assert all(type(t) is int for t in as_array[0].prompt_token_ids)
    params = mod.SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), max_tokens=np.int32(3),
                                stop_token_ids=np.array([7]), seed=np.uint64(9))
    assert tiny_llm.generate(ids, params, use_tqdm=False)[0].finished
    assert_still_serves(mod, tiny_llm, reference)


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hello", "conversation"),
        ([{"role": "user"}], "content"),
        ([{"content": "hi"}], "role"),
        (["hello"], "conversation"),
        ([[{"role": "user", "content": 5}]], "content"),
        ([{"role": "user", "content": "bad \ud800"}], "not valid text"),
    ],
)
def test_malformed_chat_messages_are_refused(mod, tiny_llm, reference, messages, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.chat(messages, greedy(mod), use_tqdm=False)
    assert_still_serves(mod, tiny_llm, reference)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stop": 5}, "stop"),
        ({"stop": [5]}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"top_k": True}, "top_k"),
        ({"max_tokens": True}, "max_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": 1.0}, "seed"),
        ({"top_k": None}, "top_k"),
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": 10**400}, "top_p"),
        ({"stop_token_ids": np.array(7)}, "stop_token_ids"),
        ({"seed": True}, "seed"),
    ],
)
def test_sampling_values_of_the_wrong_type_name_the_field(mod, kwargs, field):
    with pytest.raises(ValueError, match=field):
        mod.SamplingParams(**kwargs)


@pytest.mark.parametrize("device", ["meta", "gpu", "cuda:99", 3.5])
def test_an_unusable_device_is_refused_at_start_up(mod, tiny_model_path, device):
    with pytest.raises(ValueError, match="device"):
        mod.LLM(tiny_model_path, device=device, max_model_len=64)


@pytest.mark.parametrize(
    "options, field",
    [({"seed": 1.5}, "seed"), ({"seed": "x"}, "seed"), ({"enable_prefix_caching": "no"}, "enable_prefix_caching")],
)
def test_engine_options_of_the_wrong_type_are_refused(mod, tiny_model_path, options, field):
    if not set(options) <= {f.name for f in dataclasses.fields(mod.EngineConfig)}:
        pytest.skip(f"{mod.__name__} has no option {sorted(options)}")
    with pytest.raises(ValueError, match=field):
        mod.LLM(tiny_model_path, device="cpu", max_model_len=64, **options)


def test_a_top_k_beyond_the_vocabulary_keeps_everything(mod, tiny_llm, reference):
    """top_k larger than the vocabulary (even beyond 64 bits) means no cut, not an overflow in every later step."""
    params = mod.SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    unlimited = tiny_llm.generate(REFERENCE_PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    for top_k in (10**6, 2**63, 2**80):
        huge = dataclasses.replace(params, top_k=top_k)
        assert tiny_llm.generate(REFERENCE_PROMPT, huge, use_tqdm=False)[0].outputs[0].token_ids == unlimited
    assert_still_serves(mod, tiny_llm, reference)


@pytest.mark.parametrize("junk", [0, {}, False, "greedy"])
def test_sampling_params_that_are_not_sampling_params_are_refused(mod, tiny_llm, reference, junk):
    with pytest.raises(ValueError, match="SamplingParams"):
        tiny_llm.generate("hi", junk, use_tqdm=False)
    assert_still_serves(mod, tiny_llm, reference)
