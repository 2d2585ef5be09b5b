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

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COPIED = ("milestones", "tests", "pyproject.toml")  # what the tests need, nothing generated


@dataclass(frozen=True, slots=True)
class Mutation:
    name: str
    path: str  # the file, relative to the repository root
    find: str  # exact text, which must occur exactly once
    replace: str
    tests: tuple[str, ...]  # pytest arguments that must fail with the mutation planted
    why: str  # the mistake, in a learner's words


CATALOGUE = (
    Mutation(
        "m2-budget-ignored", "milestones/m2/scheduler.py",
        "        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)\n",
        "        num_new = seq.num_tokens - seq.num_computed_tokens\n",
        ("tests/m2",), "a prompt is scheduled whole, whatever is left of the step's token budget",
    ),
    Mutation(
        "m3-slot-off-by-one", "milestones/m3/model_runner.py",
        "table[p // block_size] * block_size + p % block_size for p in range(start, end)",
        "table[p // block_size] * block_size + (p + 1) % block_size for p in range(start, end)",
        ("tests/m3",), "a token's key and value are written one slot away from where attention reads them",
    ),
    Mutation(
        "m3-victim-self", "milestones/m3/scheduler.py",
        "victim = max(queue, key=self.running.index) if queue else seq", "victim = seq",
        ("tests/m3",), "a request that cannot grow preempts itself instead of the latest admitted one",
    ),
    Mutation(
        "m3-preempt-keeps-computed", "milestones/m3/scheduler.py",
        "        seq.num_computed_tokens = 0\n", "",
        ("tests/m3",), "preemption frees the blocks but forgets that their tokens must be computed again",
    ),
    Mutation(
        "m4-lpm-no-op", "milestones/m4/scheduler.py",
        'if self.config.scheduling_policy == "lpm" and self.tree is not None:',
        'if False and self.config.scheduling_policy == "lpm" and self.tree is not None:',
        ("tests/m4",), "the longest-prefix-match policy accepted but never applied",
    ),
    Mutation(
        "m4-evict-locked", "milestones/m4/radix_tree.py",
        "if not n.children and n.lock_ref == 0]", "if not n.children and n is not self.root]",
        ("tests/m4",), "eviction that ignores the locks of running requests",
    ),
    Mutation(
        "m5-padding-writes-slot-0", "milestones/m5/graph_runner.py",
        "inputs.slots + [self.scratch_slot] * pad", "inputs.slots + [0] * pad",
        ("tests/m5",), "the padding rows of a replayed batch write their keys and values into a real block",
    ),
    Mutation(
        "m6-future-off-by-one", "milestones/m6/worker.py",
        "found = self.tokens[(-1 - input_ids).clamp(min=0)]", "found = self.tokens[(-input_ids).clamp(min=0)]",
        ("tests/m6",), "a future id is resolved to the token in the next slot of the future map",
    ),
    Mutation(
        "m6-keep-lag-token", "milestones/m6/engine.py",
        "            if seq.is_finished:  # it finished (or was aborted) while this step computed: "
        "the token is dropped\n                continue\n",
        "",
        ("tests/m6",), "the token a finished request's lag step computed is kept",
    ),
)


def plant(scratch: Path, mutation: Mutation) -> bool:
    """Apply the mutation in the scratch copy; False if its text is not (or not once) in the file."""
    path = scratch / mutation.path
    text = path.read_text()
    if text.count(mutation.find) != 1:
        return False
    path.write_text(text.replace(mutation.find, mutation.replace))
    return True


def run(mutation: Mutation) -> tuple[str, float]:
    """Plant one mutation in a fresh copy and run its tests: 'caught', 'SURVIVED' or 'STALE'."""
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
            return "STALE", time.perf_counter() - start
        # -x: one failing test is enough; the scratch copy comes first on sys.path (pytest runs from it).
        result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                 "-p", "no:logging", *mutation.tests], cwd=scratch, capture_output=True, text=True)
        outcome = "caught" if result.returncode == 1 else "SURVIVED" if result.returncode == 0 else "ERROR"
    return outcome, time.perf_counter() - start


def main(names: list[str]) -> int:
    chosen = [m for m in CATALOGUE if not names or m.name in names]
    unknown = set(names) - {m.name for m in CATALOGUE}
    if unknown:
        print(f"unknown mutations: {', '.join(sorted(unknown))}; known: {', '.join(m.name for m in CATALOGUE)}")
        return 2
    print(f"{'mutation':28} {'outcome':9} {'seconds':>8}  tests")
    bad = 0
    for mutation in chosen:
        outcome, seconds = run(mutation)
        bad += outcome != "caught"
        print(f"{mutation.name:28} {outcome:9} {seconds:8.1f}  {' '.join(mutation.tests)}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} caught" + ("" if not bad else "; STALE: rewrite the mutation"
                                                              " for the code as it is now"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
