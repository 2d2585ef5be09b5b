"""m3's lesson, paged attention: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m3"]``; docs/m3.md shows its snippet section under "Build it yourself".
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m3]
STEPS: tuple[Step, ...] = (
    Step("block manager", ("tests/m3/test_block_manager.py",),
         "a block is free or owned by exactly one request; tables grow one block at a time",
         (Exercise("block_manager.py", "grow", ("BlockManager.grow",),
                   "extend the request's block table (a new request starts an empty one) with blocks from the "
                   "front of the free list until it can hold num_tokens tokens, and return the table. If too few "
                   "are free, change nothing and raise `RuntimeError(f\"{request_id} needs {needed} blocks but "
                   "only {self.num_free_blocks} are free\")` (the test matches 'needs 1 blocks').",
                   how="`needed = self.num_new_blocks(request_id, num_tokens)`; the table from "
                   "`self.block_tables.setdefault(request_id, [])`, extended with `self.free_blocks.popleft()` "
                   "needed times."),
          Exercise("block_manager.py", "free", ("BlockManager.free",),
                   "return every block of the request to the free list and drop its table; freeing a request "
                   "that holds no blocks (never grown, or freed already) does nothing, without an error.",
                   how="one line: extend self.free_blocks with what `self.block_tables.pop(request_id, ())` "
                   "gives."))),
    Step("slot mapping and paged attention",
         ("tests/m3/test_prepare_inputs.py", "tests/m3/test_paged_attention.py"),
         "token p of a request lives in block table[p // block_size], at offset p % block_size; a span's first "
         "is where its blocks start among the tables gathered before it, in tokens; gather reads each kv head's "
         "blocks in the tables' order, end to end",
         (Exercise("model_runner.py", "prepare_inputs", ("ModelRunner.prepare_inputs",),
                   "as in m2 (ids, positions, the rows that sample and score the prompt), but token "
                   "p goes to slot `table[p // block_size] * block_size + p % block_size`, and each request's "
                   "`RequestSpan(start, end, table[: -(-end // block_size)], end)` carries its table cut to its "
                   "context. ctx.block_tables is the tables of ctx.requests one after the other; each of those "
                   "spans' first is block_size times the number of blocks before its own there. Every tensor on "
                   "self.device (the tests check it with a stand-in device).",
                   how="m2's loop over zip(batch.seqs, batch.num_new_tokens, batch.block_tables), the slots "
                   "computed per position; then a second loop over the spans, setting "
                   "`span.first = len(block_tables) * block_size` before adding the span's table to "
                   "block_tables; `AttentionContext(self.k_cache, self.v_cache, slot_mapping, block_tables, "
                   "requests)`, the lists made tensors with self._tensor."),
          Exercise("attention.py", "gather", ("gather",),
                   "read the blocks of the tables, in order, out of cache [kv_heads, num_blocks, block_size, "
                   "dim] into one run of keys (or values): `[kv_heads, len(tables) * block_size, dim]`.",
                   how="one copy: `index_select` on the block dimension, then a view."))),
    Step("scheduler: admission and preemption", ("tests/m3/test_scheduler.py", "tests/m3/test_admission.py"),
         "admission is first come, first served and needs the first chunk's blocks plus one free block per "
         "request already running (not the newcomer), none after a preemption; the victim is the latest admitted "
         "request not yet scheduled (else the request itself, then left out of the step), sent to the front; "
         "under new_token_ratio, SGLang's retraction before the step (admission.py, given)",
         (Exercise("scheduler.py", "schedule", ("Scheduler._grow",),
                   "schedule the requests of queue in order while budget is left, each `min(tokens left, budget "
                   "left)` tokens. While a request's table cannot grow to `num_computed_tokens + num_new` tokens, "
                   "preempt through `self._preempt(victim)` (the tests patch it to record victims): the most "
                   "recently admitted request still in the queue, or else the request itself, which is then not "
                   "scheduled. Return whether any was preempted.",
                   how="pop the queue's front; `while not self.block_manager.can_grow(...)`: the victim is "
                   "`max(queue, key=self.running.index)`, or the request itself when the queue is empty (then "
                   "break); a while/else takes the request when no break happened."),
          Exercise("scheduler.py", "schedule", ("Scheduler.schedule",),
                   "m2's plan over blocks: a queue of the running requests, decodes first, then unfinished "
                   "prefills; `preempted = self._retract(queue, budget)` (SGLang's retraction, given; False under "
                   "the default rule); the queue but for the decodes `self._decodes_held_back(queue)` holds back "
                   "(given) goes to self._grow, and what it took leaves the budget. Then admit from the front "
                   "of the queue (RUNNING, appended to self.running and to a set of this step's admissions, then "
                   "taken) while `self.admission.refused(budget, preempted, len(self.running))` is False and "
                   "`self.admission.no_room(seq, num_new, self.running, admitted, tables, self._available())` is "
                   "False: admission.py holds both rules (by default, the first chunk's new blocks + "
                   "len(self.running) <= free blocks, the newcomer not counted), stopping at the first that does "
                   "not fit. If the batch is still empty, the held-back decodes go to self._grow. Return None if "
                   "nothing is scheduled.",
                   how="self.running sorted decodes first; `budget -= sum(batch.num_new_tokens)` after the first "
                   "_grow; `preempted |= ...`. Admission peeks at `self.waiting[0]`; tables are "
                   "`self.block_manager.block_tables`."),
          Exercise("scheduler.py", "schedule", ("Scheduler._take",),
                   "schedule num_new tokens of seq: seq, num_new and its table, grown to hold "
                   "`seq.num_computed_tokens + num_new` tokens, go into the batch's three lists; return num_new, "
                   "the tokens it takes from the budget.",
                   how="the table is what `self.block_manager.grow(seq.request_id, ...)` returns."),
          Exercise("scheduler.py", "schedule", ("Scheduler._preempt",),
                   "recompute later: seq leaves self.running, its blocks are freed, its num_computed_tokens is 0 "
                   "and its status WAITING; it goes to the front of the waiting queue (it is readmitted first), "
                   "self.num_preemptions counts it and self.num_preempted_tokens the computed tokens it loses (the "
                   "KV report shows both).",
                   how="`self.block_manager.free(seq.request_id)`; `self.waiting.appendleft(seq)`."))),
    Step("the engine, the same tokens as m2", ("tests/m3/test_vs_m2.py",),
         "an integrity message (every batch is checked as it is scheduled, the bookkeeping after every step) "
         "names the rule that broke; 'output token T differs' means the bookkeeping held but a token was "
         "computed from the wrong keys and values: look at your slots and first (step 2) and at who is "
         "preempted (step 3)"),
    contract("m3"),
)
# --8<-- [end:m3]
