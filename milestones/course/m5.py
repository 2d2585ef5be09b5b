"""m5's lesson, the decode step captured and replayed: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m5"]``; docs/m5.md shows its snippet section under "Build it yourself".
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m5]
STEPS: tuple[Step, ...] = (
    Step("a padded replay",
         ("tests/m5/test_padded_inputs.py", "tests/m5/test_vs_m4.py", "-k",
          "decode_inputs or padded_to_the_bucket or padded_replay or small_batch_after_a_large"),
         "a replay reads only the static buffers: every step writes every row of its bucket, the smallest "
         "captured size that holds the batch; padding rows are token 0 at position 0, write the scratch slot "
         "and read one position (context_len 1); every table entry no request fills holds the scratch block",
         (Exercise("model_runner.py", "decode_inputs", ("ModelRunner.decode_inputs",),
                   "a DecodeInputs with one entry per request of the batch (each has one new token, at position "
                   "num_computed_tokens) in each list: its token `seq.token_ids[position]`, the position, its "
                   "slot `table[position // block_size] * block_size + position % block_size`, its block table, "
                   "and its context length, position + 1 (the new token included).",
                   how="`DecodeInputs([], [], [], [], [])`, then one loop over zip(batch.seqs, "
                   "batch.block_tables) appending to its five lists."),
          Exercise("graph_runner.py", "run", ("GraphRunner.run",),
                   "the hidden states of the batch's rows, from a replay of the smallest captured size (of "
                   "self.sizes) that holds them, `self.replays[size]()`, whose first num_rows rows they are. "
                   "Before it, the first size rows of every static buffer hold this step's inputs, padding rows "
                   "included: input_ids and positions (0 for padding rows), slot_mapping (self.scratch_slot for "
                   "padding), context_lens (1 for padding), and the block tables, the scratch block in every "
                   "entry no table fills. Count `self.num_replays += 1` and `self.num_padded_rows += pad`.",
                   how="`self._fill(buffer, size, values)` for each buffer, the values padded with lists like "
                   "`[0] * pad`; `self._fill_tables(size, inputs.block_tables)` for the tables."))),
    Step("the engine, the same tokens as m4",
         ("tests/m5/test_vs_m4.py", "-k", "not padded_replay and not small_batch_after_a_large"),
         "'output token T differs' with step 1 passing: run the same workload with enforce_eager=True, which "
         "never replays; if that one agrees, the replayed steps read something the buffers did not get "
         "this step"),
    contract("m5"),
)
# --8<-- [end:m5]
