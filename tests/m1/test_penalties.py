"""Presence, frequency and repetition penalties: checked against transformers' generate on the same weights.

transformers has the repetition penalty as a logits processor of its own (``repetition_penalty=``), with the same
rule as vLLM's (a positive logit of a token of the prompt or the output is divided by the penalty, a negative one
multiplied). It has no presence or frequency penalty: for those, generate is given a logits processor written here
from OpenAI's definition (``logit -= frequency * count + presence * (count > 0)``, over the generated tokens only),
so that the test checks m1's sampler against the definition, through transformers' own generation loop.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from milestones.m1 import LLM, SamplingParams
from milestones.m1.detokenizer import IncrementalDetokenizer
from milestones.m1.sampler import Sampler
from milestones.m1.sequence import Sequence
from milestones.serving.logits_processors import LogitsProcessors
from tests.m1.test_vs_transformers import RecordingSampler

STEPS = 24


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties on the tokens generated after the prompt."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.stack([row[self.prompt_len:].bincount(minlength=scores.shape[-1]) for row in input_ids])
        return scores - self.frequency * counts - self.presence * (counts > 0)


def hf_penalized(hf, prompt: list[int], params: dict):
    processors = LogitsProcessorList()
    if params.get("presence_penalty", 0) or params.get("frequency_penalty", 0):
        processors.append(OpenAIPenalties(len(prompt), params.get("presence_penalty", 0),
                                          params.get("frequency_penalty", 0)))
    out = hf.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=STEPS,
        do_sample=False, repetition_penalty=params.get("repetition_penalty", 1.0), logits_processor=processors,
        output_scores=True, output_logits=True, return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0], torch.stack(out.logits)[:, 0]


PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.8, presence_penalty=-0.5, repetition_penalty=0.8),  # all three, in vLLM's order
]


# The bundled model, whose answers repeat themselves: a random tiny model's peaked logits shrug off any penalty.
QUESTIONS = ["Count from one to twenty in words.", "Write a short poem about the sea, the sea, the sea."]


@pytest.fixture(scope="module")
def models(bundled_model_path):
    hf = AutoModelForCausalLM.from_pretrained(bundled_model_path, dtype=torch.float32).eval()
    return hf, LLM(device="cpu", linear_backend="torch")  # transformers' own operators: logits within 1e-4


@pytest.mark.real_model
@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_penalized_greedy_tokens_and_scores_match_transformers(models, penalties):
    hf, llm = models
    sampler = llm.engine.runner.sampler
    recorder = llm.engine.runner.sampler = RecordingSampler(sampler)  # the logits it picks from: penalized
    changed = 0
    for question in QUESTIONS:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        recorder.logits.clear()
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **penalties)
        ours = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        ref_tokens, ref_scores, ref_logits = hf_penalized(hf, prompt, penalties)
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        n = len(ref_tokens)  # transformers stops at EOS; we were told to ignore it
        changed += plain[:n] != ours[:n]
        assert n >= 8 and ours[:n] == ref_tokens, (
            f"prompt of {len(prompt)} tokens, {penalties}: output token {first_difference(ours, ref_tokens)} differs "
            f"from transformers' (ours {ours}, transformers {ref_tokens})")
        # The logits the sampler picked from, step by step, against transformers' penalized scores.
        for step, penalized in enumerate(recorder.logits[:n]):
            margin = (penalized[0] - ref_scores[step]).abs().max().item()
            assert margin <= 1e-4, f"step {step}: penalized logits differ from transformers' by {margin:.2e} > 1e-4"
    llm.engine.runner.sampler = sampler
    assert changed, f"{penalties} changed no answer: the test would pass without penalties"


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence("r", None, prompt, SamplingParams(**params), 0, IncrementalDetokenizer(None, prompt, []))
    s.token_ids += output
    return s


def test_each_penalty_on_hand_made_logits():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5, -0.5]])
    features = LogitsProcessors(torch.device("cpu"))
    rows = {  # prompt [0], output [1, 2, 2]: token 0 seen in the prompt only, 3 and 4 never seen
        "repetition": (dict(repetition_penalty=2.0), [1.0, -2.0, 0.5, 0.5, -0.5]),
        "frequency": (dict(frequency_penalty=0.5), [2.0, -1.5, 0.0, 0.5, -0.5]),
        "presence": (dict(presence_penalty=0.25), [2.0, -1.25, 0.75, 0.5, -0.5]),
    }
    original = logits.clone()
    for name, (params, expected) in rows.items():
        got = features.apply_penalties(logits, [seq([0], [1, 2, 2], **params)])[0]
        assert torch.equal(logits, original), (
            f"apply_penalties with the {name} penalty changed the caller's logits to {logits[0].tolist()} (they "
            f"were {original[0].tolist()}): penalize a clone, since the caller keeps the model's logits for the "
            "logprobs")
        assert torch.equal(got, torch.tensor(expected)), f"{name}: got {got.tolist()}, expected {expected}"
    untouched = features.apply_penalties(logits, [seq([0], [1, 2, 2])])
    assert untouched is logits, "a row without penalties should cost nothing"


def test_greedy_rows_are_penalized_too():
    logits = torch.tensor([[2.0, 1.9]])
    rows = [seq([5], [0], temperature=0, presence_penalty=0.5)]
    (pick,) = LogitsProcessors(torch.device("cpu")).sample(Sampler(torch.device("cpu")), logits, rows).as_list()
    assert pick.token_id == 1, f"token 0 was generated: presence_penalty=0.5 makes 1 the argmax, got {pick.token_id}"


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in \\[-2, 2\\]"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
])
def test_out_of_range_penalties_are_refused_with_the_range(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)
