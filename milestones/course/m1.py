"""m1's lesson, the model, the sampler and the loop: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m1"]``; docs/m1.md shows its snippet section under "Build it yourself".
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m1]
# m1 has no previous milestone: each piece is checked against transformers' own module, on the same weights
STEPS: tuple[Step, ...] = (
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
)
# --8<-- [end:m1]
