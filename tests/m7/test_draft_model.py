"""m7 with a draft model: m6's tokens, the draft's keys and values kept in step with the target's.

Two drafts of the tiny model. The model itself: its picks, with the same (seed, position)
noise, are the target's, so every guess must be kept, greedy and sampled; a single rejected
one means the draft read keys and values that a rollback, a preemption or a prefix-cache
hit left wrong. Its first layer alone: a cheaper draft that is right only part of the
time, so guesses are kept and rejected, and the output is still m6's. The draft follows every
step, computing the target's chunks: the prefix cache shares as much as in m6, and no pass of the
draft goes past the step's budget by more than a token a request.

The tiny model runs here with its first 4,096 tokens only (``small_vocab_model_path``, conftest.py): the head and
the sampler's sort over the whole vocabulary were most of a step's time, and the bookkeeping checked here is the same
with any vocabulary. A structured request needs the whole one.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest

from milestones import m6, m7
from milestones.m7.detokenizer import IncrementalDetokenizer
from milestones.m7.scheduler import Scheduler
from milestones.m7.sequence import Sequence
from milestones.model_store import first_layers_copy
from milestones.speculative_config import SpeculativeConfig
from tests.chain import assert_same_outputs, completions, mixed_workload, run
from tests.m7.conftest import SMALL_VOCAB

LIMITS = dict(device="cpu", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=32, enforce_eager=True)
OPTIONS = [
    dict(),  # the pool as m6 sizes it, prefix caching on
    dict(enable_prefix_caching=False),
    dict(num_kv_blocks=24, block_size=4),  # a tight pool: requests are preempted and guess again
]
IDS = ["default", "no-prefix-cache", "tight-pool"]


def draft(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def workload():
    """Greedy and seeded requests, half of them with a shared start (prefix-cache hits), none stopping early: a
    guess is checked only while its request runs, so every one of them counts."""
    prompts, settings = mixed_workload(16, seed=5, max_prompt=50, max_output=36)
    prompts = [[3 + token % (SMALL_VOCAB - 3) for token in prompt] for prompt in prompts]  # ids the model has
    prompts = [prompts[0][:20] + p if i % 2 else p for i, p in enumerate(prompts)]
    unstructured = [{k: v for k, v in s.items() if k != "structured_outputs"} for s in settings]  # they end by EOS
    return prompts, [dict(s, ignore_eos=True) for s in unstructured]


@pytest.fixture(scope="module")
def reference(small_vocab_model_path, workload):
    return run(m6, m6.LLM(small_vocab_model_path, **LIMITS), *workload)


@pytest.fixture(scope="module")
def one_layer_draft(small_vocab_model_path, tmp_path_factory):
    return first_layers_copy(small_vocab_model_path, 1, tmp_path_factory.mktemp("draft") / "first-layer")


@pytest.fixture(scope="module")
def draft_calls(small_vocab_model_path):
    """What each propose_batch call saw and did, for a greedy and a sampled request (acceptance "rejection"), the
    model as its own draft: its rows' chunks and rooms, where each pass of the draft fed each view from, the guesses,
    their q, and num_drafted_tokens before and after."""
    calls = []
    config = draft(small_vocab_model_path) | {"acceptance": "rejection"}
    prompts = [prompt_of(40, seed=31), prompt_of(9, seed=32)]  # the first is prefilled in two chunks
    settings = [dict(max_tokens=12, temperature=0, ignore_eos=True),
                dict(max_tokens=12, temperature=0.8, top_k=20, seed=4, ignore_eos=True)]
    with m7.LLM(small_vocab_model_path, **LIMITS, speculative_config=config) as llm:
        proposer = llm.engine.speculator.proposer
        propose, prepare = proposer.propose_batch, proposer.runner.prepare

        def recorded_prepare(batch):
            call, fed = calls[-1], [(view.num_computed_tokens, len(view.token_ids)) for view in batch.seqs]
            ends = [end for _, end in fed]
            assert call["passes"] or ends == call["ends"], (  # checked here: a view past its chunk reads no table
                f"propose_batch call {len(calls) - 1}: the draft's first pass read its rows up to {ends}, but the "
                f"step's chunks end at {call['ends']} (num_computed_tokens + num_new_tokens): a view holds "
                "seq.token_ids[:end], the target's chunk and no more (the block tables hold no slot past it)"
            )
            call["passes"].append(fed)
            return prepare(batch)

        def recorded(batch):
            seqs = batch.seqs
            calls.append(dict(ids=[seq.request_id for seq in seqs], greedy=[seq.params.greedy for seq in seqs],
                              before=[seq.spec.num_drafted_tokens for seq in batch.seqs], rooms=dict(batch.guess_rooms),
                              ends=[seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens)],
                              passes=[]))
            guesses = propose(batch)
            calls[-1].update(guesses={row: list(g) for row, g in guesses.items()},
                             after=[seq.spec.num_drafted_tokens for seq in batch.seqs],
                             guess_probs={k: list(v) for k, v in batch.guess_probs.items()})
            return guesses

        proposer.runner.prepare, proposer.propose_batch = recorded_prepare, recorded
        run(m7, llm, prompts, settings)
    assert any(call["guesses"] for call in calls), "no step guessed: the tests below check nothing"
    return calls


def test_the_draft_feeds_each_row_from_where_it_stopped_to_the_end_of_its_chunk(draft_calls):
    for number, call in enumerate(draft_calls):
        first = call["passes"][0]
        fed = [start for start, _ in first]
        assert fed == call["before"], (
            f"propose_batch call {number}: the draft's first pass fed its rows from positions {fed}, but the draft "
            f"had computed {call['before']} tokens of them (seq.spec.num_drafted_tokens): a view starts at "
            "seq.spec.num_drafted_tokens, not at num_computed_tokens (after a step whose guesses were all kept the "
            "draft is a token behind the target: the last guess was never fed)"
        )
        ends = [end for _, end in first]
        assert ends == call["ends"], (
            f"propose_batch call {number}: the draft's first pass read its rows up to {ends}, but the step's chunks "
            f"end at {call['ends']} (num_computed_tokens + num_new_tokens): a view holds seq.token_ids[:end]"
        )
        for row, guesses in call["guesses"].items():
            assert len(guesses) == call["rooms"].get(row, 0), (
                f"propose_batch call {number}: row {row} got {len(guesses)} guesses with room for "
                f"{call['rooms'].get(row, 0)}: the draft guesses as many as batch.guess_rooms gives, one a pass"
            )
        assert set(call["guesses"]) == set(call["rooms"]), (
            f"propose_batch call {number} returned guesses for rows {sorted(call['guesses'])}, the rows with room are "
            f"{sorted(call['rooms'])}: a row each, every row with room"
        )
        want = [end + max(len(call["guesses"].get(row, [])) - 1, 0) for row, end in enumerate(call["ends"])]
        assert call["after"] == want, (
            f"propose_batch call {number}: num_drafted_tokens is {call['after']} afterwards, expected {want}: each "
            "row's chunk and every guess but the last (sampled, never fed) were computed by the draft, and "
            "seq.spec.num_drafted_tokens is set to its view's num_computed_tokens"
        )


def test_under_rejection_each_sampled_guess_comes_with_the_distribution_it_was_drawn_from(draft_calls):
    """acceptance "rejection": the target judges a draft's guess x against q(x), the draft's probability of it. A
    guess without its q is taken as certain (q one-hot), which keeps it with probability p(x) rather than
    min(1, p(x) / q(x)): the tokens no longer follow the target's distribution."""
    sampled_guesses = 0
    for number, call in enumerate(draft_calls):
        for row, guesses in call["guesses"].items():
            request, q = call["ids"][row], call["guess_probs"].get(call["ids"][row], [])
            if call["greedy"][row]:
                assert not q, (
                    f"propose_batch call {number}: greedy request {request!r} has {len(q)} distributions in "
                    "batch.guess_probs: a greedy pick is certain, only a sampled request's guesses get their q"
                )
                continue
            sampled_guesses += len(guesses)
            assert len(q) == len(guesses), (
                f"propose_batch call {number}: sampled request {request!r} guessed {len(guesses)} tokens, and "
                f"batch.guess_probs[{request!r}] holds {len(q)} distributions: one per guess, in order, each the "
                "next of self.runner.sampler.drawn_from after the pass that drew it"
            )
            for place, (guess, probs) in enumerate(zip(guesses, q)):
                assert abs(float(probs.sum()) - 1) < 1e-4 and float(probs[guess]) > 0, (
                    f"propose_batch call {number}: guess {place} of request {request!r}, token {guess}, comes with "
                    f"a q of sum {float(probs.sum()):.4f} giving it {float(probs[guess]):.3g}: q is the distribution "
                    "the guess was drawn from (it sums to 1 and gives the guess a chance)"
                )
    assert sampled_guesses > 0, "the sampled request guessed nothing: the test checks nothing"


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_the_model_as_its_own_draft_has_every_guess_kept(small_vocab_model_path, workload, reference, options):
    with m7.LLM(small_vocab_model_path, **LIMITS, **options, speculative_config=draft(small_vocab_model_path)) as llm:
        assert_same_outputs(run(m7, llm, *workload), reference, workload[1])
        stats = llm.engine.spec_stats()
        assert stats["num_draft_tokens"] > 100
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"], f"a guess was rejected: {stats}"
        if "num_kv_blocks" in options:
            assert llm.engine.kv_usage()["num_preemptions"] > 0
        elif options.get("enable_prefix_caching", True):
            assert llm.engine.kv_usage()["prefix_hit_rate"] > 0


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_a_smaller_draft_is_right_part_of_the_time_and_m7_still_matches_m6(small_vocab_model_path, one_layer_draft,
                                                                           workload, reference, options):
    with m7.LLM(small_vocab_model_path, **LIMITS, **options, speculative_config=draft(one_layer_draft, k=4)) as llm:
        assert_same_outputs(run(m7, llm, *workload), reference, workload[1])
        stats = llm.engine.spec_stats()
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], f"both paths must run: {stats}"
        assert llm.engine.kv_usage()["blocks_in_use"] == 0


