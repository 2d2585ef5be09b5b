"""The KV pool's bookkeeping: which fixed-size block belongs to which request.

Plain Python (no torch), like an operating system's page allocator. The pool has
``num_blocks`` blocks of ``block_size`` token slots each. A request's *block
table* lists its blocks in order, so token ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``. Blocks are handed out one
at a time as a request grows and all return to the free list when it finishes,
is aborted, or is preempted: no request reserves memory it does not use.

m4: with prefix caching a block can have several holders at once, the requests that use it and the radix tree
that keeps it for later. Each block counts its holders and returns to the free list only when the count drops to
0. A block is then exactly one of: free, *in use* (in some request's table), or *cached* (held by the tree alone,
and evictable).
"""

from __future__ import annotations

from collections import Counter, deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}  # request id -> its blocks, in token order

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceiling division

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request must still get so that its first ``num_tokens`` tokens have a slot."""
        return max(0, self.blocks_needed(num_tokens) - len(self.block_tables.get(request_id, ())))

    # --8<-- [start:grow]
    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Extend the request's block table with fresh blocks to hold ``num_tokens`` tokens; return its table."""
        needed = self.num_new_blocks(request_id, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"{request_id} needs {needed} blocks but only {self.num_free_blocks} are free")
        table = self.block_tables.setdefault(request_id, [])
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_count[block] = 1
            table.append(block)
        return table
    # --8<-- [end:grow]

    # --8<-- [start:ref_counts]
    def share(self, request_id: str, blocks: list[int]) -> None:
        """Start a request's table with blocks that already hold its prefix (a cache hit)."""
        assert not self.block_tables.get(request_id), "a shared prefix must come first in the table"
        self.block_tables[request_id] = list(blocks)
        for block in blocks:
            self.hold(block)
    # --8<-- [end:ref_counts]

    # --8<-- [start:use_cached]
    def use_cached(self, request_id: str, blocks: list[int]) -> None:
        """Start the request's table with ``blocks``, the tree's for its first tokens: where it computed its own copy
        of a block the tree already held, it holds the tree's and lets its own go. The same tokens at the same
        positions have the same keys and values, so one copy in the pool is enough (SGLang's radix cache does this)."""
        table = self.block_tables[request_id]
        for i, block in enumerate(blocks):
            if table[i] != block:
                self.hold(block)
                self.release(table[i])
                table[i] = block
    # --8<-- [end:use_cached]

    # --8<-- [start:hold_release]
    def hold(self, block: int) -> None:
        assert self.ref_count[block] > 0, "only a block in use can gain a holder"
        self.ref_count[block] += 1
    # --8<-- [end:hold_release]

    # --8<-- [start:release]
    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, "a block was released more often than held"
        if self.ref_count[block] == 0:
            self.free_blocks.append(block)
    # --8<-- [end:release]

    # --8<-- [start:free]
    def free(self, request_id: str) -> None:
        """The request lets go of all its blocks; those the tree still holds stay cached."""
        for block in self.block_tables.pop(request_id, ()):
            self.release(block)
    # --8<-- [end:free]

    # --8<-- [start:shrink]
    def shrink(self, request_id: str, num_tokens: int) -> None:
        """m7: let go of the blocks past the first ``num_tokens`` tokens (slots only rejected guesses wrote)."""
        table = self.block_tables.get(request_id, [])  # none: it was preempted or finished
        while len(table) > self.blocks_needed(num_tokens):
            self.release(table.pop())
    # --8<-- [end:shrink]

    # --8<-- [start:check_integrity]
    def check_integrity(self, cached: list[int]) -> None:
        """free + cached + in use = all blocks, with every holder counted exactly once."""
        holders = Counter(b for table in self.block_tables.values() for b in table) + Counter(cached)
        for block in range(self.num_blocks):
            assert self.ref_count[block] == holders[block], (
                f"a reference count is off: block {block} has ref_count {self.ref_count[block]} but "
                f"{holders[block]} holders (request tables, and the tree): a block gains a holder when the tree "
                "adopts it (hold) and loses one each time a holder lets go (release)"
            )
        free = list(self.free_blocks)
        assert len(free) == len(set(free)) and all(self.ref_count[b] == 0 for b in free), "the free list is corrupt"
        in_use = {b for table in self.block_tables.values() for b in table}
        cached_only = set(cached) - in_use
        assert len(free) + len(cached_only) + len(in_use) == self.num_blocks, "a block is lost"
    # --8<-- [end:check_integrity]
