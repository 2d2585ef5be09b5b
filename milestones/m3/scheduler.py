"""Decide what runs in the next step. m3: continuous batching over a paged KV pool.

Plain Python (no torch). As in m2, every step gives each running request its next
tokens (decodes first, then prefill chunks) and admits waiting requests in arrival
order, under ``max_num_seqs`` and ``max_num_batched_tokens``. What changes is
memory: a request holds only the blocks its tokens fill, taken from the block
manager as it grows.

* Admission by free blocks: a waiting request joins only if what it is charged
  fits in the free blocks the running requests do not hold back (``admission.py``).
  By default its first chunk's blocks must fit with one block per running request
  left over. Without that headroom the pool fills with new prompts and the running
  requests, growing a block every ``block_size`` tokens, are soon preempted, each
  losing all its work (the benchmarks page measures how many). ``new_token_ratio``
  switches to SGLang's reservation: the whole prompt and the output are charged.
* Preemption by recompute: when a running request cannot get a block, the victim
  is the most recently admitted running request not yet scheduled in this step
  (the request itself if there is none). The victim's blocks are freed, it goes
  back to the front of the waiting queue, and when readmitted it recomputes its
  prompt *and* the tokens it had generated, then carries on where it stopped.
  Under SGLang's reservation requests are retracted before the step instead, the
  fewest output tokens first, so that the step never runs short.
* A request that could not fit even in an empty pool is refused when added.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .admission import RETRACT_DECODE_STEPS, Admission
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
        self.admission = Admission.from_config(config)  # new_token_ratio: what admission holds back
        self.num_preemptions = 0
        self.num_preempted_tokens = 0  # computed tokens whose keys and values a preemption threw away

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
        preempted = self._retract(queue, budget)  # SGLang's reservation: give back before the step, not during it
        decodes = self._decodes_held_back(queue)  # batch_shape "prefill-first": they run when no prefill can
        preempted |= self._grow([seq for seq in queue if seq not in decodes], batch, budget)
        budget -= sum(batch.num_new_tokens)
        # Admit waiting requests in order while what each is charged fits in the free blocks the running requests
        # do not hold back (admission.py); the first that does not fit waits, and so does everyone behind it.
        admitted: set[Sequence] = set()
        while self.waiting and not self.admission.refused(budget, preempted, len(self.running)):
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.admission.no_room(seq, num_new, self.running, admitted, self.block_manager.block_tables,
                                      self._available()):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.add(seq)
            budget -= self._take(batch, seq, num_new)
        if not batch.seqs:  # no prefill to run: the decodes held back make the step
            self._grow(decodes, batch, budget)
        return batch if batch.seqs else None

    def _grow(self, queue: list[Sequence], batch: ScheduledBatch, budget: int) -> bool:
        """Schedule the running requests of ``queue`` in order, each its next tokens, while the budget lasts; one that
        cannot get a block preempts the latest admitted of those not yet scheduled. True if any was preempted."""
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
        return preempted

    def _decodes_held_back(self, queue: list[Sequence]) -> list[Sequence]:
        """SGLang's batch shape: a step runs the prefills if there are any, the decodes only when there are none.
        vLLM's (``mixed``, the default) puts both in every step, so a long prompt's chunks never stall a decode."""
        if self.config.batch_shape == "mixed":
            return []
        return [seq for seq in queue if seq.num_tokens - seq.num_computed_tokens == 1]

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
        self.num_preempted_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
    # --8<-- [end:schedule]

    # --8<-- [start:admission]
    def _available(self) -> int:
        """Blocks a request can be given now."""
        return self.block_manager.num_free_blocks

    def _retract(self, queue: list[Sequence], budget: int) -> bool:
        """SGLang's retraction (admission.py): if the step's tokens do not fit, send back the request with the fewest
        output tokens until the rest fit with RETRACT_DECODE_STEPS tokens of room each. True if any went back."""
        if not self.admission.reserves:
            return False
        tables, retracted = self.block_manager.block_tables, False
        if self.admission.shortfall(queue, budget, 0, tables, self._available()) > 0:
            while len(queue) > 1 and self.admission.shortfall(queue, budget, RETRACT_DECODE_STEPS, tables,
                                                              self._available()) > 0:
                victim = self.admission.victim(queue)
                queue.remove(victim)
                self._preempt(victim)
                retracted = True
        self.admission.after_step(queue, retracted)
        return retracted
    # --8<-- [end:admission]

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
