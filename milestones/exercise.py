"""Build a milestone yourself: a skeleton to fill in, checked by the project's own tests.

    python -m milestones.exercise start m3 [--to workspace/m3] [--no-hints] [--extras]  # make exercise M=m3 [HINTS=0]
    python -m milestones.exercise check m3 [--impl DIR] [--step N | --steps A-B]  # or: make check M=m3 [STEP=n]

``start`` copies the reference package ``milestones/mK`` (the previous milestone plus
the lesson's changes), with the shared serving layer beside it in ``serving/`` (its optional
steps are written there), and replaces the body of every function that *is* the lesson by
``raise NotImplementedError``, with a TODO saying what to build (the contract, then how,
unless ``--no-hints``) and which step checks it. The optional steps after the core (serving features such as
penalties and log-probabilities) come filled in unless ``--extras``. The lesson's functions are named in
``milestones/course/`` (``mK.py`` for milestone mK) by the snippet sections the docs already show, so skeletons are
generated from the reference and never drift.

``check`` runs the milestone's suite against the learner's package, one step at a time
from the smallest piece to the whole engine (the last steps compare it token for token
with the reference m(K-1) and run the contract every milestone keeps), stops at the first
step that fails, and prints "k of n steps pass". The steps run in this process, one pytest
session each, so torch and the tests are imported once. The tests import the learner's
package in place of ``milestones.mK`` (``install`` below, called by the tests' conftest when
``MILESTONE_IMPL`` is set).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import os
import re
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from milestones.course import LESSONS, Exercise, Step

PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent
IMPL_VARIABLE = "MILESTONE_IMPL"  # "m3=/path/to/package": the tests use that package as milestones.m3
SHARED = "serving"  # the shared layer a skeleton holds a copy of (milestones/serving), its optional steps' files


def reference_path(milestone: str, file: str) -> Path:
    """An exercise's file in the reference: in the milestone's package, or in the shared layer (``serving/...``)."""
    return PACKAGE_ROOT / file if file.startswith(f"{SHARED}/") else PACKAGE_ROOT / milestone / file


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


def todo_comment(milestone: str, step_number: int, step: Step, exercise: Exercise, hints: bool) -> list[str]:
    """The lines of a stub's TODO: the contract, then how to build it, unless hints are off (HINTS=0)."""
    lines = wrap(f"TODO({milestone}, step {step_number}, {step.name}): {exercise.todo}", 100)
    return lines + (wrap(f"How: {exercise.how}", 100) if hints and exercise.how else [])


def body_start(lines: list[str], node: ast.FunctionDef) -> int:
    """The 0-based index of the first line of the function's body that a stub replaces: the line after its docstring,
    else its first statement's, or the first of the comment lines right above that (a comment that opens a body
    tells what the body does: the answer)."""
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        return body[0].end_lineno
    begin = body[0].lineno - 1
    while begin > node.lineno and lines[begin - 1].lstrip().startswith("#"):  # never the def line itself
        begin -= 1
    return begin


def stub(source: str, milestone: str, step_number: int, step: Step, exercise: Exercise, hints: bool = True) -> str:
    """The source with the exercise's function bodies replaced by a TODO and ``raise NotImplementedError``."""
    first, last = section_lines(source, exercise.section)
    defined = functions(ast.parse(source))
    lines = source.splitlines(keepends=True)
    for name in sorted(exercise.functions, key=lambda n: -defined[n].lineno):  # bottom up: line numbers stay valid
        node = defined[name]
        if not first < node.lineno < last:
            raise LookupError(f"{name} is not inside the snippet section {exercise.section!r}")
        begin = body_start(lines, node)  # 0-based index of the first body line
        indent = " " * node.body[0].col_offset
        message = f"{name} is yours to write (see its TODO in {exercise.file}); `make check M={milestone}` checks it"
        lines[begin : node.end_lineno] = [
            *(f"{indent}# {line}\n" for line in todo_comment(milestone, step_number, step, exercise, hints)),
            f"{indent}raise NotImplementedError({message!r})\n",
        ]
    return "".join(lines)


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


