"""Structured output: a grammar per request, which masks every token that would break the request's format.

The grammar is compiled when the request arrives (a bad schema is refused there) by
llguidance, against the model's tokenizer. At each step the sampler asks it for the tokens
it accepts next (a bitmask over the vocabulary), sets every other logit to -inf, samples,
and hands it the token picked. llguidance is imported on the first structured request
only: an engine that never gets one never needs it.
"""

from __future__ import annotations

from typing import Any

from .sampling_params import InvalidParam, StructuredOutputsParams

REGEX_SPECIAL = set("\\.^$|?*+()[]{}-&~#")  # escaped in a choice: it is matched as the text it is


class Grammar:
    """A request's compiled grammar and how many of its output tokens it has read."""

    __slots__ = ("matcher", "num_tokens")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher  # an llguidance.LLMatcher
        self.num_tokens = 0

    def allowed(self) -> bytes:
        """The tokens it accepts next, a bit per token id (little-endian 32-bit words)."""
        return self.matcher.compute_bitmask()

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed: "
                               f"{self.matcher.get_error()}")
        self.num_tokens += 1

    def rewind(self, num_tokens: int) -> None:
        """Forget the tokens read after the first ``num_tokens`` (a step that was undone sampled them)."""
        assert num_tokens <= self.num_tokens, f"the grammar read {self.num_tokens} tokens, not {num_tokens}"
        if num_tokens < self.num_tokens:
            self.matcher.rollback(self.num_tokens - num_tokens)
            self.num_tokens = num_tokens


class StructuredOutputManager:
    """Compiles each structured request's grammar; the tokenizer is read once, at the first such request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.lltokenizer = None

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh grammar for one request (or one sample); ValueError says what is wrong with the format."""
        import llguidance
        import llguidance.hf

        if self.lltokenizer is None:
            self.lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=sorted(self.eos_token_ids))
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar_source(params))
        if matcher.is_error():
            raise InvalidParam("structured_outputs", f"structured_outputs: {matcher.get_error()}")
        return Grammar(matcher)


def grammar_source(params: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher

    compact = {"whitespace_flexible": False}  # JSON without free whitespace: a model cannot pad it forever
    if params.json is not None:
        return LLMatcher.grammar_from_json_schema(params.json, defaults=compact)
    if params.json_object:
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    escaped = ("".join("\\" + c if c in REGEX_SPECIAL else c for c in choice) for choice in params.choice)
    return LLMatcher.grammar_from_regex("(" + "|".join(escaped) + ")")
