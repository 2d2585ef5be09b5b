"""The router's choices, torch-free: the approximate tree of each prefill worker, and the two policies."""

from __future__ import annotations

from milestones.m9.router import BALANCE_ABS_THRESHOLD, ApproximateTree, Router


def test_the_tree_matches_whole_blocks_and_forgets_the_oldest():
    tree = ApproximateTree(block_size=4, capacity=3)
    tree.insert(list(range(10)))  # two whole blocks: prefixes of 4 and 8 tokens
    assert tree.match(list(range(8)) + [99, 98]) == 8
    assert tree.match([0, 1, 2, 9]) == 0, "a block that differs anywhere matches nothing from it on"
    assert tree.match(list(range(3))) == 0, "less than a block is never a match"
    tree.insert([50, 51, 52, 53, 54, 55, 56, 57])  # two more prefixes: four in all, one over capacity
    assert tree.size == 3 and tree.match(list(range(8))) == 0, "the least recently used prefix went first"


def test_cache_aware_sends_a_prompt_where_its_prefix_went():
    router = Router("cache_aware", num_prefill=2, num_decode=1, block_size=4, capacity=100)
    system_a, system_b = list(range(100, 116)), list(range(200, 216))
    first = router.prefill(system_a + [1, 2])
    assert first.reason == "room"  # nobody has it: the smallest tree
    second = router.prefill(system_b + [3])
    assert second.reason == "room" and second.worker != first.worker, "the other worker's tree was smaller"
    for tail in ([4, 5], [6], [7, 8, 9]):
        again = router.prefill(system_a + tail)
        assert (again.worker, again.reason, again.matched) == (first.worker, "cache", 16)
        assert router.prefill(system_b + tail).worker == second.worker


def test_cache_aware_balances_loads_far_apart():
    router = Router("cache_aware", num_prefill=2, num_decode=2, block_size=4, capacity=100)
    prompt = list(range(32))
    home = router.prefill(prompt).worker
    router.prefill_load[home] = 3 * BALANCE_ABS_THRESHOLD
    choice = router.prefill(prompt)
    assert (choice.worker, choice.reason) == (1 - home, "balance")
    router.decode_load = [5, 2]
    assert router.decode() == 1, "the least loaded decode worker"


def test_round_robin_takes_turns_whatever_the_prefix():
    router = Router("round_robin", num_prefill=3, num_decode=1, block_size=4, capacity=100)
    assert [router.prefill(list(range(16))).worker for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_a_dead_worker_gets_nothing():
    router = Router("cache_aware", num_prefill=2, num_decode=2, block_size=4, capacity=100)
    router.alive_prefill.discard(0)
    router.alive_decode.discard(1)
    assert {router.prefill([i] * 8).worker for i in range(5)} == {1}
    assert router.decode() == 0