def install(milestone: str, path: str | Path) -> None:
    """Make ``milestones.<milestone>`` the package at ``path`` (a learner's), for every import that follows, and
    ``milestones.serving`` its copy of the shared layer, where it has one (``start`` writes it)."""
    folder = Path(path).resolve()
    if not (folder / "__init__.py").is_file():
        raise FileNotFoundError(f"{folder} is not a package (no __init__.py): give the folder `start` created")
    if (folder / SHARED / "__init__.py").is_file():
        install_package(SHARED, folder / SHARED)  # first: the milestone's package imports it
    install_package(milestone, folder)


def install_package(name: str, folder: Path) -> None:
    """``milestones.<name>`` is the package in ``folder`` from now on; a module of the reference's, imported before,
    is forgotten."""
    import milestones

    qualified, init = f"milestones.{name}", folder / "__init__.py"
    if getattr(sys.modules.get(qualified), "__file__", None) == str(init):
        return  # installed already (by milestones/__init__.py, in a process that imported it with $MILESTONE_IMPL set)
    for stale in [m for m in sys.modules if m == qualified or m.startswith(qualified + ".")]:
        del sys.modules[stale]
    spec = importlib.util.spec_from_file_location(qualified, init, submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    setattr(milestones, name, module)
    spec.loader.exec_module(module)


def install_from_environment() -> None:
    """Install the package ``$MILESTONE_IMPL`` names, if it names one: ``milestones/__init__.py`` calls this, so that
    every process of a check runs the learner's package, those the tests start too (m8's ranks: ``spawn`` starts a
    fresh interpreter, which imports ``milestones.m8`` to find the function it runs, and would find the reference)."""
    if os.environ.get(IMPL_VARIABLE):
        install(*os.environ[IMPL_VARIABLE].split("=", 1))


# Each step is one pytest session: -x, its first failure ends it; no cache of failures kept between the checks.
PYTEST_OPTIONS = ("-x", "-q", "--tb=short", "-p", "no:cacheprovider", "-p", "no:logging")


def step_range(spec: str, count: int) -> range:
    """The step numbers ``A-B`` names, 1-based and inclusive (``A-``: from A on, ``-B``: up to B)."""
    match = re.fullmatch(r"(\d*)-(\d*)", spec.strip())
    if match is None:
        raise ValueError(f"--steps takes a range, A-B, A- or -B (got {spec!r}); one step is --step N")
    first, last = int(match[1] or 1), int(match[2] or count)
    if not 1 <= first <= last <= count:
        raise ValueError(f"steps {first} to {last}: the steps are 1 to {count}")
    return range(first, last + 1)


@dataclass(frozen=True, slots=True)
class StepRun:
    """What one step's pytest session gave: whether it passed, its time, its report, where its failure was raised."""

    passed: bool
    seconds: float
    output: str
    frames: tuple[tuple[Path, int], ...]  # (file, line) of the first failure's traceback, outermost first


class FirstFailure:
    """A pytest plugin that keeps the traceback of the session's first failure (or collection error)."""

    def __init__(self) -> None:
        self.frames: tuple[tuple[Path, int], ...] = ()

    def pytest_exception_interact(self, call) -> None:
        if not self.frames and call.excinfo is not None:
            self.frames = tuple((Path(entry.path), entry.lineno + 1) for entry in call.excinfo.traceback)


def run_step(step: Step) -> StepRun:
    """One pytest session over the step's tests, in this process, its report kept rather than printed."""
    import pytest

    failure, output, began = FirstFailure(), io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = pytest.main([*PYTEST_OPTIONS, *step.tests], plugins=[failure])
    if code == pytest.ExitCode.INTERRUPTED:
        raise KeyboardInterrupt
    return StepRun(code == pytest.ExitCode.OK, time.perf_counter() - began, output.getvalue(), failure.frames)


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


if __name__ == "__main__":
    sys.exit(main())
