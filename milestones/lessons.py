"""Each milestone's lesson as exercises: the functions a learner writes, and the steps of tests that check them.

An ``Exercise`` names a snippet section of a reference file (the code the milestone's
page shows) and the functions inside it whose bodies are the lesson; ``python -m
milestones.exercise start`` replaces those bodies by ``raise NotImplementedError``.
A ``Step`` is a group of tests, ordered from the smallest piece to the whole engine:
a learner passes them one at a time. The last steps of every milestone compare the
engine with the reference m(K-1), token for token, and run the contract.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Exercise:
    file: str  # in the milestone's package
    section: str  # the snippet section (as the docs include it) that holds the functions
    functions: tuple[str, ...]  # qualified names, e.g. "BlockManager.grow"
    todo: str  # what to build, in a sentence


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    tests: tuple[str, ...]  # pytest arguments, relative to the repository root
    hint: str  # what to look at when this step fails
    exercises: tuple[Exercise, ...] = ()  # what this step is the first to check


def contract(milestone: str) -> Step:
    return Step("the contract of every milestone", ("tests/contract",),
                f"{milestone} keeps the public API and its promises (errors, streaming, aborts): see docs/promises.md")


LESSONS: dict[str, tuple[Step, ...]] = {
    # --8<-- [start:m2]
    "m2": (
        Step("scheduler: budgets and chunks", ("tests/m2/test_scheduler.py",),
             "the scheduler plans every step from scratch: decodes first, then prompt chunks, then admissions",
             (Exercise("scheduler.py", "schedule", ("Scheduler.schedule", "Scheduler._take"),
                       "plan one step: each decoding request's next token first, then the next chunk of each "
                       "prompt still prefilling, then waiting requests in arrival order while a KV slot is free, "
                       "all within max_num_seqs and the max_num_batched_tokens budget."),)),
        Step("one packed forward, the same tokens as m1", ("tests/m2/test_vs_m1.py",),
             "compare your prepare_inputs with m1's: every request's positions start at its num_computed_tokens",
             (Exercise("model_runner.py", "prepare_inputs", ("ModelRunner.prepare_inputs",),
                       "pack every scheduled request's new tokens into one flat batch: ids, positions, each "
                       "token's KV slot, one RequestSpan per request, and the rows that sample (a chunk that "
                       "reaches the end of its sequence)."),
              Exercise("attention.py", "attention", ("attention",),
                       "write the new keys and values into each token's slot, then attend request by request "
                       "over its own slot, up to its context length."))),
        contract("m2"),
    ),
    # --8<-- [end:m2]
    # --8<-- [start:m3]
    "m3": (
        Step("block manager", ("tests/m3/test_block_manager.py",),
             "a block is free or owned by exactly one request; tables grow one block at a time",
             (Exercise("block_manager.py", "grow", ("BlockManager.grow",),
                       "extend the request's block table (a new request starts an empty one) with blocks from the "
                       "front of the free list until it can hold num_tokens tokens, and return the table. If too few "
                       "are free, change nothing and raise `RuntimeError(f\"{request_id} needs {needed} blocks but "
                       "only {self.num_free_blocks} are free\")` (the test matches 'needs 1 blocks')."),
              Exercise("block_manager.py", "free", ("BlockManager.free",),
                       "return every block of the request to the free list and drop its table; freeing a request "
                       "that holds no blocks (never grown, or freed already) does nothing, without an error."))),
        Step("slot mapping and paged attention",
             ("tests/m3/test_prepare_inputs.py", "tests/m3/test_paged_attention.py"),
             "token p of a request lives in block table[p // block_size], at offset p % block_size; a span's first "
             "is where its blocks start among the tables gathered before it, in tokens",
             (Exercise("model_runner.py", "prepare_inputs", ("ModelRunner.prepare_inputs",),
                       "as in m2 (ids, positions, the rows that sample, decodes to self.kernel_batch when "
                       "self.decode_kernel is set), but token p goes to slot "
                       "`table[p // block_size] * block_size + p % block_size`, and each request's "
                       "`RequestSpan(start, end, table[: -(-end // block_size)], end)` carries its table cut to its "
                       "context. ctx.block_tables is the tables of ctx.requests one after the other; each of those "
                       "spans' first is block_size times the number of blocks before its own there."),
              Exercise("attention.py", "gather", ("gather",),
                       "read the blocks of the tables, in order, into one run of keys (or values): "
                       "`[kv_heads, len(tables) * block_size, dim]`."))),
        Step("scheduler: admission and preemption", ("tests/m3/test_scheduler.py",),
             "admission is first come, first served and needs the first chunk's blocks plus one free block per "
             "request already running (not the newcomer), none after a preemption; the victim is the latest admitted "
             "request not yet scheduled (else the request itself, then left out of the step), sent to the front",
             (Exercise("scheduler.py", "schedule", ("Scheduler.schedule",),
                       "m2's plan over blocks: decodes first, then unfinished prefills, each with "
                       "`min(tokens left, budget left)`. While a request's table cannot grow to "
                       "`num_computed_tokens + num_new` tokens, preempt through `self._preempt(victim)` (the tests "
                       "patch it to record victims): the most recently admitted running request not yet scheduled in "
                       "this step, or else the request itself, which is then not scheduled. Then admit from the front "
                       "of the queue, within max_num_seqs and the budget as in m2 (RUNNING, appended to self.running, "
                       "then taken), while `new blocks of its first chunk + len(self.running) <= free blocks` (the "
                       "newcomer is not counted), stopping at the first that does not fit, and nobody in a step that "
                       "preempted. Return None if nothing is scheduled."),
              Exercise("scheduler.py", "schedule", ("Scheduler._take",),
                       "schedule num_new tokens of seq: append seq, num_new and its table, grown with "
                       "`self.block_manager.grow(seq.request_id, seq.num_computed_tokens + num_new)`, to the batch's "
                       "three lists; return num_new, the tokens it takes from the budget."),
              Exercise("scheduler.py", "schedule", ("Scheduler._preempt",),
                       "recompute later: take seq out of self.running, free its blocks, set its num_computed_tokens "
                       "to 0 and its status to WAITING, put it at the front of the waiting queue (appendleft: it is "
                       "readmitted first), and count it in self.num_preemptions (the KV report shows it)."))),
        Step("the engine, the same tokens as m2", ("tests/m3/test_vs_m2.py",),
             "an integrity message (every batch is checked as it is scheduled, the bookkeeping after every step) "
             "names the rule that broke; 'output token T differs' means the bookkeeping held but a token was "
             "computed from the wrong keys and values: look at your slots and first (step 2) and at who is "
             "preempted (step 3)"),
        contract("m3"),
    ),
    # --8<-- [end:m3]
    # --8<-- [start:m4]
    "m4": (
        Step("radix tree", ("tests/m4/test_radix_tree.py",),
             "edges hold whole blocks; locked nodes are never evicted; eviction is least recently used first",
             (Exercise("radix_tree.py", "match_prefix", ("RadixTree.match_prefix",),
                       "follow the shared edges from the root, splitting the last one where the tokens leave it; "
                       "return the blocks of the match and its last node."),
              Exercise("radix_tree.py", "insert", ("RadixTree.insert",),
                       "add a computed prefix, keeping the tree's own blocks where it already has the tokens; "
                       "return the last node and the blocks the tree newly took over."),
              Exercise("radix_tree.py", "lock", ("RadixTree.lock",),
                       "count one more user on every node up to the root, keeping num_evictable_blocks exact."),
              Exercise("radix_tree.py", "unlock", ("RadixTree.unlock",),
                       "count one user fewer on every node up to the root, keeping num_evictable_blocks exact."),
              Exercise("radix_tree.py", "evict", ("RadixTree.evict",),
                       "drop unlocked leaves, least recently used first (a parent left childless becomes a "
                       "leaf), until num_blocks blocks are released or none is left."))),
        Step("scheduler: match, cache, evict", ("tests/m4/test_scheduler.py",),
             "a request locks the path it uses; blocks the tree takes over gain a holder",
             (Exercise("scheduler.py", "schedule", ("Scheduler._match", "Scheduler._cache", "Scheduler._make_room"),
                       "start a request from its longest cached prefix (never its last token), insert its "
                       "computed blocks into the tree and move its lock down, and evict cached blocks before "
                       "preempting anyone."),)),
        Step("the engine, the same tokens as m3", ("tests/m4/test_vs_m3.py",),
             "the integrity check runs after every step: a lock lost, or a block freed while cached, shows there"),
        contract("m4"),
    ),
    # --8<-- [end:m4]
    # --8<-- [start:m5]
    "m5": (
        Step("a padded replay", ("tests/m5/test_vs_m4.py", "-k", "padded_replay or small_batch_after_a_large"),
             "a replay reads only the static buffers: copy every input into them; padding rows write to the "
             "scratch block, and unused table entries point at it",
             (Exercise("model_runner.py", "decode_inputs", ("ModelRunner.decode_inputs",),
                       "for each decoding request: its token, position, the slot its key and value go to, its "
                       "block table and its context length (the new token included)."),
              Exercise("graph_runner.py", "run", ("GraphRunner.run",),
                       "pad the batch to the smallest captured size that holds it, fill every static buffer "
                       "(padding writes to the scratch slot and reads one position), replay, and return the "
                       "real rows."))),
        Step("the engine, the same tokens as m4",
             ("tests/m5/test_vs_m4.py", "-k", "not padded_replay and not small_batch_after_a_large"),
             "the same tokens with graphs on and off (enforce_eager=True): compare the two to find the step"),
        contract("m5"),
    ),
    # --8<-- [end:m5]
    # --8<-- [start:m6]
    "m6": (
        Step("the future map", ("tests/m6/test_future_map.py",),
             "future ids are -1, -2, ...: id -1 - i is place i of the ring",
             (Exercise("future_map.py", "future_map", ("FutureMap.allocate", "FutureMap.resolve_", "FutureMap.store"),
                       "hand out future ids -1, -2, ... around a ring, keep each step's sampled tokens at their "
                       "places, and replace the future ids in a step's input ids by those tokens, on the "
                       "device."),)),
        Step("overlap, the same tokens as m5", ("tests/m6/test_vs_m5.py",),
             "a step's tokens exist only on the device until it is processed; async_scheduling=False runs the "
             "same code without the lag, to tell the two apart",
             (Exercise("engine.py", "process", ("LLMEngine._process",),
                       "take a launched step's tokens from the worker (undo the step if that raises), mark its "
                       "blocks processed, put each token in place of its future id, and finish requests, "
                       "dropping tokens of requests that finished while the step computed."),)),
        contract("m6"),
    ),
    # --8<-- [end:m6]
    # --8<-- [start:m7]
    "m7": (
        Step("the ngram proposer", ("tests/m7/test_proposer.py",),
             "the latest earlier occurrence of the longest suffix wins; never the suffix itself",
             (Exercise("proposer.py", "ngram", ("NgramProposer.propose",),
                       "find the latest earlier place where the request's last n tokens occurred (n from max_n down "
                       "to min_n) and propose up to num_tokens of the tokens that followed it."),)),
        Step("guesses checked, the same tokens as m6", ("tests/m7/test_vs_m6.py", "-m", "not real_model"),
             "a row's token counts only if every guess before it was the model's own pick; after a rejected one, "
             "drop the later rows' tokens, their KV (num_computed_tokens) and the blocks past the kept tokens",
             (Exercise("engine.py", "guesses", ("LLMEngine._check_guess",),
                       "compare the model's pick with the guess the next row read: count it and raise the "
                       "lookahead, or drop the rows after it, trim the blocks and halve the lookahead."),
              Exercise("block_manager.py", "shrink", ("BlockManager.shrink",),
                       "release the blocks at the end of a request's table that its first num_tokens tokens do "
                       "not need."))),
        Step("a checking step replayed: a decode step with a row per token", ("tests/m7/test_vs_m6.py", "-k",
                                                                               "replayed"),
             "each guess is a row of its own: its position, its slot, the request's table, and a context that "
             "ends at itself, so it reads the rows before it and none after",
             (Exercise("model_runner.py", "decode_inputs", ("ModelRunner.decode_inputs",),
                       "give every request's last token and each of its guesses a row: token, position, slot, "
                       "block table and context length, and the request that samples after it."),)),
        Step("a draft model guesses, in the requests' own blocks", ("tests/m7/test_draft_model.py",),
             "the draft computes what it has not seen (from num_drafted_tokens), then one guess per forward; a "
             "rejected guess's slot holds another token afterwards, so trim counts the draft's KV back too",
             (Exercise("drafter.py", "draft_model", ("DraftModelProposer.propose_batch",),
                       "run the draft over each request's tokens from num_drafted_tokens, sample a guess with the "
                       "request's own rules, feed it back, until each has its rooms[i] guesses; then record how "
                       "many tokens the draft computed."),
              Exercise("scheduler.py", "trim", ("Scheduler.trim",),
                       "after a rejected guess: shrink the request's blocks to its tokens, and count the draft's "
                       "keys and values only up to the slot whose token changed."))),
        Step("rejection sampling: the model's distribution, not m6's tokens", ("tests/m7/test_rejection.py",),
             "keep a guess when u * q(guess) < p(guess); otherwise draw from max(p - q, 0), never from p itself",
             (Exercise("sampler.py", "rejection_sample", ("rejection_sample",),
                       "for each row, keep the guess with probability min(1, p/q) at the guess (q one-hot when "
                       "no guess_probs are given), else pick from the residual max(p - q, 0) with the exponential "
                       "race over the given noise."),)),
        contract("m7"),
    ),
    # --8<-- [end:m7]
}