@pytest.mark.parametrize("options", [OPTIONS[0], OPTIONS[2]], ids=[IDS[0], IDS[2]])
def test_each_guess_is_what_the_draft_model_itself_would_say(small_vocab_model_path, one_layer_draft, workload,
                                                             options):
    """Every proposal equals the draft model's own continuation of the request's tokens, run by m6 from scratch
    with the request's sampling and seed: after rejections and preemptions the draft reads the right keys and
    values (a stale one would make it say something else)."""
    proposals = []
    with m7.LLM(small_vocab_model_path, **LIMITS, **options, speculative_config=draft(one_layer_draft, k=4)) as llm:
        proposer = llm.engine.speculator.proposer
        propose = proposer.propose_batch

        def recorded(batch):
            guesses = propose(batch)
            proposals.extend((list(batch.seqs[row].token_ids), batch.seqs[row].params, batch.seqs[row].seed, list(g))
                             for row, g in guesses.items())
            return guesses

        proposer.propose_batch = recorded
        run(m7, llm, *workload)
    # m6 reads a proposal's tokens as its prompt, where frequency and presence penalties count nothing: a request
    # with them is left out (the model as its own draft checks the draft's penalties, every guess kept or not).
    proposals = [p for p in proposals if p[1].frequency_penalty == p[1].presence_penalty == 0]
    assert len(proposals) > 50
    params = [m6.SamplingParams(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)} | dict(
        max_tokens=len(guesses), seed=seed, ignore_eos=True, stop=(), stop_token_ids=()))
        for _, p, seed, guesses in proposals]
    with m6.LLM(one_layer_draft, **LIMITS) as reference:
        outs = reference.generate([tokens for tokens, *_ in proposals], params, use_tqdm=False)
    for (tokens, _, _, guesses), out in zip(proposals, outs):
        assert guesses == list(out.outputs[0].token_ids), f"after {len(tokens)} tokens the draft guessed {guesses}, " \
            f"but the draft model alone says {list(out.outputs[0].token_ids)}"


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, SMALL_VOCAB) for _ in range(length)]


