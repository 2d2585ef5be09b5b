"""Which waiting request is admitted first: the scheduling policies of SGLang's scheduler (``schedule_policy.py``).

The scheduler re-orders its waiting queue by ``scheduling_policy`` at every step, before admission:

* ``fcfs``: arrival order, as m3 admits (vLLM's default, and SGLang's);
* ``lpm``, longest prefix match: the longest cached prefix first. Past ``LPM_MAX_WAITING`` waiting requests it
  is ``fcfs``, as in SGLang: a walk of the tree per waiting request per step costs more than it saves;
* ``dfs-weight``: the tree walked depth first, the subtree with the most waiting requests first, each node's own
  requests after those below it, so requests that share a prefix are admitted one after another;
* ``lof``, longest output first: by ``max_tokens``, the largest first (no limit counts as ``max_model_len``);
* ``random``: shuffled, from the engine's seed.

Every sort is stable, so ties keep arrival order. Without a prefix cache ``lpm`` and ``dfs-weight`` are ``fcfs``,
as SGLang turns a cache-aware policy into first come, first served when its tree is disabled. The tree is read, never
changed: ``cached_prefix_length`` and ``last_shared_node`` split no edge and refresh no node's LRU time, so waiting
requests neither fragment the tree nor keep their prefixes looking recently used. Torch-free, like the scheduler.
"""

from __future__ import annotations

import random
from collections import deque

from .radix_tree import Node, RadixTree
from .sequence import Sequence

POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
LPM_MAX_WAITING = 128  # SGLang's threshold: more waiting requests than this, and lpm is fcfs


class WaitingOrder:
    """``scheduling_policy`` as the scheduler applies it: ``order_waiting`` with ``random``'s seeded generator."""

    def __init__(self, policy: str, seed: int) -> None:
        self.policy, self.rng = policy, random.Random(seed)

    def __call__(self, waiting: deque[Sequence], tree: RadixTree | None, max_model_len: int) -> deque[Sequence]:
        return order_waiting(waiting, self.policy, tree, self.rng, max_model_len)


# --8<-- [start:order_waiting]
def order_waiting(waiting: deque[Sequence], policy: str, tree: RadixTree | None, rng: random.Random,
                  max_model_len: int) -> deque[Sequence]:
    """The waiting queue in the order ``policy`` admits it."""
    if policy == "lpm" and tree is not None and len(waiting) <= LPM_MAX_WAITING:
        return deque(sorted(waiting, key=lambda s: -tree.cached_prefix_length(s.token_ids[:-1])))
    if policy == "dfs-weight" and tree is not None:
        return deque(dfs_weight_order(waiting, tree))
    if policy == "lof":
        return deque(sorted(waiting, key=lambda s: -(s.params.max_tokens or max_model_len)))
    if policy == "random":
        shuffled = list(waiting)
        rng.shuffle(shuffled)
        return deque(shuffled)
    return waiting
# --8<-- [end:order_waiting]


# --8<-- [start:dfs_weight_order]
def dfs_weight_order(waiting: deque[Sequence], tree: RadixTree) -> list[Sequence]:
    """Each request placed at the node where its cached prefix ends; a node's weight is the requests at it and
    below it. Depth first from the root, the heaviest child first, a node's own requests after its subtree's."""
    at: dict[Node, list[Sequence]] = {}
    weight: dict[Node, int] = {}
    for seq in waiting:
        node = tree.last_shared_node(seq.token_ids[:-1])
        at.setdefault(node, []).append(seq)
        while node is not None:  # every node on its path gains one
            weight[node] = weight.get(node, 0) + 1
            node = node.parent
    order, stack = [], [(tree.root, False)]
    while stack:  # a stack, not recursion: a tree of long prompts can be deeper than Python's recursion limit
        node, below_done = stack.pop()
        if below_done:
            order += at.get(node, [])
            continue
        stack.append((node, True))
        children = [child for child in node.children.values() if child in weight]
        stack += [(child, False) for child in sorted(children, key=lambda c: weight[c])]  # heaviest on top
    return order
# --8<-- [end:dfs_weight_order]
