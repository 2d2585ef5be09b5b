"""What the engine hands back, shaped like vLLM's ``RequestOutput``, and the records it is made of.

Every milestone's engine turns its sequences into these with ``RequestOutput.from_sequence``: the one place a
request's state becomes what a caller sees, whatever the engine that computed it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter``) of a request's life, and its counts."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_draft_tokens: int = 0  # m7 on (speculative decoding): tokens guessed for it and checked by the model
    num_accepted_tokens: int = 0  # of those, the ones the model's own pick agreed with

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token (queueing included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens generated after the first one, per second of decoding."""
        if self.num_output_tokens < 2 or self.last_token_time == self.first_token_time:
            return None
        return (self.num_output_tokens - 1) / (self.last_token_time - self.first_token_time)


@dataclass(slots=True, frozen=True)
class Logprob:
    """A token's log-probability under the model, before penalties and temperature, and its rank (1: the likeliest)."""

    logprob: float
    rank: int


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # everything generated so far, minus any stop string
    token_ids: list[int]
    finish_reason: str | None  # None while running, then "stop", "length" or "abort"
    logprobs: list[dict[int, Logprob]] | None = None  # one per token of token_ids, if the request asked for them


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (m4 on)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # one per prompt token (the first's None), if asked

    # --8<-- [start:from_sequence]
    @classmethod
    def from_sequence(cls, seq: Any) -> RequestOutput:
        """The output of one milestone's ``Sequence`` as it stands now."""
        completion = CompletionOutput(
            index=0,
            text=seq.detokenizer.visible_text(seq.is_finished),
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        )
        # Complete once the first token is out, and never changed after: shared, not copied at every step.
        prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None
        cached = getattr(seq, "num_cached_tokens", 0)  # an engine with no prefix cache (m1-m3) finds none
        return cls(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished, seq.metrics,
                   cached, prompt_logprobs)
    # --8<-- [end:from_sequence]


def keep_logprobs(seq: Any, logprobs: dict[int, Logprob] | None) -> None:
    """A sampled token's log-probabilities, kept for the request's output (None: it did not ask for them)."""
    if logprobs is not None:
        seq.output_logprobs.append(logprobs)


def keep_prompt_logprobs(seq: Any, first: int, scored: dict[str, list[dict[int, Logprob]]]) -> None:
    """The scores a step gave the request's prompt tokens at ``first``, ``first + 1``, ... (only a request that asked
    for prompt_logprobs has some); those already held are kept (a request preempted and recomputed scores its prompt
    again)."""
    scores = scored.get(seq.request_id)
    if scores is None:
        return
    assert first <= len(seq.prompt_logprobs), (
        f"request {seq.request_id!r}: prompt token {first} scored before token {len(seq.prompt_logprobs)}")
    seq.prompt_logprobs += scores[len(seq.prompt_logprobs) - first :]
