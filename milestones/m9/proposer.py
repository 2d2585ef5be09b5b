"""Guess a request's next tokens before the model computes them: m7's proposer.

Plain Python (no torch). ``NgramProposer`` is prompt lookup: text that copies, corrects
or edits a given text repeats it, so the tokens that followed the last time the
request's latest few tokens appeared are a good guess for what follows now. A guess
costs no forward pass; the target model checks every guessed token of a request in one
step, and a wrong guess costs only the extra rows of that step. ``drafter.py`` has the
other proposer, a smaller model; the engine hands either the step's batch through
``propose_batch`` (``speculation.py``), for guesses in the room the scheduler kept.
``propose`` says what prompt lookup guesses; ``look_up`` gives the same guesses step after
step from an index kept on the request, without reading its whole history each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .sequence import Sequence
from .step import ScheduledBatch


# --8<-- [start:ngram]
@dataclass(slots=True, frozen=True)
class NgramProposer:
    """Find the latest earlier occurrence of the last n tokens (n from ``max_n`` down to ``min_n``); propose what
    followed it."""

    min_n: int
    max_n: int

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` guesses of the tokens after ``token_ids``; none where no n-gram repeats."""
        if num_tokens <= 0:
            return []
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix, last = token_ids[length - n :], token_ids[-1]
            # The latest match first: the nearest context is the likeliest to go on the same way.
            for start in range(length - n - 1, -1, -1):
                if token_ids[start + n - 1] == last and token_ids[start : start + n] == suffix:
                    return token_ids[start + n : start + n + num_tokens]
        return []
# --8<-- [end:ngram]

    min_lookahead: ClassVar[int] = 1  # a lookup that finds nothing costs nothing: never stop looking

    # --8<-- [start:propose_batch]
    def propose_batch(self, batch: ScheduledBatch) -> dict[int, list[int]]:
        """The guesses of each row with room (``batch.guess_rooms``), from its request's tokens alone: what ``propose``
        gives, read from the request's index rather than a scan of its whole history. Rows without room cost nothing."""
        return {row: self.look_up(batch.seqs[row], room) for row, room in batch.guess_rooms.items()}

    def look_up(self, seq: Sequence, num_tokens: int) -> list[int]:
        """``propose(seq.token_ids, num_tokens)`` from ``seq.spec.ngram_index``, which maps each run of min_n..max_n of
        its tokens to where the tokens after its latest occurrence start, first brought up to date with the tokens added
        since the last lookup. The engine drops only tokens of steps not processed yet, which no lookup saw."""
        if num_tokens <= 0:
            return []
        token_ids, index = seq.token_ids, seq.spec.ngram_index
        length = len(token_ids)
        if length - 1 < seq.spec.num_ngram_indexed:  # tokens a lookup saw were taken away: start over
            index.clear()
            seq.spec.num_ngram_indexed = 0
        # Each run whose next token is known: never the suffix itself. A later run overwrites: the latest wins.
        for end in range(seq.spec.num_ngram_indexed, length - 1):
            after = end + 1
            for n in range(self.min_n, min(self.max_n, after) + 1):
                index[tuple(token_ids[after - n : after])] = after
        seq.spec.num_ngram_indexed = max(length - 1, 0)
        for n in reversed(range(self.min_n, min(self.max_n, length - 1) + 1)):  # the longest suffix first
            start = index.get(tuple(token_ids[length - n :]))
            if start is not None:
                return token_ids[start : start + num_tokens]
        return []
    # --8<-- [end:propose_batch]


PROBE_INTERVAL = 8  # a request that stopped guessing (lookahead 0) guesses one token again every this many tokens


# --8<-- [start:guess_room]
def guess_room(seq: Sequence, max_model_len: int) -> int:
    """How many tokens a request may guess in its next step: at most its lookahead, and never past its last token."""
    if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_pending_tokens:
        return 0  # in the middle of its prompt, or its latest token is not known yet
    if seq.grammar is not None:
        return 0  # structured output: a guess row's mask would need the grammar to read the guesses before it
    end = max_model_len if seq.params.max_tokens is None else seq.num_prompt_tokens + seq.params.max_tokens
    room = min(end, max_model_len) - seq.num_tokens - 1  # the step also samples the token after the guesses
    # stopped: a probe now and then
    lookahead = seq.spec.num_lookahead or int(seq.num_output_tokens % PROBE_INTERVAL == 0)
    return max(0, min(lookahead, room))
# --8<-- [end:guess_room]
