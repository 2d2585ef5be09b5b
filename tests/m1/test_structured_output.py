"""Structured output: every token of a structured request is one its grammar accepts, and the text takes the format.

The grammar (llguidance) is checked on its own terms first: each output must be a sequence of tokens that a fresh
grammar of the same format accepts one by one, ending where the format is complete. Then the format itself: the JSON
parses and has the schema's fields, the regular expression matches the whole text, the choice is one of the choices.
The chain holds m2..m7 to the same tokens on its mixed workload, which has structured requests.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from milestones.m1 import LLM, SamplingParams
from milestones.serving.logits_processors import LogitsProcessors
from milestones.serving.sampling_params import StructuredOutputsParams
from tests.m1.test_sampler import seq

pytest.importorskip("llguidance", reason="structured output needs llguidance (requirements.txt)")

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "confidence"], "additionalProperties": False}
FORMATS = {
    "json_schema": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
    "choice": StructuredOutputsParams(choice=["red", "green", "blue sky", "a.b (c)"]),
}


def assert_in_format(name: str, text: str) -> None:
    if name == "json_schema":
        value = json.loads(text)
        assert set(value) == {"answer", "confidence"} and value["answer"] in ("yes", "no"), text
        assert isinstance(value["confidence"], int) and 0 <= value["confidence"] <= 9, text
    elif name == "regex":
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
    else:
        assert text in ("red", "green", "blue sky", "a.b (c)"), text


def assert_grammar_accepts(llm, params: StructuredOutputsParams, token_ids: list[int]) -> None:
    """A fresh grammar of the same format takes the tokens one by one (the last one ends it)."""
    grammar = llm.engine.structured.grammar(params)
    for position, token in enumerate(token_ids):
        assert grammar.matcher.consume_token(token), f"token {position} ({token}) breaks the format"
    assert grammar.matcher.is_stopped() or grammar.matcher.is_accepting(), "the output stops before its format ends"


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(tiny_model_path, device="cpu", max_model_len=256)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("temperature", [0, 1.5])
def test_every_token_is_one_the_grammar_accepts(llm, name, temperature):
    """On a random tiny model, which would never write any of these formats on its own."""
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=40, structured_outputs=FORMATS[name])
    for prompt in ([5, 6, 7], [1000, 2000, 3000, 4000, 5000]):
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop", f"{name}: ended by {out.finish_reason} after {out.token_ids}"
        assert_grammar_accepts(llm, FORMATS[name], out.token_ids)
        assert_in_format(name, out.text)


@pytest.mark.real_model
def test_the_bundled_model_answers_in_the_schema():
    llm = LLM(device="cpu", max_model_len=512)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                                               tokenize=False, add_generation_prompt=True)
    for name in FORMATS:
        params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=FORMATS[name])
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop", out.text
        assert_in_format(name, out.text)
    any_object = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(
        json_object=True))
    out = llm.generate(prompt, any_object, use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":  # an object the model closes within 200 tokens parses
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.text.lstrip().startswith("{")


def test_the_mask_keeps_only_the_grammars_tokens_and_leaves_other_rows_alone(llm):
    grammar = llm.engine.structured.grammar(FORMATS["regex"])
    structured, plain = seq(prompt_len=2), seq(prompt_len=2)
    structured.grammar = grammar
    logits = torch.randn(2, 49152)
    masked = LogitsProcessors(torch.device("cpu")).apply_grammars(logits, [structured, plain])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    digits = {llm.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    assert digits <= set(allowed) and len(allowed) < 100, f"{len(allowed)} tokens allowed where a digit must come"
    assert torch.equal(masked[0][allowed], logits[0][allowed]) and torch.equal(masked[1], logits[1])


@pytest.mark.parametrize("bad, message", [
    (dict(), "exactly one of"),
    (dict(json=SCHEMA, regex="a"), "exactly one of"),
    (dict(json=3), "JSON schema"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(json_object=1), "exactly one of|json_object must be True or False"),
])
def test_a_format_that_says_nothing_clear_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**bad)


def test_a_schema_the_compiler_refuses_is_refused_before_anything_is_queued(llm):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "frob"}))
    with pytest.raises(ValueError, match="structured_outputs: .*frob"):
        llm.engine.add_request([5, 6], params)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="ignore_eos=True cannot go with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=FORMATS["regex"])
