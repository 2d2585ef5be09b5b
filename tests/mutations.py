"""Planted bugs the suite must catch: a catalogue of realistic mistakes, each applied to a scratch copy.

Each ``Mutation`` is a small, named bug a learner could write, given as an exact text
replacement in one milestone file, with the tests that must fail once it is planted.
``python -m tests.mutations`` copies the repository to a temporary folder, plants each
mutation there in turn, runs its tests, and prints a table: a mutation that no test
catches is a hole in the suite, and one whose text is no longer in the file (the code was
refactored) must be rewritten, not skipped. The exit status is 1 if either happens.

    python -m tests.mutations                 # every mutation
    python -m tests.mutations m3-victim-self  # the ones named
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COPIED = ("milestones", "tests", "pyproject.toml")  # what the tests need, nothing generated
TIMEOUT_SECONDS = 600


@dataclass(frozen=True, slots=True)
class Mutation:
    name: str
    path: str  # the file, relative to the repository root
    find: str  # exact text, which must occur exactly once
    replace: str
    tests: tuple[str, ...]  # the narrowest pytest arguments that fail with the mutation planted (CI's time)
    why: str  # the mistake, in a learner's words


# --8<-- [start:catalogue]
CATALOGUE = (
    Mutation(
        "m1-top-p-drops-crossing-token", "milestones/m1/sampler.py",
        "sorted_logits.masked_fill_(mass_before > p[:, None], float(\"-inf\"))",
        "sorted_logits.masked_fill_(mass_before + sorted_probs > p[:, None], float(\"-inf\"))",
        ("tests/m1/test_sampler.py",),
        "top-p also drops the token whose probability carries the mass past p",
    ),
    Mutation(
        "m1-repetition-ignores-prompt", "milestones/serving/logits_processors.py",
        "                seen[to_device(rows[i].prompt_token_ids, torch.long, self.device)] = True\n",
        "",
        ("tests/m1/test_penalties.py::test_each_penalty_on_hand_made_logits",),
        "the repetition penalty counts only the generated tokens, not the prompt's",
    ),
    Mutation(
        "m1-logprobs-after-penalties", "milestones/serving/logits_processors.py",
        "logprobs = self.logprobs(masked, rows, tokens)",
        "logprobs = self.logprobs(penalized, rows, tokens)",
        ("tests/m1/test_logprobs.py::test_penalties_and_temperature_leave_the_logprobs_alone",),
        "log-probabilities reported from the penalized logits instead of the model's own",
    ),
    Mutation(
        "m1-decode-attention-sums-in-bfloat16", "milestones/m1/attention.py",
        "    out = torch.bmm(scores.softmax(dim=-1), values.float())\n    return out.to(values.dtype).view(1, -1, dim)",
        "    out = torch.bmm(scores.softmax(dim=-1).to(values.dtype), values)\n    return out.view(1, -1, dim)",
        ("tests/m1/test_attention.py::test_decode_attention_in_bfloat16_sums_in_float32_and_rounds_once",),
        "the attention weights rounded to bfloat16 before they multiply the values, a rounding on every weight",
    ),
    Mutation(
        "kernels-m1-kernel-reads-before-the-write", "milestones/kernels/attention_backends.py",
        "        k_cache.index_copy_(0, ctx.slot_mapping, k)  # as the reference writes them\n"
        "        v_cache.index_copy_(0, ctx.slot_mapping, v)\n"
        "        return self.kernel(q, *self.pools(ctx, layer), rows.block_tables, rows.context_lens, "
        "q.shape[-1] ** -0.5)\n",
        "        out = self.kernel(q, *self.pools(ctx, layer), rows.block_tables, rows.context_lens, "
        "q.shape[-1] ** -0.5)\n"
        "        k_cache.index_copy_(0, ctx.slot_mapping, k)  # as the reference writes them\n"
        "        v_cache.index_copy_(0, ctx.slot_mapping, v)\n"
        "        return out\n",
        ("tests/kernels/test_decode_attention.py::test_m1_hands_a_decode_step_to_the_kernel_with_its_cache_as_blocks_of_"
         "one_row",),
        "the compiled kernel called before the step's key and value are in the cache: the new token misses itself",
    ),
    Mutation(
        "kernels-m1-kernel-given-the-cache-without-blocks", "milestones/kernels/attention_backends.py",
        "        return ctx.k_cache[layer][:, :, None], ctx.v_cache[layer][:, :, None]",
        "        return ctx.k_cache[layer], ctx.v_cache[layer]",
        ("tests/kernels/test_decode_attention.py::test_m1_hands_a_decode_step_to_the_kernel_with_its_cache_as_blocks_of_"
         "one_row",),
        "m1's caches handed to the compiled kernel as they are, [rows, kv_heads, dim]: it reads blocks of one row",
    ),
    Mutation(
        "kernels-fused-layer-attends-before-the-write", "milestones/kernels/fused_layers.py",
        "        q = ops.rope_and_write_kv(q, k, v, cos[:, 0], sin[:, 0], pool_k, pool_v, rows.slots)\n"
        "        out = self.attention.kernel(q, pool_k, pool_v, rows.block_tables, rows.context_lens, plan.scale)\n",
        "        out = self.attention.kernel(q, pool_k, pool_v, rows.block_tables, rows.context_lens, plan.scale)\n"
        "        q = ops.rope_and_write_kv(q, k, v, cos[:, 0], sin[:, 0], pool_k, pool_v, rows.slots)\n",
        ("tests/kernels/test_fused_layers.py::test_fused_layers_give_the_unfused_engine_s_outputs_bit_for_bit",),
        "a fused layer attends before RoPE and the KV write: the new token misses itself, and q is not rotated",
    ),
    Mutation(
        "kernels-fused-rope-turns-the-wrong-way", "milestones/kernels/rope.cpp",
        "b = round_to<T>(-hi * static_cast<float>(sin[i]))", "b = round_to<T>(hi * static_cast<float>(sin[i]))",
        ("tests/kernels/test_fused_layers.py::test_the_cpu_ops_are_the_lesson_s_operators_bit_for_bit",),
        "the compiled RoPE forgets rotate_half's minus: each pair turns by minus its angle in the first half",
    ),
    Mutation(
        "m1-rope-positions-on-the-default-device", "milestones/m1/model.py",
        'positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")',
        "positions = torch.arange(self.max_positions, dtype=torch.float32)",
        ("tests/m1/test_rope.py::test_the_tables_build_inside_the_meta_device_as_from_pretrained_builds_them",),
        "RoPE's positions made on the default device, which is the meta device while from_pretrained builds the model",
    ),
    Mutation(
        "serve-n-unbounded", "milestones/server/limits.py",
        "    if n > limits.max_n:\n",
        "    if False:\n",
        ("tests/test_serve_limits.py::test_n_above_the_limit_is_refused_before_the_engine_sees_it",),
        "any n accepted: one request with n=100000 took 0.7 GB and froze the server for every other client",
    ),
    Mutation(
        "serve-samples-counted-once", "milestones/engine_loop.py",
        '        weight = getattr(params, "n", 1)\n',
        "        weight = 1\n",
        ("tests/test_serve_limits.py::test_samples_count_toward_max_requests_and_a_503_says_when_to_retry",),
        "a request's n samples counted as one against --max-requests, so the server runs n times more than it says",
    ),
    Mutation(
        "m2-budget-ignored", "milestones/m2/scheduler.py",
        "        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)\n",
        "        num_new = seq.num_tokens - seq.num_computed_tokens\n",
        ("tests/m2/test_scheduler.py::test_budgets_are_respected_every_step",),
        "a prompt is scheduled whole, whatever is left of the step's token budget",
    ),
    Mutation(
        "m2-chunk-samples-midway", "milestones/m2/model_runner.py",
        "            if end == seq.num_tokens:  # the chunk reaches the end",
        "            if end > start:  # the chunk reaches the end",
        ("tests/m2/test_vs_m1.py::test_m2_matches_m1_on_a_mixed_workload",),
        "every chunk of a long prompt samples a token, not only the one that ends it",
    ),
    Mutation(
        "m2-prefills-before-decodes", "milestones/m2/scheduler.py",
        "key=lambda s: s.num_tokens - s.num_computed_tokens > 1)",
        "key=lambda s: s.num_tokens - s.num_computed_tokens == 1)",
        ("tests/m2/test_scheduler.py::test_decodes_are_never_stalled_by_a_long_prefill",),
        "unfinished prefills are scheduled before decodes: a long prompt stalls them",
    ),
    Mutation(
        "m2-positions-from-zero", "milestones/m2/model_runner.py",
        "            positions += range(start, end)\n", "            positions += range(num_new)\n",
        ("tests/m2/test_prepare_inputs.py::test_the_chapters_step_three_decodes_and_a_chunk",),
        "every request's new tokens are numbered from 0, as if nothing were cached before them",
    ),
    Mutation(
        "m2-context-is-the-chunk", "milestones/m2/model_runner.py",
        "span = RequestSpan(row, row + num_new, slot, end)", "span = RequestSpan(row, row + num_new, slot, num_new)",
        ("tests/m2/test_prepare_inputs.py::test_the_chapters_step_three_decodes_and_a_chunk",),
        "a request attends only to this step's tokens, not to those cached before them",
    ),
    Mutation(
        "kernels-decode-rows-dropped", "milestones/kernels/attention_backends.py",
        "        if (rows := ctx.metadata) is not None:\n            pool_k, pool_v",
        "        if (rows := ctx.metadata) is not None and False:\n            pool_k, pool_v",
        ("tests/m2/test_attention.py::test_a_decode_kernel_backend_takes_the_decodes_rows_after_the_cache_is_written",),
        "the kernel backend takes the decodes off ctx.requests but never attends to them: their rows get no output",
    ),
    Mutation(
        "m2-decodes-out-of-arrival-order", "milestones/m2/scheduler.py",
        "queue = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)",
        "queue = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.num_tokens))",
        ("tests/m2/test_scheduler.py::test_decodes_keep_arrival_order_whatever_their_length",),
        "the running requests are sorted by length as well, so arrival order is lost within the decodes",
    ),
    Mutation(
        "m2-prefill-first-holds-nothing-back", "milestones/m2/scheduler.py",
        "        return [seq for seq in queue if seq.num_tokens - seq.num_computed_tokens == 1]",
        "        return []",
        ("tests/m2/test_scheduler.py::test_prefill_first_holds_the_decodes_back_while_a_prefill_runs",),
        "batch_shape='prefill-first' is accepted but every step is mixed: the decodes share the prefill's budget",
    ),
    Mutation(
        "m3-prefill-first-decodes-never-run", "milestones/m3/scheduler.py",
        "        if not batch.seqs:  # no prefill to run: the decodes held back make the step\n",
        "        if False:  # no prefill to run: the decodes held back make the step\n",
        ("tests/m3/test_vs_m2.py::test_m3_with_prefill_first_steps_matches_m2",),
        "under prefill-first the held-back decodes never get a step: requests stop once their prompt is in",
    ),
    Mutation(
        "m1-prompt-logprobs-score-the-token-read", "milestones/serving/step_records.py",
        "seq.prompt_token_ids[start + 1 : stop + 1]", "seq.prompt_token_ids[start:stop]",
        ("tests/m1/test_logprobs.py::test_prompt_logprobs_match_transformers",),
        "a prompt row scores the token it reads, not the one it predicts",
    ),
    Mutation(
        "m2-prompt-rows-from-the-first-row", "milestones/m2/model_runner.py",
        "prompt_rows += PromptLogprobRows.of(seq, row, start, end)",
        "prompt_rows += PromptLogprobRows.of(seq, 0, start, end)",
        ("tests/m2/test_prepare_inputs.py::test_prompt_logprob_rows_start_at_the_requests_first_row",),
        "every request's prompt rows are read from the top of the packed batch",
    ),
    Mutation(
        "serving-prompt-scored-twice-after-preemption", "milestones/serving/outputs.py",
        "seq.prompt_logprobs += scores[len(seq.prompt_logprobs) - first :]", "seq.prompt_logprobs += scores",
        ("tests/m3/test_vs_m2.py::test_m3_matches_m2_under_heavy_preemption",),
        "a preempted request that recomputes its prompt appends the scores it already had",
    ),
    Mutation(
        "m4-prompt-logprobs-from-the-cache", "milestones/m4/scheduler.py",
        "seq.token_ids[:-1] if seq.params.prompt_logprobs is None else []", "seq.token_ids[:-1]",
        ("tests/m4/test_vs_m3.py::test_a_request_asking_for_its_prompts_logprobs_computes_the_prompt_the_cache_holds",),
        "a request asking for its prompt's log-probabilities takes cached blocks, whose tokens then have no score",
    ),
    Mutation(
        "m1-samples-share-a-seed", "milestones/serving/parallel_sampling.py",
        "            seed += index\n", "",
        ("tests/m1/test_parallel_sampling.py::test_sample_i_is_the_request_alone_with_seed_plus_i",),
        "every sample of a seeded request gets the request's seed, so n samples are one sample n times",
    ),
    Mutation(
        "m4-held-samples-never-released", "milestones/m4/engine.py",
        "        for seq in self.parents.release_held(outputs):  # m4: the first sample's prompt is computed\n"
        "            self.scheduler.add(seq)\n", "",
        ("tests/m4/test_vs_m3.py::test_the_samples_of_one_prompt_share_it_through_the_cache",),
        "the samples held back while the first computes the prompt are never scheduled",
    ),
    Mutation(
        "m1-grammar-never-advanced", "milestones/serving/logits_processors.py",
        "        self.advance_grammars(rows, tokens)\n", "",
        ("tests/m1/test_structured_output.py::test_every_token_is_one_the_grammar_accepts",),
        "the grammar never reads the tokens picked, so every step masks as if the output had just begun",
    ),
    Mutation(
        "m3-slot-off-by-one", "milestones/m3/model_runner.py",
        "table[p // block_size] * block_size + p % block_size for p in range(start, end)",
        "table[p // block_size] * block_size + (p + 1) % block_size for p in range(start, end)",
        ("tests/m3/test_vs_m2.py::test_m3_matches_m2",),
        "a token's key and value are written one slot away from where attention reads them",
    ),
    Mutation(
        "m3-blocks-rounded-down", "milestones/m3/block_manager.py",
        "return -(-num_tokens // self.block_size)  # ceiling division",
        "return num_tokens // self.block_size  # ceiling division",
        ("tests/m3/test_block_manager.py::test_tables_grow_block_by_block",),
        "a request gets a block per full block of tokens, none for the partly filled last one",
    ),
    Mutation(
        "m3-free-leaks-blocks", "milestones/m3/block_manager.py",
        "self.free_blocks.extend(self.block_tables.pop(request_id, ()))",
        "self.block_tables.pop(request_id, ())",
        ("tests/m3/test_block_manager.py::test_tables_grow_block_by_block",),
        "a finished request's blocks are forgotten instead of returned to the free list",
    ),
    Mutation(
        "m3-admit-without-headroom", "milestones/m3/admission.py",
        "            return 1  # the block its next tokens will need",
        "            return 0  # the block its next tokens will need",
        ("tests/m3/test_scheduler.py::test_admission_leaves_one_free_block_per_running_request",),
        "admission takes every free block, leaving the running requests no room to grow",
    ),
    Mutation(
        "m3-victim-self", "milestones/m3/scheduler.py",
        "victim = max(queue, key=self.running.index) if queue else seq", "victim = seq",
        ("tests/m3/test_vs_m2.py::test_the_victim_is_the_latest_admitted_request_not_yet_scheduled",),
        "a request that cannot grow preempts itself instead of the latest admitted one",
    ),
    Mutation(
        "m3-preempt-keeps-computed", "milestones/m3/scheduler.py",
        "        seq.num_computed_tokens = 0\n", "",
        ("tests/m3/test_vs_m2.py::test_m3_matches_m2_under_heavy_preemption",),
        "preemption frees the blocks but forgets that their tokens must be computed again",
    ),
    Mutation(
        "m3-victim-to-the-back", "milestones/m3/scheduler.py",
        "self.waiting.appendleft(seq)", "self.waiting.append(seq)",
        ("tests/m3/test_scheduler.py::test_the_victim_is_the_latest_admitted_request_not_yet_scheduled_and_goes_to_the_front",),
        "a preempted request joins the back of the waiting queue, behind requests that never ran",
    ),
    Mutation(
        "m3-admit-after-preempting", "milestones/m3/admission.py",
        'reason = "preempted" if preempted else', 'reason = "preempted" if False else',
        ("tests/m3/test_scheduler.py::test_the_victim_is_the_latest_admitted_request_not_yet_scheduled_and_goes_to_the_front",),
        "a step that has just preempted a request admits waiting ones anyway, the victim among them",
    ),
    Mutation(
        "m3-headroom-counts-newcomer", "milestones/m3/admission.py",
        "<= available - held:", "< available - held:",
        ("tests/m3/test_scheduler.py::test_the_headroom_counts_the_requests_already_running_not_the_newcomer",),
        "the headroom keeps a block for the newcomer too, so fewer requests run than the rule allows",
    ),
    Mutation(
        "m3-self-victim-still-scheduled", "milestones/m3/scheduler.py",
        "                if victim is seq:\n                    break\n",
        "                if victim is seq:\n                    continue\n",
        ("tests/m3/test_scheduler.py::test_a_request_with_no_victim_left_preempts_itself_and_is_left_out_of_the_step",),
        "a request that preempts itself is scheduled anyway, from the waiting queue",
    ),
    Mutation(
        "m3-ratio-never-decays", "milestones/m3/admission.py",
        "self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)",
        "self.new_token_ratio = max(self.new_token_ratio, self.min_new_token_ratio)",
        ("tests/m3/test_admission.py::test_later_requests_are_admitted_as_the_ratio_decays",),
        "SGLang's ratio never decays: admission stays as careful as its first guess, however well memory holds",
    ),
    Mutation(
        "m3-outputs-not-charged", "milestones/m3/admission.py",
        "return self.held_back(seq, num_blocks, ratio=1.0)", "return self.held_back(seq, num_blocks, ratio=0.0)",
        ("tests/m3/test_admission.py::test_the_reservation_charges_a_newcomer_its_whole_prompt_and_output",),
        "the reservation charges a newcomer its prompt only, not the output it may produce",
    ),
    Mutation(
        "m3-retract-most-outputs-first", "milestones/m3/admission.py",
        "key=lambda s: (s.num_output_tokens, -s.num_prompt_tokens))",
        "key=lambda s: (-s.num_output_tokens, -s.num_prompt_tokens))",
        ("tests/m3/test_admission.py::test_the_victim_order_is_sglangs",
         "tests/m3/test_admission.py::test_retraction_comes_before_the_step_and_takes_sglangs_victim"),
        "retraction sends back the request with the most output first, the seed note's reading, not SGLang's code",
    ),
    Mutation(
        "m3-first-in-blocks", "milestones/m3/model_runner.py",
        "span.first = len(block_tables) * block_size", "span.first = len(block_tables)",
        ("tests/m3/test_prepare_inputs.py::test_the_chapters_pool_two_whole_prompts_and_a_chunk_that_stops_midway",),
        "a span's first counts the blocks before it, not their tokens: later requests read another's keys",
    ),
    Mutation(
        "m4-lpm-no-op", "milestones/m4/policies.py",
        'if policy == "lpm" and tree is not None and len(waiting) <= LPM_MAX_WAITING:',
        'if False and policy == "lpm" and tree is not None and len(waiting) <= LPM_MAX_WAITING:',
        ("tests/m4/test_scheduler.py::test_lpm_sorts_by_cached_length_without_changing_the_tree",),
        "the longest-prefix-match policy accepted but never applied",
    ),
    Mutation(
        "m4-dfs-weight-lightest-first", "milestones/m4/policies.py",
        "key=lambda c: weight[c])]  # heaviest on top", "key=lambda c: -weight[c])]  # heaviest on top",
        ("tests/m4/test_scheduler.py::test_dfs_weight_admits_the_busiest_branch_first_and_each_branch_together",),
        "dfs-weight walks the lightest branch of the tree first: requests sharing the busiest prefix wait",
    ),
    Mutation(
        "m4-evict-locked", "milestones/m4/radix_tree.py",
        "if not n.children and n.lock_ref == 0]", "if not n.children and n is not self.root]",
        ("tests/m4/test_radix_tree.py::test_locked_paths_are_never_evicted_and_eviction_is_lru",),
        "eviction that ignores the locks of running requests",
    ),
    Mutation(
        "m4-match-whole-prompt", "milestones/m4/scheduler.py",
        "match_prefix(seq.token_ids[:-1] if", "match_prefix(seq.token_ids if",
        ("tests/m4/test_vs_m3.py::test_trap_fully_cached_prompt_still_computes_its_last_token",),
        "a fully cached prompt is matched to its end, leaving no token whose logits give the next one",
    ),
    Mutation(
        "m4-cache-without-hold", "milestones/m4/scheduler.py",
        "        for block in adopted:\n            self.block_manager.hold(block)\n",
        "",
        ("tests/m4/test_cache_steps.py::test_a_running_requests_blocks_are_cached_at_the_start_of_the_next_step",),
        "blocks the tree takes over gain no holder, so they are freed while the tree still serves them",
    ),
    Mutation(
        "m4-cache-keeps-old-lock", "milestones/m4/scheduler.py",
        "        self.tree.lock(node)\n        self.tree.unlock(self.locked[seq.request_id])\n",
        "        self.tree.lock(node)\n",
        ("tests/m4/test_cache_steps.py::test_a_running_requests_blocks_are_cached_at_the_start_of_the_next_step",),
        "a request that extends its cached path locks the new end but never unlocks the old one",
    ),
    Mutation(
        "m4-cache-keeps-duplicates", "milestones/m4/scheduler.py",
        "        self.block_manager.use_cached(seq.request_id, path_blocks(node))\n",
        "",
        ("tests/m4/test_cache_steps.py::"
         "test_a_request_computing_a_prompt_the_tree_holds_keeps_one_copy_and_finishes_in_a_tight_pool",),
        "a request that computed a prefix the tree already held keeps its own copies and locks the tree's too",
    ),
    Mutation(
        "m4-evict-most-recent", "milestones/m4/radix_tree.py",
        "leaves = [(n.last_access, id(n), n)", "leaves = [(-n.last_access, id(n), n)",
        ("tests/m4/test_radix_tree.py::test_locked_paths_are_never_evicted_and_eviction_is_lru",),
        "eviction drops the most recently used leaf first instead of the least",
    ),
    Mutation(
        "m4-split-loses-locks", "milestones/m4/radix_tree.py",
        "lock_ref=child.lock_ref, last_access=child.last_access)", "lock_ref=0, last_access=child.last_access)",
        ("tests/m4/test_radix_tree.py::test_evictable_count_follows_inserts_splits_locks_and_evictions",),
        "splitting a locked edge leaves its upper half unlocked and open to eviction",
    ),
    Mutation(
        "m4-lock-recounts-locked-nodes", "milestones/m4/radix_tree.py",
        "            if node.lock_ref == 0:\n                self.num_evictable_blocks -= len(node.blocks)\n"
        "            node.lock_ref += 1",
        "            self.num_evictable_blocks -= len(node.blocks)\n            node.lock_ref += 1",
        ("tests/m4/test_radix_tree.py::test_two_requests_on_the_same_path_take_its_blocks_off_the_count_once",),
        "every lock takes the node's blocks off num_evictable_blocks, not only the one that leaves lock_ref 0",
    ),
    Mutation(
        "m4-evict-even-if-not-enough", "milestones/m4/scheduler.py",
        "if missing > 0 and self.tree is not None and missing <= self.tree.num_evictable_blocks:",
        "if missing > 0 and self.tree is not None:",
        ("tests/m4/test_cache_steps.py::test_a_request_that_will_not_fit_anyway_leaves_the_cache_alone",),
        "a request that will not fit even after eviction empties the cache anyway, and still waits",
    ),
    Mutation(
        "m4-preempt-instead-of-evicting", "milestones/m4/scheduler.py",
        "if missing > 0 and self.tree is not None and missing <= self.tree.num_evictable_blocks:", "if False:",
        ("tests/m4/test_cache_steps.py::test_cached_blocks_are_evicted_least_recently_used_first_before_anyone_is_preempted",),
        "cached blocks are never evicted: requests are preempted while the cache holds blocks nobody uses",
    ),
    Mutation(
        "m4-hit-not-counted", "milestones/m4/scheduler.py",
        "seq.num_computed_tokens = seq.num_cached_tokens = len(blocks) * self.config.block_size",
        "seq.num_computed_tokens = len(blocks) * self.config.block_size",
        ("tests/m4/test_cache_steps.py::test_the_chapters_worked_example_block_by_block",),
        "a cache hit skips the matched tokens but is not counted in num_cached_tokens (nor in the hit rate)",
    ),
    Mutation(
        "m4-match-without-lock", "milestones/m4/scheduler.py",
        "        self.block_manager.share(seq.request_id, blocks)\n        self.tree.lock(node)\n",
        "        self.block_manager.share(seq.request_id, blocks)\n",
        ("tests/m4/test_cache_steps.py::test_the_chapters_worked_example_block_by_block",),
        "a request keeps the node of its match in self.locked without locking it, so the path it reads is evictable",
    ),
    Mutation(
        "m4-match-not-stamped", "milestones/m4/radix_tree.py",
        "            node = child\n            node.last_access = next(self._clock)\n",
        "            node = child\n",
        ("tests/m4/test_radix_tree.py::test_locked_paths_are_never_evicted_and_eviction_is_lru",),
        "a match does not mark the nodes it uses as recently used, so eviction takes a prefix just reused",
    ),
    Mutation(
        "m5-padding-writes-slot-0", "milestones/m5/graph_runner.py",
        "inputs.slots + [self.scratch_slot] * pad", "inputs.slots + [0] * pad",
        ("tests/m5/test_padded_inputs.py::test_a_batch_of_three_is_padded_to_the_bucket_of_four_with_scratch_rows",),
        "the padding rows of a replayed batch write their keys and values into a real block",
    ),
    Mutation(
        "m5-tables-padded-with-block-0", "milestones/m5/graph_runner.py",
        "        rows[:size] = self.scratch_block", "        rows[:size] = 0",
        ("tests/m5/test_padded_inputs.py::test_a_batch_of_three_is_padded_to_the_bucket_of_four_with_scratch_rows",),
        "a real row's unused table entries point at block 0, a real request's, not at the scratch block",
    ),
    Mutation(
        "m5-padding-rows-keep-old-tables", "milestones/m5/graph_runner.py",
        "        rows[:size] = self.scratch_block", "        rows[: len(tables)] = self.scratch_block",
        ("tests/m5/test_padded_inputs.py::test_a_small_batch_after_a_large_one_leaves_nothing_of_it_in_the_buffers",),
        "only the real rows' tables are written, so the padding rows keep a larger batch's old tables",
    ),
    Mutation(
        "m5-always-the-largest-bucket", "milestones/m5/graph_runner.py",
        "        size = next(s for s in self.sizes if s >= num_rows)", "        size = self.sizes[-1]",
        ("tests/m5/test_padded_inputs.py::test_a_small_batch_after_a_large_one_leaves_nothing_of_it_in_the_buffers",),
        "every batch is padded to the largest bucket, not to the smallest that holds it",
    ),
    Mutation(
        "m5-stale-positions", "milestones/m5/graph_runner.py",
        "        self._fill(self.positions, size, inputs.positions + [0] * pad)\n", "",
        ("tests/m5/test_vs_m4.py::test_m5_matches_m4_on_a_mixed_workload",),
        "a replay reads the positions its static buffer held at capture, not this step's",
    ),
    Mutation(
        "m5-dispatch-full-for-any-decode", "milestones/m5/dispatcher.py",
        "            elif batch.num_tokens <= self.decode[-1]:  # a row a token\n",
        "            elif True:\n",
        ("tests/m5/test_dispatcher.py::test_a_decode_step_larger_than_every_captured_batch_goes_to_the_pieces",),
        "a decode step larger than every captured batch is sent to the full graphs, which have no bucket for it",
    ),
    Mutation(
        "m5-pieces-attend-to-the-padding", "milestones/m5/piecewise.py",
        "            cut.out[:n] = self.attention.forward(cut.q[:n], cut.k[:n], cut.v[:n], layer, ctx)\n",
        "            cut.out[:] = self.attention.forward(cut.q, cut.k, cut.v, layer, ctx)\n",
        ("tests/m5/test_dispatcher.py::test_a_piecewise_replay_runs_the_pieces_in_order_with_attention_on_the_real_tokens_"
         "between",),
        "a replay in pieces hands attention the padding rows too: their keys and values would be written somewhere",
    ),
    Mutation(
        "m5-paged-decode-scores-in-bfloat16", "milestones/m5/attention.py",
        "scores = torch.matmul(q, keys.float().transpose(2, 3)) * scale",
        "scores = torch.matmul(q, keys.transpose(2, 3).to(q.dtype)).to(keys.dtype).float() * scale",
        ("tests/m5/test_paged_decode_attention.py",),
        "the captured step's scores rounded to the cache's dtype, where the kernel keeps them in float32",
    ),
    Mutation(
        "m6-penalty-history-unresolved", "milestones/m6/model_runner.py",
        "LogitsProcessors(config.device, resolve=self.future_map.resolve_)", "LogitsProcessors(config.device)",
        ("tests/m6/test_vs_m5.py::test_m6_matches_m5_on_a_mixed_workload",),
        "m6 does not tell the serving layer that a penalty's history may end in a future id: a penalty counts the id "
        "the host wrote for the token still on the device",
    ),
    Mutation(
        "m6-penalty-history-known-only", "milestones/m6/step.py",
        "output = tuple(seq.token_ids[seq.num_prompt_tokens :]) if seq.params.has_penalties else ()",
        "output = tuple(seq.output_token_ids) if seq.params.has_penalties else ()",
        ("tests/m6/test_sampling_row.py",),
        "a penalty's history leaves out the token the previous step is still computing",
    ),
    Mutation(
        "m6-future-off-by-one", "milestones/m6/future_map.py",
        "found = self.tokens[(-1 - input_ids).clamp(min=0)]", "found = self.tokens[(-input_ids).clamp(min=0)]",
        ("tests/m6/test_future_map.py::test_resolve_replaces_only_future_ids_by_their_stored_tokens",),
        "a future id is resolved to the token in the next slot of the future map",
    ),
    Mutation(
        "m6-keep-lag-token", "milestones/m6/engine.py",
        "            if seq.is_finished:  # it finished (or was aborted) while this step computed: "
        "the token is dropped\n                continue\n",
        "",
        ("tests/m6/test_process.py::test_a_request_that_stops_leaves_at_once_without_the_token_in_flight",),
        "the token a finished request's lag step computed is kept",
    ),
    Mutation(
        "m6-cache-unprocessed-blocks", "milestones/m6/scheduler.py",
        "num_blocks = seq.num_processed_tokens // self.config.block_size",
        "num_blocks = seq.num_computed_tokens // self.config.block_size",
        ("tests/m6/test_vs_m5.py::test_blocks_a_failed_step_was_to_fill_never_reach_the_prefix_cache",),
        "blocks of a step still in flight enter the prefix cache before anything is written in them",
    ),
    Mutation(
        "m6-roll-back-keeps-computed", "milestones/m6/rollback.py",
        "                seq.num_computed_tokens = computed\n", "                pass\n",
        ("tests/m6/test_vs_m5.py::test_a_failed_step_is_undone_so_stepping_on_gives_m5s_tokens",),
        "a failed step's tokens stay counted as computed, so they are never computed again",
    ),
    Mutation(
        "m6-step-not-counted", "milestones/m6/engine.py",
        "        self.num_steps += 1\n        for seq, before, computed in zip(",
        "        for seq, before, computed in zip(",
        ("tests/m6/test_process.py::test_each_processed_step_is_counted_and_traced",),
        "a processed step is not counted, so num_steps and the reports built on it stay at 0",
    ),
    Mutation(
        "m6-process-not-traced", "milestones/m6/engine.py",
        '        self.tracer.record("process", start, launched.number, len(launched.seqs))\n', "",
        ("tests/m6/test_process.py::test_each_processed_step_is_counted_and_traced",),
        "processing a step leaves no 'process' event in the trace, so the overlap cannot be measured",
    ),
    Mutation(
        "m6-processed-for-preempted", "milestones/m6/engine.py",
        "            if seq.status is SequenceStatus.RUNNING:  # not preempted or finished since: the blocks are still "
        "its own\n",
        "            if True:\n",
        ("tests/m6/test_process.py::test_a_request_preempted_while_its_step_computes_gets_no_processed_tokens",),
        "a request preempted while its step computed counts that step's tokens as written, in blocks it gave back",
    ),
    Mutation(
        "m6-finished-keeps-pending", "milestones/m6/engine.py",
        "                drop_pending_tokens(seq)  # the step in flight computes one token too many for it\n",
        "",
        ("tests/m6/test_process.py::test_a_request_that_stops_leaves_at_once_without_the_token_in_flight",),
        "a request that stops keeps the future id of the step in flight in its tokens",
    ),
    Mutation(
        "m6-undo-only-exceptions", "milestones/m6/engine.py",
        "        except BaseException:  # the step raised, or the wait for it was interrupted (Ctrl-C)",
        "        except Exception:",
        ("tests/m6/test_process.py::test_a_step_whose_result_raises_is_undone_and_the_error_reaches_the_caller",),
        "a wait interrupted by Ctrl-C (a BaseException) leaves the step booked: its future ids stay in the requests",
    ),
    Mutation(
        "serving-mask-not-applied", "milestones/serving/logits_processors.py",
        "masked = self.apply_grammars(logits, rows)", "masked = logits",
        ("tests/m1/test_structured_output.py::test_every_token_is_one_the_grammar_accepts",),
        "the grammar reads every token picked but masks none: the sampler picks from the whole vocabulary",
    ),
    Mutation(
        "m7-guesses-for-structured-requests", "milestones/m7/proposer.py",
        "    if seq.grammar is not None:\n        return 0", "    if False:\n        return 0",
        ("tests/m7/test_vs_m6.py::test_m7_matches_m6",),
        "structured requests get guesses, whose rows the grammar cannot mask without reading the guesses first",
    ),
    Mutation(
        "m7-ngram-shortest-first", "milestones/m7/proposer.py",
        "        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):",
        "        for n in range(self.min_n, min(self.max_n, length - 1) + 1):",
        ("tests/m7/test_proposer.py::test_the_latest_earlier_occurrence_of_the_longest_suffix_wins",),
        "the proposer tries the shortest suffix first, so a single repeated token beats a longer match",
    ),
    Mutation(
        "m7-ngram-index-keeps-earliest", "milestones/m7/proposer.py",
        "index[tuple(token_ids[after - n : after])] = after",
        "index.setdefault(tuple(token_ids[after - n : after]), after)",
        ("tests/m7/test_proposer.py::test_the_index_guesses_what_propose_guesses_as_tokens_come",),
        "the index keeps a run's first occurrence, not its latest, so it guesses what followed the oldest copy",
    ),
    Mutation(
        "m7-ngram-index-reads-suffix", "milestones/m7/proposer.py",
        "for end in range(seq.spec.num_ngram_indexed, length - 1):",
        "for end in range(seq.spec.num_ngram_indexed, length):",
        ("tests/m7/test_proposer.py::test_the_index_guesses_what_propose_guesses_as_tokens_come",),
        "the index takes in the suffix itself, whose next token is not known, so the suffix matches itself: no guess",
    ),
    Mutation(
        "m7-ngram-index-keeps-after-cut", "milestones/m7/proposer.py",
        "if length - 1 < seq.spec.num_ngram_indexed:", "if False:",
        ("tests/m7/test_proposer.py::test_the_index_guesses_what_propose_guesses_as_tokens_come",),
        "the index keeps runs of tokens the request no longer has, and guesses from them",
    ),
    Mutation(
        "m7-lookahead-kept-on-rejection", "milestones/m7/speculation.py",
        "            seq.spec.num_lookahead = max(self.proposer.min_lookahead, seq.spec.num_lookahead // 2)",
        "            pass",
        ("tests/m7/test_guesses.py::test_a_rejected_guess_voids_the_rows_after_it_trims_and_halves_the_lookahead",),
        "a rejected guess leaves the lookahead as it was, so a request keeps paying for guesses that fail",
    ),
    Mutation(
        "m7-kept-guess-not-counted", "milestones/m7/speculation.py",
        "            self.num_accepted_tokens += 1\n", "",
        ("tests/m7/test_guesses.py::test_a_kept_guess_is_counted_and_raises_the_lookahead_up_to_num_speculative_tokens",),
        "a kept guess counts for the request but not for the engine, so spec_stats under-reports acceptance",
    ),
    Mutation(
        "m7-shrink-keeps-a-block", "milestones/m7/block_manager.py",
        "        while len(table) > self.blocks_needed(num_tokens):",
        "        while len(table) > self.blocks_needed(num_tokens) + 1:",
        ("tests/m7/test_guesses.py::test_shrink_lets_go_of_the_blocks_past_the_tokens",),
        "shrink keeps one block too many, so blocks that only rejected guesses reached stay taken",
    ),
    Mutation(
        "m7-decode-row-sees-later-guesses", "milestones/m7/model_runner.py",
        "                inputs.context_lens.append(position + 1)",
        "                inputs.context_lens.append(seq.num_computed_tokens + len(tokens))",
        ("tests/m7/test_decode_rows.py::test_rows_of_a_replayed_checking_step_one_per_token_and_guess",),
        "each row of a replayed checking step attends to the whole step, so a guess sees the guesses after it",
    ),
    Mutation(
        "m7-keep-rows-after-a-rejection", "milestones/m7/speculation.py",
        "            drop_pending_tokens(seq)\n            self.scheduler.trim(seq)",
        "            self.scheduler.trim(seq)",
        ("tests/m7/test_guesses.py::test_a_rejected_guess_voids_the_rows_after_it_trims_and_halves_the_lookahead",),
        "after a rejected guess the next rows' tokens are accepted too, though they read a wrong token",
    ),
    Mutation(
        "m7-rejected-blocks-kept", "milestones/m7/scheduler.py",
        "        self.block_manager.shrink(seq.request_id, seq.num_tokens)\n", "        pass\n",
        ("tests/m7/test_guesses.py::test_trim_shrinks_to_the_tokens_and_counts_the_drafts_keys_back",),
        "the blocks that only rejected guesses reached stay in the request's table",
    ),
    Mutation(
        "m7-one-noise-per-step", "milestones/m7/step.py",
        "return cls(seq.params, seq.seed, position + 1, seq.prompt_token_ids, output, seq.grammar, guess, q)",
        "return cls(seq.params, seq.seed, seq.num_tokens, seq.prompt_token_ids, output, seq.grammar, guess, q)",
        ("tests/m7/test_vs_m6.py::test_m7_matches_m6",),
        "every row of a request draws the noise of its first, not of the position it samples",
    ),
    Mutation(
        "m7-draft-guess-judged-as-certain", "milestones/m7/sampler.py",
        "drawn_from = torch.stack([row.guess_probs for row in rows]) if rows[0].guess_probs is not None else None",
        "drawn_from = None",
        ("tests/m7/test_rejection.py::test_the_engine_keeps_the_models_distribution_under_rejection",),
        "a draft's guess is judged as if it were certain: the distribution holds, but fewer guesses are kept",
    ),
    Mutation(
        "m7-cache-rejected-tokens", "milestones/m7/rollback.py",
        "    seq.num_processed_tokens = min(seq.num_processed_tokens, seq.num_computed_tokens)\n", "",
        ("tests/m7/test_vs_m6.py::test_every_stop_rule_inside_an_accepted_run",),
        "the rows after a rejected guess still count as processed, so the prefix cache may take their blocks",
    ),
    Mutation(
        "m7-draft-kv-kept-after-a-rejection", "milestones/m7/scheduler.py",
        "        seq.spec.num_drafted_tokens = min(seq.spec.num_drafted_tokens, seq.num_tokens - 1)\n", "",
        ("tests/m7/test_guesses.py::test_trim_shrinks_to_the_tokens_and_counts_the_drafts_keys_back",),
        "the draft model's keys and values of a rejected guess stay counted, though the model's pick replaced it",
    ),
    Mutation(
        "m7-cache-blocks-the-draft-never-wrote", "milestones/m7/scheduler.py",
        "            written = min(written, seq.spec.num_drafted_tokens)\n", "            pass\n",
        ("tests/m7/test_draft_model.py::test_a_block_waits_for_the_drafts_last_guess_before_it_is_cached",),
        "the prefix cache takes blocks whose draft-model keys and values were never written",
    ),
    Mutation(
        "m7-draft-only-when-guessing", "milestones/m7/engine.py",
        "        if batch is not None:\n            self.speculator.propose(batch)",
        "        if batch is not None and batch.guess_rooms:\n            self.speculator.propose(batch)",
        ("tests/m7/test_draft_model.py::test_a_request_that_never_guesses_has_its_prompt_cached",),
        "the draft runs only in steps with guesses, so the blocks of requests that never guess are never cached",
    ),
    Mutation(
        "m7-draft-whole-prompt-at-once", "milestones/m7/drafter.py",
        "DraftView(seq.token_ids[: seq.num_computed_tokens + num_new],", "DraftView(list(seq.token_ids),",
        ("tests/m7/test_draft_model.py::test_each_draft_pass_stays_within_the_step_budget",),
        "the draft computes the rest of a request's prompt at once, not the target's chunk, past the step's budget",
    ),
    Mutation(
        "m7-draft-count-kept-after-a-failed-step", "milestones/m7/rollback.py",
        "                seq.spec.num_drafted_tokens = min(seq.spec.num_drafted_tokens, computed)",
        "                pass",
        ("tests/m7/test_draft_model.py::test_a_failed_step_is_undone_for_the_draft_too",),
        "a step that raises is undone for the target only: the draft counts the chunk as computed, ahead of it",
    ),
    Mutation(
        "m7-guess-row-reads-later-guesses", "milestones/m7/model_runner.py",
        "span.block_table, start + i + 1)", "span.block_table, end)",
        ("tests/m7/test_vs_m6.py::test_m7_matches_m6",),
        "each row of a checking step attends to the whole step, so a guess sees the guesses after it",
    ),
    Mutation(
        "m7-rejection-without-residual", "milestones/m7/sampler.py",
        "    residual = (probs - q).clamp(min=0)", "    residual = probs",
        ("tests/m7/test_rejection.py::test_the_tokens_follow_the_targets_probabilities_whatever_the_draft",),
        "a rejected guess is replaced by a draw from the model's probabilities, not from what the guess left over",
    ),
    Mutation(
        "m8-no-all-reduce-after-o-proj", "milestones/m8/model.py",
        "x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, ctx))",
        "x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)",
        ("tests/m8/test_sharding.py::test_sharded_logits_match_one_rank",),
        "each rank adds only its own heads' share of o_proj's output: the all-reduce after attention is left out",
    ),
    Mutation(
        "m8-replicated-kv-head-by-rank-modulo", "milestones/m8/distributed.py",
        "head = self.rank * num_kv_heads // self.size", "head = self.rank % num_kv_heads",
        ("tests/m8/test_sharding.py::test_kv_heads_are_replicated_where_ranks_outnumber_them",
         "tests/m8/test_sharding.py::test_sharded_logits_match_one_rank"),
        "with more ranks than KV heads, rank r holds KV head r mod the KV heads, not the one its query heads read",
    ),
    Mutation(
        "m8-embedding-of-others-tokens-not-zeroed", "milestones/m8/model.py",
        "return torch.where(mine[:, None], F.embedding(local * mine, self.weight), 0)",
        "return F.embedding(local * mine, self.weight)",
        ("tests/m8/test_sharding.py::test_sharded_logits_match_one_rank",),
        "a rank looks up its first row for a token of another rank's part of the vocabulary, which the sum then adds",
    ),
    Mutation(
        "m8-ranks-disagree-on-the-block-table", "milestones/m8/model_runner.py",
        "forward = replace(step.forward, sample_seqs=[]) if",
        "forward = replace(step.forward, sample_seqs=[], block_tables=step.forward.block_tables[::-1]) if",
        ("tests/m8/test_vs_m7.py::test_two_ranks_overlapped_match_m7",),
        "the other ranks read a step's blocks in another order than rank 0: each rank's keys and values of a request "
        "come from different blocks",
    ),
    Mutation(
        "m9-block-sent-to-the-wrong-slot", "milestones/m9/disaggregation.py",
        "        self.k_cache[:, :, table] = kv[0]\n        self.v_cache[:, :, table] = kv[1]\n",
        "        self.k_cache[:, :, table[::-1]] = kv[0]\n        self.v_cache[:, :, table[::-1]] = kv[1]\n",
        ("tests/m9/test_transfer.py::test_the_blocks_that_arrive_are_those_the_prefill_worker_computed",),
        "the decode worker writes the arrived blocks into its reserved blocks last to first: the prompt's keys and "
        "values are all there, each in another block than the one its tokens' positions read",
    ),
    Mutation(
        "m9-reservation-never-released", "milestones/m9/scheduler.py",
        "        elif self.reserved.pop(seq.request_id, None) is not None:  # m9: its KV never arrived\n"
        "            self.block_manager.free(seq.request_id)\n",
        "        elif self.reserved.pop(seq.request_id, None) is not None:  # m9: its KV never arrived\n"
        "            pass\n",
        ("tests/m9/test_transfer.py::test_a_request_aborted_on_either_side_gives_its_blocks_back",),
        "a request aborted while its blocks are reserved on the decode side leaves the reservation, but the blocks "
        "stay taken: the decode pool shrinks with every such abort",
    ),
    Mutation(
        "m9-router-ignores-its-tree", "milestones/m9/router.py",
        "            if matches[best] > CACHE_THRESHOLD * len(token_ids):\n",
        "            if False:\n",
        ("tests/m9/test_router.py::test_cache_aware_sends_a_prompt_where_its_prefix_went",),
        "cache-aware routing never picks the worker that holds the prompt's prefix, only the smallest tree: a "
        "shared system prompt is recomputed on every worker",
    ),
    Mutation(
        "m9-decode-side-never-guesses", "milestones/m9/scheduler.py",
        "        self._start_guessing(seq)\n"
        "        seq.num_computed_tokens = seq.num_processed_tokens",
        "        seq.spec.num_lookahead = 0\n"
        "        seq.num_computed_tokens = seq.num_processed_tokens",
        ("tests/m9/test_vs_m8.py::test_guessing_on_the_decode_side_and_preempting_on_both",),
        "a request that arrives on the decode worker starts with no lookahead, and a kept guess is what raises it: "
        "the decode side never guesses (its tokens are still m8's, only slower)",
    ),
    Mutation(
        "q4_1-kernel-nibble-order", "milestones/kernels/quant_linear.cpp",
        "nibbles(q + j * PANEL, q0, q1);",
        "nibbles(q + j * PANEL, q1, q0);",
        ("tests/kernels/test_quant_linear.py::test_outputs_are_the_product_with_the_de_quantized_weights_within_the_"
         "factored_sum_s_bound",),
        "the kernel takes a byte's high 4 bits for the first k of the pair and the low 4 for the second",
    ),
    Mutation(
        "q4_1-kernel-minimum-not-times-the-sum", "milestones/kernels/quant_linear.cpp",
        "    sum += m * x_sum;",
        "    sum += m;",
        ("tests/kernels/test_quant_linear.py::test_outputs_are_the_product_with_the_de_quantized_weights_within_the_"
         "factored_sum_s_bound",),
        "the block's minimum added once, not once for each of its weights: m * sum(x) is sum(m * x)",
    ),
    Mutation(
        "q4_1-packing-nibble-order", "milestones/kernels/quant_blocks.py",
        "q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)",
        "q = torch.cat([nibbles >> 4, nibbles & 15], dim=-1)",
        ("tests/kernels/test_quant_linear.py::test_packed_blocks_de_quantize_to_gguf_py_s_weights",),
        "the file's byte i is read as weights i + 16 (low bits) and i (high bits): the halves of every block swapped",
    ),
    Mutation(
        "q4_1-dequantize-minimum-dropped", "milestones/kernels/quant_blocks.py",
        "w = d[:, :, None] * q + m[:, :, None]",
        "w = d[:, :, None] * q",
        ("tests/kernels/test_quant_linear.py::test_packed_blocks_de_quantize_to_gguf_py_s_weights",),
        "the check's de-quantization forgets the minimum, so it compares the file with weights it does not hold",
    ),
)
# --8<-- [end:catalogue]


def plant(scratch: Path, mutation: Mutation) -> bool:
    """Apply the mutation in the scratch copy; False if its text is not (or not once) in the file."""
    path = scratch / mutation.path
    text = path.read_text()
    if text.count(mutation.find) != 1:
        return False
    path.write_text(text.replace(mutation.find, mutation.replace))
    return True


@dataclass(frozen=True, slots=True)
class Outcome:
    verdict: str  # caught, skipped (its tests cannot run here), SURVIVED, STALE (not once in the file), TIMEOUT, ERROR
    seconds: float
    caught_by: str  # the first failing test, or why there is none


def run(mutation: Mutation) -> Outcome:
    """Plant one mutation in a fresh copy of the repository and run its tests."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as folder:
        scratch = Path(folder)
        for name in COPIED:
            source = REPO_ROOT / name
            if source.is_dir():
                shutil.copytree(source, scratch / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, scratch / name)
        if not plant(scratch, mutation):
            return Outcome("STALE", time.perf_counter() - start, f"its text is not once in {mutation.path}")
        # -x: one failing test is enough; the scratch copy comes first on sys.path (pytest runs from it).
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-rfs", "-p", "no:cacheprovider", "-p", "no:logging",
                   *mutation.tests]
        try:
            result = subprocess.run(command, cwd=scratch, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:  # a hang is a failure a learner cannot read: the suite should say why
            return Outcome("TIMEOUT", time.perf_counter() - start, f"no verdict within {TIMEOUT_SECONDS} s")
    seconds = time.perf_counter() - start
    skipped = re.search(r"^SKIPPED \[\d+\] (.+)$", result.stdout, re.MULTILINE)
    if result.returncode == 0 and skipped and not re.search(r"\b\d+ passed\b", result.stdout):
        return Outcome("skipped", seconds, f"no test could run here: {skipped.group(1)}")  # e.g. no C++ compiler
    if result.returncode == 0:
        return Outcome("SURVIVED", seconds, "every test passed")
    failed = re.search(r"^FAILED (\S+)", result.stdout, re.MULTILINE)
    if result.returncode == 1 and failed:
        return Outcome("caught", seconds, failed.group(1))
    last_lines = " | ".join((result.stdout + result.stderr).strip().splitlines()[-3:])
    return Outcome("ERROR", seconds, f"pytest exited with {result.returncode}: {last_lines}")


def main(names: list[str]) -> int:
    unknown = set(names) - {m.name for m in CATALOGUE}
    if unknown:
        print(f"unknown mutations: {', '.join(sorted(unknown))}; known: {', '.join(m.name for m in CATALOGUE)}")
        return 2
    chosen = [m for m in CATALOGUE if not names or m.name in names]
    print(f"{'mutation':32} {'outcome':9} {'seconds':>7}  caught by")
    verdicts = []
    for mutation in chosen:
        outcome = run(mutation)
        verdicts.append(outcome.verdict)
        print(f"{mutation.name:32} {outcome.verdict:9} {outcome.seconds:7.1f}  {outcome.caught_by}", flush=True)
    skipped = verdicts.count("skipped")
    bad = len(verdicts) - verdicts.count("caught") - skipped
    print(f"{verdicts.count('caught')} of {len(chosen)} caught" + (f", {skipped} skipped" if skipped else ""))
    if bad:
        print("SURVIVED: add a test that fails for it; STALE: rewrite the mutation for the code as it is now;"
              " TIMEOUT: a test should fail with a message rather than hang")
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
