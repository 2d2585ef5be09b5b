"""m7's lesson, speculative decoding: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m7"]``; docs/m7.md shows its snippet section under "Build it yourself".
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m7]
STEPS: tuple[Step, ...] = (
    Step("the ngram proposer", ("tests/m7/test_proposer.py",),
         "the longest suffix first (n from max_n down to min_n); its latest earlier occurrence wins; never the "
         "suffix itself",
         (Exercise("proposer.py", "ngram", ("NgramProposer.propose",),
                   "at most num_tokens guesses of the tokens after token_ids ([] when num_tokens <= 0): the "
                   "longest suffix wins, of n tokens for n from min(max_n, len(token_ids) - 1) down to min_n, "
                   "that also occurs at an earlier start (never at len - n: that is the suffix itself); of its "
                   "occurrences, the latest start; the guesses are `token_ids[start + n : start + n + "
                   "num_tokens]`, which may be shorter. No suffix occurs earlier: [].",
                   how="two loops, n from the longest down, then start from len - n - 1 back to 0, comparing "
                   "`token_ids[start : start + n]` with the suffix; return at the first match (comparing the "
                   "last token first is cheaper)."),)),
    Step("guesses checked, the same tokens as m6",
         ("tests/m7/test_guesses.py", "tests/m7/test_vs_m6.py", "-m", "not real_model", "-k", "not replayed"),
         "a row's token counts only if every guess before it was the model's own pick; after a rejected one, "
         "drop the later rows' tokens, their KV (num_computed_tokens) and the blocks past the kept tokens, "
         "and halve the lookahead; a kept guess raises it by one, up to num_speculative_tokens",
         (Exercise("speculation.py", "check", ("Speculator.check",),
                   "token is the model's pick where the next row read guess. Equal: the guess is kept, counted "
                   "once in `seq.metrics.num_accepted_tokens` and once in `self.num_accepted_tokens`, and "
                   "seq.spec.num_lookahead rises by one, to at most `self.config.num_speculative_tokens`. Not equal: "
                   "the rows after it read a wrong token, so their tokens and KV are dropped, the request is "
                   "trimmed (its blocks past its tokens, a draft's count), and seq.spec.num_lookahead is halved, "
                   "rounding down, to at least `self.proposer.min_lookahead`.",
                   how="an if/else on token == guess; a rejection calls `drop_pending_tokens(seq)` (rollback.py: "
                   "the later rows' tokens and computed count) and `self.scheduler.trim(seq)` (below); halve with "
                   "`// 2` and bound it with max."),
          Exercise("block_manager.py", "shrink", ("BlockManager.shrink",),
                   "the request's table keeps only the blocks its first num_tokens tokens need "
                   "(`self.blocks_needed(num_tokens)`), the others taken off its end, each let go with "
                   "`self.release(block)` (another holder may keep it); a request with no table (preempted or "
                   "finished) is left alone, with no error.",
                   how="`self.block_tables.get(request_id, [])`, then pop while it is longer than needed."),
          Exercise("scheduler.py", "trim", ("Scheduler.trim",),
                   "after a rejected guess: the request keeps only the blocks of its seq.num_tokens tokens (the "
                   "block manager's shrink), and seq.spec.num_drafted_tokens becomes at most `seq.num_tokens - 1`: a "
                   "draft model's keys and values count only up to the slot whose token changed (step 4's draft "
                   "relies on it).",
                   how="two lines: `self.block_manager.shrink(seq.request_id, seq.num_tokens)`, then the min."))),
    Step("a checking step replayed: a decode step with a row per token",
         ("tests/m7/test_decode_rows.py", "tests/m7/test_vs_m6.py", "-k", "replayed"),
         "each guess is a row of its own: its position, its slot, the request's table, and a context that "
         "ends at itself, so it reads the rows before it and none after",
         (Exercise("model_runner.py", "decode_inputs", ("ModelRunner.decode_inputs",),
                   "`(DecodeInputs, sample_seqs)`: for each request of the batch, a row for every token of "
                   "`(seq.token_ids + seq.spec.draft_token_ids)[seq.num_computed_tokens:]` (its last token, then its "
                   "guesses), at positions num_computed_tokens, ...: the token, its position p, its slot "
                   "`table[p // block_size] * block_size + p % block_size`, a copy of the request's table (one "
                   "copy for all its rows: the host grows the live one while the step runs), context length p + "
                   "1 (the row reads the rows before it and itself), and seq in sample_seqs.",
                   how="`DecodeInputs([], [], [], [], [])`; per (seq, table) of the batch, `table = "
                   "list(table)`, then `for position, token in enumerate(tokens, seq.num_computed_tokens)` "
                   "append to the five lists and to sample_seqs."),)),
    Step("a draft model guesses, in the requests' own blocks", ("tests/m7/test_draft_model.py",),
         "the draft computes what the target computes every step (from seq.spec.num_drafted_tokens to the end of each "
         "row's chunk), with the first guesses, then one guess per forward; a rejected guess's slot holds "
         "another token afterwards, so trim (step 2) counts the draft's KV back",
         (Exercise("drafter.py", "draft_model", ("DraftModelProposer.propose_batch",),
                   "the draft computes, for every row of the batch, its tokens from seq.spec.num_drafted_tokens to the "
                   "end of the row's chunk (num_computed_tokens + num_new_tokens), and up to "
                   "`batch.guess_rooms.get(row, 0)` guesses, one more forward each; afterwards each "
                   "seq.spec.num_drafted_tokens says how far the draft computed. Return `{row: [guesses]}` for every "
                   "row with room. With self.rejection, each sampled (not greedy) request's guesses also get the "
                   "distribution each was drawn from, in order: `batch.guess_probs[request_id]`.",
                   how="give each row a `DraftView(seq.token_ids[:end], seq.spec.num_drafted_tokens, params, seq.seed, "
                   "seq.prompt_token_ids, room)`, params without logprobs or prompt_logprobs. While some view is "
                   "active (first all of them, then those with room left), one forward of the draft over them: "
                   "`self.runner.execute(sampling_guesses_only(self.runner.prepare(ScheduledBatch(views, new "
                   "tokens, tables))))`, new tokens being each view's tokens not yet computed, gives one token per "
                   "view with room, in order (sampled by the request's own rules): every view is now computed to "
                   "its end, and a view with room appends its token, adds it to its row's guesses and has one "
                   "less room; with self.rejection, a view that is not greedy also appends the next of "
                   "`self.runner.sampler.drawn_from` (read after the forward) to its request's "
                   "`batch.guess_probs` list. Then set each `seq.spec.num_drafted_tokens` to its view's "
                   "num_computed_tokens."),)),
    Step("rejection sampling: the model's distribution, not m6's tokens",
         ("tests/m7/test_rejection.py", "-k", "not engine_keeps"),  # the rule; the engine-wide tests run in make test
         "keep a guess when u * q(guess) < p(guess); otherwise draw from max(p - q, 0), never from p itself",
         (Exercise("sampler.py", "rejection_sample", ("rejection_sample",),
                   "a token per row, from the target's probs p [rows, vocab], the guesses [rows], uniforms [rows] "
                   "of U(0, 1), noise [rows, vocab] of Exponential(1), and the proposer's guess_probs q (None: "
                   "q is one-hot at the guess): the guess is kept with probability min(1, p/q) at the guess, "
                   "exactly when `u * q(guess) < p(guess)`; else the row's token is the exponential race over "
                   "the residual max(p - q, 0), its `argmax(residual / noise)`.",
                   how="q from `F.one_hot(guesses, vocab)` when it is None; p and q at the guess with `gather`; "
                   "the residual `(probs - q).clamp(min=0)` (no need to normalise it for an argmax); "
                   "`torch.where(keep, guesses, ...)`."),)),
    contract("m7"),
)
# --8<-- [end:m7]
