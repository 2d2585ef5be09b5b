"""The exercises stay real: every lesson function is stubbed, the skeleton fails every step, the reference passes.

The reference passing *all* steps is what the rest of the suite shows (the steps are its
own test files); here ``check`` runs the first step on an untouched copy of the reference,
to show that the learner's package really replaces ``milestones.mK`` in the tests. And the
learner's loop: ``check`` stops at the first failing step, runs the steps chosen (``STEP=n``,
``STEPS=a-b``), and reports a failure under the step that owns the function it was raised in;
``HINTS=0`` writes TODOs that state the contract alone.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from milestones import CHANGED_FILES, MILESTONES
from milestones.course import LESSONS, Exercise, Step
from milestones.exercise import PACKAGE_ROOT, REPO_ROOT
from milestones.exercise.cli import main, step_range
from milestones.exercise.failures import failure_report, owner, stub_in_output
from milestones.exercise.skeleton import header, start
from milestones.exercise.stubs import functions, reference_path, section_lines, stub, wrap
from tests.conftest import needs_compiler

TAUGHT = MILESTONES  # every milestone is an exercise, m1 (the model itself) included


def chained_to(milestone: str) -> str:
    """What a milestone's engine must give the same tokens as: the milestone before it, or transformers for m1."""
    index = MILESTONES.index(milestone)
    return MILESTONES[index - 1] if index else "transformers"


def own_files(milestone: str) -> set[str]:
    """The files that are the milestone's lesson: those it changes, or every file of m1, which changes none, and the
    shared layer's (its optional steps)."""
    if milestone == MILESTONES[0]:
        return {path.name for path in (PACKAGE_ROOT / milestone).glob("*.py")} | {
            f"serving/{path.name}" for path in (PACKAGE_ROOT / "serving").glob("*.py")}
    return CHANGED_FILES[milestone]


def test_every_milestone_has_a_lesson_whose_steps_end_with_the_chain_and_the_contract():
    assert sorted(LESSONS) == TAUGHT
    for milestone, steps in LESSONS.items():
        assert steps[-1].tests == ("tests/contract",), milestone
        assert any(f"test_vs_{chained_to(milestone)}.py" in " ".join(step.tests) for step in steps), milestone
        for step in steps:
            for path in (t for t in step.tests if t.startswith("tests/")):
                assert (REPO_ROOT / path.split("::")[0]).exists(), f"{milestone}: no {path}"


def test_each_lesson_is_the_module_named_after_its_milestone_in_its_snippet_section():
    """milestones/course/mK.py holds mK's steps: docs/mK.md includes its section mK, docs/hooks/diffs.py reads it."""
    for milestone, steps in LESSONS.items():
        module = importlib.import_module(f"milestones.course.{milestone}")
        assert module.STEPS is steps, f"LESSONS[{milestone!r}] is not milestones/course/{milestone}.py's STEPS"
        section_lines(Path(module.__file__).read_text(), milestone)  # raises LookupError without the section


def test_the_docs_hook_finds_the_files_each_lesson_declares():
    """The hook folds a diff that shows a lesson's answers; it reads the lesson modules as text, not imported."""
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("diffs_hook", REPO_ROOT / "docs" / "hooks" / "diffs.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    for milestone, steps in LESSONS.items():
        declared = {exercise.file for step in steps for exercise in step.exercises}
        assert hook.lesson_files(REPO_ROOT, milestone) == declared, milestone
    assert hook.lesson_files(REPO_ROOT, "m0") == set()


@pytest.mark.parametrize("lesson", TAUGHT)
def test_exercises_name_functions_of_the_lessons_own_files(lesson):
    for step in LESSONS[lesson]:
        for exercise in step.exercises:
            assert exercise.file in own_files(lesson), f"{exercise.file} is not part of {lesson}'s lesson"
            source = reference_path(lesson, exercise.file).read_text()
            first, last = section_lines(source, exercise.section)
            defined = functions(ast.parse(source))
            for name in exercise.functions:
                assert name in defined and first < defined[name].lineno < last, f"{name} not in {exercise.section}"


@pytest.mark.parametrize("extras", [False, True], ids=["core", "extras"])
@pytest.mark.parametrize("lesson", TAUGHT)
def test_the_skeleton_stubs_exactly_the_lesson(lesson, extras, tmp_path):
    """The core's functions, and the optional steps' too with EXTRAS=1; every other function as the reference."""
    destination = tmp_path / lesson
    todo = start(lesson, destination, extras=extras)
    stubbed = {(e.file, name) for step in LESSONS[lesson] if extras or not step.optional for e in step.exercises
               for name in e.functions}
    assert len(todo) == len(stubbed) > 0
    files = [*((path, path.name) for path in (PACKAGE_ROOT / lesson).glob("*.py")),
             *((path, f"serving/{path.name}") for path in (PACKAGE_ROOT / "serving").glob("*.py"))]  # its copy
    for path, file in sorted(files):
        reference, skeleton = path.read_text(), (destination / file).read_text()
        ours = {name for exercise_file, name in stubbed if exercise_file == file}
        if not ours:
            assert skeleton == reference, f"{file} has no exercise but differs from the reference"
            continue
        reference_functions, skeleton_functions = functions(ast.parse(reference)), functions(ast.parse(skeleton))
        assert reference_functions.keys() == skeleton_functions.keys()
        for name, node in skeleton_functions.items():
            raises = any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in node.body)
            if name in ours:
                assert raises and not any(isinstance(n, ast.Return) for n in ast.walk(node)), name
            else:
                assert ast.unparse(node) == ast.unparse(reference_functions[name]), f"{name} changed"
        assert skeleton.startswith(header(lesson, hints=True)), f"{file} does not open with the header comment"
    with pytest.raises(FileExistsError, match="never overwritten"):
        start(lesson, destination)


