"""Build a milestone yourself: a skeleton to fill in, checked by the project's own tests.

    python -m milestones.exercise start m3 [--to workspace/m3]   # or: make exercise M=m3
    python -m milestones.exercise check m3 [--impl workspace/m3]  # or: make check M=m3

``start`` copies the reference package ``milestones/mK`` (the previous milestone plus
the lesson's changes) and replaces the body of every function that *is* the lesson by
``raise NotImplementedError``, with a TODO saying what to build and which step checks
it. The lesson's functions are named in ``milestones/course/`` (``mK.py`` for milestone mK) by the snippet
sections the docs already show, so skeletons are generated from the reference and never drift.

``check`` runs the milestone's suite against the learner's package, one step at a time
from the smallest piece to the whole engine (the last steps compare it token for token
with the reference m(K-1) and run the contract every milestone keeps), and prints
"k of n steps pass". The tests import the learner's package in place of ``milestones.mK``
(``install`` below, called by the tests' conftest when ``MILESTONE_IMPL`` is set).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from milestones.course import LESSONS, Exercise, Step

PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent
IMPL_VARIABLE = "MILESTONE_IMPL"  # "m3=/path/to/package": the tests use that package as milestones.m3


def section_lines(source: str, section: str) -> tuple[int, int]:
    """The first and last line (1-based) of the named snippet section (its start and end markers)."""
    marks = {m.group(1): number for number, line in enumerate(source.splitlines(), 1)
             if (m := re.search(rf"--8<-- \[(start|end):{section}\]", line))}
    if set(marks) != {"start", "end"}:
        raise LookupError(f"no snippet section {section!r}")
    return marks["start"], marks["end"]


def functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Every function of a module by its qualified name: ``grow`` at the top level, ``BlockManager.grow`` in a class."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
    return found


def wrap(text: str, width: int) -> list[str]:
    """``textwrap.wrap``, except that a `code span` is never broken across lines (a longer line rather)."""
    unbroken = re.sub(r"`[^`]*`", lambda span: span.group().replace(" ", "\0"), text)
    lines = textwrap.wrap(unbroken, width, break_long_words=False, break_on_hyphens=False)
    return [line.replace("\0", " ") for line in lines]


def stub(source: str, milestone: str, step_number: int, step: Step, exercise: Exercise) -> str:
    """The source with the exercise's function bodies replaced by a TODO and ``raise NotImplementedError``."""
    first, last = section_lines(source, exercise.section)
    defined = functions(ast.parse(source))
    lines = source.splitlines(keepends=True)
    for name in sorted(exercise.functions, key=lambda n: -defined[n].lineno):  # bottom up: line numbers stay valid
        node = defined[name]
        if not first < node.lineno < last:
            raise LookupError(f"{name} is not inside the snippet section {exercise.section!r}")
        body = node.body
        has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        begin = body[0].end_lineno if has_docstring else body[0].lineno - 1  # 0-based index of the first body line
        indent = " " * body[0].col_offset
        todo = wrap(f"TODO({milestone}, step {step_number}, {step.name}): {exercise.todo}", 100)
        message = f"{name} is yours to write (see its TODO in {exercise.file}); `make check M={milestone}` checks it"
        lines[begin : node.end_lineno] = [
            *(f"{indent}# {line}\n" for line in todo),
            f"{indent}raise NotImplementedError({message!r})\n",
        ]
    return "".join(lines)


def start(milestone: str, destination: Path) -> list[str]:
    """Write the skeleton of ``milestone`` to ``destination``; the functions left to write, in step order."""
    if destination.exists():
        raise FileExistsError(f"{destination} already exists: your work is never overwritten. Remove it, "
                              "or give another folder with --to")
    shutil.copytree(PACKAGE_ROOT / milestone, destination, ignore=shutil.ignore_patterns("__pycache__"))
    todo = []
    for number, step in enumerate(LESSONS[milestone], 1):
        for exercise in step.exercises:
            path = destination / exercise.file
            path.write_text(stub(path.read_text(), milestone, number, step, exercise))
            todo += [f"step {number} ({step.name}): {exercise.file}: {name}" for name in exercise.functions]
    return todo


