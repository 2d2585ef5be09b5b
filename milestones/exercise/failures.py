"""A failing step read: which lesson function raised its failure, and the part of pytest's report worth showing.

A step's tests also run the functions of the steps before it, so the step whose test failed is not always the step
to fix: the check names the one that owns the function at fault.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from milestones.course import Step
from milestones.exercise.stubs import functions


def owner(frames: tuple[tuple[Path, int], ...], package: Path, lesson: tuple[Step, ...]) -> tuple[int, str] | None:
    """The step that owns the failure and the lesson function it was raised in: the innermost frame of the traceback
    inside a function of the learner's package that an exercise names, unless that frame is a ``raise`` of the
    function's own (a refusal such as "needs 3 blocks but only 2 are free", not a stub's NotImplementedError): then
    the function that asked is at fault, the next lesson function out. None if no lesson function is on it (a wrong
    result the test itself asserts)."""
    steps = {(e.file, name): number for number, step in enumerate(lesson, 1) for e in step.exercises
             for name in e.functions}
    found = []  # (step, function, refused) from the innermost frame out
    for path, line in reversed(frames):
        if not path.is_relative_to(package) or not path.is_file():
            continue
        file, tree = path.relative_to(package).as_posix(), ast.parse(path.read_text())
        for name, node in functions(tree).items():
            if (file, name) in steps and node.lineno <= line <= node.end_lineno:
                refused = any(isinstance(n, ast.Raise) and n.lineno <= line <= n.end_lineno
                              and "NotImplementedError" not in ast.unparse(n) for n in ast.walk(node))
                found.append((steps[file, name], name, refused))
    for index, (number, name, refused) in enumerate(found):
        if not refused or index == len(found) - 1:
            return number, name
    return None


def stub_in_output(output: str, lesson: tuple[Step, ...]) -> tuple[int, str] | None:
    """The step and the lesson function of a stub whose NotImplementedError the step's output shows: one raised in
    another process (m8's ranks), which printed its traceback (pytest's "Captured stderr"), while the failure's own
    traceback is rank 0's, in whichever collective found the rank gone. None if no stub raised."""
    steps = {name: number for number, step in enumerate(lesson, 1) for e in step.exercises for name in e.functions}
    for name in re.findall(r"NotImplementedError: ([\w.]+) is yours to write", output):
        if name in steps:
            return steps[name], name
    return None


PROGRESS_BAR = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")  # tqdm's lines: a worker's start-up, in its captured stderr


def failure_report(output: str, max_lines: int = 60) -> str:
    """pytest's report from its first failure (or collection error) on, without progress bars, cut to ``max_lines``
    lines; a stub's NotImplementedError that the cut would lose (another process's traceback, m8's ranks or m9's
    workers) is kept after the cut."""
    lines = [line for line in output.rstrip().splitlines() if not PROGRESS_BAR.search(line)]
    first = next((i for i, line in enumerate(lines) if re.match(r"=+ (FAILURES|ERRORS) =+$", line)), 0)
    shown, rest = lines[first : first + max_lines], lines[first + max_lines :]
    if not rest:
        return "\n".join(shown)
    stubs = [line for line in rest[:-3] if "is yours to write" in line][:1]
    return "\n".join([*shown, "...", *stubs, *lines[-3:]])
