"""Incremental detokenization: never half a character, stop strings, the stream adds up."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from milestones.m1.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, how are you?",
    "北京欢迎你，上海也不错。",
    "Dragons 🐉🐉 and cats 🐱 👩‍👩‍👧",
    "mixed: naïve café – 東京 🚀!",
]


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    return AutoTokenizer.from_pretrained(bundled_model_path)


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
