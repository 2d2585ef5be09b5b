"""m7 == m6: guessed tokens checked in one forward give m6's tokens, greedy and seeded, whatever is guessed.

A random tiny model's text never repeats, so an ngram proposer would guess nothing
there. The tiny-model tests swap in a proposer that guesses from m6's own output,
wrong on purpose at every third position: guesses are kept and rejected at known
places, so both paths run in every test. The ngram proposer itself meets real text on
the bundled model, asked to copy a passage.

test_m7_matches_m6 runs the whole workload, a structured request included, on the tiny model.
The tests of how guesses are scheduled, streamed, counted, stopped or undone run it without
the structured request on the tiny model cut to 4,096 tokens (conftest.py), whose steps cost
a fraction: a grammar needs the tokenizer's whole vocabulary.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from milestones import m6, m7
from milestones.m7.config import default_capture_sizes
from milestones.m7.proposer import NgramProposer
from milestones.m7.sequence import Sequence
from milestones.m7.step import DecodeInputs
from tests.chain import LIMITS as CHAIN_LIMITS
from tests.chain import Completion, assert_same_outputs, completions, mixed_workload, run, stop_rules_from
from tests.conftest import needs_compiler
from tests.m7.conftest import SMALL_VOCAB

LIMITS = dict(CHAIN_LIMITS, enforce_eager=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

# SGLang's admission (admission.py), its ratio low and decaying fast, so that requests are retracted
SGLANG = dict(new_token_ratio=0.2, min_new_token_ratio=0.01, new_token_ratio_decay=0.05)


@dataclasses.dataclass(frozen=True)
class OracleProposer(NgramProposer):
    """Guesses each request's next tokens from a run of m6 (prompt + output), wrong where the position is 0 mod 3."""

    futures: tuple[tuple[int, ...], ...] = ()

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        n = len(token_ids)
        future = next(f for f in self.futures if list(f[:n]) == token_ids)
        return [g + 1 if (n + i) % 3 == 0 else g for i, g in enumerate(future[n : n + num_tokens])]

    def look_up(self, seq: Sequence, num_tokens: int) -> list[int]:
        return self.propose(seq.token_ids, num_tokens)  # propose_batch asks here: the oracle, not the request's index


def speculating(llm, prompts, reference: list[Completion]):
    """``llm`` (m7) with the oracle proposer in place of the ngram one."""
    futures = tuple(tuple(p) + tuple(sample.token_ids) for p, c in zip(prompts, reference)
                    for sample in (Completion(*c).samples or [c]))  # each of a request's n samples
    llm.engine.speculator.proposer = OracleProposer(1, 1, futures)
    return llm


@pytest.fixture(scope="module")
def workload():
    return mixed_workload(16, seed=7, max_prompt=60, max_output=40)


@pytest.fixture(scope="module")
def reference(tiny_model_path, workload):
    return run(m6, m6.LLM(tiny_model_path, **LIMITS), *workload)


@pytest.fixture(scope="module")
def plain_workload():
    """The workload without its structured request, its prompts in the small vocabulary: for the tests whose point
    is how guesses are scheduled, streamed, counted or undone, on the tiny model cut to 4,096 tokens (conftest.py),
    where a step's head and the sampler's sort cost a twelfth. test_m7_matches_m6 runs the whole workload."""
    prompts, settings = mixed_workload(16, seed=7, max_prompt=60, max_output=40)
    prompts = [[3 + token % (SMALL_VOCAB - 3) for token in prompt] for prompt in prompts]
    return prompts, [{k: v for k, v in s.items() if k != "structured_outputs"} for s in settings]


@pytest.fixture(scope="module")
def plain_reference(small_vocab_model_path, plain_workload):
    return run(m6, m6.LLM(small_vocab_model_path, **LIMITS), *plain_workload)


def spec_counts(llm) -> tuple[int, int]:
    stats = llm.engine.spec_stats()
    return stats["num_draft_tokens"], stats["num_accepted_tokens"]


def assert_guessed_both_ways(llm):
    drafted, accepted = spec_counts(llm)
    assert 0 < accepted < drafted, f"{drafted} guesses, {accepted} accepted: both paths must run"


@pytest.mark.parametrize("options", [
    dict(),  # the pool as m6 sizes it, prefix caching on
    dict(enable_prefix_caching=False),
    dict(num_kv_blocks=24, block_size=4),  # a tight pool: requests are preempted and speculate again
    dict(num_kv_blocks=24, block_size=4, **SGLANG),  # and retracted, SGLang's way
    dict(num_kv_blocks=24, block_size=4, batch_shape="prefill-first"),  # decodes (and guesses) wait for prefills
], ids=["default", "no-prefix-cache", "tight-pool", "tight-pool-sglang", "tight-pool-prefill-first"])
def test_m7_matches_m6(tiny_model_path, workload, reference, options):
    with speculating(m7.LLM(tiny_model_path, **LIMITS, **options, speculative_config=NGRAM), workload[0],
                     reference) as llm:
        ours = run(m7, llm, *workload)
        assert_same_outputs(ours, reference, workload[1])
        assert_guessed_both_ways(llm)
        if "num_kv_blocks" in options:
            assert llm.engine.kv_usage()["num_preemptions"] > 0


