"""A step's records, in the order a step makes them: what the scheduler plans, what the forward pass reads.

Plain data in one module, so a step can be followed from the scheduler to the sampler;
torch appears only in type hints, so the scheduling side stays torch-free. Attention's
own inputs (``AttentionContext``, ``RequestSpan``) stay with attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from milestones.serving.outputs import Logprob
from milestones.serving.step_records import PromptLogprobRows

from .dispatcher import Dispatch
from .sequence import Sequence

if TYPE_CHECKING:  # only for type hints
    import torch

    from milestones.serving.sampling_params import SamplingParams
    from milestones.serving.structured_output import Grammar

    from .attention import RequestSpan


@dataclass(slots=True)
class ScheduledBatch:
    """The work of one step: these sequences, each with this many new tokens, and their block tables."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    block_tables: list[list[int]]
    guess_rooms: dict[int, int] = field(default_factory=dict)  # m7: row -> how many tokens its request may guess
    guess_probs: dict[str, list] = field(default_factory=dict)  # m7, a draft: request id -> each guess's q (tensors)


# --8<-- [start:model_inputs]
@dataclass(slots=True)
class ModelInputs:
    """An eager step's forward pass, as host lists the worker makes tensors of, and which rows sample."""

    input_ids: list[int]  # the tokens computed this step (negative: a future id, resolved on the device)
    positions: list[int]  # where each sits in its sequence
    slot_mapping: list[int]  # where each token's key and value go
    block_tables: list[int]  # the blocks of ``requests``, one after the other
    requests: list[RequestSpan]  # attended one by one
    sample_rows: list[int]  # rows whose output predicts a sequence's next token
    sample_seqs: list[Sequence]  # the sequence of each of those rows (the host's: the worker reads none of it)
    prompt_rows: list[PromptLogprobRows]  # rows that score a prompt's own tokens, for requests that ask
# --8<-- [end:model_inputs]


@dataclass(slots=True)
class DecodeInputs:
    """One decode step on the host, one entry per request: the token, where it goes, what it reads."""

    token_ids: list[int]  # negative: a future id, the token the previous step is still sampling
    positions: list[int]
    slots: list[int]  # block * block_size + offset where each token's key and value are written
    block_tables: list[list[int]]
    context_lens: list[int]  # tokens each request attends to, the new one included


# --8<-- [start:step_inputs]
@dataclass(slots=True, frozen=True)
class SamplingRow:
    """What sampling reads of a request, copied when its step is launched: the host moves on while it runs."""

    params: SamplingParams
    seed: int
    num_tokens: int  # tokens before the one this row samples: with the seed, it fixes the noise
    prompt_token_ids: list[int]  # penalties read these two: the prompt's tokens, never changed after arrival,
    output_token_ids: tuple[int, ...] = ()  # and a copy of the output's (with penalties only), maybe ending in a future
    grammar: Grammar | None = None  # structured_outputs: the request's own, which the worker's sampler advances
    guess: int | None = None  # m7, acceptance "rejection": the guess this row's pick decides on (None: pick freely)
    guess_probs: torch.Tensor | None = None  # m7, and a draft model: q, the distribution the guess was drawn from

    @classmethod
    def of(cls, seq: Sequence, position: int, rejection: bool = False, drawn_from: dict | None = None) -> SamplingRow:
        """The row that reads the token at ``position`` (m7: a guess, or the last token) and samples the next. m7,
        rejection with a draft: ``drawn_from`` (``ScheduledBatch.guess_probs``) holds each guess's q."""
        guess = q = None
        if rejection and 0 <= (ahead := position + 1 - seq.num_tokens) < len(seq.spec.draft_token_ids):  # m7
            guess = seq.spec.draft_token_ids[ahead]  # the guess that stands where this row's token goes
            probs = (drawn_from or {}).get(seq.request_id)  # none: prompt lookup's guesses, or a greedy request's
            q = probs[ahead] if probs else None  # None: the guess is judged as certain
        output = ()  # m7: a guess row's history holds the guesses before it, as if they were accepted
        if seq.params.has_penalties:
            output = tuple((seq.token_ids + seq.spec.draft_token_ids)[seq.num_prompt_tokens : position + 1])
        return cls(seq.params, seq.seed, position + 1, seq.prompt_token_ids, output, seq.grammar, guess, q)


@dataclass(slots=True)
class StepInputs:
    """One step as the host hands it to the forward worker: plain data, never read again by the host."""

    forward: DecodeInputs | ModelInputs  # replayed whole (a DecodeInputs), in pieces, or run eagerly
    dispatch: Dispatch  # which of the three, at which captured size
    samples: list[SamplingRow]  # one per row that samples, in order
    future_ids: list[int]  # where each sampled token waits on the device for the next step
    sample_seqs: list[Sequence]  # the host's own record of who samples (the worker reads ``samples``)
    num_seqs: int  # the batch size, for the trace
# --8<-- [end:step_inputs]


# --8<-- [start:shard_step]
@dataclass(slots=True, frozen=True)
class ShardStep:
    """m8: what rank 0 sends the other ranks of a step, pickled: the forward's lists (none of the host's sequences),
    and the future ids where they keep the tokens it samples."""

    forward: DecodeInputs | ModelInputs
    dispatch: Dispatch  # every rank runs the step as rank 0 does: its collectives are in the same pieces
    future_ids: list[int]
# --8<-- [end:shard_step]


# --8<-- [start:launched_step]
@dataclass(slots=True)
class LaunchedRow:
    """A row of a launched step that samples: whose token it is, and where in its token_ids the token goes (its
    future id stands there until the step is processed)."""

    seq: Sequence
    index: int
    guess: int | None = None  # m7: the guess the request's next row read, which this row's pick must equal


@dataclass(slots=True)
class LaunchedStep:
    """A step on the forward worker, not yet processed: what the host must do when its tokens arrive."""

    number: int
    seqs: list[Sequence]
    num_computed_before: list[int]  # each sequence's computed tokens before the step: what a failure restores
    num_computed_after: list[int]  # and after it: processed once the step is
    rows: list[LaunchedRow]  # one per token the step samples, in its order
# --8<-- [end:launched_step]


@dataclass(slots=True)
class StepOutput:
    """What a step computed: its picks, and the prompt scores of the requests that asked. m6: the picks stay on the
    device (one per ``LaunchedStep.rows``); the worker adds the step's number and, on CUDA, the event that says their
    copy to the host is done, or the exception the step raised instead."""

    tokens: torch.Tensor | None  # None: the step raised
    logprobs: list[dict[int, Logprob] | None]  # per token, for rows whose request asked (``SamplingParams.logprobs``)
    prompt_logprobs: dict[str, list[dict[int, Logprob]]]  # by request id: one per prompt token its rows scored
    step_number: int = 0
    ready: torch.cuda.Event | None = None  # CUDA: the copy of the tokens to the host is done
    error: BaseException | None = None
