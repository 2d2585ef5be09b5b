"""A step's records, in the order a step makes them: what the scheduler plans, what the forward pass reads.

Plain data in one module, so a step can be followed from the scheduler to the sampler;
torch appears only in type hints, so the scheduling side stays torch-free. Attention's
own inputs (``AttentionContext``, ``RequestSpan``) stay with attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from milestones.serving.outputs import Logprob
from milestones.serving.step_records import PromptLogprobRows, SampledToken

from .sequence import Sequence

if TYPE_CHECKING:  # only for type hints
    import torch

    from .attention import AttentionContext


@dataclass(slots=True)
class ScheduledBatch:
    """The work of one step: these sequences, each with this many new tokens, and their block tables."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    block_tables: list[list[int]]


# --8<-- [start:model_inputs]
@dataclass(slots=True)
class ModelInputs:
    """One step's forward pass, as tensors, and which of its rows predict a new token."""

    input_ids: torch.Tensor  # [num_tokens]: the tokens computed this step
    positions: torch.Tensor  # [num_tokens]: where each sits in its sequence
    ctx: AttentionContext  # where attention writes and reads keys and values
    sample_rows: list[int]  # rows whose output predicts a sequence's next token
    sample_seqs: list[Sequence]  # the sequence of each of those rows
    prompt_rows: list[PromptLogprobRows]  # rows that score a prompt's own tokens, for requests that ask
# --8<-- [end:model_inputs]


@dataclass(slots=True)
class DecodeInputs:
    """One decode step on the host, one entry per request: the token, where it goes, what it reads."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # block * block_size + offset where each token's key and value are written
    block_tables: list[list[int]]
    context_lens: list[int]  # tokens each request attends to, the new one included


@dataclass(slots=True)
class StepOutput:
    """What a step computed: a pick per sequence of its batch, and the prompt scores of the requests that asked."""

    sampled: list[SampledToken | None]  # None: a chunk of a prompt that predicts nothing yet
    prompt_logprobs: dict[str, list[dict[int, Logprob]]]  # by request id: one per prompt token its rows scored
