"""Turn tokens into text one token at a time, and spot stop strings.

Two traps make this harder than ``decode(token)``:

* one character may span several tokens (an emoji is four UTF-8 bytes, and a
  byte-level tokenizer may give each byte its own token). Decoding a partial
  character yields U+FFFD, so we wait until the character is complete;
* some tokenizers drop a token's leading space when it is decoded alone, so we
  always decode a few tokens of context and keep only the new suffix.

Stop strings are matched on the text, and the text that could still turn into a
stop string is held back while streaming, so what has been streamed never has to
be taken back.
"""

from __future__ import annotations

from collections.abc import Callable

from milestones.serving.text_stream import text_stream

CONTEXT_TOKENS = 5  # tokens of left context decoded with each new token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.decode = text_decoder(tokenizer)
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the context window in self.tokens
        self.read_offset = len(self.tokens)  # tokens before this are already in self.text
        self.text = ""
        # The same rule in Rust where the tokenizer has it (a platform speed-up: milestones/serving/text_stream.py).
        self.next_text = text_stream(tokenizer, self.tokens) or self.new_text

    # --8<-- [start:add_token]
    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; return the stop string it completed, if any."""
        new_text = self.next_text(token_id)
        if not new_text:
            return None  # nothing new yet, or half a character: wait for more tokens
        self.text += new_text
        return self._truncate_at_stop(len(new_text))

    def new_text(self, token_id: int) -> str:
        """The text one more token completes: the window decoded with it, minus the window without it."""
        self.tokens.append(token_id)
        before = self.decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self.decode(self.tokens[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return after[len(before) :]
    # --8<-- [end:add_token]

    def _truncate_at_stop(self, num_new_chars: int) -> str | None:
        if not self.stop:
            return None
        # A stop string completed by this token must end inside the new text.
        start = max(0, len(self.text) - num_new_chars - self.hold_back)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text a user may see now: all of it once finished, else minus what may become a stop string."""
        if finished or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """Token ids to text, special tokens left out. Paid twice per token of every request: a fast tokenizer's own
    decoder takes a third of the time of transformers' ``decode`` around it, which adds nothing to its text unless it
    cleans up spaces (then that ``decode`` is used)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
