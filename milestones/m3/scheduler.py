"""Decide what runs in the next step. m3: continuous batching over a paged KV pool.

Plain Python (no torch). As in m2, every step gives each running request its next
tokens (decodes first, then prefill chunks) and admits waiting requests in arrival
order, under ``max_num_seqs`` and ``max_num_batched_tokens``. What changes is
memory: a request holds only the blocks its tokens fill, taken from the block
manager as it grows.

* Admission by free blocks: a waiting request joins only if its next chunk's
  blocks are free now, with one block per running request left over. Without
  that headroom the pool fills with new prompts and the running requests,
  growing a block every ``block_size`` tokens, are soon preempted, each losing
  all its work (the benchmarks page measures how many).
* Preemption by recompute: when a running request cannot get a block, the victim
  is the most recently admitted running request not yet scheduled in this step
  (the request itself if there is none). The victim's blocks are freed, it goes
  back to the front of the waiting queue, and when readmitted it recomputes its
  prompt *and* the tokens it had generated, then carries on where it stopped.
* A request that could not fit even in an empty pool is refused when added.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus, check_sequences
from .step import ScheduledBatch

if TYPE_CHECKING:  # only for type hints: the scheduler itself never touches torch
    from .config import EngineConfig


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.by_id: dict[str, Sequence] = {}  # the unfinished requests, found by id without a scan
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        longest = seq.num_prompt_tokens + (seq.params.max_tokens or self.config.max_model_len - seq.num_prompt_tokens)
        needed = self.block_manager.blocks_needed(longest)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"this request may grow to {longest} tokens, which needs {needed} KV blocks of "
                f"{self.block_manager.block_size} tokens, but the whole pool has {self.block_manager.num_blocks}: "
                "lower max_tokens, or give the engine more blocks (num_kv_blocks or kv_cache_memory_bytes)"
            )
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # --8<-- [start:schedule]
    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        # Decodes (one token left to compute) first, then unfinished prefills; admission order within each.
        queue = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        preempted = False
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_grow(seq.request_id, seq.num_computed_tokens + num_new):
                victim = max(queue, key=self.running.index) if queue else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                queue.remove(victim)
            else:
                budget -= self._take(batch, seq, num_new)
        # Admit waiting requests while their first chunk's blocks are free and one more block per running
        # request stays free, room for everyone to grow (never right after a preemption).
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            needed = self.block_manager.num_new_blocks(seq.request_id, seq.num_computed_tokens + num_new)
            if needed + len(self.running) > self.block_manager.num_free_blocks:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._take(batch, seq, num_new)
        return batch if batch.seqs else None

    def _take(self, batch: ScheduledBatch, seq: Sequence, num_new: int) -> int:
        """Schedule ``num_new`` tokens of the sequence, growing its block table to hold them."""
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        batch.block_tables.append(self.block_manager.grow(seq.request_id, seq.num_computed_tokens + num_new))
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and send it back to the front of the queue, to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
    # --8<-- [end:schedule]

    def finish(self, seq: Sequence) -> None:
        """Forget a finished (or aborted) sequence and return its blocks at once."""
        self.by_id.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq.request_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def check_integrity(self) -> None:
        """Every request's state agrees with where it sits, its blocks hold what it computed, and no block is lost."""
        unfinished = {seq.request_id for seq in [*self.running_seqs(), *self.waiting]}
        assert self.by_id.keys() == unfinished, (
            f"by_id holds {sorted(self.by_id)}, the unfinished requests are {sorted(unfinished)}: add and finish "
            "keep it"
        )
        check_sequences(self.running, list(self.waiting), self.config.max_model_len)
        tables = self.block_manager.block_tables
        assert set(tables) == {seq.request_id for seq in self.running}, "a block table has no running request"
        for seq in self.running:
            assert len(tables[seq.request_id]) >= self.block_manager.blocks_needed(seq.num_computed_tokens), (
                f"request {seq.request_id!r} computed more tokens than its blocks hold"
            )
        self.block_manager.check_integrity()

    def running_seqs(self) -> list[Sequence]:
        return list(self.running)

    def find(self, request_id: str) -> Sequence | None:
        return self.by_id.get(request_id)
