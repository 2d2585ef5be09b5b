"""Incremental detokenization: never half a character, stop strings, the stream adds up."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from milestones.m1.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from milestones.serving.text_stream import DETOKENIZER_ENV

TEXTS = [
    "Hello world, how are you?",
    "北京欢迎你，上海也不错。",
    "Dragons 🐉🐉 and cats 🐱 👩‍👩‍👧",
    "mixed: naïve café – 東京 🚀!",
]


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    return AutoTokenizer.from_pretrained(bundled_model_path)


@pytest.fixture(autouse=True, params=["stream", "python"])
def rule(request, monkeypatch):
    """Every test runs with the tokenizer's own stream (the default) and with the lesson's Python rule."""
    if request.param == "python":
        monkeypatch.setenv(DETOKENIZER_ENV, "python")
    else:
        monkeypatch.delenv(DETOKENIZER_ENV, raising=False)
    return request.param


def test_the_switch_picks_the_rule(tokenizer, rule):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), [])
    assert (detok.next_text == detok.new_text) is (rule == "python")


def test_the_stream_gives_the_lessons_text_token_by_token(tokenizer, monkeypatch):
    """Random prompts and random tokens (special ones, lone bytes, prompts ending inside a character among them):
    the text after every token is the same by both rules."""
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(8))]
        ids = [rng.randrange(len(tokenizer)) if rng.random() < 0.7 else rng.randrange(300) for _ in range(40)]
        with monkeypatch.context() as env:
            env.delenv(DETOKENIZER_ENV, raising=False)
            ours = IncrementalDetokenizer(tokenizer, prompt, ["\n\n"])
            env.setenv(DETOKENIZER_ENV, "python")
            lesson = IncrementalDetokenizer(tokenizer, prompt, ["\n\n"])
        assert ours.next_text != ours.new_text or "\ufffd" in tokenizer.decode(prompt[-CONTEXT_TOKENS:],
                                                                          skip_special_tokens=True)
        for i, token in enumerate(ids):
            assert ours.add_token(token) == lesson.add_token(token), (prompt, ids[: i + 1])
            assert ours.text == lesson.text, (prompt, ids[: i + 1])


@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_splits_a_character_and_adds_up(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split()), "expected multi-token characters in this text"
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    shown = []
    for token in ids:
        detok.add_token(token)
        visible = detok.visible_text(False)
        assert "\ufffd" not in visible
        shown.append(visible)
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))
    assert detok.visible_text(True) == tokenizer.decode(ids) == text


def test_stop_string_is_held_back_then_cut(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    detok = IncrementalDetokenizer(tokenizer, [], ["END"])
    matched = None
    for token in ids:
        matched = detok.add_token(token)
        assert "EN" not in detok.visible_text(False)
        if matched:
            break
    assert matched == "END"
    assert detok.visible_text(True) == "The answer is 42. "


def test_earliest_of_several_stop_strings_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ["world", "lo w"])
    for token in tokenizer.encode("hello world"):
        if detok.add_token(token):
            break
    assert detok.visible_text(True) == "hel"
