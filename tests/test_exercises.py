"""The exercises stay real: every lesson function is stubbed, the skeleton fails every step, the reference passes.

The reference passing *all* steps is what the rest of the suite shows (the steps are its
own test files); here ``check`` runs the first step on an untouched copy of the reference,
to show that the learner's package really replaces ``milestones.mK`` in the tests.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from milestones import CHANGED_FILES, MILESTONES
from milestones.course import LESSONS
from milestones.exercise import PACKAGE_ROOT, REPO_ROOT, functions, section_lines, start, wrap
from tests.conftest import needs_compiler

TAUGHT = MILESTONES  # every milestone is an exercise, m1 (the model itself) included


def chained_to(milestone: str) -> str:
    """What a milestone's engine must give the same tokens as: the milestone before it, or transformers for m1."""
    index = MILESTONES.index(milestone)
    return MILESTONES[index - 1] if index else "transformers"


def own_files(milestone: str) -> set[str]:
    """The files that are the milestone's lesson: those it changes, or every file of m1, which changes none."""
    if milestone == MILESTONES[0]:
        return {path.name for path in (PACKAGE_ROOT / milestone).glob("*.py")}
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
            source = (PACKAGE_ROOT / lesson / exercise.file).read_text()
            first, last = section_lines(source, exercise.section)
            defined = functions(ast.parse(source))
            for name in exercise.functions:
                assert name in defined and first < defined[name].lineno < last, f"{name} not in {exercise.section}"


@pytest.mark.parametrize("lesson", TAUGHT)
def test_the_skeleton_stubs_exactly_the_lesson(lesson, tmp_path):
    destination = tmp_path / lesson
    todo = start(lesson, destination)
    stubbed = {(e.file, name) for step in LESSONS[lesson] for e in step.exercises for name in e.functions}
    assert len(todo) == len(stubbed) > 0
    for path in sorted((PACKAGE_ROOT / lesson).glob("*.py")):
        reference, skeleton = path.read_text(), (destination / path.name).read_text()
        ours = {name for file, name in stubbed if file == path.name}
        if not ours:
            assert skeleton == reference, f"{path.name} has no exercise but differs from the reference"
            continue
        reference_functions, skeleton_functions = functions(ast.parse(reference)), functions(ast.parse(skeleton))
        assert reference_functions.keys() == skeleton_functions.keys()
        for name, node in skeleton_functions.items():
            raises = any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in node.body)
            if name in ours:
                assert raises and not any(isinstance(n, ast.Return) for n in ast.walk(node)), name
            else:
                assert ast.unparse(node) == ast.unparse(reference_functions[name]), f"{name} changed"
    with pytest.raises(FileExistsError, match="never overwritten"):
        start(lesson, destination)


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
    start(lesson, tmp_path / lesson)
    result = check(lesson, tmp_path / lesson)
    steps = len(LESSONS[lesson])
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"0 of {steps} steps pass" in result.stdout, result.stdout
    assert "is yours to write" in result.stdout and "NotImplementedError" in result.stdout, result.stdout


@pytest.mark.parametrize("lesson", TAUGHT)
def test_the_reference_copied_as_a_learners_package_passes_the_first_step(lesson, tmp_path):
    package = tmp_path / lesson
    shutil.copytree(PACKAGE_ROOT / lesson, package, ignore=shutil.ignore_patterns("__pycache__"))
    result = check(lesson, package, "--steps", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 1 steps pass" in result.stdout
