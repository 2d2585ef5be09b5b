"""Decide what runs in the next step. m1: one request at a time, first come first served.

Plain Python (no torch). The running request is prefilled in one step (all its
prompt tokens), then decoded one token per step until it finishes; only then is
the next waiting request admitted.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .sequence import Sequence, SequenceStatus, check_sequences
from .step import ScheduledBatch

if TYPE_CHECKING:  # only for type hints: the scheduler itself never touches torch
    from .config import EngineConfig


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.by_id: dict[str, Sequence] = {}  # the unfinished requests, found by id without a scan
        self.running: Sequence | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return self.running is not None or bool(self.waiting)

    # --8<-- [start:schedule]
    def schedule(self) -> ScheduledBatch | None:
        if self.running is None:
            if not self.waiting:
                return None
            self.running = self.waiting.popleft()
            self.running.status = SequenceStatus.RUNNING
        seq = self.running
        # Prefill computes the whole prompt; afterwards only the last sampled token is new.
        return ScheduledBatch([seq], [seq.num_tokens - seq.num_computed_tokens])
    # --8<-- [end:schedule]

    def finish(self, seq: Sequence) -> None:
        """Forget a sequence that has finished (or been aborted) so its cache can be reused."""
        self.by_id.pop(seq.request_id, None)
        if self.running is seq:
            self.running = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def check_integrity(self) -> None:
        """Every request's state agrees with where it sits (one running at most: ``running`` is a single slot)."""
        unfinished = {seq.request_id for seq in [*self.running_seqs(), *self.waiting]}
        assert self.by_id.keys() == unfinished, (
            f"by_id holds {sorted(self.by_id)}, the unfinished requests are {sorted(unfinished)}: add and finish "
            "keep it"
        )
        check_sequences(self.running_seqs(), list(self.waiting), self.config.max_model_len)

    def running_seqs(self) -> list[Sequence]:
        return [self.running] if self.running else []

    def find(self, request_id: str) -> Sequence | None:
        return self.by_id.get(request_id)
