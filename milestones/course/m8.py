"""m8's lesson, tensor parallelism: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m8"]``; docs/m8.md shows its snippet section under "Build it yourself".
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m8]
STEPS: tuple[Step, ...] = (
    Step("each rank's share", ("tests/m8/test_sharding.py", "-k", "shares or replicated"),
         "rank r takes the r-th equal part; where ranks outnumber the KV heads, a rank holds a copy of the one KV "
         "head its query heads read; the vocabulary is cut in parts of vocab_rows, the last one shorter",
         (Exercise("distributed.py", "shares", ("TensorParallel.part", "TensorParallel.kv_part",
                                                "TensorParallel.vocab_part"),
                   "part(total): this rank's equal share of total heads or columns, as a range; rank r of size "
                   "takes the r-th (the engine refuses sizes that do not divide them). kv_part(num_kv_heads): "
                   "the same share of the KV heads where size <= num_kv_heads; where ranks outnumber them, "
                   "the one KV head that this rank's query heads read, `range(head, head + 1)` with head = "
                   "`rank * num_kv_heads // size` (each is held by size / num_kv_heads ranks). "
                   "vocab_part(vocab_size): this rank's token ids, parts of `self.vocab_rows(vocab_size)` ids "
                   "(rounded up, so that every rank's embedding has as many rows), each bound to vocab_size: the "
                   "last part is shorter, or empty.",
                   how="`per = total // self.size`, then `range(self.rank * per, (self.rank + 1) * per)`; kv_part "
                   "is part(num_kv_heads) when `self.size <= num_kv_heads`; vocab_part is the same range with "
                   "per = vocab_rows, both ends taken through `min(vocab_size, ...)`."),)),
    Step("each rank's shard of the weights",
         ("tests/m8/test_shards.py",
          "tests/m8/test_sharding.py::test_each_rank_holds_its_share_of_the_weights"),
         "q, k, v, gate and up are column-parallel (a rank reads its heads' or its width's rows), o_proj and "
         "down row-parallel (the same as columns); the embedding and the LM head are cut by token ids; the norms "
         "are whole; a token id of another rank looks up zeros",
         (Exercise("model.py", "checkpoint_tensors", ("CausalLM.checkpoint_tensors",),
                   "`{checkpoint name: Shard(target, dim, start, stop, full_shape)}` for every parameter of "
                   "`self.named_parameters(remove_duplicate=False)` (a tied LM head too): load_weights copies "
                   "`[start, stop)` along dim (stop None: to the end) of the stored tensor, which must have "
                   "full_shape, into target. A qkv_proj parameter (weight, or qwen2's bias) names three: its "
                   "rows split in `[attn.q_size, attn.kv_size, attn.kv_size]` (attn: the submodule it belongs "
                   "to, `name.rsplit('.', 2)[0]`) are q_proj's, k_proj's and v_proj's targets, each dim 0 from "
                   "`heads.start * head_dim` to `heads.stop * head_dim` (attn.q_heads for q, attn.kv_heads for "
                   "k and v) in a full shape of the model's whole heads' rows, `[total * head_dim, "
                   "*rows.shape[1:]]`. o_proj's weight: dim 1, the columns of attn.q_heads, in [hidden_size, "
                   "num_heads * head_dim]. gate_proj's and up_proj's weights: dim 0, the rows `mlp.columns` "
                   "names, in [intermediate_size, hidden_size]; down_proj's: dim 1, the same columns, in "
                   "[hidden_size, intermediate_size]. The embedding and the LM head: dim 0, the token ids "
                   "`self.model.embed_tokens.token_ids`, into the first `len(token_ids)` rows of the parameter "
                   "(the rest is padding), in [vocab_size, hidden_size]. Anything else (the norms): the whole "
                   "tensor, `Shard(param.data, 0, 0, None, list(param.shape))`.",
                   how="one loop over named_parameters with an if/elif per kind, testing `'.qkv_proj.' in name` "
                   "and `name.endswith(...)`; the config is self.config (num_heads, num_kv_heads, head_dim, "
                   "hidden_size, intermediate_size, vocab_size); for q, k and v, zip the three names, row blocks, "
                   "head ranges and head totals, and `name.replace('qkv_proj', part)`."),
          Exercise("model.py", "vocab_parallel_embedding", ("VocabParallelEmbedding.forward",),
                   "input_ids [num_tokens] (ids of the whole vocabulary) in, [num_tokens, hidden_size] out: a "
                   "token id of this rank's part, `self.token_ids`, gets its row of self.weight (row `id - "
                   "self.token_ids.start`); any other token id gets zeros, so that adding up every rank's "
                   "lookup gives each token its row. The padding rows after the part are never read.",
                   how="`local = input_ids - self.token_ids.start`; a mask of `0 <= local < len(self.token_ids)`; "
                   "`F.embedding(local * mine, self.weight)` looks up a valid row for every token (row 0 for the "
                   "others), then `torch.where(mine[:, None], ..., 0)`."))),
    Step("the all-reduces, one rank's logits", ("tests/m8/test_sharding.py", "-m", "not real_model"),
         "o_proj and down_proj give each rank a partial sum of the layer's output: add them up (tp.all_reduce) "
         "before the residual adds it, on every rank, in the same order; the embedding's lookups too",
         (Exercise("model.py", "decoder_layer", ("DecoderLayer.forward",),
                   "[n, hidden] in and out, as m1's, on this rank's shard: self_attn's and mlp's outputs are each "
                   "rank's partial sums (their o_proj and down_proj read only this rank's heads or width), so "
                   "each is added up over the ranks, `self.tp.all_reduce(...)`, before its residual adds it: h = "
                   "x + all_reduce(self_attn(input_layernorm(x), cos, sin, ctx)), then h + "
                   "all_reduce(mlp(post_attention_layernorm(h))). Every rank calls both, in that order.",
                   how="m1's two lines, each sub-block's output wrapped in `self.tp.all_reduce(...)`."),
          Exercise("model.py", "forward", ("CausalLM.forward",),
                   "input_ids and positions [num_tokens] in, the hidden states [num_tokens, hidden_size] out, as "
                   "m1's: the embeddings of input_ids, added up over the ranks (`self.tp.all_reduce`: each rank "
                   "looked up its own token ids, zeros for the others'), through every layer of "
                   "self.model.layers in order with ctx and RoPE's cos and sin looked up once, `self.rope("
                   "positions, x.dtype)`, then self.model.norm.",
                   how="`x = self.tp.all_reduce(self.model.embed_tokens(input_ids))`, then m1's lines."))),
    Step("a step's message to the other ranks", ("tests/m8/test_messages.py",),
         "a broadcast receives into a tensor of the size the sender's has: send the payload's length first, then "
         "the pickled bytes; with one rank (no messages group) there is nothing to send",
         (Exercise("distributed.py", "messages", ("TensorParallel.send_step", "TensorParallel.receive_step"),
                   "send_step(step), on rank 0: every other rank's receive_step() returns an equal object (a "
                   "ShardStep, or None that tells them to stop), in the order sent, over self.messages (a gloo "
                   "group of host tensors, rank 0 the source of each broadcast). Without a messages group (one "
                   "rank), send_step does nothing. Rank 0 waits at most COLLECTIVE_TIMEOUT for the others to take "
                   "a step (`self.messages.broadcast(tensor, 0, COLLECTIVE_TIMEOUT).wait()`: a rank that hangs "
                   "fails the step); receive_step waits as long as rank 0 takes to send, the engine idle or not "
                   "(`self.messages.broadcast(tensor, 0).wait()`: the group's own timeout).",
                   how="two broadcasts a message: the pickled bytes' length as a one-element long tensor, then the "
                   "bytes; rank 0 builds them with `torch.frombuffer(bytearray(pickle.dumps(step)), "
                   "dtype=torch.uint8)` and `torch.tensor([payload.numel()])`; a receiver broadcasts into "
                   "`torch.zeros(1, dtype=torch.long)`, then into `torch.empty(int(length), dtype=torch.uint8)`, "
                   "and returns `pickle.loads(payload.numpy().tobytes())`."),)),
    Step("every rank's step, the same tokens as m7",
         # two ranks: every path of a step (chunks, overlap, prompt scores); four, speculating, run in make test
         ("tests/m8/test_vs_m7.py", "-k", "two_ranks"),
         "rank 0 sends each step before it computes (the other ranks must meet its collectives, in its order); "
         "every rank takes part in the logits' gather; the other ranks keep rank 0's tokens where the next step "
         "looks. A rank that failed printed its traceback under Captured stderr (\"Process tensor-parallel-rank-N\")",
         (Exercise("model_runner.py", "execute", ("ModelRunner.execute",),
                   "rank 0's half of a step, as m7's, the other ranks computing their shards of it with it: first "
                   "send them `ShardStep(forward, step.future_ids)` (self.tp.send_step), forward being "
                   "step.forward without the host's sequences (a ModelInputs's sample_seqs emptied: they are not "
                   "to be pickled; a DecodeInputs as it is); then `hidden, prompt_logprobs = "
                   "self.forward(step.forward)`. No samples (every request in the middle of its prompt): return "
                   "`StepOutput(torch.empty(0, dtype=torch.long, device=self.device), [], prompt_logprobs)`. "
                   "Otherwise the picks of `self.features.sample(self.sampler, self.logits(hidden), "
                   "step.samples)` (self.logits: every rank's part of the vocabulary, gathered), their tokens "
                   "stored at step.future_ids (self.future_map.store) and broadcast to the other ranks "
                   "(self.tp.broadcast); return `StepOutput(tokens, picked.logprobs, prompt_logprobs)`.",
                   how="`replace(step.forward, sample_seqs=[])` when `isinstance(step.forward, ModelInputs)`; "
                   "the rest is m7's execute with self.forward and self.logits, and one line more, "
                   "`self.tp.broadcast(tokens)`, after the store."),
          Exercise("model_runner.py", "execute", ("ModelRunner.execute_shard",),
                   "every rank but 0, for each ShardStep rank 0 sent (serve calls it): compute this rank's shard "
                   "of step.forward (self.forward), and where the step samples (step.future_ids not empty) take "
                   "part in rank 0's collectives in its order: the logits' gather (self.logits of the hidden "
                   "rows; the result is rank 0's to use), then the broadcast of the tokens it sampled, received "
                   "into a long tensor of len(step.future_ids) on self.device and kept at step.future_ids "
                   "(self.future_map.store), where the next step's inputs look for them.",
                   how="`hidden, _ = self.forward(step.forward)`; then, if step.future_ids, `self.logits(hidden)`, "
                   "`tokens = torch.empty(...)` and `self.future_map.store(step.future_ids, "
                   "self.tp.broadcast(tokens))`."))),
    contract("m8"),
)
# --8<-- [end:m8]
