"""m7's phase of a step: guesses in before the launch, checked once the step's picks arrive.

The scheduler keeps room for each decoding request's guesses (budget and blocks: bookkeeping,
torch-free); ``Speculator.propose`` asks the proposer to fill it, every step (a draft model
computes the step's chunks too, room or not), and ``Speculator.check`` decides each guess
when the pick of the row that read the token before it is known. It also counts, in one
place, the guesses made and kept (``LLMEngine.spec_stats``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .rollback import drop_pending_tokens

if TYPE_CHECKING:  # only for type hints
    from milestones.speculative_config import SpeculativeConfig

    from .drafter import DraftModelProposer
    from .proposer import NgramProposer
    from .scheduler import Scheduler
    from .sequence import Sequence
    from .step import ScheduledBatch


@dataclass(slots=True)
class Speculator:
    """The proposer, and what its guesses did: made, and kept."""

    proposer: NgramProposer | DraftModelProposer | None  # None: nothing guesses, and m7 runs as m6
    scheduler: Scheduler
    config: SpeculativeConfig | None
    num_guessing: int = 0  # requests' steps that checked guesses
    num_draft_tokens: int = 0  # the guesses
    num_accepted_tokens: int = 0  # of those, the ones the model agreed with

    # --8<-- [start:propose]
    def propose(self, batch: ScheduledBatch) -> None:
        """Each request's guesses, as many as the scheduler kept room for, join the step after its last token. The
        proposer sees every step, with room or without: a draft model computes the step's chunks to keep up."""
        if self.proposer is None:
            return
        for row, guesses in self.proposer.propose_batch(batch).items():
            self.scheduler.add_guesses(batch, row, guesses)
            batch.seqs[row].metrics.num_draft_tokens += len(guesses)
            self.num_draft_tokens += len(guesses)
            self.num_guessing += bool(guesses)
    # --8<-- [end:propose]

    # --8<-- [start:check]
    def check(self, seq: Sequence, token: int, guess: int) -> None:
        """The pick agrees with the guess the next row read (that row counts), or the rows after are void."""
        if token == guess:
            seq.metrics.num_accepted_tokens += 1
            self.num_accepted_tokens += 1
            seq.spec.num_lookahead = min(seq.spec.num_lookahead + 1, self.config.num_speculative_tokens)
        else:
            drop_pending_tokens(seq)
            self.scheduler.trim(seq)  # blocks only rejected guesses reached go back to the pool
            seq.spec.num_lookahead = max(self.proposer.min_lookahead, seq.spec.num_lookahead // 2)  # less, or none
    # --8<-- [end:check]

    def stats(self) -> dict[str, int | float]:
        """The guesses made and kept so far, over every request."""
        return {"num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
                "mean_tokens_per_step": 1 + self.num_accepted_tokens / max(1, self.num_guessing)}
