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
                   "x [..., hidden] in, the same shape and dtype out: each vector (the last dimension) divided by "
                   "its root mean square, `sqrt(mean(x**2) + self.eps)` (the mean not subtracted, eps inside the "
                   "root), then multiplied by self.weight. The tests compare it with transformers' LlamaRMSNorm on "
                   "SmolLM2's weights: float32 within 1e-5, bfloat16 in, bfloat16 out, and float16 inputs of 300, "
                   "whose squares overflow float16.",
                   how="compute in float32 (`x.float()`): the mean of the squares over the last dimension "
                   "(keepdim), `torch.rsqrt` of it plus eps, times x; cast that back to x's dtype, then multiply "
                   "by self.weight (transformers' order)."),)),
    Step("rotary position embedding (RoPE)", ("tests/m1/test_rope.py",),
         "a pair is dimensions i and i + head_dim/2 (the two halves, not neighbours); angles in float32, like "
         "transformers'",
         (Exercise("model.py", "rope", ("RotaryEmbedding.build_tables",),
                   "register buffers `cos` and `sin`, [max_positions, head_dim] float32 on `device` and no part "
                   "of the weights (`persistent=False`): row p holds the cos (the sin) of position p's angles, "
                   "pair i's angle being `p * rope_inv_freq(self.cfg)[i]`, which dimensions i and i + head_dim/2 "
                   "share, for every position below self.max_positions. It also runs inside `with "
                   "torch.device(\"meta\")` (from_pretrained builds the model there, then calls it again with the "
                   "real device), so every tensor it makes names its device. Compared with transformers' "
                   "LlamaRotaryEmbedding (SmolLM2, Llama-3 scaled frequencies, Qwen3's head_dim of 32) within "
                   "1e-5.",
                   how="the positions, `torch.arange(self.max_positions, dtype=torch.float32, device=\"cpu\")`; "
                   "their `torch.outer` with `rope_inv_freq(self.cfg)` is [max_positions, head_dim/2]; join it "
                   "with itself on the last dimension; `self.register_buffer(\"cos\", angles.cos().to(device), "
                   "persistent=False)`, and the same for sin."),
          Exercise("model.py", "rope", ("RotaryEmbedding.forward",),
                   "positions [T] in: the rows of the cos and sin tables at these positions, each as "
                   "[T, 1, head_dim] (one row per token, shared by all heads), in dtype.",
                   how="index self.cos and self.sin by positions, then `.unsqueeze(1)` and `.to(dtype)`."),
          Exercise("model.py", "rope", ("rotate_half",),
                   "`[-x2, x1]` joined on the last dimension, where x1 and x2 are the first and the second half "
                   "of x's last dimension. Compared with transformers' rotate_half.",
                   how="`x.chunk(2, dim=-1)`, then `torch.cat`."),
          Exercise("model.py", "rope", ("apply_rope",),
                   "x [T, heads, head_dim] with each (i, i + head_dim/2) pair (a, b) rotated by its angle, to "
                   "(a cos - b sin, b cos + a sin), given cos and sin [T, 1, head_dim] from RotaryEmbedding."
                   "forward. Compared with transformers' apply_rotary_pos_emb.",
                   how="one line: x times cos, plus rotate_half(x) times sin (rotate_half puts -b where a was and "
                   "a where b was)."))),
    Step("attention over the KV cache (GQA)", ("tests/m1/test_attention.py",),
         "keys are rotated, values are not; query head h reads KV head h // group; a prompt's token i sees rows "
         "0..i, a decode step's token every row; only this layer's rows of the cache change",
         (Exercise("model.py", "self_attention", ("SelfAttention.forward",),
                   "x [n, hidden] in, [n, hidden] out: the layer's attention, with q [n, num_heads, head_dim] and "
                   "k, v [n, num_kv_heads, head_dim] projected from x by the stacked self.qkv_proj (q, then k, "
                   "then v); where the module has q_norm (Qwen3), q and k normalised by self.q_norm and "
                   "self.k_norm before RoPE; q and k (not v) rotated with apply_rope; attended over the cache by "
                   "attention.py's `attention(q, k, v, self.layer_index, ctx)`; the heads' outputs side by side "
                   "through o_proj. Compared with LlamaAttention on SmolLM2's layer 2, and Qwen2Attention and "
                   "Qwen3Attention, with their cache.",
                   how="`self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)`, each viewed "
                   "as [n, heads, head_dim]; `if hasattr(self, \"q_norm\")`; attention's output [n, num_heads, "
                   "head_dim] reshaped to [n, num_heads * head_dim] for o_proj."),
          Exercise("attention.py", "attention", ("attention",),
                   "q [n, heads, dim] and k, v [n, kv_heads, dim] for the n new tokens: write k and v into this "
                   "layer's cache, `ctx.k_cache[layer]` and `ctx.v_cache[layer]`, at rows ctx.slot_mapping; then "
                   "return [n, heads, dim], each token's attention over rows 0..ctx.context_len-1: one new token "
                   "(a decode step) with decode_attention, as it sees every row; a prompt causally, token i "
                   "seeing rows 0..i. The tests check the output and every row of the cache after each step.",
                   how="`k_cache.index_copy_(0, ctx.slot_mapping, k)`, the same for v; the keys and values are "
                   "the cache's first context_len rows, transposed to [kv_heads, context_len, dim]; for a prompt, "
                   "`F.scaled_dot_product_attention` takes [1, heads, n, dim] and `is_causal=True, "
                   "enable_gqa=True`; transpose its output back."),
          Exercise("attention.py", "decode_attention", ("decode_attention",),
                   "one query q [1, heads, dim] against keys and values [kv_heads, context_len, dim]: the "
                   "softmax over the rows of `q . k / sqrt(dim)` weights the values, summed in float32 whatever "
                   "the cache holds; query head h reads key/value head `h // (heads // kv_heads)`. Return "
                   "[1, heads, dim] in values' dtype.",
                   how="view q as [kv_heads, group, dim] and make it float32 (`.float()`, like keys and "
                   "values), so that each key/value head serves its group in one `torch.bmm` with the keys "
                   "transposed; softmax on the last dimension; a second `torch.bmm` with the values; back to "
                   "values' dtype, viewed as [1, heads, dim]."))),
    Step("the MLP (SwiGLU)", ("tests/m1/test_mlp.py",),
         "SiLU goes on the gate projection only, which then multiplies the up projection",
         (Exercise("model.py", "mlp", ("MLP.forward",),
                   "SwiGLU: the SiLU of gate_proj(x), times up_proj(x), through down_proj; [n, hidden] in and "
                   "out. Compared with transformers' LlamaMLP on SmolLM2's weights.",
                   how="`F.silu` is SiLU; the product is elementwise."),)),
    Step("one decoder layer", ("tests/m1/test_decoder_layer.py",),
         "each sub-block adds its output to its input: x + attention(norm(x)), then h + mlp(norm(h))",
         (Exercise("model.py", "decoder_layer", ("DecoderLayer.forward",),
                   "[n, hidden] in and out: h = x + self_attn(input_layernorm(x), cos, sin, ctx), then h + "
                   "mlp(post_attention_layernorm(h)). Compared with LlamaDecoderLayer on SmolLM2's layer 5, a "
                   "prefill then decode steps.",
                   how="two lines, one per sub-block, each adding its output to its own input."),)),
    Step("the forward pass, transformers' logits", ("tests/m1/test_forward.py",),
         "the final norm comes after the last layer; RoPE's cos and sin are looked up once and shared by the "
         "layers; logits within 1e-4 of transformers' at the prefill and at every decode step",
         (Exercise("model.py", "forward", ("CausalLM.forward",),
                   "input_ids and positions [num_tokens] in, the hidden states [num_tokens, hidden_size] out: "
                   "the embeddings of input_ids (self.model.embed_tokens) through every layer of "
                   "self.model.layers in order, with ctx and with RoPE's cos and sin looked up once, "
                   "`self.rope(positions, x.dtype)`, then self.model.norm. Compared with LlamaForCausalLM on "
                   "SmolLM2.",
                   how="`x = self.model.embed_tokens(input_ids)`, then `cos, sin = self.rope(positions, "
                   "x.dtype)`, then `x = layer(x, cos, sin, ctx)` for each layer."),
          Exercise("model.py", "compute_logits", ("CausalLM.compute_logits",),
                   "the LM head (self.lm_head) over the given hidden rows, as float32 whatever the model's dtype: "
                   "[rows, vocab]."))),
    Step("the sampler", ("tests/m1/test_sampler.py",),
         "greedy rows ignore the noise; top-p keeps the token that crosses it, on what top-k kept; the noise "
         "depends on the request's seed and the token's position alone",
         (Exercise("sampler.py", "sample", ("Sampler.__call__",),
                   "logits [rows, vocab] (float32, a row per sequence of seqs, as the serving layer left them: "
                   "grammars masked, penalties applied) in; the picked token ids out, a tensor [rows] on "
                   "self.device. A greedy row (`seq.params.greedy`) takes its argmax; every other row divides "
                   "its logits by its temperature, goes through self.filtered_probs, and takes "
                   "`argmax(probs / noise)` with its own `self.exponential_noise(seq, vocab)`. The tests "
                   "recompute every row's token.",
                   how="`tokens = logits.argmax(dim=-1)`; the other rows together: their indices and "
                   "temperatures as tensors (to_device), `self.filtered_probs(logits[index] / temperature[:, "
                   "None], sampled)`, their noise stacked, and `tokens[index] = (probs / noise).argmax(dim=-1)`."),
          Exercise("sampler.py", "filtered_probs", ("Sampler.filtered_probs",),
                   "logits [rows, vocab] in (divided by the temperature already), probabilities [rows, vocab] "
                   "out. Each row keeps its top_k likeliest tokens (-1, or a top_k beyond the vocabulary, keeps "
                   "every token); then top-p, on the probabilities of what top-k kept (their softmax): a token "
                   "stays exactly when the tokens ranked above it hold at most top_p in all, so the token whose "
                   "probability takes the mass past top_p stays too. Filtered tokens get probability 0, kept "
                   "ones the softmax over the kept tokens' logits. Compared with transformers' TopKLogitsWarper, "
                   "then TopPLogitsWarper, within 1e-7 + 1e-5 of p.",
                   how="sort each row, descending, keeping the order; -inf at ranks >= k; the softmax of that; "
                   "the mass before each token is `cumsum - probs`; -inf where it exceeds top_p; scatter the "
                   "sorted logits back to their columns (into a tensor of -inf) and take the softmax. With every "
                   "top_k -1 and every top_p 1.0, the plain softmax."),
          Exercise("sampler.py", "exponential_noise", ("Sampler.exponential_noise",),
                   "Exponential(1) noise [vocab] for the sequence's next token, a function of "
                   "`noise_seed(seq.seed, seq.num_tokens)` alone: the tests seed a generator with it, draw "
                   "`torch.empty(vocab, device=self.device).exponential_(generator=...)`, and compare the "
                   "numbers exactly.",
                   how="`self.generator.manual_seed(...)`, then draw with `generator=self.generator` at once, so "
                   "that nothing else draws from it in between."))),
    # transformers' tokens on tiny random checkpoints; the CPU's packed linear layers ("auto") are no part of the
    # lesson, and the contract runs them
    Step("the loop: transformers' tokens and stops",
         ("tests/m1/test_generate.py", "tests/m1/test_vs_transformers.py", "-m", "not real_model", "-k",
          "not auto"),
         "stop tokens stay in token_ids but add no text; max_tokens counts output tokens; the first rule that "
         "matches wins: stop token, stop string, max_tokens, full context",
         (Exercise("model_runner.py", "prepare_inputs", ("ModelRunner.prepare_inputs",),
                   "for the batch's one sequence and its num_new tokens: input_ids, its tokens from "
                   "num_computed_tokens on (int64); positions, their indices; an AttentionContext over "
                   "self.k_cache and self.v_cache whose slot_mapping is the positions (a token's cache row is its "
                   "position) and whose context_len is num_computed_tokens + num_new; sample_rows [num_new - 1] "
                   "(only the last new token predicts), sample_seqs [seq], and prompt_rows "
                   "`PromptLogprobRows.of(seq, 0, start, start + num_new)` (the rows that score the prompt, if "
                   "the request asks for prompt_logprobs).",
                   how="`(seq,), (num_new,) = batch.seqs, batch.num_new_tokens`; `torch.tensor` of the token "
                   "ids and `torch.arange` of the positions, on self.device; `AttentionContext(self.k_cache, "
                   "self.v_cache, slot_mapping=positions, context_len=...)`; `ModelInputs(input_ids, positions, "
                   "ctx, sample_rows=..., sample_seqs=..., prompt_rows=...)`."),
          Exercise("model_runner.py", "execute", ("ModelRunner.execute",),
                   "one step of the batch: a StepOutput of the picks for inputs.sample_seqs (a SampledToken "
                   "each) from the logits of the hidden rows at inputs.sample_rows, through the serving layer's "
                   "one seam, `self.features.sample(self.sampler, logits, inputs.sample_seqs).as_list()`, and "
                   "the prompt scores `self.features.prompt_logprobs(self.compute_logits, hidden, "
                   "inputs.prompt_rows)`; self.model runs once, over the inputs self.prepare_inputs gives, and "
                   "the logits come from self.compute_logits (the CPU's packed head, or the model's).",
                   how="`inputs = self.prepare_inputs(batch)`; `hidden = self.model(inputs.input_ids, "
                   "inputs.positions, inputs.ctx)`; `logits = self.compute_logits(hidden[inputs.sample_rows])`."),
          Exercise("engine.py", "stop_rules", ("LLMEngine._append_token",),
                   "append token to seq.token_ids; set seq.metrics.first_token_time (the first time only), "
                   "last_token_time and num_output_tokens; then the stop rules, the first that matches wins: a "
                   "stop token (in self.eos_token_ids unless params.ignore_eos, or in params.stop_token_ids) "
                   "finishes with `seq.finish(\"stop\")` and never reaches the detokenizer (it adds no text); "
                   "else `seq.detokenizer.add_token(token)` returns a stop string: \"stop\"; else "
                   "params.max_tokens output tokens: \"length\"; else seq.num_tokens reaches "
                   "self.config.max_model_len: \"length\".",
                   how="one `time.perf_counter()` for both times; then an if/elif chain in the rules' order, "
                   "each branch one `seq.finish(...)`, the detokenizer fed in the second condition itself, so "
                   "that a stop token never reaches it."))),
    # Serving features, after the core: filled in unless EXTRAS=1, and never called by the core steps' tests.
    Step("optional: penalties and logprobs",
         ("tests/m1/test_penalties.py", "tests/m1/test_logprobs.py", "-m", "not real_model"),
         "the repetition penalty divides a positive logit and multiplies a negative one, on the prompt's tokens "
         "too; logprobs come from the model's logits, before penalties and temperature; a token's rank is 1 + the "
         "number of likelier tokens",
         (Exercise("serving/logits_processors.py", "penalties", ("LogitsProcessors.apply_penalties",),
                   "for each row whose `row.params.has_penalties`: the repetition penalty on every token of the "
                   "prompt or the output (a positive logit divided by it, a negative one multiplied), then minus "
                   "`frequency_penalty` times each token's count in the output and `presence_penalty` once for "
                   "each token in it. Return new logits (the caller's stay as they are), or the same tensor when "
                   "no row has penalties. (With self.resolve set, from m6 on, the output's ids go through it "
                   "first: the last may be a future id.)",
                   how="clone the logits; per row, the output's counts `bincount(minlength=vocab)`; for the "
                   "repetition penalty, a mask of the tokens seen (counts > 0, the prompt's tokens set too) and "
                   "`torch.where(row > 0, row / penalty, row * penalty)` where it is set; then subtract "
                   "`frequency_penalty * counts + presence_penalty * (counts > 0)` in place."),
          Exercise("serving/logits_processors.py", "logprobs", ("LogitsProcessors.logprobs",),
                   "for each row whose `row.params.logprobs` is k (not None), what `ranked_logprobs` gives for its "
                   "logits, its chosen token and k; None for the other rows.",
                   how="the rows that ask in one call: their logits and their chosen tokens through one index "
                   "tensor, and their ks; each answer back at its row."),
          Exercise("serving/logits_processors.py", "ranked_logprobs", ("ranked_logprobs",),
                   "row by row of logits [rows, vocab], a dict `{token: Logprob(logprob, rank)}` from their "
                   "log_softmax: the row's chosen token first (rank: 1 + the number of likelier tokens), then its "
                   "k likeliest in order (rank 1, 2, ...; the chosen one not twice; none whose log-probability is "
                   "-inf, a token a grammar masked). The runner scores a prompt's tokens with it too, each prompt "
                   "token in the chosen one's place.",
                   how="log_softmax once; the chosen tokens' values with `gather`; the ranks `(logprobs > "
                   "chosen's).sum(dim=-1) + 1`; one `topk(max(ks))` for all rows; then a dict per row, the chosen "
                   "token first, `setdefault` for each of its top k.")),
         optional=True),
    contract("m1"),
)
# --8<-- [end:m1]