def test_m1s_serving_features_are_an_optional_step_after_the_core():
    """The lesson first: penalties and log-probabilities are m1's optional step, after the loop, and no core step
    runs their tests (the core steps' tests ask for neither: tests/test_exercise_path.py walks the core with them
    left as stubs)."""
    steps = LESSONS["m1"]
    optional = [number for number, step in enumerate(steps, 1) if step.optional]
    assert [name for number in optional for e in steps[number - 1].exercises for name in e.functions] == [
        "LogitsProcessors.apply_penalties", "LogitsProcessors.logprobs", "ranked_logprobs"]
    core = [step for step in steps if not step.optional and step.exercises]
    assert optional and all(number > steps.index(core[-1]) + 1 for number in optional), "optional steps come last"
    for step in core:
        assert not any("penalties" in test or "logprobs" in test for test in step.tests), step.name


def test_a_todo_never_breaks_a_code_span_across_lines():
    span = "`table[p // block_size] * block_size + p % block_size`"
    lines = wrap("token p goes to slot " * 4 + span + ", then more words" * 3, 100)
    assert sum(span in line for line in lines) == 1, lines
    assert " ".join(lines) == "token p goes to slot " * 4 + span + ", then more words" * 3


def check(milestone: str, package: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "milestones.exercise", "check", milestone, "--impl", str(package),
                           *options], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)


# m5's tests capture with torch.compile on a CPU: without a compiler they skip, and a skipped step proves nothing.
NEEDS_COMPILER = {"m5": needs_compiler}


@pytest.mark.parametrize("lesson", [pytest.param(m, marks=NEEDS_COMPILER.get(m, ())) for m in TAUGHT])
def test_the_skeleton_fails_every_step_and_says_what_to_write(lesson, tmp_path):
    """Every step, run on past the first failure (``--keep-going``), fails on the skeleton with every function left to
    write (the optional steps' too): no step is free."""
    start(lesson, tmp_path / lesson, extras=True)
    result = check(lesson, tmp_path / lesson, "--keep-going")
    steps = len(LESSONS[lesson])
    assert result.returncode == 1, result.stdout + result.stderr
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("  step ")]
    assert len(verdicts) == steps and all(" FAIL (" in line for line in verdicts), result.stdout
    assert f"0 of {steps} steps pass" in result.stdout, result.stdout
    assert "is yours to write" in result.stdout and "NotImplementedError" in result.stdout, result.stdout


