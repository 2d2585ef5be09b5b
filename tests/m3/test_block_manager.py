"""The block manager alone (no torch): allocation, growth, release, and a property-based test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from milestones.m3.block_manager import BlockManager


def test_tables_grow_block_by_block():
    """8 blocks of 4 tokens, free in the order 0, 1, ..., 7: each grow takes what it needs from the front."""
    manager = BlockManager(num_blocks=8, block_size=4)
    for request_id, num_tokens, want, why in [
        ("a", 1, [0], "a new request's first block is the front of the free list, block 0"),
        ("a", 4, [0], "4 tokens still fit in a's first block: nothing is added"),
        ("a", 5, [0, 1], "a 5th token needs a second block, the next one at the front of the free list"),
        ("b", 9, [2, 3, 4], "9 tokens need 3 blocks of 4, taken in order from the front of the free list"),
    ]:
        table = manager.grow(request_id, num_tokens)
        assert table == want, (
            f"grow({request_id!r}, {num_tokens}) returned the table {table}, expected {want}: {why} (a table holds "
            "-(-num_tokens // block_size) blocks, the missing ones popped from the front of self.free_blocks)"
        )
    assert manager.num_free_blocks == 3, f"{manager.num_free_blocks} blocks are free after 5 were taken of 8, not 3"
    assert manager.num_new_blocks("a", 13) == 2 and manager.can_grow("a", 13) and not manager.can_grow("a", 21)
    manager.free("a")
    assert manager.num_free_blocks == 5 and "a" not in manager.block_tables, (
        f"after free('a'), {manager.num_free_blocks} blocks are free and the tables are {manager.block_tables}: "
        "expected 5 free and no table for 'a' (free returns every block of the request and drops its table)"
    )
    manager.check_integrity()


def test_growing_past_the_pool_raises_without_side_effects():
    manager = BlockManager(num_blocks=2, block_size=2)
    manager.grow("a", 3)
    with pytest.raises(RuntimeError, match="needs 1 blocks"):
        manager.grow("b", 1)
    assert manager.block_tables == {"a": [0, 1]}, (
        f"a grow that raised left the tables {manager.block_tables}, not {{'a': [0, 1]}}: check that enough blocks "
        "are free before changing anything (no table, not even an empty one, for 'b')"
    )
    manager.check_integrity()


def test_freeing_a_request_that_holds_no_blocks_does_nothing():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.grow("a", 3)
    for request_id in ("never-grown", "a", "a"):  # an id with no table, then a request freed twice
        try:
            manager.free(request_id)
        except Exception as error:
            pytest.fail(f"free({request_id!r}) raised {error!r}: freeing a request that holds no blocks (never grown, "
                        "or freed already) must do nothing")
    assert manager.num_free_blocks == 4 and not manager.block_tables, (
        "free returns each block of the request once, and freeing it again adds nothing"
    )
    manager.check_integrity()


operations = st.lists(
    st.tuples(st.sampled_from(["grow", "free", "preempt"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 8), ops=operations)
def test_random_sequences_never_share_or_lose_a_block(num_blocks, block_size, ops):
    manager = BlockManager(num_blocks, block_size)
    sizes: dict[str, int] = {}
    for op, owner, amount in ops:
        request = f"r{owner}"
        if op == "grow":
            target = sizes.get(request, 0) + amount
            if manager.can_grow(request, target):
                table = manager.grow(request, target)
                sizes[request] = target
                assert len(table) == manager.blocks_needed(target)
            else:
                with pytest.raises(RuntimeError):
                    manager.grow(request, target)
        else:  # finishing and preempting both hand every block back
            manager.free(request)
            sizes.pop(request, None)
        manager.check_integrity()
        owned = [b for table in manager.block_tables.values() for b in table]
        assert len(owned) + manager.num_free_blocks == num_blocks
    for request in list(sizes):
        manager.free(request)
    assert manager.num_free_blocks == num_blocks and not manager.block_tables
