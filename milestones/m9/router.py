"""The router in front of the workers: which prefill worker and which decode worker serve a request (m9).

SGLang's router keeps, for each prefill worker, an approximate radix tree of the prompts it has
sent there: approximate because it never hears what the worker's own cache evicted. A new request
goes where the longest part of its prompt was sent before, unless the workers' loads are too far
apart, in which case it goes to the least loaded; and where no worker has much of it, to the worker
whose tree is smallest (the most room). Round-robin, the other policy, throws every prefix away
whenever a prompt lands on a worker that has not seen it. The decode worker is the least loaded.

The tree here is kept at block granularity, as the workers' own caches are: a prompt's prefixes of
1, 2, ... whole blocks, each known by its tokens, in least-recently-used order (a radix tree's
paths, flattened, as vLLM's prefix cache keys its blocks). Plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

CACHE_THRESHOLD = 0.5  # SGLang's router's --cache-threshold: the share of a prompt a worker must hold to get it
BALANCE_ABS_THRESHOLD = 32  # --balance-abs-threshold: loads this many requests apart, and
BALANCE_REL_THRESHOLD = 1.5  # --balance-rel-threshold: the largest this many times the smallest: balance first


# --8<-- [start:approximate_tree]
class ApproximateTree:
    """The prompts sent to one worker, as their whole-block prefixes; the oldest forgotten past ``capacity``
    blocks (about the worker's pool: what it can keep cached)."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size, self.capacity = block_size, capacity
        self.prefixes: OrderedDict[tuple[int, ...], None] = OrderedDict()  # least recently used first

    def _prefixes(self, token_ids: list[int]) -> list[tuple[int, ...]]:
        whole = len(token_ids) // self.block_size
        return [tuple(token_ids[: n * self.block_size]) for n in range(1, whole + 1)]

    def match(self, token_ids: list[int]) -> int:
        """Tokens of the longest whole-block prefix of ``token_ids`` sent here (and not forgotten since)."""
        matched = 0
        for prefix in self._prefixes(token_ids):
            if prefix not in self.prefixes:
                break
            matched = len(prefix)
        return matched

    def insert(self, token_ids: list[int]) -> None:
        for prefix in self._prefixes(token_ids):
            self.prefixes[prefix] = None
            self.prefixes.move_to_end(prefix)
        while len(self.prefixes) > self.capacity:
            self.prefixes.popitem(last=False)

    @property
    def size(self) -> int:
        return len(self.prefixes)
# --8<-- [end:approximate_tree]


@dataclass(slots=True)
class Choice:
    """Where a request goes, and why (for the chapter's tables and the tests)."""

    worker: int
    reason: str  # "balance", "cache", "room" or "round robin"
    matched: int  # prompt tokens the chosen worker's tree held (round robin: 0, it keeps no trees)


# --8<-- [start:choose]
class Router:
    """Picks a prefill worker by ``policy`` ("cache_aware" or "round_robin") and the least loaded decode worker.
    ``load`` counts the unfinished requests sent to each; the caller keeps them."""

    def __init__(self, policy: str, num_prefill: int, num_decode: int, block_size: int, capacity: int) -> None:
        self.policy = policy
        self.trees = [ApproximateTree(block_size, capacity) for _ in range(num_prefill)]
        self.prefill_load, self.decode_load = [0] * num_prefill, [0] * num_decode
        self.alive_prefill, self.alive_decode = set(range(num_prefill)), set(range(num_decode))
        self.next = 0  # round robin's turn

    def prefill(self, token_ids: list[int]) -> Choice:
        alive = sorted(self.alive_prefill)
        if self.policy == "round_robin":
            worker = alive[self.next % len(alive)]
            self.next += 1
            return Choice(worker, "round robin", 0)  # it keeps no trees
        loads = [self.prefill_load[w] for w in alive]
        matches = {w: self.trees[w].match(token_ids) for w in alive}
        if max(loads) - min(loads) > BALANCE_ABS_THRESHOLD and max(loads) > min(loads) * BALANCE_REL_THRESHOLD:
            worker, reason = min(alive, key=lambda w: self.prefill_load[w]), "balance"
        else:
            best = max(alive, key=lambda w: (matches[w], -self.prefill_load[w]))
            if matches[best] > CACHE_THRESHOLD * len(token_ids):
                worker, reason = best, "cache"
            else:  # nobody holds much of it: where the tree is smallest, the least loaded of those
                worker, reason = min(alive, key=lambda w: (self.trees[w].size, self.prefill_load[w])), "room"
        self.trees[worker].insert(token_ids)
        return Choice(worker, reason, matches[worker])

    def decode(self) -> int:
        return min(sorted(self.alive_decode), key=lambda w: self.decode_load[w])
# --8<-- [end:choose]
