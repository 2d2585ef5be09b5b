"""The radix tree alone (no torch): match, insert, split, locks, LRU eviction, the read-only length query,
the evictable-block count, and a property-based test."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from milestones.m4.radix_tree import RadixTree

BS = 2


def test_match_insert_and_split_at_block_boundaries():
    tree = RadixTree(BS)
    node, adopted = tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert adopted == [10, 11, 12], f"insert into an empty tree adopted {adopted}: every block is new to it"
    blocks, node = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert blocks == [10, 11], (
        f"[1, 2, 3, 4, 9, 9] matched blocks {blocks}, expected [10, 11]: only the blocks whose tokens (and all "
        "before them) agree"
    )
    assert node.blocks == [10, 11] and node.tokens == (1, 2, 3, 4) and node.children, (
        f"the match ended at a node with tokens {node.tokens} and blocks {node.blocks}: an edge the prompt leaves "
        "midway is split (self._split(child, same)), so the match's last node ends exactly where the match does"
    )
    assert tree.match_prefix([1, 2, 3])[0] == [10], "whole blocks only: [1, 2, 3] matches the block [1, 2] alone"
    assert tree.match_prefix([7, 8]) == ([], tree.root), "no shared block: ([], self.root)"
    # A second prompt that shares two blocks then diverges: the edge is split, only the new block is adopted.
    _, adopted = tree.insert([1, 2, 3, 4, 7, 7], [20, 21, 22])
    assert adopted == [22], (
        f"the second insert adopted {adopted}, expected [22]: the tree keeps its own blocks 10, 11 for the tokens "
        "it had and takes only the block of the new ones"
    )
    assert tree.match_prefix([1, 2, 3, 4, 7, 7, 0])[0] == [10, 11, 22]
    assert sorted(tree.cached_blocks()) == [10, 11, 12, 22], f"the tree holds {sorted(tree.cached_blocks())}"
    tree.check_integrity()


def test_duplicate_insert_keeps_the_first_blocks():
    tree = RadixTree(BS)
    tree.insert([1, 2, 3, 4], [10, 11])
    node, adopted = tree.insert([1, 2, 3, 4], [30, 31])  # computed again by a request running alongside
    assert adopted == [] and node.blocks == [10, 11], (
        f"inserting tokens the tree has adopted {adopted} and ended at blocks {node.blocks}: it keeps its own "
        "blocks [10, 11] and adopts nothing ([])"
    )
    assert tree.match_prefix([1, 2, 3, 4, 5])[0] == [10, 11]
    tree.check_integrity()


def test_lock_and_unlock_count_every_node_up_to_the_root():
    tree = RadixTree(BS)
    tree.insert([1, 1, 2, 2], [1, 2])
    leaf, _ = tree.insert([1, 1, 3, 3], [5, 6])  # splits the edge: [1, 1] (block 1) above [2, 2] and [3, 3]
    path, node = [], leaf
    while node is not None:  # the leaf, its parent [1, 1], the root
        path.append(node)
        node = node.parent
    before = [n.lock_ref for n in path]
    tree.lock(leaf)
    after = [n.lock_ref for n in path]
    assert after == [b + 1 for b in before], (
        f"lock_ref from the leaf up to the root went from {before} to {after} on lock(leaf), expected "
        f"{[b + 1 for b in before]}: lock adds one to the node and to every node up to the root (node.parent until "
        "None), so no node a request reads through can be evicted"
    )
    assert tree.num_evictable_blocks == 1, (
        f"num_evictable_blocks is {tree.num_evictable_blocks} with the leaf's path locked, expected 1 (block 2, "
        "of the other leaf): a node's blocks leave the count when its lock_ref leaves 0"
    )
    tree.unlock(leaf)
    assert [n.lock_ref for n in path] == before, (
        f"lock_ref from the leaf up to the root is {[n.lock_ref for n in path]} after unlock, expected {before} "
        "again: unlock takes one off the node and every node up to the root"
    )
    assert tree.num_evictable_blocks == 3, (
        f"num_evictable_blocks is {tree.num_evictable_blocks} after unlock, expected 3: the path's blocks come back "
        "when its nodes' lock_ref returns to 0"
    )


def test_locked_paths_are_never_evicted_and_eviction_is_lru():
    tree = RadixTree(BS)
    a, _ = tree.insert([1, 1, 2, 2], [1, 2])
    b, _ = tree.insert([3, 3], [3])
    c, _ = tree.insert([4, 4], [4])
    tree.match_prefix([3, 3])  # touch b: now c is the least recently used
    tree.lock(a)
    assert tree.num_evictable_blocks == 2, (
        f"num_evictable_blocks is {tree.num_evictable_blocks} with a's path locked, expected 2 (b and c): a node's "
        "blocks leave the count when its lock_ref leaves 0"
    )
    first = tree.evict(1)
    assert not set(first) & {1, 2}, (
        f"evict(1) released {first}, blocks of a, which is locked: only unlocked leaves (lock_ref 0) are evicted"
    )
    assert first == [4], (
        f"evict(1) released {first}, expected c's [4]: match_prefix([3, 3]) stamped b as used after c, so c is the "
        "least recently used leaf (every match and insert stamps last_access = next(self._clock))"
    )
    rest = tree.evict(10)
    assert rest == [3], f"evict(10) released {rest}, expected [3]: a's path is locked, so only b can go"
    tree.unlock(a)
    assert tree.num_evictable_blocks == 2, (
        f"num_evictable_blocks is {tree.num_evictable_blocks} after unlock, expected 2: a's blocks come back when "
        "its lock_ref returns to 0"
    )
    released = sorted(tree.evict(10))
    assert released == [1, 2], (
        f"evict(10) released {released}, expected [1, 2]: the leaf first, then its parent, a leaf once its child "
        "is gone"
    )
    assert tree.cached_blocks() == []
    tree.check_integrity()


def test_cached_prefix_length_agrees_with_match_prefix_and_changes_nothing():
    tree = RadixTree(BS)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    tree.insert([7, 7], [13])
    before = _snapshot(tree)
    prompts = [[1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 5, 6, 0], [1, 2, 3], [7, 7, 7], [8, 8], []]
    lengths = [tree.cached_prefix_length(p) for p in prompts]
    assert lengths == [4, 6, 2, 2, 0, 0]
    assert _snapshot(tree) == before  # the first prompt leaves an edge midway, yet nothing was split or touched
    assert lengths == [len(tree.match_prefix(p)[0]) * BS for p in prompts]
    assert _snapshot(tree) != before  # match_prefix, by contrast, splits the edge and stamps LRU times


def test_evictable_count_follows_inserts_splits_locks_and_evictions():
    tree = RadixTree(BS)
    node, _ = tree.insert([1, 2, 3, 4, 5, 6], [1, 2, 3])
    assert tree.num_evictable_blocks == 3, (
        f"num_evictable_blocks is {tree.num_evictable_blocks} after inserting 3 blocks, expected 3: a new node is "
        "unlocked, so insert adds its blocks"
    )
    tree.lock(node)
    assert tree.num_evictable_blocks == 0, f"num_evictable_blocks is {tree.num_evictable_blocks} once locked, not 0"
    tree.insert([1, 2, 9, 9], [4, 5])  # splits the locked edge after one block and hangs an unlocked leaf
    assert tree.num_evictable_blocks == 1, (
        f"num_evictable_blocks is {tree.num_evictable_blocks}, expected 1: the split changes nothing (both halves "
        "stay locked), the new leaf [9, 9] adds its block"
    )
    tree.check_integrity()
    tree.unlock(node)
    assert tree.num_evictable_blocks == 4, f"num_evictable_blocks is {tree.num_evictable_blocks} after unlock, not 4"
    first = tree.evict(1)
    assert first == [2, 3] and tree.num_evictable_blocks == 2, (
        f"evict(1) released {first} (num_evictable_blocks now {tree.num_evictable_blocks}), expected [2, 3] and 2: "
        "the least recently used leaf goes whole, even past num_blocks"
    )
    rest = sorted(tree.evict(10))
    assert rest == [1, 5] and tree.num_evictable_blocks == 0, f"evict(10) released {rest}, expected [1, 5]"
    tree.check_integrity()


def test_two_requests_on_the_same_path_take_its_blocks_off_the_count_once():
    """Two running requests share a cached prompt: the second lock, and the first unlock, change no count."""
    tree = RadixTree(BS)
    node, _ = tree.insert([1, 2, 3, 4], [1, 2])
    tree.lock(node)
    tree.lock(node)
    assert (node.lock_ref, tree.num_evictable_blocks) == (2, 0), (
        f"after two locks the node has lock_ref {node.lock_ref} and num_evictable_blocks is "
        f"{tree.num_evictable_blocks}, expected 2 and 0: a node's blocks leave the count only when its lock_ref "
        "leaves 0"
    )
    tree.unlock(node)
    assert tree.num_evictable_blocks == 0, (
        f"num_evictable_blocks is {tree.num_evictable_blocks} with one lock left, expected 0: the blocks come back "
        "only when lock_ref returns to 0"
    )
    tree.unlock(node)
    assert tree.num_evictable_blocks == 2, f"num_evictable_blocks is {tree.num_evictable_blocks} once unlocked, not 2"
    tree.check_integrity()


def test_integrity_check_catches_a_wrong_evictable_count():
    tree = RadixTree(BS)
    tree.insert([1, 2, 3, 4], [1, 2])
    tree.check_integrity()
    tree.num_evictable_blocks += 1
    with pytest.raises(AssertionError, match="num_evictable_blocks is 3 but 2 blocks are unlocked"):
        tree.check_integrity()


def test_split_keeps_lock_counts():
    tree = RadixTree(BS)
    node, _ = tree.insert([1, 2, 3, 4, 5, 6], [1, 2, 3])
    tree.lock(node)
    _, upper = tree.match_prefix([1, 2, 3, 4, 0, 0])  # splits the locked edge
    assert upper.children and upper.lock_ref == 1, (
        f"the match ended at a node with {len(upper.children)} children and lock_ref {upper.lock_ref}: leaving the "
        "edge midway splits it (self._split), and the upper half keeps the lock of the original"
    )
    tree.check_integrity()
    tree.unlock(node)
    assert tree.root.lock_ref == 1, f"the root's lock_ref is {tree.root.lock_ref}: unlock undoes lock, up to the root"
    tree.check_integrity()


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 2), min_size=0, max_size=12),  # a small alphabet, so prefixes are shared often
        st.integers(0, 6),
    ),
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_random_operations_agree_with_a_simple_model(ops):
    tree = RadixTree(BS)
    new_block = itertools.count()
    oracle: dict[tuple[int, ...], int] = {}  # every cached block-aligned prefix -> the block holding its last block
    locks = []
    for op, tokens, n in ops:
        whole = tokens[: len(tokens) // BS * BS]
        if op == "insert":
            blocks = [next(new_block) for _ in range(len(whole) // BS)]
            _, adopted = tree.insert(whole, blocks)
            for i, block in enumerate(blocks):
                key = tuple(whole[: (i + 1) * BS])
                if key not in oracle:
                    oracle[key] = block
                    assert block in adopted, f"insert({whole}) did not report block {block} as adopted, yet it is new"
        elif op in ("match", "lock"):
            expected = []
            for i in range(len(tokens) // BS):
                key = tuple(tokens[: (i + 1) * BS])
                if key not in oracle:
                    break
                expected.append(oracle[key])
            before = _snapshot(tree)
            assert tree.cached_prefix_length(tokens) == len(expected) * BS
            assert _snapshot(tree) == before, "the read-only query changed the tree"
            blocks, node = tree.match_prefix(tokens)
            assert blocks == expected, f"match_prefix({tokens}) gave {blocks}, the cached blocks are {expected}"
            if op == "lock":
                tree.lock(node)
                locks.append(node)
        elif op == "unlock" and locks:
            tree.unlock(locks.pop(n % len(locks)))
        elif op == "evict":
            protected = {b for node in locks for b in _path_blocks(node)}
            released = tree.evict(n)
            assert not set(released) & protected, "evicted a locked block"
            assert len(released) >= min(n, 1) or not _evictable(tree), "eviction stopped early"
            for key in [k for k, b in oracle.items() if b in released]:
                del oracle[key]
        tree.check_integrity()
        assert sorted(tree.cached_blocks()) == sorted(oracle.values()), f"after {op}, the tree holds other blocks"
        on_locked_paths = {b for node in locks for b in _path_blocks(node)}
        assert tree.num_evictable_blocks == len(set(oracle.values()) - on_locked_paths), (
            f"after {op}, num_evictable_blocks is {tree.num_evictable_blocks}: the blocks of nodes with lock_ref 0 "
            f"are {len(set(oracle.values()) - on_locked_paths)}"
        )
    for node in locks:
        tree.unlock(node)
    tree.evict(10**6)
    assert tree.cached_blocks() == [] and tree.root.lock_ref == 1


def _snapshot(tree):
    """Every node as (the tokens from the root to its end, its blocks, lock count, LRU time): shape and state."""
    return sorted((_prefix(n), tuple(n.blocks), n.lock_ref, n.last_access) for n in tree._nodes())


def _prefix(node):
    edges = []
    while node.parent is not None:
        edges.append(node.tokens)
        node = node.parent
    return sum(reversed(edges), ())


def _path_blocks(node):
    while node.parent is not None:
        yield from node.blocks
        node = node.parent


def _evictable(tree):
    return any(not n.children and n.lock_ref == 0 for n in tree._nodes())
