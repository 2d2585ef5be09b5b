"""A learner's package written (``start``): the reference milestone copied, its lesson's functions stubbed.

A copy rather than an empty package, so that everything around the stubs is the reference's and
``diff -ru milestones/m(K-1) workspace/mK`` shows the lesson's changes without the answers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from milestones.course import LESSONS, Step
from milestones.exercise import PACKAGE_ROOT, SHARED
from milestones.exercise.stubs import stub, wrap


def header(milestone: str, hints: bool) -> str:
    """The comment that opens each file with stubs: the raw docs/*.md show include markers, the built site the code."""
    text = (f"Your {milestone}: each function whose body is a TODO is yours to write, in step order, and `make check "
            f"M={milestone}` checks them (STEP=n: step n alone). Read the lesson on the built site: `make docs-serve`, "
            f"then http://127.0.0.1:8000/{milestone}/ (docs/{milestone}.md, its source, shows `--8<--` lines where "
            "the site shows code).")
    if not hints:
        text += (f" Written with HINTS=0: each TODO states the contract alone; milestones/course/{milestone}.py "
                 "has the hints.")
    return "".join(f"# {line}\n" for line in wrap(text, 110))


def stubbed_steps(milestone: str, extras: bool) -> list[tuple[int, Step]]:
    """The steps whose functions a skeleton leaves to write (numbered from 1): every step with ``extras``, else the
    core's alone."""
    return [(number, step) for number, step in enumerate(LESSONS[milestone], 1) if extras or not step.optional]


def start(milestone: str, destination: Path, hints: bool = True, extras: bool = False) -> list[str]:
    """Write the skeleton of ``milestone`` to ``destination``; the functions left to write, in step order."""
    if destination.exists():
        raise FileExistsError(f"{destination} already exists: your work is never overwritten. Remove it, "
                              "or give another folder with --to")
    shutil.copytree(PACKAGE_ROOT / milestone, destination, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PACKAGE_ROOT / SHARED, destination / SHARED, ignore=shutil.ignore_patterns("__pycache__"))
    todo, stubbed = [], set()
    for number, step in stubbed_steps(milestone, extras):
        for exercise in step.exercises:
            path = destination / exercise.file
            path.write_text(stub(path.read_text(), milestone, number, step, exercise, hints))
            stubbed.add(path)
            todo += [f"step {number} ({step.name}): {exercise.file}: {name}" for name in exercise.functions]
    for path in stubbed:
        path.write_text(header(milestone, hints) + path.read_text())
    return todo
