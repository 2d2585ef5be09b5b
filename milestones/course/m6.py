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
                   "ring, self.tokens.shape[0]), and move self.next on by count, round the ring; return the "
                   "list ([] for 0).",
                   how="a list comprehension, then `self.next = (self.next + count) % size`."),
          Exercise("future_map.py", "future_map", ("FutureMap.resolve_",),
                   "in place, on the device, with no loop on the host: every negative entry of input_ids "
                   "becomes self.tokens[-1 - id] (the caller's tensor itself must change); entries >= 0 stay as "
                   "they are.",
                   how="look every entry up at `(-1 - input_ids).clamp(min=0)`, then `input_ids.copy_("
                   "torch.where(input_ids < 0, found, input_ids))`."),
          Exercise("future_map.py", "future_map", ("FutureMap.store",),
                   "put tokens[j] at place `-1 - future_ids[j]` of self.tokens; no future ids, nothing to do.",
                   how="one indexed assignment, the places made a tensor on self.tokens' device with "
                   "to_device."))),
    Step("overlap, the same tokens as m5", ("tests/m6/test_process.py", "tests/m6/test_vs_m5.py"),
         "a step's tokens exist only on the device until it is processed; _process counts the step, undoes it "
         "if its result raises (any BaseException), drops the token of a request that finished while it "
         "computed, and gives a request that finishes now its place back at once; async_scheduling=False runs "
         "the same code without the lag, to tell the two apart",
         (Exercise("engine.py", "process", ("LLMEngine._process",),
                   "process a launched step, one step late. Its StepOutput is `self.worker.result("
                   "launched.number)`; if that raises anything (any BaseException: a failed step, or Ctrl-C), "
                   "the step is undone, `roll_back(launched, self.pending)`, self.pending becomes None, and the "
                   "exception goes on up. Otherwise the step counts in self.num_steps; each of launched.seqs "
                   "still RUNNING gets `num_processed_tokens` = its entry of launched.num_computed_after (a "
                   "preempted or finished one's blocks are no longer its own), and its prompt's scores, if it "
                   "asked, `keep_prompt_logprobs(seq, before + 1, output.prompt_logprobs)` (before: its entry "
                   "of launched.num_computed_before). Each of launched.rows (a LaunchedRow: seq and index) has "
                   "its token in output.tokens and its logprobs in output.logprobs: a request already finished "
                   "drops its token; any other keeps its logprobs, `keep_logprobs(seq, logprobs)`, accepts the "
                   "token with `self._accept_token(seq, row.index, token)`, and, if that finished it, has its "
                   "pending tokens dropped and leaves the scheduler (`self.scheduler.finish(seq)`); it gives "
                   "`RequestOutput.from_sequence(seq)`. The samples a request with n > 1 held back go to the "
                   "scheduler (`self.parents.release_held(outputs)`), the step is traced, "
                   "`self.tracer.record(\"process\", start, launched.number, len(launched.seqs))` (start: "
                   "`self.tracer.now()` once the result is in), and the outputs are returned through "
                   "`self.parents.merge(outputs)`.",
                   how="a try/except BaseException around the result alone; `output.tokens.tolist()` once; "
                   "zip(launched.seqs, launched.num_computed_before, launched.num_computed_after), then "
                   "zip(launched.rows, tokens, output.logprobs); `drop_pending_tokens(seq)` (rollback.py) for a "
                   "request that finished now; `for seq in self.parents.release_held(outputs): "
                   "self.scheduler.add(seq)`."),)),
    contract("m6"),
)
# --8<-- [end:m6]
