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

m7: with ``speculative_config`` it also keeps room for guesses, and never makes one. After the plan above, each
decoding request gets room from the budget and free blocks the step left over (``_keep_guess_room``,
``ScheduledBatch.guess_rooms``); the engine asks the proposer to fill it (``speculation.py``), ``add_guesses`` joins
the guesses to the step, and ``trim`` gives back what rejected ones held. It runs no model, not even a draft.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .admission import RETRACT_DECODE_STEPS, Admission
from .block_manager import BlockManager
from .policies import WaitingOrder
from .proposer import guess_room
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
        self.reserved: dict[str, Sequence] = {}  # m9, a decode worker: requests whose prompt's KV is on its way
        self.running: list[Sequence] = []  # in admission order
        self.locked: dict[str, Node] = {}  # request id -> the deepest tree node it locks
        self.locked_tokens: dict[str, int] = {}  # request id -> the tokens from the root to that node
        self.admission = Admission.from_config(config)  # new_token_ratio: what admission holds back
        self.num_preemptions = 0
        self.num_preempted_tokens = 0  # computed tokens whose keys and values a preemption threw away
        self.num_prompt_tokens = 0  # tokens needing KV at admission, summed over admissions
        self.num_cached_tokens = 0  # of those, found in the prefix cache

    def add(self, seq: Sequence) -> None:
        check_fits(seq.num_prompt_tokens, seq.params.max_tokens, self.config.max_model_len, self.block_manager)
        self._start_guessing(seq)
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def _start_guessing(self, seq: Sequence) -> None:
        speculative = self.config.speculative_config  # m7: a request starts guessing as many tokens as it may
        seq.spec.num_lookahead = speculative.num_speculative_tokens if speculative is not None else 0

    # --8<-- [start:reserve]
    def reserve(self, seq: Sequence) -> list[int] | None:
        """m9, a decode worker: the blocks a prompt computed elsewhere will arrive in, taken before its prefill begins
        (SGLang's prealloc), with the room the running requests hold back left free; None: not now. A request sent
        back to wait (preempted here) goes first: it is recomputed here, and would otherwise wait for ever."""
        growing = [s for s in self.running if not self._samples_its_last_token(s)]
        headroom = self.admission.held(growing, set(), self.block_manager.block_tables)
        if self.waiting or not self._make_room(seq, seq.num_prompt_tokens, headroom=headroom):
            return None
        self.reserved[seq.request_id] = seq
        self.by_id[seq.request_id] = seq
        return list(self.block_manager.grow(seq.request_id, seq.num_prompt_tokens))

    def start_decoding(self, seq: Sequence) -> None:
        """m9, a decode worker: the prompt's keys and values are in its reserved blocks, so it runs from its first
        output token on, as if it had computed the prompt itself."""
        del self.reserved[seq.request_id]
        self._start_guessing(seq)
        seq.num_computed_tokens = seq.num_processed_tokens = seq.spec.num_drafted_tokens = seq.num_prompt_tokens
        if self.tree is not None:  # it locks the root: the next step inserts its prompt's blocks (``_cache``)
            self.tree.lock(self.tree.root)
            self.locked[seq.request_id], self.locked_tokens[seq.request_id] = self.tree.root, 0
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
    # --8<-- [end:reserve]

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # --8<-- [start:schedule]
    def schedule(self) -> ScheduledBatch | None:
        for seq in self.running:
            self._cache(seq)
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        # Decodes (one token left to compute) first, then unfinished prefills; admission order within each.
        # A request whose step in flight samples its last token (by length) has nothing left to compute.
        finishing = [s for s in self.running if self._samples_its_last_token(s)]
        queue = sorted((s for s in self.running if s not in finishing),
                       key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        preempted = self._retract(queue, budget)  # SGLang's reservation: give back before the step, not during it
        decodes = self._decodes_held_back(queue)  # batch_shape "prefill-first": they run when no prefill can
        preempted |= self._grow([seq for seq in queue if seq not in decodes], batch, budget)
        budget -= sum(batch.num_new_tokens)
        self.waiting = self.order_waiting(self.waiting, self.tree, self.config.max_model_len)  # scheduling_policy
        # Admit waiting requests in order while what each is charged fits in the blocks the running requests do not
        # hold back (admission.py), cached blocks no request locks included; the first that does not fit waits. A
        # finishing request gives up its place at once, as in m5: the steps of the one admitted instead run after
        # its last.
        admitted: set[Sequence] = set()
        while self.waiting and not self.admission.refused(budget, preempted, len(self.running) - len(finishing)):
            seq = self.waiting[0]
            self._match(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            growing = [s for s in self.running if s not in finishing]
            if self.admission.no_room(seq, num_new, growing, admitted, self.block_manager.block_tables,
                                      self._available()):
                self._release(seq)
                break
            # evict what its first chunk needs and what the running requests hold back: free blocks, not cached ones
            self._make_room(seq, seq.num_computed_tokens + num_new,
                            headroom=self.admission.held(growing, admitted, self.block_manager.block_tables))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.add(seq)
            self.num_prompt_tokens += seq.num_tokens
            self.num_cached_tokens += seq.num_cached_tokens
            budget -= self._take(batch, seq, num_new)
        if not batch.seqs:  # no prefill to run: the decodes held back make the step
            self._grow(decodes, batch, budget)
            budget -= sum(batch.num_new_tokens)
        # --8<-- [start:guess_or_not]
        speculative = self.config.speculative_config
        limit = speculative.disable_by_batch_size if speculative is not None else None
        if speculative is not None and (limit is None or len(batch.seqs) < limit):  # m7: a busy step guesses nothing
            self._keep_guess_room(batch, budget)
        # --8<-- [end:guess_or_not]
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

    # --8<-- [start:keep_guess_room]
    def _keep_guess_room(self, batch: ScheduledBatch, budget: int) -> None:
        """m7: room for guesses of each decoding request's next tokens, checked by this step with its last one. They get
        only the budget and free blocks that every request's own tokens left: a guess never delays nor preempts anyone.
        The blocks come first: a draft model writes its keys and values in them as it guesses. Only the room is kept
        here (``batch.guess_rooms``): the engine's speculator asks the proposer to fill it, then ``add_guesses``."""
        for i, seq in enumerate(batch.seqs):
            slots = (len(batch.block_tables[i]) + self.block_manager.num_free_blocks) * self.config.block_size
            room = min(guess_room(seq, self.config.max_model_len), budget, slots - seq.num_computed_tokens - 1)
            if room > 0:
                batch.block_tables[i] = self.block_manager.grow(seq.request_id, seq.num_computed_tokens + 1 + room)
                batch.guess_rooms[i] = room
                budget -= room
    # --8<-- [end:keep_guess_room]

    # --8<-- [start:add_guesses]
    def add_guesses(self, batch: ScheduledBatch, row: int, guesses: list[int]) -> None:
        """m7: the request's guesses, from the proposer (``Speculator.propose``), join the step after its last token;
        the blocks of its room that they leave unused go back. The budget the room took stays spent."""
        seq = batch.seqs[row]
        self.block_manager.shrink(seq.request_id, seq.num_computed_tokens + 1 + len(guesses))
        seq.spec.draft_token_ids = guesses
        batch.num_new_tokens[row] += len(guesses)
    # --8<-- [end:add_guesses]

    def _samples_its_last_token(self, seq: Sequence) -> bool:
        """Will the token its step in flight samples end it by length (max_tokens, max_model_len)? Only a stop
        that depends on the token's value (EOS, a stop string) leaves a request in the next step for nothing."""
        max_tokens = seq.params.max_tokens
        at_max_tokens = max_tokens is not None and seq.num_output_tokens + seq.num_pending_tokens >= max_tokens
        return seq.num_pending_tokens > 0 and (seq.num_tokens >= self.config.max_model_len or at_max_tokens)

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
        # the tree's blocks hold their keys and values
        seq.num_processed_tokens = seq.spec.num_drafted_tokens = seq.num_cached_tokens

    # --8<-- [start:cache]
    def _cache(self, seq: Sequence) -> None:
        """Insert the sequence's fully computed blocks into the tree, switch it to the tree's copies, and lock its
        new path.

        Only blocks of processed steps: a step still in flight may yet fail, and a block in the tree must hold
        its keys and values for good. So no step still writes a block the request switches; the step in flight may
        read a copy it lets go, but steps run in launch order: only a later one writes that block again. m7:
        processed tokens are kept ones (a rejected guess lowers the count), and with a draft model a block goes in
        only once the draft wrote it too. The draft computes every chunk the target does, so that holds back only a
        block that ends with the last guess of a step whose guesses were all kept: the draft feeds that guess in
        the request's next step. A tree's block the request switches to went in by the same rule: it holds both
        models' KV, as the request's own copy did."""
        if self.tree is None:
            return
        written = seq.num_processed_tokens
        speculative = self.config.speculative_config
        if speculative is not None and speculative.method == "draft_model":  # m7: a cached block holds both models' KV
            written = min(written, seq.spec.num_drafted_tokens)
        num_blocks = written // self.config.block_size
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
    # --8<-- [end:cache]

    # --8<-- [start:trim]
    def trim(self, seq: Sequence) -> None:
        """m7: forget what rejected guesses left behind: the blocks only they reached, and a draft model's keys and
        values from the first slot whose token changed (the model's own pick sits where a guess was)."""
        self.block_manager.shrink(seq.request_id, seq.num_tokens)
        seq.spec.num_drafted_tokens = min(seq.spec.num_drafted_tokens, seq.num_tokens - 1)
    # --8<-- [end:trim]

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
        seq.num_computed_tokens = seq.num_processed_tokens = seq.spec.num_drafted_tokens = 0

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
        elif self.reserved.pop(seq.request_id, None) is not None:  # m9: its KV never arrived
            self.block_manager.free(seq.request_id)

    def check_integrity(self) -> None:
        """Every request's state agrees with where it sits and its blocks hold what it computed; free + cached +
        in-use blocks = the pool, the tree is well formed, and (m7) no request holds blocks past its tokens, and a
        draft model keeps up with the target."""
        unfinished = {seq.request_id for seq in [*self.running_seqs(), *self.waiting, *self.reserved.values()]}
        assert self.by_id.keys() == unfinished, (
            f"by_id holds {sorted(self.by_id)}, the unfinished requests are {sorted(unfinished)}: add and finish "
            "keep it"
        )
        check_sequences(self.running, list(self.waiting), self.config.max_model_len)
        tables = self.block_manager.block_tables
        assert set(tables) == {seq.request_id for seq in [*self.running, *self.reserved.values()]}, (
            "a block table has no running request, nor a reservation (m9)")
        for seq in self.reserved.values():  # m9: exactly the prompt's blocks, nothing computed here yet
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0, (
                f"reserved request {seq.request_id!r} is {seq.status.value} with {seq.num_computed_tokens} computed")
            assert len(tables[seq.request_id]) == self.block_manager.blocks_needed(seq.num_prompt_tokens), (
                f"reserved request {seq.request_id!r} holds {len(tables[seq.request_id])} blocks for a prompt of "
                f"{seq.num_prompt_tokens} tokens")
        drafting = self.config.speculative_config is not None and self.config.speculative_config.method == "draft_model"
        for seq in self.running:
            drafted = seq.spec.num_drafted_tokens
            assert not drafting or seq.num_computed_tokens - 1 <= drafted <= seq.num_computed_tokens, (
                f"request {seq.request_id!r}: the draft computed {drafted} tokens and the target "
                f"{seq.num_computed_tokens}: the draft computes every chunk the target does, behind it only by the "
                "last guess of a step whose guesses were all kept (m7)"
            )
            assert len(tables[seq.request_id]) >= self.block_manager.blocks_needed(seq.num_computed_tokens), (
                f"request {seq.request_id!r} computed more tokens than its blocks hold"
            )
            assert len(tables[seq.request_id]) <= self.block_manager.blocks_needed(seq.num_tokens), (
                f"request {seq.request_id!r} holds blocks past its tokens: those of rejected guesses (m7)"
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


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, blocks: BlockManager) -> None:
    """Refuse a request that could never fit in the whole pool, however long it waits (m9: the router checks it
    against its workers' pools before it sends the request anywhere)."""
    longest = num_prompt_tokens + (max_tokens or max_model_len - num_prompt_tokens)
    needed = blocks.blocks_needed(longest)
    if needed > blocks.num_blocks:
        raise ValueError(
            f"this request may grow to {longest} tokens, which needs {needed} KV blocks of {blocks.block_size} "
            f"tokens, but the whole pool has {blocks.num_blocks}: lower max_tokens, or give the engine more blocks "
            "(num_kv_blocks or kv_cache_memory_bytes)"
        )
