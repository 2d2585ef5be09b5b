"""Log-probabilities of generated tokens, against transformers' own logits on the same weights.

vLLM's default (``raw_logprobs``): the log-softmax of the model's logits, before penalties and temperature, so a
request's log-probabilities say what the model thinks whatever rule picked its tokens. transformers' ``generate``
returns those raw logits (``output_logits=True``); both run float32 with the same operators (``linear_backend=
"torch"``, ``attention_backend="torch"``), so they agree within 1e-4 (m1's test of the logits themselves holds them
to that).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from milestones.m1 import LLM, SamplingParams
from milestones.m1.detokenizer import IncrementalDetokenizer
from milestones.m1.sampler import Sampler
from milestones.m1.sequence import Sequence
from milestones.m1.step import ScheduledBatch
from milestones.serving.logits_processors import LogitsProcessors
from milestones.serving.outputs import CompletionOutput
from tests.m1.test_sampler import seq
from tests.m1.test_vs_transformers import hf_generate, varied_prompts

ATOL = 1e-4
STEPS = 12


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    path = tiny_model_factory("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, LLM(path, device="cpu", dtype="float32", max_model_len=512, linear_backend="torch",
                   attention_backend="torch")


def check_against(completion: CompletionOutput, logits: torch.Tensor, k: int) -> None:
    """Each position's entries are the chosen token's, then the k likeliest, as log_softmax(logits) gives them."""
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    for position, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
        reference = logits[position].log_softmax(-1)
        top = reference.topk(k)
        expected = {token, *top.indices.tolist()}
        assert next(iter(entries)) == token, f"token {position}: the chosen token {token} is not the first entry"
        assert set(entries) == expected, f"token {position}: entries for {sorted(entries)}, expected {sorted(expected)}"
        for token_id, entry in entries.items():
            margin = abs(entry.logprob - reference[token_id].item())
            assert margin <= ATOL, (f"token {position}: log-probability of {token_id} is {entry.logprob:.6f}, "
                                    f"transformers' {reference[token_id].item():.6f} ({margin:.2e} > {ATOL})")
            rank = int((reference > reference[token_id]).sum()) + 1
            assert entry.rank == rank, f"token {position}: {token_id} ranks {entry.rank}, transformers' logits {rank}"


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_greedy_logprobs_match_transformers(models, k):
    hf, llm = models
    for prompt in varied_prompts(4):
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=k)
        ours = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        ref_tokens, ref_logits = hf_generate(hf, prompt, STEPS)
        assert ours.token_ids[: len(ref_tokens)] == ref_tokens
        check_against(ours, ref_logits, k)
        assert all(entries[token].rank == 1 for token, entries in zip(ours.token_ids, ours.logprobs)), "greedy: rank 1"


def test_sampled_and_penalized_tokens_get_the_models_own_logprobs(models):
    """Temperature, top-k and penalties change which token is picked, never the log-probabilities reported."""
    hf, llm = models
    prompt = varied_prompts(4)[3]
    params = SamplingParams(temperature=1.5, top_k=50, max_tokens=STEPS, ignore_eos=True, seed=7, logprobs=3,
                            presence_penalty=1.0, repetition_penalty=1.2)
    ours = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():  # the model's logits for the sampled continuation, in one forward
        logits = hf(torch.tensor([prompt + ours.token_ids])).logits[0, len(prompt) - 1 : -1]
    check_against(ours, logits, 3)


def test_no_logprobs_unless_asked(models):
    _, llm = models
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is None


def test_the_chosen_tokens_rank_counts_the_likelier_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    found = LogitsProcessors(torch.device("cpu")).logprobs(logits, [seq(logprobs=2), seq()], torch.tensor([2, 1]))
    assert found[1] is None, "a row that did not ask gets nothing"
    assert list(found[0]) == [2, 1, 3], "the chosen token first, then the likeliest in order"
    assert [entry.rank for entry in found[0].values()] == [3, 1, 2]
    expected = logits[0].log_softmax(-1)
    assert all(abs(entry.logprob - expected[token].item()) < 1e-6 for token, entry in found[0].items())


def test_penalties_and_temperature_leave_the_logprobs_alone():
    """The log-probabilities are log_softmax of the model's logits, not of what penalties and temperature made them."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    asking = seq(prompt_len=1, temperature=0.5, repetition_penalty=3.0, presence_penalty=2.0, logprobs=3)
    asking.token_ids += [2, 2]  # token 1 is the prompt's, token 2 was generated twice
    (pick,) = LogitsProcessors(torch.device("cpu")).sample(Sampler(torch.device("cpu")), logits, [asking]).as_list()
    expected = logits[0].log_softmax(-1)
    for token, entry in pick.logprobs.items():
        assert abs(entry.logprob - expected[token].item()) < 1e-6, (
            f"token {token}: {entry.logprob:.6f} reported, the model's own log-probability is "
            f"{expected[token].item():.6f}: log-probabilities come from the logits before penalties and temperature")


