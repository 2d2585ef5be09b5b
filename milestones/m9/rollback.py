"""Undo what launching a step booked: the plumbing m6's lag needs, kept out of the loop that the lesson is.

From m6 on, the host books a step's work when it launches it (its tokens counted as computed, a future
id appended per sample), a step before the device computes it. Two things can then cancel that booking:
a request that finishes while its next step is already in flight, and a step that raises (or a wait for
it interrupted by Ctrl-C). Both put the request back as if the step had never been launched. m7 adds a
third: a rejected guess voids the rows after it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sequence import Sequence, SequenceStatus
from .step import LaunchedStep

if TYPE_CHECKING:  # only for type hints
    from .scheduler import Scheduler


def drop_pending_tokens(seq: Sequence) -> None:
    """Forget the tokens of steps still in flight, and the KV they compute, as if they were never launched."""
    del seq.token_ids[seq.num_tokens - seq.num_pending_tokens :]
    seq.num_pending_tokens = 0
    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
    seq.num_processed_tokens = min(seq.num_processed_tokens, seq.num_computed_tokens)


def roll_back(failed: LaunchedStep, pending: LaunchedStep | None, scheduler: Scheduler) -> None:
    """A step raised, or the wait for it was interrupted: undo what launching it, and the step launched after it
    (``pending``), booked, the later first.

    The worker may still be computing those steps. It finishes them before anything launched from now on (it keeps
    launch order), and ``result`` throws their results away."""
    for launched in [pending, failed] if pending is not None else [failed]:
        for seq, computed in zip(launched.seqs, launched.num_computed_before):
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens = computed
                # m7: the draft computes it again too
                seq.spec.num_drafted_tokens = min(seq.spec.num_drafted_tokens, computed)
        for row in launched.rows:
            seq, index = row.seq, row.index
            if index < seq.num_tokens:  # m7: a request's first row undoes its later ones too
                seq.num_pending_tokens -= seq.num_tokens - index  # its future id, and any of a later step undone
                del seq.token_ids[index:]
                scheduler.trim(seq)  # m7: the blocks grown for its guesses
