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
    # --8<-- [start:m1]
    "m1": (  # m1 has no previous milestone: each piece is checked against transformers' own module, on the same weights
        Step("RMSNorm", ("tests/m1/test_rmsnorm.py",),
             "RMSNorm does not subtract the mean; eps goes inside the square root; square in float32, return x's dtype",
             (Exercise("model.py", "rmsnorm", ("RMSNorm.forward",),
                       "scale each vector (the last dimension of x) to unit root mean square: divide by "
                       "`sqrt(mean(x**2) + self.eps)`, the mean not subtracted, computed in float32; cast the result "
                       "back to x's dtype, then multiply by self.weight. The tests compare it with transformers' "
                       "LlamaRMSNorm on SmolLM2's weights: float32 within 1e-5, bfloat16 in, bfloat16 out, and float16 "
                       "inputs of 300, whose squares overflow float16."),)),
        Step("rotary position embedding (RoPE)", ("tests/m1/test_rope.py",),
             "a pair is dimensions i and i + head_dim/2 (the two halves, not neighbours); angles in float32, like "
             "transformers'",
             (Exercise("model.py", "rope", ("RotaryEmbedding.build_tables",),
                       "the angle of position p in pair i is `p * rope_inv_freq(self.cfg)[i]`, in float32, for every "
                       "position below self.max_positions; dimensions i and i + head_dim/2 share it. Register its cos "
                       "and its sin as buffers named `cos` and `sin`, [max_positions, head_dim] float32 on `device` "
                       "(`persistent=False`: not weights). Compared with transformers' LlamaRotaryEmbedding (SmolLM2, "
                       "Llama-3 scaled frequencies, Qwen3's head_dim of 32) within 1e-5."),
              Exercise("model.py", "rope", ("RotaryEmbedding.forward",),
                       "the rows of the cos and sin tables at these positions, as [T, 1, head_dim] (one row per "
                       "token, shared by all heads), in dtype."),
              Exercise("model.py", "rope", ("rotate_half",),
                       "`[-x2, x1]` joined on the last dimension, where x1 and x2 are the first and the second half "
                       "of x's last dimension. Compared with transformers' rotate_half."),
              Exercise("model.py", "rope", ("apply_rope",),
                       "rotate each (i, i + head_dim/2) pair (a, b) of x [T, heads, head_dim] by its angle, to "
                       "(a cos - b sin, b cos + a sin), with cos and sin [T, 1, head_dim] from RotaryEmbedding."
                       "forward (rotate_half lines the b's up with the a's). Compared with transformers' "
                       "apply_rotary_pos_emb."))),
        Step("attention over the KV cache (GQA)", ("tests/m1/test_attention.py",),
             "keys are rotated, values are not; query head h reads KV head h // group; a prompt's token i sees rows "
             "0..i, a decode step's token every row; only this layer's rows of the cache change",
             (Exercise("model.py", "self_attention", ("SelfAttention.forward",),
                       "project x [n, hidden] to q [n, num_heads, head_dim] and k, v [n, num_kv_heads, head_dim]; "
                       "where the module has q_norm (Qwen3), normalise q and k with self.q_norm and self.k_norm before "
                       "RoPE; rotate q and k (not v) with apply_rope; attend with `attention(q, k, v, "
                       "self.layer_index, ctx)`; return o_proj of the heads side by side, [n, hidden]. Compared with "
                       "LlamaAttention on SmolLM2's layer 2, and Qwen2Attention and Qwen3Attention, with their cache."),
              Exercise("attention.py", "attention", ("attention",),
                       "write k and v into this layer's cache, `ctx.k_cache[layer]` and `ctx.v_cache[layer]`, at rows "
                       "ctx.slot_mapping; then attend over rows 0..ctx.context_len-1: one new token with "
                       "decode_attention (it sees every row), a prompt causally (token i sees rows 0..i; "
                       "`F.scaled_dot_product_attention` takes [1, heads, n, dim] and `enable_gqa=True`). Return "
                       "[n, heads, dim]. The tests check the output and every row of the cache after each step. (If "
                       "ctx.kernel_batch is set, a CPU speed-up, the step's attention is one call of the compiled "
                       "kernel instead, once k and v are written: `batch.kernel(q, k, v, tables, lens, scale)` with "
                       "this layer's caches given a block dimension of one, `k_cache[:, :, None]` and "
                       "`v_cache[:, :, None]`, the batch's block_tables and context_lens, and `q.shape[-1] ** -0.5`.)"),
              Exercise("attention.py", "decode_attention", ("decode_attention",),
                       "one query q [1, heads, dim] against keys and values [kv_heads, context_len, dim]: the "
                       "softmax of `q . k / sqrt(dim)` weights the values, all in float32 (`.float()` on q, keys and "
                       "values); query head h reads key/value head `h // (heads // kv_heads)`. Return [1, heads, dim] "
                       "in values' dtype."))),
        Step("the MLP (SwiGLU)", ("tests/m1/test_mlp.py",),
             "SiLU goes on the gate projection only, which then multiplies the up projection",
             (Exercise("model.py", "mlp", ("MLP.forward",),
                       "SwiGLU: the SiLU of gate_proj(x), times up_proj(x), through down_proj; [n, hidden] in and "
                       "out. Compared with transformers' LlamaMLP on SmolLM2's weights."),)),
        Step("one decoder layer", ("tests/m1/test_decoder_layer.py",),
             "each sub-block adds its output to its input: x + attention(norm(x)), then h + mlp(norm(h))",
             (Exercise("model.py", "decoder_layer", ("DecoderLayer.forward",),
                       "add self_attn(input_layernorm(x), cos, sin, ctx) to x, then add "
                       "mlp(post_attention_layernorm(h)) to that sum h; return [n, hidden]. Compared with "
                       "LlamaDecoderLayer on SmolLM2's layer 5, a prefill then decode steps."),)),
        Step("the forward pass, transformers' logits", ("tests/m1/test_forward.py",),
             "the final norm comes after the last layer; RoPE's cos and sin are looked up once and shared by the "
             "layers; logits within 1e-4 of transformers' at the prefill and at every decode step",
             (Exercise("model.py", "forward", ("CausalLM.forward",),
                       "embed input_ids with self.model.embed_tokens, look up cos and sin once, `self.rope(positions, "
                       "x.dtype)`, run every layer of self.model.layers with them and ctx, and return self.model.norm "
                       "of the result: [num_tokens, hidden_size]. Compared with LlamaForCausalLM on SmolLM2."),
              Exercise("model.py", "compute_logits", ("CausalLM.compute_logits",),
                       "the LM head (self.lm_head) over the given hidden rows, as float32 whatever the model's dtype: "
                       "[rows, vocab]."))),
        Step("the sampler", ("tests/m1/test_sampler.py",
                             "tests/m1/test_penalties.py::test_each_penalty_on_hand_made_logits",
                             "tests/m1/test_penalties.py::test_greedy_rows_are_penalized_too",
                             "tests/m1/test_logprobs.py::test_the_chosen_tokens_rank_counts_the_likelier_tokens"),
             "greedy rows ignore the noise; top-p keeps the token that crosses it, on what top-k kept; the noise "
             "depends on the request's seed and the token's position alone",
             (Exercise("sampler.py", "sample", ("Sampler.__call__",),
                       "return a list of `SampledToken(token_id, logprobs)`, one per row of logits [rows, vocab]. "
                       "First `logits = self.apply_grammars(logits, seqs)` (structured requests: their format's tokens "
                       "only), then `self.apply_penalties(logits, seqs)` (keep the logits from before the penalties "
                       "for the log-probabilities); then a greedy row (`seq.params.greedy`) takes its argmax; the "
                       "other rows "
                       "divide their logits by their temperature, go through self.filtered_probs together, and each "
                       "takes `argmax(probs / noise)` with its own `self.exponential_noise(seq, vocab)`; each row's "
                       "logprobs are `self.logprobs(model_logits, seqs, token_ids)`'s, after "
                       "`self.advance_grammars(seqs, token_ids)`: the tests recompute every row's token."),
              Exercise("sampler.py", "penalties", ("Sampler.apply_penalties",),
                       "for each row whose `seq.params.has_penalties`: the repetition penalty on every token of the "
                       "prompt or the output (a positive logit divided by it, a negative one multiplied), then minus "
                       "`frequency_penalty` times each token's count in the output and `presence_penalty` once for "
                       "each token in it. Return new logits (the caller's stay as they are), or the same tensor when "
                       "no row has penalties."),
              Exercise("sampler.py", "logprobs", ("Sampler.logprobs",),
                       "for each row whose `seq.params.logprobs` is k (not None), what `ranked_logprobs` gives for its "
                       "logits, its chosen token and k (the rows that ask, in one call); None for the other rows."),
              Exercise("sampler.py", "ranked_logprobs", ("ranked_logprobs",),
                       "row by row of logits [rows, vocab], a dict `{token: Logprob(logprob, rank)}` from their "
                       "log_softmax: the row's chosen token first (rank: 1 + the number of likelier tokens), then its "
                       "k likeliest in order (rank 1, 2, ...; the chosen one not twice). The runner scores a prompt's "
                       "tokens with it too, each prompt token in the chosen one's place."),
              Exercise("sampler.py", "filtered_probs", ("Sampler.filtered_probs",),
                       "the probabilities [rows, vocab] after each row's top-k (-1, or a top_k beyond the vocabulary, "
                       "keeps every token), then top-p on what top-k kept: a token stays if the tokens ranked above it "
                       "hold at most top_p, so the one that crosses top_p stays; filtered tokens get probability 0. "
                       "Compared with transformers' TopKLogitsWarper, then TopPLogitsWarper, within 1e-7 + 1e-5 of p."),
              Exercise("sampler.py", "exponential_noise", ("Sampler.exponential_noise",),
                       "Exponential(1) noise [vocab] for the sequence's next token: seed self.generator with "
                       "`noise_seed(seq.seed, seq.num_tokens)`, then draw `torch.empty(vocab, "
                       "device=self.device).exponential_(generator=self.generator)`, so that nothing else changes it "
                       "(the tests draw the same numbers and compare them exactly)."))),
        # transformers' tokens on tiny random checkpoints; the CPU's packed linear layers ("auto") are no part of the
        # lesson, and the contract runs them
        Step("the loop: transformers' tokens and stops",
             ("tests/m1/test_generate.py", "tests/m1/test_vs_transformers.py", "tests/m1/test_logprobs.py", "-m",
              "not real_model", "-k", "not auto"),
             "stop tokens stay in token_ids but add no text; max_tokens counts output tokens; the first rule that "
             "matches wins: stop token, stop string, max_tokens, full context",
             (Exercise("model_runner.py", "prepare_inputs", ("ModelRunner.prepare_inputs",),
                       "for the batch's one sequence and its num_new tokens: input_ids, its tokens from "
                       "num_computed_tokens on (int64); positions, their indices; an AttentionContext over "
                       "self.k_cache and self.v_cache whose slot_mapping is the positions (a token's cache row is its "
                       "position) and whose context_len is num_computed_tokens + num_new; sample_rows [num_new - 1] "
                       "(only the last new token predicts), sample_seqs [seq], and prompt_rows "
                       "`PromptLogprobRows.of(seq, 0, start, start + num_new)` (the rows that score the prompt, if "
                       "the request asks for prompt_logprobs). With self.decode_kernel set, a step of one new token "
                       "also sets `ctx.kernel_batch = self.kernel_batch(ctx.context_len)`."),
              Exercise("model_runner.py", "execute", ("ModelRunner.execute",),
                       "prepare the inputs, run self.model over them once, take the hidden rows of "
                       "inputs.sample_rows through self.compute_logits (the CPU's packed head, or the model's), and "
                       "return a StepOutput: what self.sampler gives for inputs.sample_seqs (a SampledToken each), "
                       "and `self.prompt_logprobs(hidden, inputs.prompt_rows)`."),
              Exercise("engine.py", "stop_rules", ("LLMEngine._append_token",),
                       "append token to seq.token_ids; set seq.metrics.first_token_time (the first time only), "
                       "last_token_time and num_output_tokens; then the stop rules, the first that matches wins: a "
                       "stop token (in self.eos_token_ids unless params.ignore_eos, or in params.stop_token_ids) "
                       "finishes with `seq.finish(\"stop\")` and never reaches the detokenizer (it adds no text); "
                       "else `seq.detokenizer.add_token(token)` returns a stop string: \"stop\"; else "
                       "params.max_tokens output tokens: \"length\"; else seq.num_tokens reaches "
                       "self.config.max_model_len: \"length\"."))),
        contract("m1"),
    ),
    # --8<-- [end:m1]
    # --8<-- [start:m2]
    "m2": (
        Step("scheduler: budgets and chunks", ("tests/m2/test_scheduler.py",),
             "the scheduler plans every step from scratch: decodes first, then unfinished prefills, then admissions "
             "in arrival order while fewer than max_num_seqs run, each request getting min(tokens left, budget left)",
             (Exercise("scheduler.py", "schedule", ("Scheduler.schedule",),
                       "plan one step from scratch with a budget of max_num_batched_tokens: the running requests "
                       "first, decodes (one token left to compute) before prefills and arrival order within each "
                       "(a stable sort), each through `budget -= self._take(batch, seq, budget)`, stopping once the "
                       "budget is 0; then, while budget is left and fewer than max_num_seqs run, admit the front of "
                       "self.waiting (popleft): status RUNNING, `self.kv_slot[seq.request_id] = "
                       "self.free_slots.pop()`, appended to self.running, then taken. Return the "
                       "`ScheduledBatch([], [], [])` you filled, or None if it holds no request."),
              Exercise("scheduler.py", "schedule", ("Scheduler._take",),
                       "schedule `min(tokens left to compute, budget)` new tokens of seq: append seq, that number "
                       "and its slot `self.kv_slot[seq.request_id]` to batch.seqs, batch.num_new_tokens and "
                       "batch.kv_slots; return the number, which the caller takes from the budget."))),
        Step("one packed forward: inputs and attention",
             ("tests/m2/test_prepare_inputs.py", "tests/m2/test_attention.py"),
             "a request's new tokens sit at num_computed_tokens, num_computed_tokens + 1, ...; its span's "
             "context_len counts every token it attends to, this step's included; only a chunk that reaches the end "
             "of its tokens samples; attention writes this layer's new keys and values before anyone reads them",
             (Exercise("model_runner.py", "prepare_inputs", ("ModelRunner.prepare_inputs",),
                       "pack every scheduled request's new tokens, `token_ids[num_computed_tokens : "
                       "num_computed_tokens + num_new]` at positions num_computed_tokens, ..., into one flat batch, "
                       "each token going to its request's KV slot (batch.kv_slots), with one `RequestSpan(row, row "
                       "+ num_new, slot, num_computed_tokens + num_new)` per request (row: its first row). With "
                       "self.decode_kernel set, the spans of requests with one new token go to a list of decodes "
                       "instead, and `ctx.kernel_batch = self.kernel_batch(decodes)`; with self.batched_attention "
                       "set, `ctx.ragged_batch = self.ragged_batch(spans)`. A request whose chunk reaches "
                       "the end of its tokens samples from its last row (sample_rows, and its seq in sample_seqs). "
                       "Every request adds `PromptLogprobRows.of(seq, row, start, end)` to prompt_rows. "
                       "Return `ModelInputs(input_ids, positions, ctx, sample_rows, sample_seqs)` with "
                       "`ctx = AttentionContext(self.k_cache, self.v_cache, token_slots, positions, spans)`, the "
                       "lists of numbers made tensors with self._tensor."),
              Exercise("attention.py", "attention", ("attention",),
                       "with `k_cache = ctx.k_cache[layer]` (and v), write the new keys and values first, "
                       "`k_cache[ctx.token_slots, :, ctx.positions] = k`. If ctx.ragged_batch is set (batched "
                       "attention, CUDA's speed-up), return `ctx.ragged_batch(q, k_cache, v_cache)`, the whole step "
                       "in one call. If ctx.kernel_batch is set, its rows are "
                       "`batch.kernel(q[batch.rows], k_cache, v_cache, batch.block_tables, batch.context_lens, "
                       "head_dim ** -0.5)`. Each span of ctx.requests attends over its own slot's first context_len "
                       "positions, `k_cache[span.kv_slot, :, : span.context_len]`, with decode_attention for one "
                       "row and prefill_attention for a chunk. Return the output, shaped like q."))),
        Step("the engine, the same tokens as m1", ("tests/m2/test_vs_m1.py",),
             "an integrity message (every batch is checked as it is scheduled, the bookkeeping after every step) "
             "names the rule that broke; 'output token T differs' means steps 1 and 2 held on their examples but "
             "a token was computed from other inputs than m1's: run the failing request alone through your "
             "prepare_inputs and compare its positions and context lengths with m1's"),
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
                       "as in m2 (ids, positions, the rows that sample and score the prompt, decodes to "
                       "self.kernel_batch when self.decode_kernel is set, and `ctx.ragged_batch = "
                       "self.ragged_batch(requests, ctx.block_tables)` when self.batched_attention is set), but token "
                       "p goes to slot "
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
             "edges hold whole blocks; every match and insert stamps the nodes it passes (LRU); a node's blocks "
             "count in num_evictable_blocks exactly while its lock_ref is 0; eviction takes unlocked leaves, least "
             "recently used first",
             (Exercise("radix_tree.py", "match_prefix", ("RadixTree.match_prefix",),
                       "walk `self._shared_edges(tokens)` from the root: an edge shared only in part is cut with "
                       "`self._split(child, same)` so the match ends at a node; stamp every node passed with "
                       "`node.last_access = next(self._clock)` and gather its blocks. Return (the blocks of the "
                       "match, its last node), ([], self.root) when nothing matches."),
              Exercise("radix_tree.py", "insert", ("RadixTree.insert",),
                       "walk from the root block by block (children are keyed by their first block's tokens); "
                       "where the tree has the tokens keep its blocks (split an edge shared in part), and where "
                       "the path ends hang `Node(tuple(tokens[i:]), list(blocks[i // block_size:]), parent=node)`, "
                       "whose blocks are new and unlocked, so they count in num_evictable_blocks. Stamp every node "
                       "passed or made (last_access). Return (the last node, the list of blocks the tree newly "
                       "took over), [] when it had every token."),
              Exercise("radix_tree.py", "lock", ("RadixTree.lock",),
                       "add one to lock_ref of the node and of every node up to the root; a node whose lock_ref "
                       "leaves 0 takes its blocks off num_evictable_blocks."),
              Exercise("radix_tree.py", "unlock", ("RadixTree.unlock",),
                       "take one off lock_ref of the node and of every node up to the root; a node whose lock_ref "
                       "returns to 0 puts its blocks back in num_evictable_blocks."),
              Exercise("radix_tree.py", "evict", ("RadixTree.evict",),
                       "take the unlocked leaves (no children, lock_ref 0) in order of last_access, oldest first; "
                       "drop each whole (out of its parent's children, its blocks off num_evictable_blocks), and "
                       "when a parent is left childless and unlocked it becomes a candidate in turn. Stop once "
                       "num_blocks blocks are released or no candidate is left; return the released blocks."))),
        Step("scheduler: match, cache, evict", ("tests/m4/test_cache_steps.py", "tests/m4/test_scheduler.py"),
             "the match is made on token_ids[:-1]; a request's whole computed blocks go into the tree at the start "
             "of every step; blocks the tree adopts gain a holder; a request locks the deepest node it uses and "
             "only that one; eviction, least recently used first, comes before any preemption and only if it is "
             "enough",
             (Exercise("scheduler.py", "schedule", ("Scheduler._match",),
                       "with a tree (self.tree is not None): `self.tree.match_prefix(seq.token_ids[:-1])` (never "
                       "the last token: its logits are needed), start the request's table with the matched blocks "
                       "(`self.block_manager.share(seq.request_id, blocks)`), lock the last node and keep it in "
                       "`self.locked[seq.request_id]`, and set both num_computed_tokens and num_cached_tokens to "
                       "the matched tokens."),
              Exercise("scheduler.py", "schedule", ("Scheduler._cache",),
                       "with a tree: insert the request's whole computed blocks, its first "
                       "`num_computed_tokens // block_size` blocks and their tokens, into the tree; "
                       "`self.block_manager.hold(block)` for each block insert adopted; lock the node insert "
                       "returned, unlock the one in self.locked and keep the new one there."),
              Exercise("scheduler.py", "schedule", ("Scheduler._make_room",),
                       "the blocks the request needs to hold num_tokens tokens "
                       "(`self.block_manager.num_new_blocks`) plus headroom: if fewer are free and the tree's "
                       "num_evictable_blocks can make up the difference, `self.tree.evict(missing)` and "
                       "`self.block_manager.release(block)` each block it returns; if not, evict nothing. Return "
                       "whether the needed blocks are free now."),)),
        Step("the engine, the same tokens as m3", ("tests/m4/test_vs_m3.py",),
             "an integrity message (every batch is checked as it is scheduled, the bookkeeping after every step) "
             "names the rule that broke: a lock lost, a reference count off, a block freed while cached; 'output "
             "token T differs' means the bookkeeping held but a request read blocks that do not hold its prefix"),
        contract("m4"),
    ),
    # --8<-- [end:m4]
    # --8<-- [start:m5]
    "m5": (
        Step("a padded replay",
             ("tests/m5/test_padded_inputs.py", "tests/m5/test_vs_m4.py", "-k",
              "decode_inputs or padded_to_the_bucket or padded_replay or small_batch_after_a_large"),
             "a replay reads only the static buffers: every step writes every row of its bucket, the smallest "
             "captured size that holds the batch; padding rows are token 0 at position 0, write the scratch slot "
             "and read one position (context_len 1); every table entry no request fills holds the scratch block",
             (Exercise("model_runner.py", "decode_inputs", ("ModelRunner.decode_inputs",),
                       "`DecodeInputs([], [], [], [], [])` filled with one entry per request of the batch (each "
                       "has one new token, at position num_computed_tokens): its token "
                       "`seq.token_ids[position]`, the position, its slot `table[position // block_size] * "
                       "block_size + position % block_size`, its block table, and its context length, position + "
                       "1 (the new token included)."),
              Exercise("graph_runner.py", "run", ("GraphRunner.run",),
                       "size: the smallest of self.sizes that holds the batch's rows. Fill the first size rows of "
                       "every static buffer with `self._fill(buffer, size, values)`: input_ids and positions (0 "
                       "for padding rows), slot_mapping (self.scratch_slot for padding) and context_lens (1 for "
                       "padding); the block tables with `self._fill_tables(size, inputs.block_tables)`, which "
                       "puts the scratch block in every entry no table fills. Count `self.num_replays += 1` and "
                       "`self.num_padded_rows += pad`, replay with `self.replays[size]()` and return its first "
                       "num_rows rows."))),
        Step("the engine, the same tokens as m4",
             ("tests/m5/test_vs_m4.py", "-k", "not padded_replay and not small_batch_after_a_large"),
             "'output token T differs' with step 1 passing: run the same workload with enforce_eager=True, which "
             "never replays; if that one agrees, the replayed steps read something the buffers did not get "
             "this step"),
        contract("m5"),
    ),
    # --8<-- [end:m5]
    # --8<-- [start:m6]
    "m6": (
        Step("the future map", ("tests/m6/test_future_map.py",),
             "future ids are -1, -2, ...: id -1 - i is place i of the ring, and the ids go round it; resolve_ "
             "changes the step's own input tensor, in place",
             (Exercise("future_map.py", "future_map", ("FutureMap.allocate",),
                       "hand out count future ids, `-1 - (self.next + i) % size` for i in range(count) (size: the "
                       "ring, self.tokens.shape[0]), then move self.next on by count, round the ring; return the "
                       "list ([] for 0)."),
              Exercise("future_map.py", "future_map", ("FutureMap.resolve_",),
                       "in place, on the device, with no loop on the host: every negative entry of input_ids "
                       "becomes self.tokens[-1 - id] (`input_ids.copy_(...)`: the caller's tensor itself must "
                       "change); entries >= 0 stay as they are."),
              Exercise("future_map.py", "future_map", ("FutureMap.store",),
                       "put tokens[j] at place `-1 - future_ids[j]` of self.tokens (the indices made a tensor on "
                       "its device with to_device); no future ids, nothing to do."))),
        Step("overlap, the same tokens as m5", ("tests/m6/test_process.py", "tests/m6/test_vs_m5.py"),
             "a step's tokens exist only on the device until it is processed; _process counts the step, undoes it "
             "if its result raises (any BaseException), drops the token of a request that finished while it "
             "computed, and gives a request that finishes now its place back at once; async_scheduling=False runs "
             "the same code without the lag, to tell the two apart",
             (Exercise("engine.py", "process", ("LLMEngine._process",),
                       "`output = self.worker.result(launched.number)` (a StepOutput); if that raises anything (except"
                       " BaseException: a failed step, or Ctrl-C), `roll_back(launched, self.pending)`, `self.pending "
                       "= None`, and raise it again. Then `start = self.tracer.now()`, `self.num_steps += 1`; each of "
                       "launched.seqs still RUNNING gets `num_processed_tokens` = its entry of "
                       "launched.num_computed_after (a preempted or finished one's blocks are no longer its own), and,"
                       " if output.prompt_logprobs has its request id, `seq.add_prompt_logprobs(before + 1, those "
                       "scores)` (before: its entry of launched.num_computed_before). For each of "
                       "launched.sample_seqs, with its entry of launched.token_indices and its SampledToken in "
                       "output.sampled: skip a request already finished (its token is dropped); else append the "
                       "token's logprobs, if any, to seq.output_logprobs, `self._accept_token(seq, index, "
                       "sampled.token_id)`, and if that finished it, `drop_pending_tokens(seq)` and "
                       "`self.scheduler.finish(seq)`; append `RequestOutput.from_sequence(seq)`. Record "
                       "`self.tracer.record(\"process\", start, launched.number, len(launched.seqs))` and return the "
                       "outputs; before that, the samples a request with n > 1 held back go to the scheduler (`for seq"
                       " in self.parents.release_held(outputs): self.scheduler.add(seq)`), and the outputs go back "
                       "through `self.parents.merge(outputs)`."),)),
        contract("m6"),
    ),
    # --8<-- [end:m6]
    # --8<-- [start:m7]
    "m7": (
        Step("the ngram proposer", ("tests/m7/test_proposer.py",),
             "the longest suffix first (n from max_n down to min_n); its latest earlier occurrence wins; never the "
             "suffix itself",
             (Exercise("proposer.py", "ngram", ("NgramProposer.propose",),
                       "num_tokens <= 0: []. For n from min(max_n, len(token_ids) - 1) down to min_n, look for the "
                       "last n tokens at an earlier start, from the latest (len - n - 1) back to 0, never at len - "
                       "n (the suffix itself); at the first match return "
                       "`token_ids[start + n : start + n + num_tokens]`, which may be shorter. No match for any "
                       "n: []."),)),
        Step("guesses checked, the same tokens as m6",
             ("tests/m7/test_guesses.py", "tests/m7/test_vs_m6.py", "-m", "not real_model", "-k", "not replayed"),
             "a row's token counts only if every guess before it was the model's own pick; after a rejected one, "
             "drop the later rows' tokens, their KV (num_computed_tokens) and the blocks past the kept tokens, "
             "and halve the lookahead; a kept guess raises it by one, up to num_speculative_tokens",
             (Exercise("speculation.py", "check", ("Speculator.check",),
                       "token is the model's pick where the next row read guess. If they are equal, the guess is "
                       "kept: add one to `seq.metrics.num_accepted_tokens` and to `self.num_accepted_tokens`, and "
                       "raise seq.num_lookahead by one, to at most `self.config.num_speculative_tokens`. If not, the "
                       "rows after it read a wrong token: `drop_pending_tokens(seq)` (their tokens and KV), "
                       "`self.scheduler.trim(seq)`, and halve seq.num_lookahead, to at least "
                       "`self.proposer.min_lookahead`."),
              Exercise("block_manager.py", "shrink", ("BlockManager.shrink",),
                       "pop blocks off the end of the request's table while it has more than "
                       "`self.blocks_needed(num_tokens)`, each let go with `self.release(block)` (another holder "
                       "may keep it); a request with no table (preempted or finished) is left alone."),
              Exercise("scheduler.py", "trim", ("Scheduler.trim",),
                       "after a rejected guess: `self.block_manager.shrink(seq.request_id, seq.num_tokens)`, and "
                       "`seq.num_drafted_tokens = min(seq.num_drafted_tokens, seq.num_tokens - 1)`: a draft model's "
                       "keys and values count only up to the slot whose token changed (step 4's draft relies on "
                       "it)."))),
        Step("a checking step replayed: a decode step with a row per token",
             ("tests/m7/test_decode_rows.py", "tests/m7/test_vs_m6.py", "-k", "replayed"),
             "each guess is a row of its own: its position, its slot, the request's table, and a context that "
             "ends at itself, so it reads the rows before it and none after",
             (Exercise("model_runner.py", "decode_inputs", ("ModelRunner.decode_inputs",),
                       "for each request, a row for every token of `(seq.token_ids + "
                       "seq.draft_token_ids)[seq.num_computed_tokens:]` (its last token, then its guesses), at "
                       "positions num_computed_tokens, ...: the token, its position, its slot `table[p // "
                       "block_size] * block_size + p % block_size`, a copy of the request's table (`list(table)`, "
                       "the same for its rows: the host grows the live one while the step runs), context length p + "
                       "1, and seq in the returned sample_seqs. Return `(DecodeInputs(...), sample_seqs)`."),)),
        Step("a draft model guesses, in the requests' own blocks", ("tests/m7/test_draft_model.py",),
             "the draft computes what it has not seen (from num_drafted_tokens), then one guess per forward; a "
             "rejected guess's slot holds another token afterwards, so trim (step 2) counts the draft's KV back",
             (Exercise("drafter.py", "draft_model", ("DraftModelProposer.propose_batch",),
                       "give each request a `DraftView(list(seq.token_ids), seq.num_drafted_tokens, seq.params, "
                       "seq.seed)`, the draft's copy computed up to num_drafted_tokens. While some request has "
                       "fewer than rooms[i] guesses, one forward of the draft over those: "
                       "`self.runner.execute(self.runner.prepare(ScheduledBatch(views, new tokens, tables)))`, new "
                       "tokens being each view's tokens not yet computed, gives one token per view (sampled by the "
                       "request's own rules): the view is now computed to its end, and the token is appended to it "
                       "and to the request's guesses. Then set each `seq.num_drafted_tokens` to its view's "
                       "num_computed_tokens and return the guesses."),)),
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
