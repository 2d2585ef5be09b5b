"""m6's lesson, overlap scheduling: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m6"]``; docs/m6.md shows its snippet section under "Build it yourself".
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m6]
STEPS: tuple[Step, ...] = (
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
                   "launched.rows (a LaunchedRow: seq and index), with its token in output.tokens.tolist() and its "
                   "logprobs in output.logprobs: skip a request already finished (its token is dropped); else "
                   "append the logprobs, if any, to seq.output_logprobs, `self._accept_token(seq, row.index, "
                   "token)`, and if that finished it, `drop_pending_tokens(seq)` and "
                   "`self.scheduler.finish(seq)`; append `RequestOutput.from_sequence(seq)`. Record "
                   "`self.tracer.record(\"process\", start, launched.number, len(launched.seqs))` and return the "
                   "outputs; before that, the samples a request with n > 1 held back go to the scheduler (`for seq"
                   " in self.parents.release_held(outputs): self.scheduler.add(seq)`), and the outputs go back "
                   "through `self.parents.merge(outputs)`."),)),
    contract("m6"),
)
# --8<-- [end:m6]
