"""Decide what runs in the next step. m2: continuous batching with a token budget.

Plain Python (no torch). Every step is planned from scratch (iteration-level
scheduling, as in vLLM V1):

1. every running request that is decoding gets its one next token;
2. running requests still prefilling get the next chunk of their prompt;
3. waiting requests are admitted in arrival order while a KV slot is free.

All of it under ``max_num_seqs`` running requests and ``max_num_batched_tokens``
tokens per step. A prompt longer than what is left of the budget is prefilled in
chunks over several steps, so one long prompt never stalls the others' decodes.
``batch_shape="prefill-first"`` switches to SGLang's steps: the prefill chunks and
admissions alone while there are any, the decodes in the steps between.
Each running request owns one contiguous KV slot, sized for ``max_model_len``.
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
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(config.max_num_seqs - 1, -1, -1))
        self.kv_slot: dict[str, int] = {}  # request id -> its KV slot

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # --8<-- [start:schedule]
    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        # Decodes (one token left to compute) first, then unfinished prefills; arrival order within each.
        queue = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        decodes = self._decodes_held_back(queue)  # batch_shape "prefill-first": they run when no prefill can
        for seq in queue:
            if budget == 0:
                break
            if seq not in decodes:
                budget -= self._take(batch, seq, budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.kv_slot[seq.request_id] = self.free_slots.pop()
            self.running.append(seq)
            budget -= self._take(batch, seq, budget)
        if not batch.seqs:  # no prefill to run: the decodes held back make the step
            for seq in decodes:
                budget -= self._take(batch, seq, budget)
        return batch if batch.seqs else None

    def _decodes_held_back(self, queue: list[Sequence]) -> list[Sequence]:
        """SGLang's batch shape: a step runs the prefills if there are any, the decodes only when there are none.
        vLLM's (``mixed``, the default) puts both in every step, so a long prompt's chunks never stall a decode."""
        if self.config.batch_shape == "mixed":
            return []
        return [seq for seq in queue if seq.num_tokens - seq.num_computed_tokens == 1]

    def _take(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Schedule as many of the sequence's uncomputed tokens as the budget allows."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        batch.kv_slots.append(self.kv_slot[seq.request_id])
        return num_new
    # --8<-- [end:schedule]

    def finish(self, seq: Sequence) -> None:
        """Forget a finished (or aborted) sequence and free its KV slot at once."""
        self.by_id.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(self.kv_slot.pop(seq.request_id))
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def check_integrity(self) -> None:
        """Every request's state agrees with where it sits, and each running one owns its own KV slot."""
        unfinished = {seq.request_id for seq in [*self.running_seqs(), *self.waiting]}
        assert self.by_id.keys() == unfinished, (
            f"by_id holds {sorted(self.by_id)}, the unfinished requests are {sorted(unfinished)}: add and finish "
            "keep it"
        )
        check_sequences(self.running, list(self.waiting), self.config.max_model_len)
        assert set(self.kv_slot) == {seq.request_id for seq in self.running}, "a KV slot has no running request"
        slots = [*self.kv_slot.values(), *self.free_slots]
        assert sorted(slots) == list(range(self.config.max_num_seqs)), "a KV slot is lost or has two owners"

    def running_seqs(self) -> list[Sequence]:
        return list(self.running)

    def find(self, request_id: str) -> Sequence | None:
        return self.by_id.get(request_id)