@needs_compiler
def test_checking_steps_are_replayed_and_give_m6s_tokens(tiny_model_path, workload, reference):
    """A checking step is a decode step with a row per token: it fits m5's captured buckets, which count rows."""
    sizes = [5, 10]  # one request with 4 guesses, two; more rows than 10 run eagerly
    captured = dict(LIMITS, enforce_eager=False, cudagraph_capture_sizes=sizes)
    with speculating(m7.LLM(tiny_model_path, **captured, speculative_config=NGRAM), workload[0], reference) as llm:
        runner, replayed = llm.engine.runner, []
        real_run = runner.graph_runner.run

        def counting(inputs: DecodeInputs, future_map):
            replayed.append((len(inputs.token_ids), len({id(table) for table in inputs.block_tables})))
            return real_run(inputs, future_map)

        runner.graph_runner.run = counting
        assert_same_outputs(run(m7, llm, *workload), reference, workload[1])
        assert_guessed_both_ways(llm)
        assert any(rows > seqs for rows, seqs in replayed), f"no replayed step checked a guess: {replayed}"
        assert llm.engine.graph_stats()["eager_steps"] > 0


def test_captured_sizes_count_rows_so_checking_steps_fit():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_capture_sizes(cpu, 1, 1) == [1]  # m6's sizes without speculation
    assert default_capture_sizes(cpu, 1, 5) == [1, 5]  # a CPU adds one request's checking step
    assert default_capture_sizes(cpu, 16, 5) == [1, 4, 5]
    assert default_capture_sizes(cuda, 4, 5)[-1] == 20  # CUDA: every request checking k guesses


def test_a_captured_size_beyond_every_requests_guesses_is_refused(tiny_model_path):
    bound = re.escape("row counts in [1, max_num_seqs * (1 + num_speculative_tokens) = 25]")
    with pytest.raises(ValueError, match=bound):
        m7.LLM(tiny_model_path, **dict(LIMITS, enforce_eager=False, cudagraph_capture_sizes=[26]),
               speculative_config=NGRAM)


def test_a_step_of_disable_by_batch_size_requests_guesses_nothing(small_vocab_model_path, plain_workload,
                                                                  plain_reference):
    config = dict(NGRAM, disable_by_batch_size=5)
    with speculating(m7.LLM(small_vocab_model_path, **LIMITS, speculative_config=config), plain_workload[0],
                     plain_reference) as llm:
        runner, steps = llm.engine.runner, []
        real_prepare = runner.prepare

        def recording(batch):
            steps.append((len(batch.seqs), sum(len(seq.spec.draft_token_ids) for seq in batch.seqs)))
            return real_prepare(batch)

        runner.prepare = recording
        assert_same_outputs(run(m7, llm, *plain_workload), plain_reference, plain_workload[1])
        assert_guessed_both_ways(llm)
        assert all(guesses == 0 for seqs, guesses in steps if seqs >= 5), steps
        assert any(seqs >= 5 for seqs, _ in steps), "no step was busy enough: the test checks nothing"


def test_without_speculative_config_m7_is_m6(small_vocab_model_path, plain_workload, plain_reference):
    with m7.LLM(small_vocab_model_path, **LIMITS) as llm:
        assert_same_outputs(run(m7, llm, *plain_workload), plain_reference, plain_workload[1])
        assert spec_counts(llm) == (0, 0)


def test_every_stop_rule_inside_an_accepted_run(small_vocab_model_path):
    """Stop tokens and stop strings taken from the middle of each request's output, so they fall among guesses."""
    prompts, greedy = mixed_workload(12, seed=11, max_prompt=40, max_output=30)
    prompts = [[3 + token % (SMALL_VOCAB - 3) for token in prompt] for prompt in prompts]  # the small vocabulary's
    greedy = [dict({k: v for k, v in s.items() if k != "structured_outputs"}, temperature=0, max_tokens=30,
                   ignore_eos=True) for s in greedy]  # a structured output ends by EOS
    base = run(m6, m6.LLM(small_vocab_model_path, **LIMITS), prompts, greedy)
    settings = stop_rules_from(base, greedy, otherwise=lambda i, s: dict(s, max_tokens=5 + i))
    reference_llm = m6.LLM(small_vocab_model_path, **LIMITS)
    reference = run(m6, reference_llm, prompts, settings)
    with speculating(m7.LLM(small_vocab_model_path, **LIMITS, speculative_config=NGRAM), prompts, reference) as llm:
        assert_same_outputs(run(m7, llm, prompts, settings), reference, settings)
        assert_guessed_both_ways(llm)
        # No rejected guess, and no token after a stop, reached the prefix cache: it caches what m6 does.
        assert llm.engine.kv_usage()["blocks_cached"] == reference_llm.engine.kv_usage()["blocks_cached"]
        assert llm.engine.kv_usage()["blocks_in_use"] == 0


