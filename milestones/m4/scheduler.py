"""Decide what runs in the next step. m4: continuous batching over a paged pool with a prefix cache.

Plain Python (no torch). Scheduling is m3's (admission under ``admission.py``'s
rule, preemption by recompute or SGLang's retraction); what changes is where
blocks come from.

* Match at admission: a waiting request first looks up the longest cached prefix
  of its tokens in the radix tree. Those blocks start its block table and count
  as computed, so only the rest of the prompt is prefilled. At least the last
  token is always computed, since its logits are needed to sample.
* Insert after compute: at the start of every step, each running request's newly
  completed blocks go into the tree, so requests running side by side can share a
  prompt as soon as one has computed it; at the end, everything it computed goes in.
* Locks: a request locks the path it uses, so its blocks are never evicted under it.
* Evict before preempting: when blocks run out, unlocked cached leaves are dropped
  (least recently used first); only when none is left is a request preempted.
* ``scheduling_policy`` orders the waiting queue before admission: ``"fcfs"`` (arrival), ``"lpm"``,
  ``"dfs-weight"``, ``"lof"`` or ``"random"``, SGLang's policies (``policies.py``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .admission import RETRACT_DECODE_STEPS, Admission
from .block_manager import BlockManager
from .policies import WaitingOrder
from .radix_tree import Node, RadixTree, path_blocks
from .sequence import Sequence, SequenceStatus, check_sequences
from .step import ScheduledBatch

if TYPE_CHECKING:  # only for type hints: the scheduler itself never touches torch
    from .config import EngineConfig


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.tree = RadixTree(config.block_size) if config.enable_prefix_caching else None
        self.order_waiting = WaitingOrder(config.scheduling_policy, config.seed)  # policies.py
        self.waiting: deque[Sequence] = deque()
        self.by_id: dict[str, Sequence] = {}  # the unfinished requests, found by id without a scan
        self.running: list[Sequence] = []  # in admission order
        self.locked: dict[str, Node] = {}  # request id -> the deepest tree node it locks
        self.locked_tokens: dict[str, int] = {}  # request id -> the tokens from the root to that node
        self.admission = Admission.from_config(config)  # new_token_ratio: what admission holds back
        self.num_preemptions = 0
        self.num_preempted_tokens = 0  # computed tokens whose keys and values a preemption threw away
        self.num_prompt_tokens = 0  # tokens needing KV at admission, summed over admissions
        self.num_cached_tokens = 0  # of those, found in the prefix cache

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
        for seq in self.running:
            self._cache(seq)
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        # Decodes (one token left to compute) first, then unfinished prefills; admission order within each.
        queue = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        preempted = self._retract(queue, budget)  # SGLang's reservation: give back before the step, not during it
        decodes = self._decodes_held_back(queue)  # batch_shape "prefill-first": they run when no prefill can
        preempted |= self._grow([seq for seq in queue if seq not in decodes], batch, budget)
        budget -= sum(batch.num_new_tokens)
        self.waiting = self.order_waiting(self.waiting, self.tree, self.config.max_model_len)  # scheduling_policy
        # Admit waiting requests in order while what each is charged fits in the blocks the running requests do not
        # hold back (admission.py), cached blocks no request locks included; the first that does not fit waits.
        admitted: set[Sequence] = set()
        while self.waiting and not self.admission.refused(budget, preempted, len(self.running)):
            seq = self.waiting[0]
            self._match(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.admission.no_room(seq, num_new, self.running, admitted, self.block_manager.block_tables,
                                      self._available()):
                self._release(seq)
                break
            # evict what its first chunk needs and what the running requests hold back: free blocks, not cached ones
            self._make_room(seq, seq.num_computed_tokens + num_new,
                            headroom=self.admission.held(self.running, admitted, self.block_manager.block_tables))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.add(seq)
            self.num_prompt_tokens += seq.num_tokens
            self.num_cached_tokens += seq.num_cached_tokens
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
            while not self._make_room(seq, seq.num_computed_tokens + num_new):
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

    def _match(self, seq: Sequence) -> None:
        """Start the sequence from its longest cached prefix, leaving at least its last token to compute."""
        if self.tree is None:
            return
        # A request that asks for its prompt's log-probabilities computes every prompt token: it matches nothing.
        blocks, node = self.tree.match_prefix(seq.token_ids[:-1] if seq.params.prompt_logprobs is None else [])
        self.block_manager.share(seq.request_id, blocks)
        self.tree.lock(node)
        self.locked[seq.request_id] = node
        self.locked_tokens[seq.request_id] = len(blocks) * self.config.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = len(blocks) * self.config.block_size

    def _cache(self, seq: Sequence) -> None:
        """Insert the sequence's fully computed blocks into the tree, switch it to the tree's copies, and lock its
        new path."""
        if self.tree is None:
            return
        num_blocks = seq.num_computed_tokens // self.config.block_size
        if num_blocks * self.config.block_size <= self.locked_tokens[seq.request_id]:
            return  # nothing new since the last insert (checked every step: kept, not walked up the tree)
        table = self.block_manager.block_tables[seq.request_id]
        node, adopted = self.tree.insert(seq.token_ids[: num_blocks * self.config.block_size], table[:num_blocks])
        for block in adopted:
            self.block_manager.hold(block)
        # Where the tree held the tokens first (a request asking for its prompt's log-probabilities, or one
        # admitted beside the request that brought them), its own copies go: holding them and locking the
        # tree's would take two blocks per block, which a tight pool may never have (it would preempt
        # itself, recompute the prefix, and lock the tree's copies again, forever).
        self.block_manager.use_cached(seq.request_id, path_blocks(node))
        self.tree.lock(node)
        self.tree.unlock(self.locked[seq.request_id])
        self.locked[seq.request_id] = node
        self.locked_tokens[seq.request_id] = num_blocks * self.config.block_size

    def _make_room(self, seq: Sequence, num_tokens: int, headroom: int = 0) -> bool:
        """Can the sequence hold ``num_tokens`` tokens with ``headroom`` blocks still free afterwards?

        Evicts unlocked cached blocks if that is what it takes, and only if it is enough:
        a request that will not fit anyway leaves the cache alone.
        """
        needed = self.block_manager.num_new_blocks(seq.request_id, num_tokens) + headroom
        missing = needed - self.block_manager.num_free_blocks
        if missing > 0 and self.tree is not None and missing <= self.tree.num_evictable_blocks:
            for block in self.tree.evict(missing):
                self.block_manager.release(block)
        return needed <= self.block_manager.num_free_blocks

    def _take(self, batch: ScheduledBatch, seq: Sequence, num_new: int) -> int:
        """Schedule ``num_new`` tokens of the sequence, growing its block table to hold them."""
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        batch.block_tables.append(self.block_manager.grow(seq.request_id, seq.num_computed_tokens + num_new))
        return num_new

    def _release(self, seq: Sequence) -> None:
        """Let go of the sequence's blocks and lock; what the tree holds stays cached."""
        self.block_manager.free(seq.request_id)
        if seq.request_id in self.locked:
            self.tree.unlock(self.locked.pop(seq.request_id))
            del self.locked_tokens[seq.request_id]
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and send it back to the front of the queue, to be recomputed."""
        self._cache(seq)  # what it computed stays in the cache, so readmission is mostly a hit
        self.running.remove(seq)
        self.num_preempted_tokens += seq.num_computed_tokens
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
    # --8<-- [end:schedule]

    # --8<-- [start:admission]
    def _available(self) -> int:
        """Blocks a request can be given now: the free ones and the cached ones no request locks (evicted on demand)."""
        return self.block_manager.num_free_blocks + (self.tree.num_evictable_blocks if self.tree is not None else 0)

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
        """Cache what a finished (or aborted) sequence computed, then return its blocks at once."""
        self.by_id.pop(seq.request_id, None)
        if seq in self.running:
            self._cache(seq)
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def check_integrity(self) -> None:
        """Every request's state agrees with where it sits and its blocks hold what it computed; free + cached +
        in-use blocks = the pool, and the tree is well formed."""
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
        cached = self.tree.cached_blocks() if self.tree is not None else []
        self.block_manager.check_integrity(cached)
        if self.tree is not None:
            self.tree.check_integrity()
            self.tree.check_locks(self.locked, self.locked_tokens, tables)

    def running_seqs(self) -> list[Sequence]:
        return list(self.running)

    def find(self, request_id: str) -> Sequence | None:
        return self.by_id.get(request_id)
