"""What the engine hands back, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import Logprob, RequestMetrics, Sequence


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
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # one per prompt token (the first's None), if asked

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=seq.detokenizer.visible_text(seq.is_finished),
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        )
        # Complete once the first token is out, and never changed after: shared, not copied at every step.
        prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None
        return cls(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished, seq.metrics,
                   seq.num_cached_tokens, prompt_logprobs)
