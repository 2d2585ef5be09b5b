"""The KV pool's bookkeeping: which fixed-size block belongs to which request.

Plain Python (no torch), like an operating system's page allocator. The pool has
``num_blocks`` blocks of ``block_size`` token slots each. A request's *block
table* lists its blocks in order, so token ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``. Blocks are handed out one
at a time as a request grows and all return to the free list when it finishes,
is aborted, or is preempted: no request reserves memory it does not use.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}  # request id -> its blocks, in token order

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceiling division

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request must still get so that its first ``num_tokens`` tokens have a slot."""
        return max(0, self.blocks_needed(num_tokens) - len(self.block_tables.get(request_id, ())))

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= self.num_free_blocks

    # --8<-- [start:grow]
    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Extend the request's block table to hold ``num_tokens`` tokens; return its table."""
        needed = self.num_new_blocks(request_id, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"{request_id} needs {needed} blocks but only {self.num_free_blocks} are free")
        table = self.block_tables.setdefault(request_id, [])
        table.extend(self.free_blocks.popleft() for _ in range(needed))
        return table
    # --8<-- [end:grow]

    # --8<-- [start:free]
    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool."""
        self.free_blocks.extend(self.block_tables.pop(request_id, ()))
    # --8<-- [end:free]

    def check_integrity(self) -> None:
        """Every block is either free or owned by exactly one request."""
        owned = [b for table in self.block_tables.values() for b in table]
        everything = owned + list(self.free_blocks)
        assert len(everything) == len(set(everything)) == self.num_blocks, "a block is lost or has two owners"