def test_parallel_samples_share_their_prompt_in_the_cache_as_in_m6(small_vocab_model_path, one_layer_draft):
    """n samples: the first computes the prompt, the others follow once its blocks are cached and share them (m4). The
    draft computes the prompt's chunks beside the target, so the blocks are cached as soon as in m6."""
    prompt, settings = prompt_of(150, seed=11), dict(n=4, max_tokens=12, temperature=0.8, seed=3)
    outputs, cached = {}, {}
    for mod, options in [(m6, {}), (m7, dict(speculative_config=draft(one_layer_draft)))]:
        with mod.LLM(small_vocab_model_path, **LIMITS, **options) as llm:
            outputs[mod] = run(mod, llm, [prompt], [settings])
            cached[mod] = llm.engine.scheduler.num_cached_tokens
    assert_same_outputs(outputs[m7], outputs[m6], [settings])
    assert cached[m7] == cached[m6] == 3 * 144, f"prompt tokens the samples found cached: {cached[m7]} in m7 with a " \
        f"draft, {cached[m6]} in m6: the 9 full blocks of the prompt for each sample after the first"


@pytest.mark.parametrize("why", ["structured", "busy"])
def test_a_request_that_never_guesses_has_its_prompt_cached(tiny_model_path, small_vocab_model_path, why):
    """A structured request gets no guesses, nor does any request in a step of disable_by_batch_size requests. The
    draft computes their chunks all the same, so their blocks are cached, and a later request with the same prompt
    finds them there, as in m6."""
    prompt = prompt_of(100, seed=12)
    # A grammar covers the tokenizer's whole vocabulary: the structured request needs the whole tiny model.
    model = tiny_model_path if why == "structured" else small_vocab_model_path
    one_layer = first_layers_copy(model, 1, model.parent / "first-layer")
    first = dict(max_tokens=8, temperature=0)
    speculative = draft(one_layer)
    if why == "structured":
        first.update(structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"})
    else:
        speculative.update(disable_by_batch_size=1)  # every step has a request: nothing guesses
    cached = {}
    for mod, options in [(m6, {}), (m7, dict(speculative_config=speculative))]:
        with mod.LLM(model, **LIMITS, **options) as llm:
            run(mod, llm, [prompt], [first])
            run(mod, llm, [prompt + [7]], [dict(max_tokens=2, temperature=0)])
            cached[mod] = llm.engine.scheduler.num_cached_tokens
            if mod is m7:
                assert llm.engine.spec_stats()["num_draft_tokens"] == 0, "a request guessed: the test needs none"
    assert cached[m7] == cached[m6] == 96, f"the second request found {cached[m7]} prompt tokens cached in m7 with " \
        f"a draft, {cached[m6]} in m6: the 6 full blocks of the first one's prompt"


@pytest.mark.parametrize("options", [dict(), dict(num_kv_blocks=30, block_size=4)], ids=["default", "tight-pool"])
def test_each_draft_pass_stays_within_the_step_budget(small_vocab_model_path, options):
    """Long prompts and a budget of 32 tokens: the draft computes the target's chunks, so a forward pass of the draft
    never takes more than the budget, but for one token a request (the last guess of a step whose guesses were all
    kept: the model as its own draft has every guess kept). After a preemption it computes the prompt again in the
    target's chunks too, not all at once."""
    rng = random.Random(13)
    longest = 90 if options else 200
    prompts = [prompt_of(rng.randint(longest - 30, longest), seed=i) for i in range(5)]
    passes = []  # (tokens, requests) of each forward pass of the draft
    with m7.LLM(small_vocab_model_path, **LIMITS, **options, speculative_config=draft(small_vocab_model_path)) as llm:
        runner = llm.engine.speculator.proposer.runner
        prepare = runner.prepare

        def counted(batch):
            passes.append((sum(batch.num_new_tokens), len(batch.seqs)))
            return prepare(batch)

        runner.prepare = counted
        run(m7, llm, prompts, [dict(max_tokens=20, temperature=0, ignore_eos=True)] * len(prompts))
        if options:
            assert llm.engine.kv_usage()["num_preemptions"] > 0
    budget = LIMITS["max_num_batched_tokens"]
    over = [(tokens, requests) for tokens, requests in passes if tokens > budget + requests]
    assert not over, f"draft passes of (tokens, requests) {over[:5]} exceed the budget of {budget} tokens by more " \
        "than a token a request"
    assert max(tokens for tokens, _ in passes) >= budget, "no pass took a whole budget: the prompts were too short"


def test_a_failed_step_is_undone_for_the_draft_too(small_vocab_model_path):
    """A step raises while one request decodes and another is in the middle of its prompt. The draft computed both
    chunks before the launch; its count goes back with the target's (roll_back), so it computes them again with the
    target, every guess of the model as its own draft is still kept, and the tokens are m6's."""
    prompts = [prompt_of(20, seed=21), prompt_of(150, seed=22)]
    settings = [dict(max_tokens=16, temperature=0, ignore_eos=True),
                dict(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)]
    with m6.LLM(small_vocab_model_path, **LIMITS) as llm:
        reference = run(m6, llm, prompts, settings)
    with m7.LLM(small_vocab_model_path, **LIMITS, speculative_config=draft(small_vocab_model_path)) as llm:
        engine, failed = llm.engine, []
        real_execute = engine.runner.execute

        def fails_once(inputs):
            sampling = len({id(seq) for seq in inputs.sample_seqs})
            if 0 < sampling < inputs.num_seqs and not failed:  # a request samples, another is inside its prompt
                failed.append(inputs)
                raise RuntimeError("injected failure in a step that computes a prompt chunk")
            return real_execute(inputs)

        engine.runner.execute = fails_once
        ids = [engine.add_request(p, m7.SamplingParams(**s)) for p, s in zip(prompts, settings)]
        finished = {}
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except RuntimeError:
                outputs = []
            finished.update((out.request_id, out) for out in outputs if out.finished)
            engine.check_integrity()  # the draft's count at the target's, or one behind
        assert failed, "no step both decoded and computed a prompt chunk: nothing was undone"
        assert_same_outputs(completions([finished[i] for i in ids]), reference, settings)
        stats = engine.spec_stats()
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0, f"a guess was rejected: {stats}"


def test_a_block_waits_for_the_drafts_last_guess_before_it_is_cached():
    """After a step whose guesses were all kept, the draft has not fed the last guess: the block that ends with it is
    cached once the draft has written it too (in the request's next step), not as soon as the target has. A request
    that found the block sooner would have its draft read a slot nobody wrote."""
    speculative = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3)
    scheduler = Scheduler(m7.EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=4,
                                          num_kv_blocks=16, speculative_config=speculative))
    prompt = list(range(100, 110))
    seq = Sequence("r", None, prompt, m7.SamplingParams(max_tokens=20), 0, IncrementalDetokenizer(None, prompt, []))
    scheduler.add(seq)
    scheduler.schedule()  # admitted: its 10 prompt tokens
    seq.token_ids += list(range(200, 207))  # 17 tokens: the first one sampled, then 3 guesses kept and the bonus
    scheduler.block_manager.grow(seq.request_id, seq.num_tokens)
    seq.num_computed_tokens = seq.num_processed_tokens = 16  # the target wrote positions 0 to 15
    seq.spec.num_drafted_tokens = 15  # the draft has not fed the last guess, at position 15: the end of the 4th block
    scheduler._cache(seq)
    assert scheduler.locked_tokens[seq.request_id] == 12, (
        f"{scheduler.locked_tokens[seq.request_id]} tokens cached, expected 12: the 4th block ends with a slot the "
        "draft has not written, so it waits (the smaller of num_processed_tokens and num_drafted_tokens)"
    )
    seq.spec.num_drafted_tokens = 16  # the request's next step: the draft feeds the last guess with the bonus token
    scheduler._cache(seq)
    assert scheduler.locked_tokens[seq.request_id] == 16
    scheduler.check_integrity()


def test_first_layers_copy_keeps_the_first_layers(small_vocab_model_path, one_layer_draft):
    from safetensors import safe_open

    assert json.loads((one_layer_draft / "config.json").read_text())["num_hidden_layers"] == 1
    with safe_open(one_layer_draft / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert any(".layers.0." in n for n in names) and not any(".layers.1." in n for n in names)
    assert (one_layer_draft / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="num_layers must be in \\[1, 2\\]"):
        first_layers_copy(small_vocab_model_path, 3, one_layer_draft.parent / "too-many")


def test_a_draft_with_another_tokenizer_is_refused(small_vocab_model_path, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(small_vocab_model_path, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens trade ids: the same size, another map
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="has another tokenizer than the target's"):
        m7.LLM(small_vocab_model_path, **LIMITS, speculative_config=draft(other))


@pytest.mark.parametrize("config, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "only method 'draft_model' has one, which it needs"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only method 'draft_model' has one"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3}, "model must be a path"),
])
def test_bad_draft_configs_are_refused(small_vocab_model_path, config, message):
    with pytest.raises(ValueError, match=message):
        m7.LLM(small_vocab_model_path, **LIMITS, speculative_config=config)