@pytest.mark.parametrize("bad", [-1, 21])
@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_out_of_range_are_refused_with_the_range(name, bad):
    with pytest.raises(ValueError, match=rf"{name} must be None or in \[0, 20\]"):
        SamplingParams(**{name: bad})


def check_prompt_against(prompt: list[int], found: list, logits: torch.Tensor, k: int) -> None:
    """The first prompt token has no score; token i's comes from the logits at position i - 1, as in check_against."""
    assert found is not None and len(found) == len(prompt), (
        f"{0 if found is None else len(found)} prompt entries for a prompt of {len(prompt)} tokens")
    assert found[0] is None, "nothing comes before the first prompt token to predict it"
    check_against(CompletionOutput(0, "", prompt[1:], None, found[1:]), logits[: len(prompt) - 1], k)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_prompt_logprobs_match_transformers(models, k):
    """Every prompt token's log-probability given the tokens before it: lm-eval's loglikelihood reads these."""
    hf, llm = models
    for prompt in varied_prompts(8)[1:]:
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)
        result = llm.generate(prompt, params, use_tqdm=False)[0]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0]
        check_prompt_against(prompt, result.prompt_logprobs, logits, k)
        assert result.outputs[0].logprobs is None, "prompt_logprobs alone asks nothing of the generated tokens"


def test_prompt_logprobs_run_the_lm_head_over_the_scored_rows(models, monkeypatch):
    """A prefill that scores its prompt runs the LM head over the rows that predict prompt tokens too (the others
    only over the last row: tests/m1/test_generate.py)."""
    _, llm = models
    runner, prompt, rows = llm.engine.runner, [5, 6, 7, 8, 9], []
    head = runner.compute_logits
    monkeypatch.setattr(runner, "compute_logits", lambda hidden: rows.append(len(hidden)) or head(hidden))
    scored = Sequence("s", None, prompt, SamplingParams(temperature=0, prompt_logprobs=1), seed=0,
                      detokenizer=IncrementalDetokenizer(None, prompt, []))
    output = runner.execute(ScheduledBatch([scored], [5]))
    assert sorted(rows) == [1, 4], f"with prompt_logprobs the LM head ran over {rows} rows: 4 score, 1 samples"
    assert len(output.prompt_logprobs["s"]) == 4, "tokens 2 to 5 of the prompt are scored, by rows 1 to 4"


def test_a_one_token_prompt_has_one_empty_score_and_none_unless_asked(models):
    _, llm = models
    asked, not_asked = llm.generate([[5], [5, 6, 7]], [SamplingParams(max_tokens=1, prompt_logprobs=2),
                                                        SamplingParams(max_tokens=1)], use_tqdm=False)
    assert asked.prompt_logprobs == [None]
    assert not_asked.prompt_logprobs is None
