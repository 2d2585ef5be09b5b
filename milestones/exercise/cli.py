"""The command line, ``python -m milestones.exercise start|check`` (``make exercise`` and ``make check``): its
arguments turned into a call of ``start`` or ``check``, and their errors into a message and an exit status."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import milestones.exercise
from milestones.course import LESSONS
from milestones.exercise import REPO_ROOT
from milestones.exercise.check import check
from milestones.exercise.skeleton import start


def step_range(spec: str, count: int) -> range:
    """The step numbers ``A-B`` names, 1-based and inclusive (``A-``: from A on, ``-B``: up to B)."""
    match = re.fullmatch(r"(\d*)-(\d*)", spec.strip())
    if match is None:
        raise ValueError(f"--steps takes a range, A-B, A- or -B (got {spec!r}); one step is --step N")
    first, last = int(match[1] or 1), int(match[2] or count)
    if not 1 <= first <= last <= count:
        raise ValueError(f"steps {first} to {last}: the steps are 1 to {count}")
    return range(first, last + 1)


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``, else the process's arguments): what ``start`` or ``check`` returns, its exit
    status."""
    description = milestones.exercise.__doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m milestones.exercise", description=description)
    commands = parser.add_subparsers(dest="command", required=True)
    begin = commands.add_parser("start", help="write a skeleton of the milestone to fill in")
    begin.add_argument("milestone", choices=sorted(LESSONS))
    begin.add_argument("--to", type=Path, help="where (default: workspace/<milestone>)")
    begin.add_argument("--no-hints", dest="hints", action="store_false",
                       help="TODOs that state the contract alone, without how to build it (make exercise HINTS=0)")
    begin.add_argument("--extras", action="store_true",
                       help="the optional steps' functions left to write too, not filled in (make exercise EXTRAS=1)")
    judge = commands.add_parser("check", help="run the milestone's suite against your package, step by step")
    judge.add_argument("milestone", choices=sorted(LESSONS))
    judge.add_argument("--impl", type=Path, help="your package (default: $IMPL, else workspace/<milestone>)")
    which = judge.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, metavar="N", help="run step N alone (make check STEP=N)")
    which.add_argument("--steps", metavar="A-B", help="run steps A to B, A- from A on, -B up to B (make STEPS=A-B)")
    judge.add_argument("--keep-going", action="store_true", help="run every chosen step, even after one fails")
    args = parser.parse_args(argv)
    default = REPO_ROOT / "workspace" / args.milestone
    if args.command == "start":
        return begin_exercise(args.milestone, args.to or default, args.hints, args.extras)
    count = len(LESSONS[args.milestone])
    try:
        numbers = step_range(f"{args.step}-{args.step}" if args.step is not None else args.steps or "-", count)
    except ValueError as error:
        parser.error(f"{args.milestone}: {error}")
    implementation = args.impl or Path(os.environ.get("IMPL") or default)
    if not (implementation / "__init__.py").is_file():
        print(f"{implementation} is not a package: run `make exercise M={args.milestone}` first, "
              "or give your package with IMPL=...", file=sys.stderr)
        return 2
    try:
        return check(args.milestone, implementation, numbers, args.keep_going)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def begin_exercise(milestone: str, destination: Path, hints: bool, extras: bool) -> int:
    """``start``, from the command line: what it wrote, or why it wrote nothing."""
    try:
        todo = start(milestone, destination, hints, extras)
    except FileExistsError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"Wrote {destination}, the reference {milestone} with its lesson left to you"
          f"{'' if hints else ' (HINTS=0: each TODO states the contract alone)'}:")
    print("\n".join(f"  {line}" for line in todo))
    for number, step in enumerate(LESSONS[milestone], 1):
        if step.optional and not extras:
            print(f"  step {number} ({step.name}) comes filled in: `make exercise M={milestone} EXTRAS=1` leaves "
                  "it to you too (the core steps never call it)")
    print(f"Check it with: make check M={milestone} IMPL={destination} (STEP=n for step n alone)")
    return 0
