"""One request as the engine tracks it: its tokens, how many are computed, and its state.

Plain Python (no torch), so the scheduler that moves sequences around can be
read and tested on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from milestones.serving.outputs import Logprob, RequestMetrics
from milestones.serving.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # only for type hints
    from milestones.serving.structured_output import Grammar


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SpecState:
    """m7: what speculation keeps for a request between steps: the guesses for the next step, how many to make, and
    each proposer's own record (the draft model's keys and values, the ngram lookup's index)."""

    draft_token_ids: list[int] = field(default_factory=list)  # guesses of the tokens after the last, for a step
    num_lookahead: int = 0  # how many tokens to guess next: up on each accepted guess, halved on a rejected one
    num_drafted_tokens: int = 0  # draft_model: tokens whose keys and values the draft model wrote (some rejected)
    ngram_index: dict[tuple[int, ...], int] = field(default_factory=dict)  # ngram: run -> end of its latest copy
    num_ngram_indexed: int = 0  # ngram: the runs ending before this token are in ngram_index (proposer.look_up)


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # seeds the noise of every sampled token; resolved from the engine's seed when not given
    detokenizer: IncrementalDetokenizer
    # m6: the counters' one order (check_integrity): processed <= computed < num_tokens, known <= max_model_len
    # (m7: and the draft's, drafted < known)
    token_ids: list[int] = field(default_factory=list)  # prompt, generated tokens, then future ids (negative)
    num_computed_tokens: int = 0  # tokens whose keys and values are in the KV cache once the launched steps have run
    num_processed_tokens: int = 0  # of those, written by steps already processed: what the prefix cache may share
    num_pending_tokens: int = 0  # sampled by launched steps, not known yet: their future ids end token_ids
    num_cached_tokens: int = 0  # found in the prefix cache when last admitted (a metric: a waiting request keeps it)
    spec: SpecState = field(default_factory=SpecState)  # m7: what speculation keeps for it
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # one per output token, if asked for
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)  # one per prompt token, if asked
    grammar: Grammar | None = None  # structured_outputs: what the output may be, and how much of it was read

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # nothing comes before the first token to predict it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens known so far (pending ones are not)."""
        return self.token_ids[self.num_prompt_tokens : self.num_tokens - self.num_pending_tokens]

    @property
    def num_output_tokens(self) -> int:
        """The generated tokens known so far (pending ones are not)."""
        return self.num_tokens - self.num_prompt_tokens - self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = time.perf_counter()

    def check_integrity(self, status: SequenceStatus, max_model_len: int) -> None:
        """Raise AssertionError if the request's counters contradict each other or the queue it sits in."""
        name = f"request {self.request_id!r}"
        assert self.status is status, f"{name} is {self.status.value} but sits among the {status.value} requests"
        assert self.token_ids[: self.num_prompt_tokens] == self.prompt_token_ids, f"{name} lost its prompt"
        # Between steps, only the step in flight has a token the host does not know yet: the last one, if any.
        pending = self.num_pending_tokens
        assert pending <= (1 if status is SequenceStatus.RUNNING else 0), f"{name} has {pending} pending tokens"
        num_known = self.num_tokens - pending
        assert all(t >= 0 for t in self.token_ids[:num_known]) and all(t < 0 for t in self.token_ids[num_known:]), (
            f"{name}: its future ids are not its last {pending} tokens (num_pending_tokens)")
        processed, computed = self.num_processed_tokens, self.num_computed_tokens
        assert 0 <= processed <= computed < self.num_tokens and num_known <= max_model_len, (
            f"{name}: processed {processed} <= computed {computed} < num_tokens {self.num_tokens} and known "
            f"{num_known} (num_tokens - num_pending_tokens) <= max_model_len {max_model_len} must hold")
        assert not self.spec.draft_token_ids or status is SequenceStatus.RUNNING, f"{name} waits with guesses"
        assert self.spec.num_drafted_tokens < max(1, self.num_tokens - pending), (
            f"{name}: the draft model's keys and values reach a token not known yet, or one that changed")
        limit = self.params.max_tokens
        assert limit is None or self.num_output_tokens < limit, f"{name} reached max_tokens without finishing"


def check_sequences(running: list[Sequence], waiting: list[Sequence], max_model_len: int) -> None:
    """Each unfinished request sits in one place, in the state that place implies; waiting ones hold no KV."""
    request_ids = [seq.request_id for seq in [*running, *waiting]]
    assert len(request_ids) == len(set(request_ids)), "a request sits in the scheduler twice"
    for seq in running:
        seq.check_integrity(SequenceStatus.RUNNING, max_model_len)
    for seq in waiting:
        seq.check_integrity(SequenceStatus.WAITING, max_model_len)
        assert seq.num_computed_tokens == 0, (
            f"waiting request {seq.request_id!r} claims {seq.num_computed_tokens} computed tokens: a waiting request "
            "holds no keys and values, so a request sent back to wait (preempted) restarts from num_computed_tokens=0"
        )