@pytest.mark.parametrize("lesson", TAUGHT)
def test_the_reference_copied_as_a_learners_package_passes_the_first_step(lesson, tmp_path):
    package = tmp_path / lesson
    shutil.copytree(PACKAGE_ROOT / lesson, package, ignore=shutil.ignore_patterns("__pycache__"))
    result = check(lesson, package, "--step", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 1 steps pass" in result.stdout


def reference_with_a_stub(lesson: str, number: int, name: str, folder: Path) -> Path:
    """A copy of the reference in which only ``name``, an exercise of step ``number``, is a stub."""
    shutil.copytree(PACKAGE_ROOT / lesson, folder, ignore=shutil.ignore_patterns("__pycache__"))
    step = LESSONS[lesson][number - 1]
    exercise = next(e for e in step.exercises if name in e.functions)
    path = folder / exercise.file
    only = Exercise(exercise.file, exercise.section, (name,), exercise.todo, exercise.how)
    path.write_text(stub(path.read_text(), lesson, number, step, only))
    return folder


def test_check_stops_at_the_first_failing_step_and_runs_no_later_one(tmp_path):
    package = reference_with_a_stub("m1", 2, "rotate_half", tmp_path / "m1")
    result = check("m1", package)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    verdicts, steps = {int(line.split()[1]): line for line in lines if line.startswith("  step ")}, len(LESSONS["m1"])
    assert sorted(verdicts) == list(range(1, steps + 1)), result.stdout
    assert " pass (" in verdicts[1] and " FAIL (" in verdicts[2], result.stdout
    assert all(verdicts[n].endswith(" not run") for n in range(3, steps + 1)), result.stdout
    assert f"1 of {steps} steps pass, step 2 fails, {steps - 2} not run" in result.stdout
    assert "The first failing step, 2 (rotary position embedding (RoPE))" in result.stdout
    assert "rotate_half is yours to write" in result.stdout


def test_a_failure_is_reported_under_the_step_that_owns_the_function_it_was_raised_in(tmp_path):
    """Step 5's test calls RMSNorm.forward, step 1's: the report names step 1 and gives step 1's hint."""
    package = reference_with_a_stub("m1", 1, "RMSNorm.forward", tmp_path / "m1")
    result = check("m1", package, "--step", "5")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout and "the failure is in step 1's RMSNorm.forward" in result.stdout, result.stdout
    assert f"which step 1 (RMSNorm) is about: {LESSONS['m1'][0].hint}" in result.stdout, result.stdout
    assert f"`make check M=m1 IMPL={package} STEP=1` runs that step alone" in result.stdout, result.stdout


def test_a_refusal_raised_on_purpose_is_the_callers_fault(tmp_path):
    """A lesson function that raises on purpose (BlockManager.grow's "needs 3 blocks but only 2 are free") was asked
    for something it must refuse: the report names the function that asked (the scheduler, a later step); a stub's
    NotImplementedError, or an error inside the function's own work, stays the function's."""
    source = textwrap.dedent("""\
        def grow(n):
            if n > 2:
                raise RuntimeError("needs more blocks")
            return [0] * n + n.missing


        def stubbed():
            raise NotImplementedError("yours to write")


        def schedule(n):
            return grow(n)
        """)
    (tmp_path / "lesson.py").write_text(source)
    lines = source.splitlines()
    at = {text.strip(): number for number, text in enumerate(lines, 1)}
    lesson = (Step("one", (), "", (Exercise("lesson.py", "s", ("grow", "stubbed"), ""),)),
              Step("two", (), "", (Exercise("lesson.py", "s", ("schedule",), ""),)))
    file, call = tmp_path / "lesson.py", at["return grow(n)"]
    assert owner(((file, call), (file, at['raise RuntimeError("needs more blocks")'])), tmp_path, lesson) == (
        2, "schedule")
    assert owner(((file, call), (file, at['raise NotImplementedError("yours to write")'])), tmp_path, lesson) == (
        1, "stubbed")
    assert owner(((file, call), (file, at["return [0] * n + n.missing"])), tmp_path, lesson) == (1, "grow")
    assert owner(((file, at['raise RuntimeError("needs more blocks")']),), tmp_path, lesson) == (1, "grow")


def test_a_stub_that_raised_in_another_process_owns_the_failure():
    """m8's ranks are processes: a stub that raises in one ends it, and the failure's traceback is rank 0's, in the
    collective that found it gone; the rank's traceback, printed, names the stub, and its step owns the failure."""
    lesson = (Step("one", (), "", (Exercise("model.py", "s", ("forward",), ""),)),
              Step("two", (), "", (Exercise("runner.py", "s", ("Runner.execute", "Runner.execute_shard"), ""),)))
    output = ("E   RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer\n"
              "----- Captured stderr call -----\nProcess tensor-parallel-rank-1:\nTraceback (most recent call last):\n"
              "NotImplementedError: Runner.execute_shard is yours to write (see its TODO in runner.py)\n")
    assert stub_in_output(output, lesson) == (2, "Runner.execute_shard")
    assert stub_in_output(output.replace("Runner.execute_shard", "Other.method"), lesson) is None
    assert stub_in_output(output.splitlines()[0], lesson) is None



def test_the_report_keeps_a_workers_stub_that_its_cut_would_lose():
    """m9's workers print their start-up progress and then a stub's traceback into the captured stderr: the report
    drops the progress bars and, past its cut, still shows which stub raised."""
    bar = "Capturing the decode step:  50%|#####     | 1/2 [00:03<00:03,  3.29s/batch size]"
    stub = "NotImplementedError: PrefillSide.hand_off is yours to write"
    output = "\n".join(["collected 1 item", "=" * 10 + " FAILURES " + "=" * 10, *[bar] * 40,
                         *[f"frame {i}" for i in range(70)], stub, "tail 1", "tail 2", "1 failed in 9.0s"])
    report = failure_report(output).splitlines()
    assert bar not in report and len(report) == 65
    assert report[-5:] == ["...", stub, "tail 1", "tail 2", "1 failed in 9.0s"]
    assert failure_report("=== FAILURES ===\nshort") == "=== FAILURES ===\nshort", "a short report is kept whole"


def test_step_ranges_name_steps_from_one_inclusive():
    assert step_range("2-5", 9) == range(2, 6)
    assert step_range("3-", 9) == range(3, 10)
    assert step_range("-4", 9) == range(1, 5)
    assert step_range("-", 9) == range(1, 10)
    assert step_range("7-7", 9) == range(7, 8)
    for spec, message in [("5", "takes a range"), ("two-three", "takes a range"), ("0-2", "are 1 to 9"),
                          ("4-2", "are 1 to 9"), ("3-12", "are 1 to 9")]:
        with pytest.raises(ValueError, match=message):
            step_range(spec, 9)


@pytest.mark.parametrize("options", [["--step", str(len(LESSONS["m1"]) + 1)], ["--steps", "0-3"],
                                     ["--step", "2", "--steps", "2-3"]])
def test_check_refuses_steps_the_lesson_does_not_have(options, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["check", "m1", "--impl", str(PACKAGE_ROOT / "m1"), *options])
    assert exit_.value.code == 2
    assert "usage:" in capsys.readouterr().err


def make_commands(*arguments: str) -> str:
    """What ``make -n`` would run for the arguments (nothing is run)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    return subprocess.run([make, "-n", *arguments], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout


def test_make_passes_step_steps_and_hints_through():
    assert "-m milestones.exercise check m1 --step 3" in make_commands("check", "M=m1", "STEP=3")
    assert "-m milestones.exercise check m7 --steps 2-4" in make_commands("check", "M=m7", "STEPS=2-4")
    assert "-m milestones.exercise start m1 --no-hints" in make_commands("exercise", "M=m1", "HINTS=0")
    assert "--no-hints" not in make_commands("exercise", "M=m1")
    assert "-m milestones.exercise start m1 --extras" in make_commands("exercise", "M=m1", "EXTRAS=1")
    assert "--extras" not in make_commands("exercise", "M=m1")


def todo_text(skeleton: str, name: str) -> str:
    """The comment right above a stub's ``raise``, its lines joined into the text they were wrapped from."""
    lines, end = skeleton.splitlines(), functions(ast.parse(skeleton))[name].body[-1].lineno - 1
    first = end
    while first > 0 and lines[first - 1].lstrip().startswith("#"):
        first -= 1
    return " ".join(line.strip().removeprefix("# ") for line in lines[first:end])


@pytest.mark.parametrize("lesson", TAUGHT)
def test_hints_0_writes_todos_that_state_the_contract_alone(lesson, tmp_path):
    start(lesson, tmp_path / "hints", hints=True, extras=True)
    start(lesson, tmp_path / "contract", hints=False, extras=True)
    for number, step in enumerate(LESSONS[lesson], 1):
        for exercise in step.exercises:
            hinted = (tmp_path / "hints" / exercise.file).read_text()
            bare = (tmp_path / "contract" / exercise.file).read_text()
            assert bare.startswith(header(lesson, hints=False)) and "HINTS=0" in header(lesson, hints=False)
            for name in exercise.functions:
                contract = f"TODO({lesson}, step {number}, {step.name}): {exercise.todo}"
                assert todo_text(bare, name) == contract, name
                assert todo_text(hinted, name) == contract + (f" How: {exercise.how}" if exercise.how else ""), name
