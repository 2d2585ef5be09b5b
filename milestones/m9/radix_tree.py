"""A radix tree over token ids, at block granularity: which KV blocks hold which prefix.

Plain Python (no torch). Each edge holds whole blocks: ``tokens`` is a multiple of
``block_size`` long and ``blocks[i]`` holds the keys and values of
``tokens[i*block_size:(i+1)*block_size]``. A path from the root spells a prefix,
and its blocks are that prefix's KV, ready to be reused by any request that
starts with the same tokens (a block's KV depends on every token before it,
which is why only whole prefixes can be shared).

* ``match_prefix`` finds the longest cached prefix of a prompt, to use it.
  ``cached_prefix_length`` only measures it, changing nothing (for sorting).
* ``insert`` adds a computed prefix; the parts already present are left alone.
* ``lock``/``unlock`` count the running requests that use a path; a locked node
  is never evicted.
* ``evict`` drops least-recently-used unlocked leaves to free their blocks.
  ``num_evictable_blocks`` counts what it could free, kept up to date by every
  change so that the scheduler can ask at every step without a walk of the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field


# --8<-- [start:node]
@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    blocks: list[int]
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # keyed by their first block's tokens
    lock_ref: int = 0  # running requests whose path goes through this node
    last_access: int = 0
# --8<-- [end:node]


class RadixTree:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = Node((), [])
        self.root.lock_ref = 1  # the root is never evicted
        self.num_evictable_blocks = 0  # blocks of unlocked nodes; check_integrity recounts them
        self._clock = itertools.count(1)

    # --8<-- [start:match_prefix]
    def match_prefix(self, tokens: list[int]) -> tuple[list[int], Node]:
        """The blocks of the longest cached prefix of ``tokens`` (whole blocks only), and its last node."""
        node, blocks = self.root, []
        for child, same in self._shared_edges(tokens):
            if same < len(child.blocks):
                child = self._split(child, same)  # the prompt leaves this edge midway: stop at a node of its own
            node = child
            node.last_access = next(self._clock)
            blocks += node.blocks
        return blocks, node
    # --8<-- [end:match_prefix]

    # --8<-- [start:cached_prefix_length]
    def cached_prefix_length(self, tokens: list[int]) -> int:
        """How many tokens ``match_prefix`` would match, found read-only: no edge is split, no node counts as used."""
        return self.block_size * sum(same for _, same in self._shared_edges(tokens))
    # --8<-- [end:cached_prefix_length]

    def last_shared_node(self, tokens: list[int]) -> Node:
        """The node where ``match_prefix`` would stop, found read-only (an edge shared in part: its child, which
        stands for the node a split would make)."""
        node = self.root
        for child, _ in self._shared_edges(tokens):
            node = child
        return node

    # --8<-- [start:shared_edges]
    def _shared_edges(self, tokens: list[int]) -> Iterator[tuple[Node, int]]:
        """The edges ``tokens`` follows from the root, each with how many of its blocks the tokens share.

        The last edge may be shared only in part; the walk stops there, so a caller may split it.
        """
        node, i = self.root, 0
        while i + self.block_size <= len(tokens):
            child = node.children.get(tuple(tokens[i : i + self.block_size]))
            if child is None:
                return
            same = self._common_blocks(child, tokens, i)
            whole_edge = same == len(child.blocks)
            yield child, same
            if not whole_edge:
                return
            node, i = child, i + len(child.tokens)
    # --8<-- [end:shared_edges]

    # --8<-- [start:insert]
    def insert(self, tokens: list[int], blocks: list[int]) -> tuple[Node, list[int]]:
        """Add a computed prefix. Returns its last node and the blocks the tree newly took over.

        Where the tree already holds the same tokens (another request computed them
        first), it keeps its own blocks: the caller's duplicates are not taken.
        """
        assert len(tokens) == len(blocks) * self.block_size, "insert whole blocks only"
        node, i, adopted = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i : i + self.block_size]))
            if child is None:
                child = Node(tuple(tokens[i:]), list(blocks[i // self.block_size :]), parent=node)
                node.children[child.tokens[: self.block_size]] = child
                adopted = child.blocks
                self.num_evictable_blocks += len(adopted)  # a new node is unlocked
            else:
                same = self._common_blocks(child, tokens, i)
                if same < len(child.blocks):
                    child = self._split(child, same)
            node, i = child, i + len(child.tokens)
            node.last_access = next(self._clock)
        return node, list(adopted)
    # --8<-- [end:insert]

    # --8<-- [start:lock]
    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.num_evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent
    # --8<-- [end:lock]

    # --8<-- [start:unlock]
    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlocked more often than locked"
            if node.lock_ref == 0:
                self.num_evictable_blocks += len(node.blocks)
            node = node.parent
    # --8<-- [end:unlock]

    # --8<-- [start:evict]
    def evict(self, num_blocks: int) -> list[int]:
        """Drop least-recently-used unlocked leaves until ``num_blocks`` blocks are released (or none is left)."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        released: list[int] = []
        while leaves and len(released) < num_blocks:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.tokens[: self.block_size]]
            released += leaf.blocks
            self.num_evictable_blocks -= len(leaf.blocks)
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return released
    # --8<-- [end:evict]

    def cached_blocks(self) -> list[int]:
        return [b for node in self._nodes() for b in node.blocks]

    def check_integrity(self) -> None:
        """Edges hold whole blocks, children are keyed by their first block, locks never grow downwards,
        and ``num_evictable_blocks`` equals a recount."""
        for node in self._nodes():
            assert len(node.tokens) == len(node.blocks) * self.block_size and node.blocks, (
                f"a node holds {len(node.tokens)} tokens in {len(node.blocks)} blocks of {self.block_size}: an edge "
                "holds whole blocks, at least one"
            )
            assert node.parent.children[node.tokens[: self.block_size]] is node, (
                f"a node whose edge starts {node.tokens[: self.block_size]} is not its parent's child under that key"
            )
            assert 0 <= node.lock_ref <= node.parent.lock_ref, (
                f"a node has lock_ref {node.lock_ref} under a parent with {node.parent.lock_ref}: a lock holds every "
                "node up to the root, so a parent is locked at least as often as its child (a split keeps the lock "
                "count on both halves)"
            )
        blocks = self.cached_blocks()
        assert len(blocks) == len(set(blocks)), "a block appears twice in the tree"
        unlocked = sum(len(node.blocks) for node in self._nodes() if node.lock_ref == 0)
        counted = self.num_evictable_blocks
        assert counted == unlocked, f"num_evictable_blocks is {counted} but {unlocked} blocks are unlocked"

    def check_locks(self, locked: dict[str, Node], locked_tokens: dict[str, int],
                    block_tables: dict[str, list[int]]) -> None:
        """The scheduler's locks agree with the tree: one lock per request (the root counts them), each on a path as
        long as ``locked_tokens`` says, whose blocks begin the request's block table."""
        assert self.root.lock_ref == 1 + len(locked), (
            f"a lock was lost: the tree's root has lock_ref {self.root.lock_ref} for {len(locked)} requests in the "
            "scheduler's locked (plus its own 1): each locks the node it keeps there once (tree.lock), and unlocks it "
            "once when it moves its lock or lets go"
        )
        for request_id, node in locked.items():
            assert sum(len(n.tokens) for n in _path(node)) == locked_tokens[request_id], (
                f"request {request_id!r}: locked_tokens is not the length of its locked path"
            )
            blocks = path_blocks(node)
            assert block_tables[request_id][: len(blocks)] == blocks, (
                f"request {request_id!r} holds copies of blocks that the tree has on its locked path: its table "
                "starts with the path's blocks (_cache hands it the tree's, block_manager.use_cached)"
            )

    def _common_blocks(self, child: Node, tokens: list[int], start: int) -> int:
        """How many whole blocks of the child's edge equal ``tokens`` from ``start``."""
        size, same = self.block_size, 0
        while same < len(child.blocks):
            begin = same * size
            if tuple(tokens[start + begin : start + begin + size]) != child.tokens[begin : begin + size]:
                break
            same += 1
        return same

    # --8<-- [start:split]
    def _split(self, child: Node, num_blocks: int) -> Node:
        """Cut an edge after ``num_blocks`` blocks; the new upper node carries the same locks.

        Both halves have the original's lock count, so the number of evictable blocks stays the same.
        """
        cut = num_blocks * self.block_size
        upper = Node(child.tokens[:cut], child.blocks[:num_blocks], child.parent,
                     lock_ref=child.lock_ref, last_access=child.last_access)
        child.parent.children[upper.tokens[: self.block_size]] = upper
        child.tokens, child.blocks, child.parent = child.tokens[cut:], child.blocks[num_blocks:], upper
        upper.children[child.tokens[: self.block_size]] = child
        return upper
    # --8<-- [end:split]

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def path_blocks(node: Node) -> list[int]:
    """The blocks of the path from the root to ``node``, in token order."""
    return [block for n in reversed(_path(node)) for block in n.blocks]


def _path(node: Node) -> list[Node]:
    """The nodes from ``node`` up to (not including) the root."""
    nodes = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    return nodes
