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
        "m3-admit-without-headroom", "milestones/m3/scheduler.py",
        "if needed + len(self.running) > self.block_manager.num_free_blocks:",
        "if needed > self.block_manager.num_free_blocks:",
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
        "m3-admit-after-preempting", "milestones/m3/scheduler.py",
        "len(self.running) < self.config.max_num_seqs and not preempted:",
        "len(self.running) < self.config.max_num_seqs:",
        ("tests/m3/test_scheduler.py::test_the_victim_is_the_latest_admitted_request_not_yet_scheduled_and_goes_to_the_front",),
        "a step that has just preempted a request admits waiting ones anyway, the victim among them",
    ),
    Mutation(
        "m3-headroom-counts-newcomer", "milestones/m3/scheduler.py",
        "if needed + len(self.running) > self.block_manager.num_free_blocks:",
        "if needed + len(self.running) + 1 > self.block_manager.num_free_blocks:",
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
        "m3-first-in-blocks", "milestones/m3/model_runner.py",
        "span.first = len(block_tables) * block_size", "span.first = len(block_tables)",
        ("tests/m3/test_prepare_inputs.py::test_the_chapters_pool_two_whole_prompts_and_a_chunk_that_stops_midway",),
        "a span's first counts the blocks before it, not their tokens: later requests read another's keys",
    ),
    Mutation(
        "m4-lpm-no-op", "milestones/m4/scheduler.py",
        'if self.config.scheduling_policy == "lpm" and self.tree is not None:',
        'if False and self.config.scheduling_policy == "lpm" and self.tree is not None:',
        ("tests/m4/test_scheduler.py::test_lpm_sorts_by_cached_length_without_changing_the_tree",),
        "the longest-prefix-match policy accepted but never applied",
    ),
    Mutation(
        "m4-evict-locked", "milestones/m4/radix_tree.py",
        "if not n.children and n.lock_ref == 0]", "if not n.children and n is not self.root]",
        ("tests/m4/test_radix_tree.py::test_locked_paths_are_never_evicted_and_eviction_is_lru",),
        "eviction that ignores the locks of running requests",
    ),
    Mutation(
        "m4-match-whole-prompt", "milestones/m4/scheduler.py",
        "blocks, node = self.tree.match_prefix(seq.token_ids[:-1])",
        "blocks, node = self.tree.match_prefix(seq.token_ids)",
        ("tests/m4/test_vs_m3.py::test_trap_fully_cached_prompt_still_computes_its_last_token",),
        "a fully cached prompt is matched to its end, leaving no token whose logits give the next one",
    ),
    Mutation(
        "m4-cache-without-hold", "milestones/m4/scheduler.py",
        "        for block in adopted:\n            self.block_manager.hold(block)\n",
        "",
        ("tests/m4/test_scheduler.py::test_lpm_sorts_by_cached_length_without_changing_the_tree",),
        "blocks the tree takes over gain no holder, so they are freed while the tree still serves them",
    ),
    Mutation(
        "m4-cache-keeps-old-lock", "milestones/m4/scheduler.py",
        "        self.tree.lock(node)\n        self.tree.unlock(locked)\n",
        "        self.tree.lock(node)\n",
        ("tests/m4/test_scheduler.py::test_lpm_sorts_by_cached_length_without_changing_the_tree",),
        "a request that extends its cached path locks the new end but never unlocks the old one",
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
        "m5-padding-writes-slot-0", "milestones/m5/graph_runner.py",
        "inputs.slots + [self.scratch_slot] * pad", "inputs.slots + [0] * pad",
        ("tests/m5/test_vs_m4.py::test_m5_matches_m4_with_preemption_and_prefix_hits",),
        "the padding rows of a replayed batch write their keys and values into a real block",
    ),
    Mutation(
        "m5-stale-positions", "milestones/m5/graph_runner.py",
        "        self._fill(self.positions, size, inputs.positions + [0] * pad)\n", "",
        ("tests/m5/test_vs_m4.py::test_m5_matches_m4_on_a_mixed_workload",),
        "a replay reads the positions its static buffer held at capture, not this step's",
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
        ("tests/m6/test_vs_m5.py::test_trap_every_request_finishes_at_a_different_step",),
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
        "m6-roll-back-keeps-computed", "milestones/m6/engine.py",
        "                    seq.num_computed_tokens = computed\n", "                    pass\n",
        ("tests/m6/test_vs_m5.py::test_a_failed_step_is_undone_so_stepping_on_gives_m5s_tokens",),
        "a failed step's tokens stay counted as computed, so they are never computed again",
    ),
    Mutation(
        "m7-keep-rows-after-a-rejection", "milestones/m7/engine.py",
        "            self._drop_pending_tokens(seq)\n            self.scheduler.trim(seq)",
        "            self.scheduler.trim(seq)",
        ("tests/m7/test_vs_m6.py::test_m7_matches_m6",),
        "after a rejected guess the next rows' tokens are accepted too, though they read a wrong token",
    ),
    Mutation(
        "m7-rejected-blocks-kept", "milestones/m7/scheduler.py",
        "        self.block_manager.shrink(seq.request_id, seq.num_tokens)\n", "        pass\n",
        ("tests/m7/test_vs_m6.py::test_m7_matches_m6",),
        "the blocks that only rejected guesses reached stay in the request's table",
    ),
    Mutation(
        "m7-one-noise-per-step", "milestones/m7/step.py",
        "return cls(seq.params, seq.seed, position + 1, guess)",
        "return cls(seq.params, seq.seed, seq.num_tokens, guess)",
        ("tests/m7/test_vs_m6.py::test_m7_matches_m6",),
        "every row of a request draws the noise of its first, not of the position it samples",
    ),
    Mutation(
        "m7-cache-rejected-tokens", "milestones/m7/engine.py",
        "        seq.num_processed_tokens = min(seq.num_processed_tokens, seq.num_computed_tokens)\n", "",
        ("tests/m7/test_vs_m6.py::test_every_stop_rule_inside_an_accepted_run",),
        "the rows after a rejected guess still count as processed, so the prefix cache may take their blocks",
    ),
    Mutation(
        "m7-draft-kv-kept-after-a-rejection", "milestones/m7/scheduler.py",
        "        seq.num_drafted_tokens = min(seq.num_drafted_tokens, seq.num_tokens - 1)\n", "",
        ("tests/m7/test_draft_model.py::test_each_guess_is_what_the_draft_model_itself_would_say",),
        "the draft model's keys and values of a rejected guess stay counted, though the model's pick replaced it",
    ),
    Mutation(
        "m7-cache-blocks-the-draft-never-wrote", "milestones/m7/scheduler.py",
        "            written = min(written, seq.num_drafted_tokens)\n", "            pass\n",
        ("tests/m7/test_draft_model.py::test_the_model_as_its_own_draft_has_every_guess_kept",),
        "the prefix cache takes blocks whose draft-model keys and values were never written",
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