def test_a_step_streams_several_tokens_of_a_request_once(small_vocab_model_path, plain_workload, plain_reference):
    prompts, settings = plain_workload
    with speculating(m7.LLM(small_vocab_model_path, **LIMITS, speculative_config=NGRAM), prompts,
                     plain_reference) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, m7.SamplingParams(**s)) for p, s in zip(prompts, settings)]
        streamed, seen, most_in_a_step = dict.fromkeys(ids, ""), dict.fromkeys(ids, 0), 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            assert len({o.request_id for o in outs}) == len(outs), "a request reported twice in one step"
            for out in outs:
                text, tokens = out.outputs[0].text, out.outputs[0].token_ids
                assert text.startswith(streamed[out.request_id]), "streamed text was taken back"
                most_in_a_step = max(most_in_a_step, len(tokens) - seen[out.request_id])
                streamed[out.request_id], seen[out.request_id] = text, len(tokens)
        assert most_in_a_step > 1, "no step kept a guess"


def test_metrics_count_guesses_per_request(small_vocab_model_path, plain_workload, plain_reference):
    with speculating(m7.LLM(small_vocab_model_path, **LIMITS, speculative_config=NGRAM), plain_workload[0],
                     plain_reference) as llm:
        outs = llm.generate(plain_workload[0], [m7.SamplingParams(**s) for s in plain_workload[1]], use_tqdm=False)
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        accepted = sum(o.metrics.num_accepted_tokens for o in outs)
        assert (drafted, accepted) == spec_counts(llm)
        assert all(o.metrics.num_accepted_tokens <= o.metrics.num_draft_tokens for o in outs)


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram"}, "num_speculative_tokens required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "takes the keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min \\(5\\) must be at most prompt_lookup_max \\(3\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ("ngram", "speculative_config must be a dict"),
])
def test_bad_speculative_configs_are_refused(tiny_model_path, config, message):
    with pytest.raises(ValueError, match=message):
        m7.LLM(tiny_model_path, **LIMITS, speculative_config=config)


def test_overlap_cannot_be_forced_on_with_speculation(tiny_model_path):
    with pytest.raises(ValueError, match="async_scheduling=True cannot overlap speculative steps"):
        m7.LLM(tiny_model_path, **LIMITS, speculative_config=NGRAM, async_scheduling=True)


def test_with_overlap_on_step_waits_for_each_step_while_guessing(tiny_model_path, workload, reference):
    """What "auto" resolves to on CUDA, overlap on, made here by hand: with a proposer, step() runs m5's loop (the
    proposer reads each request's latest token on the host), and the tokens are m6's."""
    with speculating(m7.LLM(tiny_model_path, **LIMITS, speculative_config=NGRAM), workload[0], reference) as llm:
        llm.engine.config.async_scheduling = True
        assert_same_outputs(run(m7, llm, *workload), reference, workload[1])
        assert_guessed_both_ways(llm)


@pytest.mark.real_model
def test_ngram_guesses_real_text_and_m7_still_matches_m6(bundled_model_path):
    """Asked to copy a passage, the model repeats it: prompt lookup guesses it, and most guesses are kept."""
    passage = "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times."
    prompts = [f"Copy this sentence exactly.\n{passage}\nCopy: {passage[:20]}", f"Say it again: {passage}\nAgain:"]
    settings = [dict(temperature=0, max_tokens=24), dict(temperature=0.8, seed=3, max_tokens=24)]
    limits = dict(device="cpu", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, enforce_eager=True)
    reference = run(m6, m6.LLM(bundled_model_path, **limits), prompts, settings)
    with m7.LLM(bundled_model_path, **limits, speculative_config=NGRAM) as llm:
        assert_same_outputs(run(m7, llm, prompts, settings), reference, settings)
        stats = llm.engine.spec_stats()
    print(f"\nngram on a copy: {stats}")
    assert stats["num_accepted_tokens"] > 0


def test_a_failed_step_with_guesses_is_undone(small_vocab_model_path, plain_workload, plain_reference):
    """A step that checks guesses raises: its rows, its computed tokens and the blocks grown for its guesses are
    undone, and stepping on gives m6's tokens."""
    prompts, settings = plain_workload
    # Blocks of 4 tokens: the guesses of the failing step reach into a block of their own.
    with speculating(m7.LLM(small_vocab_model_path, **LIMITS, block_size=4, speculative_config=NGRAM), prompts,
                     plain_reference) as llm:
        engine, failed = llm.engine, []
        real_run = engine.runner.execute

        def fails_once_with_guesses(inputs):
            guessing = len(inputs.samples) > len({id(seq) for seq in inputs.sample_seqs})  # a request samples twice
            if guessing and not failed:
                failed.append(inputs)
                raise RuntimeError("injected failure in a step that checks guesses")
            return real_run(inputs)

        engine.runner.execute = fails_once_with_guesses
        ids = [engine.add_request(p, m7.SamplingParams(**s)) for p, s in zip(prompts, settings)]
        finished, failures = {}, 0
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except RuntimeError:
                failures += 1
                outputs = []
            finished.update((out.request_id, out) for out in outputs if out.finished)
            engine.check_integrity()  # no request holds blocks past its tokens after the undo
        assert failures == 1
        assert_same_outputs(completions([finished[i] for i in ids]), plain_reference)
