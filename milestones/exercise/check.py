"""``check``: the milestone's steps run in order against a learner's package, each verdict printed, then the first
failure under the step that owns it.

It stops at the first failing step: each step builds on those before it, so a later one would fail for the same
reason, more slowly.
"""

from __future__ import annotations

import os
from pathlib import Path

from milestones.course import LESSONS, Step
from milestones.exercise import REPO_ROOT
from milestones.exercise.failures import failure_report, owner, stub_in_output
from milestones.exercise.install import IMPL_VARIABLE
from milestones.exercise.session import StepRun, run_step


def prepare(milestone: str, package: Path) -> None:
    """Set this process up for the tests, before anything imports torch: the learner's package stands in for
    ``milestones.<milestone>``, and torch computes on one thread (unless $OMP_NUM_THREADS says otherwise)."""
    os.environ.update({"MILESTONES": milestone, IMPL_VARIABLE: f"{milestone}={package}"})
    # The steps' tensors are small: a second thread gains little, and where other processes keep the cores busy,
    # torch's threads wait for each other at every operation (m7's check, on a loaded two-core machine: 563 s on
    # two threads, 182 s on one).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.chdir(REPO_ROOT)  # the steps name their tests from the repository's root


def build_kernels() -> None:
    """Build (or load, once built) the compiled CPU kernels the engines use, before the first step: a first build
    takes minutes, and inside a step its message would be hidden and its time counted as the step's."""
    from milestones.kernels.decode_attention import load_decode_kernel
    from milestones.kernels.panel_linear import load_panel_linear
    from milestones.kernels.rms_norm import load_rms_norm

    for load in (load_decode_kernel, load_panel_linear, load_rms_norm):
        try:
            load()
        except Exception as error:  # a compiler error arrives as one of several exception types
            print(f"  (a compiled kernel cannot be built here, so the engines use plain torch: {error})")
            return


def check(milestone: str, implementation: Path, numbers: range, keep_going: bool = False) -> int:
    """Run the chosen steps in order against the learner's package and stop at the first that fails (unless
    ``keep_going``); print each verdict, then the first failure, under the step that owns the function it was
    raised in. Runs in this process."""
    lesson, package = LESSONS[milestone], implementation.resolve()
    prepare(milestone, package)
    which = f"step {numbers[0]}" if len(numbers) == 1 else f"steps {numbers[0]} to {numbers[-1]}"
    until = "every one" if keep_going else "up to the first that fails"
    print(f"Checking {implementation} as {milestone}, {which} of {len(lesson)}, smallest first, {until}:", flush=True)
    build_kernels()
    passed, failures = 0, []
    for number in numbers:
        step = lesson[number - 1]
        print(f"  step {number} of {len(lesson)}: {step.name:40} ", end="", flush=True)
        if failures and not keep_going:
            print("not run")
            continue
        run = run_step(step)
        found = None if run.passed else stub_in_output(run.output, lesson) or owner(run.frames, package, lesson)
        elsewhere = f": the failure is in step {found[0]}'s {found[1]}" if found and found[0] != number else ""
        print(f"{'pass' if run.passed else 'FAIL'} ({run.seconds:.0f} s){elsewhere}", flush=True)
        passed += run.passed
        failures += [] if run.passed else [(number, run, found)]
    print(summary(passed, [number for number, *_ in failures], len(numbers)))
    if failures:
        report(milestone, lesson, *failures[0], implementation)
    return 1 if failures else 0


def summary(passed: int, failed: list[int], chosen: int) -> str:
    """"k of n steps pass", then which failed and how many did not run."""
    parts = [f"{passed} of {chosen} steps pass"]
    if failed:
        parts.append(f"step {failed[0]} fails" if len(failed) == 1 else f"steps {', '.join(map(str, failed))} fail")
    if chosen > passed + len(failed):
        parts.append(f"{chosen - passed - len(failed)} not run")
    return ", ".join(parts)


def report(milestone: str, lesson: tuple[Step, ...], number: int, run: StepRun, found: tuple[int, str] | None,
           implementation: Path) -> None:
    """The failure, under the step that owns it: the one whose function raised it, else the step whose test failed;
    then the command that reruns that step, with the learner's package named unless it is the default one."""
    step = lesson[number - 1]
    if found is None or found[0] == number:
        print(f"\nThe first failing step, {number} ({step.name}): {step.hint}")
    else:
        owning = lesson[found[0] - 1]
        print(f"\nStep {number}'s tests fail in {found[1]}, which step {found[0]} ({owning.name}) is about: "
              f"{owning.hint}")
    default = (REPO_ROOT / "workspace" / milestone).resolve()
    package = "" if implementation.resolve() == default else f" IMPL={implementation}"
    print(f"(`make check M={milestone}{package} STEP={found[0] if found else number}` runs that step alone)\n")
    print(failure_report(run.output))
