"""The detokenizer's rule run by the tokenizer itself: a platform speed-up, not a lesson.

A milestone's ``detokenizer.py`` teaches incremental detokenization in Python: decode a
window of tokens with and without the new one, keep the difference, wait while it ends in
half a character. That is two ``decode`` calls and a few list slices a token, 3 us of
every request's every step on a CPU: at batch 256 the largest share of the engine's own
work. Hugging Face's fast tokenizers ship the same rule in Rust
(``tokenizers.decoders.DecodeStream``), about 1 us a token, which vLLM V1 uses when the
tokenizer has it (its ``FastIncrementalDetokenizer``; the Python rule stays for the
others). ``text_stream`` hands the lesson that stream where it gives the lesson's text:
a fast tokenizer whose ``decode`` adds no clean-up of spaces, after a context that decodes
whole (the stream starts reading there; the lesson's window reads past it). Set
``MILESTONES_DETOKENIZER=python`` to run the lesson's rule everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable

DETOKENIZER_ENV = "MILESTONES_DETOKENIZER"  # "python": the lesson's rule even where the tokenizer has a stream


def text_stream(tokenizer, context: list[int]) -> Callable[[int], str] | None:
    """A function from one more token to the text it completes ('' while a character is incomplete), after the
    ``context`` tokens; None where only the lesson's rule gives the lesson's text (or the switch asks for it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if os.environ.get(DETOKENIZER_ENV) == "python" or backend is None:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None  # transformers' decode rewrites spaces around punctuation after the tokenizer's own decode
    try:
        from tokenizers.decoders import DecodeStream  # tokenizers 0.21 on
    except ImportError:
        return None
    if "\ufffd" in backend.decode(context, skip_special_tokens=True):
        return None  # a prompt ending inside a character: the stream would give the context's text out again
    stream = DecodeStream(ids=list(context), skip_special_tokens=True)

    def step(token_id: int) -> str:
        return stream.step(backend, token_id) or ""

    return step
