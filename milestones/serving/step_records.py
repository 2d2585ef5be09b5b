"""The records the serving features add to a step: a row's pick with its log-probabilities, and the rows of a
request that score its own prompt.

Plain data, no torch: a milestone's step records (``step.py``) hold them, and its scheduler side stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .outputs import Logprob


@dataclass(slots=True)
class SampledToken:
    """One row's pick, with its log-probabilities when its request asked for them (``SamplingParams.logprobs``)."""

    token_id: int
    logprobs: dict[int, Logprob] | None = None  # the chosen token's first, then the likeliest ones'


# --8<-- [start:prompt_rows]
@dataclass(slots=True)
class PromptLogprobRows:
    """A request's rows of one step that score its own prompt (``SamplingParams.prompt_logprobs``): the row reading
    the token at position p predicts, and so scores, the prompt's token at p + 1."""

    request_id: str
    first_row: int  # the row of the step's batch that reads position ``start``; the others follow it
    start: int
    token_ids: list[int]  # the prompt tokens they score: those at start + 1, start + 2, ...
    k: int  # how many of the likeliest tokens each row lists besides the prompt's own

    @classmethod
    def of(cls, seq: Any, first_row: int, start: int, end: int) -> list[PromptLogprobRows]:
        """The rows of the chunk [start, end) that predict a prompt token, if the request asks: a list of one, or
        empty. The prompt's last token predicts the first generated one: its row samples instead."""
        stop = min(end, len(seq.prompt_token_ids) - 1)
        if seq.params.prompt_logprobs is None or start >= stop:
            return []
        return [cls(seq.request_id, first_row, start, seq.prompt_token_ids[start + 1 : stop + 1],
                    seq.params.prompt_logprobs)]
# --8<-- [end:prompt_rows]
