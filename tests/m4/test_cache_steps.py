"""The m4 scheduler's cache steps alone, without a model: _match, _cache and _make_room on the chapter's examples.

The chain finds a wrong match or a lost holder only as a different token or an integrity message steps later;
here the scheduler runs the chapter's worked example and its rules one step at a time, and the message names
the rule: block numbers, hits, locks, holders, and eviction before preemption.
"""

from __future__ import annotations

from milestones.m4.config import EngineConfig
from milestones.m4.detokenizer import IncrementalDetokenizer
from milestones.m4.radix_tree import Node
from milestones.m4.scheduler import Scheduler
from milestones.m4.sequence import Sequence
from milestones.serving.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 3, prompt_logprobs: int | None = None) -> Sequence:
    detokenizer = IncrementalDetokenizer(None, prompt, [])
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Sequence(request_id, None, prompt, params, seed=0, detokenizer=detokenizer)


def make_scheduler(num_kv_blocks: int, max_model_len: int = 64, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(EngineConfig(max_model_len=max_model_len, max_num_seqs=4,
                                  max_num_batched_tokens=max_num_batched_tokens, block_size=BLOCK_SIZE,
                                  num_kv_blocks=num_kv_blocks))


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Plan one step and pretend to run it: a chunk that completes a request's tokens samples 900, 901, ...;
    a request that reaches max_tokens finishes. Returns the plan, (request id, new tokens) per request."""
    batch = scheduler.schedule()
    plan = [(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)] if batch else []
    for seq, num_new in zip(batch.seqs if batch else (), batch.num_new_tokens if batch else ()):
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(900 + seq.num_output_tokens)
            if seq.num_output_tokens == seq.params.max_tokens:
                seq.finish("length")
                scheduler.finish(seq)
    scheduler.check_integrity()
    return plan


def serve(scheduler: Scheduler, seq: Sequence) -> None:
    """Run one request alone until it finishes."""
    scheduler.add(seq)
    for _ in range(20):
        step(scheduler)
        if seq.is_finished:
            return
    raise AssertionError(f"request {seq.request_id} did not finish in 20 steps")


def edges(scheduler: Scheduler) -> dict[tuple[int, ...], list[int]]:
    """Every node of the tree as its whole prefix from the root -> its blocks."""
    found = {}
    for node in scheduler.tree._nodes():
        prefix, up = (), node
        while up.parent is not None:
            prefix, up = up.tokens + prefix, up.parent
        found[prefix] = list(node.blocks)
    return found


S = list(range(100, 108))  # the system prompt: two blocks
A, B, C = list(range(200, 205)), list(range(300, 306)), list(range(400, 404))
ANSWER = [900, 901, 902]  # what step() samples for every request


def test_the_chapters_worked_example_block_by_block():
    """Three requests one after the other (block_size 4): S + A, then S + B, then S + A + its answer + C. The
    chapter's trees, its block numbers and its 20 of 47 prompt tokens from the cache."""
    scheduler = make_scheduler(num_kv_blocks=16)
    first = make_seq("1", S + A)
    serve(scheduler, first)
    assert edges(scheduler) == {tuple(S + A[:4]): [0, 1, 2]}, (
        f"after request 1 the tree is {edges(scheduler)}: the chapter's one edge s0 ... a3 with blocks 0 1 2. A "
        "request inserts its num_computed_tokens // block_size whole blocks (15 computed tokens: 3 blocks; block 3, "
        "with a4 and two generated tokens, is incomplete and is not cached)"
    )
    assert scheduler.block_manager.ref_count[:4] == [1, 1, 1, 0], (
        f"ref counts of blocks 0-3 are {scheduler.block_manager.ref_count[:4]}, expected [1, 1, 1, 0]: the tree "
        "holds the blocks it adopted (self.block_manager.hold(block) for each adopted block) and the finished "
        "request let go of all of its own"
    )
    second = make_seq("2", S + B)
    serve(scheduler, second)
    assert second.num_cached_tokens == 8, (
        f"request 2 (S + B) took {second.num_cached_tokens} tokens from the cache, the chapter's 8: _match sets "
        "num_computed_tokens and num_cached_tokens to the matched blocks times block_size"
    )
    want = {tuple(S): [0, 1], tuple(S + A[:4]): [2], tuple(S + B[:4]): [4], tuple(S + B + ANSWER[:2]): [5]}
    assert edges(scheduler) == want, (
        f"after request 2 the tree is {edges(scheduler)}, the chapter's {want}: the edge split after S, request "
        "2's blocks below it in two nodes, inserted after its prefill (at the start of the next step, _cache for "
        "every running request) and when it finished"
    )
    third = make_seq("3", S + A + ANSWER + C)
    serve(scheduler, third)
    assert third.num_cached_tokens == 12, (
        f"request 3 took {third.num_cached_tokens} tokens from the cache, the chapter's 12 (S and a0 ... a3)"
    )
    want[tuple(S + A + ANSWER + C)] = [6, 7]
    assert edges(scheduler) == want, (
        f"after request 3 the tree is {edges(scheduler)}, the chapter's {want}: a4, the answer and C in blocks 6 7"
    )
    hit = (scheduler.num_cached_tokens, scheduler.num_prompt_tokens)
    assert hit == (20, 47), f"{hit[0]} of {hit[1]} prompt tokens came from the cache, the chapter's 20 of 47"


def test_a_fully_cached_prompt_matches_all_but_its_last_token_and_locks_its_path():
    """A prompt of exactly two blocks, cached: only the first block is taken, the second is computed again."""
    scheduler = make_scheduler(num_kv_blocks=16)
    prompt = list(range(500, 508))
    serve(scheduler, make_seq("first", prompt, max_tokens=1))
    again = make_seq("again", prompt, max_tokens=2)
    scheduler.add(again)
    plan = step(scheduler)
    assert plan == [("again", 4)] and again.num_cached_tokens == 4, (
        f"the cached 8-token prompt was planned as {plan} with {again.num_cached_tokens} cached tokens, expected "
        "[('again', 4)] and 4: the match is made on seq.token_ids[:-1], whole blocks only, so the last token, and "
        "its block, is always computed"
    )
    node = scheduler.locked.get("again")
    assert isinstance(node, Node) and node.lock_ref >= 1, (
        "self.locked[request_id] is the last node of its match, locked with self.tree.lock(node)"
    )
    table = scheduler.block_manager.block_tables["again"]
    assert table[0] == node.blocks[-1] and scheduler.block_manager.ref_count[table[0]] == 2, (
        f"its table {table} starts with the matched block {node.blocks[-1]}, held by the tree and by it "
        "(self.block_manager.share(request_id, blocks)): two holders"
    )


def test_a_running_requests_blocks_are_cached_at_the_start_of_the_next_step():
    """F and H, the same 13-token prompt, are admitted together and both compute it. G, added a step later with the
    same 12 first tokens, hits them while both still run: the tree took F's blocks and none of H's, and H switched
    to F's, freeing its own copies."""
    scheduler = make_scheduler(num_kv_blocks=16)
    shared = list(range(600, 612))
    f, h = make_seq("F", shared + [1], max_tokens=4), make_seq("H", shared + [1], max_tokens=4)
    scheduler.add(f)
    scheduler.add(h)
    step(scheduler)
    h_own = scheduler.block_manager.block_tables["H"][:3]
    g = make_seq("G", shared + [2, 3, 4])
    scheduler.add(g)
    step(scheduler)
    assert g.num_cached_tokens == 12, (
        f"G found {g.num_cached_tokens} cached tokens, expected 12: at the start of every step schedule() calls "
        "self._cache(seq) for every running request, so F's 3 computed blocks were in the tree when G came"
    )
    f_table, h_table = scheduler.block_manager.block_tables["F"], scheduler.block_manager.block_tables["H"]
    holders = [scheduler.block_manager.ref_count[b] for b in f_table[:3]]
    assert holders == [4, 4, 4], (
        f"F's first 3 blocks have {holders} holders, expected 4 each: F, the tree that adopted them "
        "(self.block_manager.hold(block) for each block insert returns as adopted), H that switched to them, and G"
    )
    assert edges(scheduler)[tuple(shared)] == f_table[:3], "the tree holds F's blocks for the shared 12 tokens"
    h_holders = [scheduler.block_manager.ref_count[b] for b in h_own]
    assert h_table[:3] == f_table[:3] and h_holders == [0, 0, 0], (
        f"H's table starts with {h_table[:3]} and its own first blocks {h_own} have {h_holders} holders, expected "
        f"F's {f_table[:3]} and 0 each: insert keeps the tree's blocks where it has the tokens, so H takes the "
        "tree's and lets its own copies go (self.block_manager.use_cached(request_id, the blocks of the path))"
    )
    locked = scheduler.locked["F"]
    assert locked.blocks == f_table[:3] and locked.lock_ref == 3 and scheduler.locked["H"] is locked, (
        f"F's lock is on a node with blocks {locked.blocks} (lock_ref {locked.lock_ref}): _cache locks the node "
        "insert returns and unlocks the one it held before (self.locked[request_id] is the new one), so F, H and G "
        "each count once on the shared node"
    )
    assert scheduler.tree.root.lock_ref == 1 + len(scheduler.running), "the root counts one lock per running request"


def test_a_request_computing_a_prompt_the_tree_holds_keeps_one_copy_and_finishes_in_a_tight_pool():
    """W's 40-token prompt (10 blocks) is cached. L, the same prompt asking for its log-probabilities, matches
    nothing and computes it again, 8 tokens a step. Each chunk it inserts is the tree's already: L switches to the
    tree's blocks and frees its own. Holding its copies and locking the tree's, it would need 2 blocks per block
    of the prompt, 21 of a pool of 16: it would preempt itself, match nothing again and recompute, forever."""
    scheduler = make_scheduler(num_kv_blocks=16, max_num_batched_tokens=8)
    prompt = list(range(700, 740))
    serve(scheduler, make_seq("W", prompt))
    tree_blocks = [b for _, blocks in sorted(edges(scheduler).items(), key=lambda edge: len(edge[0])) for b in blocks]
    lp = make_seq("L", prompt, prompt_logprobs=1)
    scheduler.add(lp)
    step(scheduler)
    own = scheduler.block_manager.block_tables["L"][:2]
    step(scheduler)
    table = scheduler.block_manager.block_tables["L"]
    assert lp.num_cached_tokens == 0 and table[:2] == tree_blocks[:2], (
        f"after its first chunk L's table starts with {table[:2]}, expected the tree's {tree_blocks[:2]} (L "
        f"matched {lp.num_cached_tokens} tokens: a request asking for its prompt's log-probabilities matches "
        "nothing): _cache inserts its 2 computed blocks, insert keeps the tree's, and "
        "self.block_manager.use_cached(request_id, blocks of the locked path) switches L to them"
    )
    assert [scheduler.block_manager.ref_count[b] for b in own] == [0, 0], (
        f"L's own first blocks {own} still have holders: use_cached releases each copy it replaces"
    )
    for _ in range(20):
        step(scheduler)
    assert lp.is_finished and scheduler.num_preemptions == 0, (
        f"L is {lp.status.value} after 22 steps and was preempted {scheduler.num_preemptions} times: it needs 6 steps "
        "for its prompt and 3 for its tokens, in 11 blocks of a pool of 16 once it holds no copy of its own"
    )


def warm(scheduler: Scheduler, *firsts: int) -> None:
    """Finish one-token requests of 9 tokens (two whole blocks cached each), the first one least recently used."""
    for first in firsts:
        serve(scheduler, make_seq(f"warm{first}", list(range(first, first + 9)), max_tokens=1))


def test_cached_blocks_are_evicted_least_recently_used_first_before_anyone_is_preempted():
    """A pool of 8: two cached prefixes of 2 blocks each and 4 free blocks. R (15 tokens) takes the 4 free ones;
    its 17th token needs a fifth block: the least recently used prefix is evicted for it, and nobody is preempted."""
    scheduler = make_scheduler(num_kv_blocks=8, max_model_len=32)
    warm(scheduler, 1000, 2000)
    old, recent = tuple(range(1000, 1008)), tuple(range(2000, 2008))
    kept = edges(scheduler)[recent]
    r = make_seq("R", list(range(3000, 3015)), max_tokens=8)
    scheduler.add(r)
    plans = [step(scheduler) for _ in range(3)]
    assert scheduler.num_preemptions == 0 and plans[-1] == [("R", 1)], (
        f"R was preempted {scheduler.num_preemptions} times (plans {plans}): when a request is short of blocks, "
        "_make_room evicts unlocked cached blocks first (self.tree.evict(missing), each block it returns released "
        "with self.block_manager.release(block)), and only when they are not enough is anyone preempted"
    )
    assert old not in edges(scheduler) and edges(scheduler).get(recent) == kept, (
        f"the tree holds {sorted(edges(scheduler).values())}: the least recently used prefix (the first warm-up's) "
        f"goes, the more recent one ({kept}) stays, since one eviction is enough"
    )


def test_a_request_that_will_not_fit_anyway_leaves_the_cache_alone():
    """Pool of 8, 4 blocks cached and R running on 3: X needs 6 blocks plus one of headroom for R, 7 > 1 free + 4
    evictable. X waits and nothing is evicted for it."""
    scheduler = make_scheduler(num_kv_blocks=8, max_model_len=32)
    warm(scheduler, 1000, 2000)
    scheduler.add(make_seq("R", list(range(3000, 3010)), max_tokens=8))
    step(scheduler)
    before = edges(scheduler)
    scheduler.add(make_seq("X", list(range(4000, 4024)), max_tokens=2))
    plan = step(scheduler)
    assert [rid for rid, _ in plan] == ["R"], f"the step planned {plan}: X does not fit, even after eviction"
    after = {prefix: blocks for prefix, blocks in edges(scheduler).items() if prefix in before}
    assert after == before, (
        f"the tree's nodes went from {before} to {after} for a request that was not admitted: _make_room evicts "
        "only if that is enough (missing <= self.tree.num_evictable_blocks); a request that will not fit anyway "
        "leaves the cache alone"
    )
    # Admission refused X before any eviction (admission.py counts the evictable blocks); a running request's growth
    # goes through _make_room itself: R asking for 6 more blocks than it holds finds 1 free + 4 evictable, not enough.
    r = scheduler.find("R")
    assert not scheduler._make_room(r, r.num_computed_tokens + 6 * BLOCK_SIZE), "6 blocks made out of 5"
    after = {prefix: blocks for prefix, blocks in edges(scheduler).items() if prefix in before}
    assert after == before, (
        f"the tree's nodes went from {before} to {after} though R's growth could not fit even after eviction: "
        "_make_room evicts only if that is enough (missing <= self.tree.num_evictable_blocks)"
    )
