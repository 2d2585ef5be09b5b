"""m2's lesson, continuous batching: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m2"]``; docs/m2.md shows its snippet section under "Build it yourself".
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m2]
STEPS: tuple[Step, ...] = (
    Step("scheduler: budgets and chunks", ("tests/m2/test_scheduler.py",),
         "the scheduler plans every step from scratch: decodes first, then unfinished prefills, then admissions "
         "in arrival order while fewer than max_num_seqs run, each request getting min(tokens left, budget left)",
         (Exercise("scheduler.py", "schedule", ("Scheduler.schedule",),
                   "plan one step from scratch within a budget of max_num_batched_tokens tokens: the running "
                   "requests first, decodes (one token left to compute) before prefills and arrival order within "
                   "each, each taken with self._take until the budget is spent; then, while budget is left and "
                   "fewer than max_num_seqs run, the front of self.waiting is admitted (status RUNNING, a KV slot "
                   "of its own from self.free_slots in `self.kv_slot[seq.request_id]`, appended to self.running) "
                   "and taken. The decodes `self._decodes_held_back(queue)` returns (given: none, unless "
                   "batch_shape is 'prefill-first') are skipped, and taken last if nothing else was. Return the "
                   "ScheduledBatch, or None if it holds no request.",
                   how="`batch = ScheduledBatch([], [], [])`; a stable sort of self.running keyed on \"more than "
                   "one token left\"; `budget -= self._take(batch, seq, budget)`, breaking at a budget of 0; "
                   "admission pops with popleft and `self.free_slots.pop()`."),
          Exercise("scheduler.py", "schedule", ("Scheduler._take",),
                   "schedule `min(tokens left to compute, budget)` new tokens of seq: seq, that number and its "
                   "slot `self.kv_slot[seq.request_id]` go into the batch (batch.seqs, batch.num_new_tokens, "
                   "batch.kv_slots); return the number, which the caller takes from the budget.",
                   how="three appends and a return."))),
    Step("one packed forward: inputs and attention",
         ("tests/m2/test_prepare_inputs.py", "tests/m2/test_attention.py"),
         "a request's new tokens sit at num_computed_tokens, num_computed_tokens + 1, ...; its span's "
         "context_len counts every token it attends to, this step's included; only a chunk that reaches the end "
         "of its tokens samples; attention writes this layer's new keys and values before anyone reads them",
         (Exercise("model_runner.py", "prepare_inputs", ("ModelRunner.prepare_inputs",),
                   "every scheduled request's new tokens, `token_ids[num_computed_tokens : num_computed_tokens + "
                   "num_new]` at positions num_computed_tokens, ..., packed one request after the other into one "
                   "flat batch, each token going to its request's KV slot (batch.kv_slots), with one "
                   "`RequestSpan(row, row + num_new, slot, num_computed_tokens + num_new)` per request (row: its "
                   "first row). A request whose "
                   "chunk reaches the end of its tokens samples from its last row (sample_rows, and its seq in "
                   "sample_seqs). Every request adds `PromptLogprobRows.of(seq, row, start, end)` to "
                   "prompt_rows. Return `ModelInputs(input_ids, positions, ctx, sample_rows, sample_seqs, "
                   "prompt_rows)` with `ctx = AttentionContext(self.k_cache, self.v_cache, token_slots, "
                   "positions, spans)`, every tensor on self.device (the tests check it with a stand-in device).",
                   how="one list per field (a token's id, position and slot; the spans; the rows), "
                   "filled in one loop over zip(batch.seqs, batch.num_new_tokens, batch.kv_slots), row being "
                   "the number of tokens packed so far; the lists of numbers made tensors with self._tensor."),
          Exercise("attention.py", "attention", ("attention",),
                   "the new keys and values written first, into this layer's cache (`ctx.k_cache[layer]`, and "
                   "v, [num_slots, kv_heads, max_model_len, head_dim]) at each token's slot and position; then "
                   "the output, shaped like q: each span of ctx.requests attends over its own slot's first "
                   "context_len positions, "
                   "with decode_attention for one row and prefill_attention for a chunk.",
                   how="`k_cache[ctx.token_slots, :, ctx.positions] = k`; `out = torch.empty_like(q)`; a span's "
                   "keys are `k_cache[span.kv_slot, :, : span.context_len]` (a view, no copy), its rows "
                   "`out[span.start : span.end]`."))),
    Step("the engine, the same tokens as m1", ("tests/m2/test_vs_m1.py",),
         "an integrity message (every batch is checked as it is scheduled, the bookkeeping after every step) "
         "names the rule that broke; 'output token T differs' means steps 1 and 2 held on their examples but "
         "a token was computed from other inputs than m1's: run the failing request alone through your "
         "prepare_inputs and compare its positions and context lengths with m1's"),
    contract("m2"),
)
# --8<-- [end:m2]