def install(milestone: str, path: str | Path) -> None:
    """Make ``milestones.<milestone>`` the package at ``path`` (a learner's), for every import that follows."""
    import milestones

    folder = Path(path).resolve()
    if not (folder / "__init__.py").is_file():
        raise FileNotFoundError(f"{folder} is not a package (no __init__.py): give the folder `start` created")
    name = f"milestones.{milestone}"
    init = folder / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    setattr(milestones, milestone, module)
    spec.loader.exec_module(module)


def check(milestone: str, implementation: Path, steps: int | None = None) -> int:
    """Run the milestone's steps against the learner's package; print each verdict and the first failure."""
    chosen = LESSONS[milestone][:steps]
    env = {**os.environ, "MILESTONES": milestone, IMPL_VARIABLE: f"{milestone}={implementation.resolve()}"}
    print(f"Checking {implementation} as {milestone}, {len(chosen)} steps, smallest first:")
    passed, first_failure = 0, None
    for number, step in enumerate(chosen, 1):
        began = time.perf_counter()
        command = [sys.executable, "-m", "pytest", "-x", "-q", "--tb=short", "-p", "no:cacheprovider",
                   "-p", "no:logging", *step.tests]
        result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        ok = result.returncode == 0
        passed += ok
        print(f"  step {number} of {len(chosen)}: {step.name:40} {'pass' if ok else 'FAIL'} "
              f"({time.perf_counter() - began:.0f} s)", flush=True)
        if not ok and first_failure is None:
            first_failure = (number, step, result.stdout + result.stderr)
    print(f"{passed} of {len(chosen)} steps pass")
    if first_failure is not None:
        number, step, output = first_failure
        print(f"\nThe first failing step, {number} ({step.name}): {step.hint}\n")
        print(failure_report(output))
    return 0 if passed == len(chosen) else 1


def failure_report(output: str, max_lines: int = 60) -> str:
    """pytest's report from its first failure (or collection error) on, cut to ``max_lines`` lines."""
    lines = output.rstrip().splitlines()
    first = next((i for i, line in enumerate(lines) if re.match(r"=+ (FAILURES|ERRORS) =+$", line)), 0)
    shown = lines[first : first + max_lines]
    return "\n".join(shown + (["...", *lines[-3:]] if len(lines) > first + max_lines else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m milestones.exercise", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    begin = commands.add_parser("start", help="write a skeleton of the milestone to fill in")
    begin.add_argument("milestone", choices=sorted(LESSONS))
    begin.add_argument("--to", type=Path, help="where (default: workspace/<milestone>)")
    judge = commands.add_parser("check", help="run the milestone's suite against your package, step by step")
    judge.add_argument("milestone", choices=sorted(LESSONS))
    judge.add_argument("--impl", type=Path, help="your package (default: $IMPL, else workspace/<milestone>)")
    judge.add_argument("--steps", type=int, help="run only the first N steps")
    args = parser.parse_args(argv)
    default = REPO_ROOT / "workspace" / args.milestone
    if args.command == "start":
        destination = args.to or default
        try:
            todo = start(args.milestone, destination)
        except FileExistsError as err:
            print(err, file=sys.stderr)
            return 2
        print(f"Wrote {destination}, the reference {args.milestone} with its lesson left to you:")
        print("\n".join(f"  {line}" for line in todo))
        print(f"Check it with: make check M={args.milestone} IMPL={destination}")
        return 0
    implementation = args.impl or Path(os.environ.get("IMPL") or default)
    if not (implementation / "__init__.py").is_file():
        print(f"{implementation} is not a package: run `make exercise M={args.milestone}` first, "
              "or give your package with IMPL=...", file=sys.stderr)
        return 2
    return check(args.milestone, implementation, args.steps)


if __name__ == "__main__":
    sys.exit(main())
