"""The learner's whole path, end to end: every exercise can be completed, and completing it passes every step.

For each milestone with an exercise, ``start`` writes the skeleton; the test then fills it
the way a learner would, touching nothing but each stub (its TODO comment and its
``raise NotImplementedError``), which it replaces by the reference function's body, and the
comment that opens each file with stubs, which it removes; and ``check`` runs every step
against the filled package. A stub cut in the wrong place, or a
step whose tests need something the skeleton lost, fails here.

Each milestone's check reruns that milestone's own tests (the steps' files, the contract),
so that test is the slowest of the exercise tests (about 1 minute for m1, 3 for m7, on a
loaded two-core machine): it is marked ``real_model``, like the tests it reruns, and CI's
``make test`` runs it (it deselects no marker); ``make test-fast`` leaves it out. It walks
the first and the last milestone's paths. The milestones between add nothing a walk could
find that the quick tests and the suite do not: their filled packages are their references
byte for byte (tested here), the suite runs the same test files on those references, and
``tests/test_exercises.py`` runs every step of every skeleton through the same ``check``.
What a walk adds is the steps' files run one step at a time against a package outside
``milestones/``, the same mechanism for every milestone; walking all seven took a quarter
of CI's ``make test``.

The quick tests here run everywhere: filling the stubs gives back the reference byte for
byte, the "Build it yourself" page says what milestones/course/ declares, and the chapters keep
the lesson's functions folded.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from milestones.course import LESSONS
from milestones.exercise import PACKAGE_ROOT, REPO_ROOT
from milestones.exercise.skeleton import header, start
from milestones.exercise.stubs import functions, reference_path, section_lines
from tests.conftest import needs_compiler

# m5's steps, and those of the milestones copied from it, capture with torch.compile on a CPU: without a compiler
# they skip, and a skipped step proves nothing.
NEEDS_COMPILER = {m: needs_compiler for m in ("m5", "m6", "m7", "m8", "m9")}
ORDERED = sorted(LESSONS, key=lambda m: int(m.removeprefix("m")))
WALKED = (ORDERED[0], ORDERED[-1])  # the first and the last path, walked to the end (why: the docstring)


@dataclass(frozen=True, slots=True)
class Stub:
    """A stubbed function in a skeleton: its TODO comment and ``raise`` are lines ``first`` to ``last`` (0-based)."""

    name: str
    first: int
    last: int


def reference_body(source: str, name: str) -> list[str]:
    """The lines of the function's body after its docstring, or from the comment lines that open it: exactly what
    ``stubs.stub`` removes."""
    node = functions(ast.parse(source))[name]
    body, lines = node.body, source.splitlines(keepends=True)
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    begin = body[0].end_lineno if has_docstring else body[0].lineno - 1
    while not has_docstring and begin > node.lineno and lines[begin - 1].lstrip().startswith("#"):
        begin -= 1
    return lines[begin : node.end_lineno]


def find_stub(lines: list[str], name: str, node: ast.FunctionDef) -> Stub:
    """Where the stub is: the ``# TODO(`` comment lines and the ``raise NotImplementedError`` that ends the body."""
    raise_ = node.body[-1]
    assert isinstance(raise_, ast.Raise) and "NotImplementedError" in ast.unparse(raise_), (
        f"{name} does not end with `raise NotImplementedError`: it is not a stub"
    )
    first = raise_.lineno - 1
    while first > 0 and lines[first - 1].lstrip().startswith("#") and not lines[first].lstrip().startswith("# TODO("):
        first -= 1
    assert lines[first].lstrip().startswith("# TODO("), f"{name}: no `# TODO(` comment right above its raise"
    return Stub(name, first, raise_.end_lineno - 1)


def fill(skeleton: str, reference: str, names: set[str]) -> str:
    """The skeleton with each named stub replaced by the reference's body, as a learner writes it; nothing else."""
    defined = functions(ast.parse(skeleton))
    lines = skeleton.splitlines(keepends=True)
    stubs = [find_stub(lines, name, defined[name]) for name in names]
    for stub in sorted(stubs, key=lambda s: -s.first):  # bottom up: the line numbers above stay valid
        lines[stub.first : stub.last + 1] = reference_body(reference, stub.name)
    return "".join(lines)


def first_difference(ours: str, reference: str) -> str:
    """Where two sources first differ, to say what a fill got wrong."""
    a, b = ours.splitlines() + ["<end of file>"], reference.splitlines() + ["<end of file>"]
    number = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return f"line {number + 1}: filled {a[number]!r}, reference {b[number]!r}"


def package_files(folder: Path) -> dict[str, str]:
    """Every file of a package but the bytecode caches, by its path inside the package."""
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def write_skeleton(lesson: str, package: Path) -> None:
    """The lesson's skeleton with every function left to write, the optional steps' too (EXTRAS=1)."""
    start(lesson, package, extras=True)


def fill_steps(lesson: str, package: Path, numbers: set[int]) -> None:
    """Fill the stubs of the steps ``numbers`` (from 1) with the reference's bodies, as a learner writes them, and
    remove the comment that opens a file once none of its stubs is left."""
    chosen: dict[str, set[str]] = {}
    for number, step in enumerate(LESSONS[lesson], 1):
        for exercise in step.exercises:
            if number in numbers:
                chosen.setdefault(exercise.file, set()).update(exercise.functions)
    opening = header(lesson, hints=True)
    for file, names in sorted(chosen.items()):
        path = package / file
        skeleton = path.read_text()
        assert skeleton.startswith(opening), f"{file} does not open with the skeleton's comment"
        filled = fill(skeleton.removeprefix(opening), reference_path(lesson, file).read_text(), names)
        path.write_text(filled if "raise NotImplementedError(" not in filled else opening + filled)


def write_filled(lesson: str, package: Path) -> None:
    """The skeleton with every stub filled: the reference, if the stubs were cut in the right places."""
    write_skeleton(lesson, package)
    fill_steps(lesson, package, set(range(1, len(LESSONS[lesson]) + 1)))


@pytest.mark.parametrize("lesson", sorted(LESSONS))
def test_filling_only_the_stubs_gives_back_the_reference(lesson, tmp_path):
    """What the learner writes is all the skeleton lacks: filled, the package is the reference, byte for byte."""
    write_filled(lesson, tmp_path / lesson)
    reference = {**package_files(PACKAGE_ROOT / lesson),  # and its copy of the shared layer, in serving/
                 **{f"serving/{name}": text for name, text in package_files(PACKAGE_ROOT / "serving").items()}}
    filled = package_files(tmp_path / lesson)
    assert filled.keys() == reference.keys(), f"files: {sorted(filled.keys() ^ reference.keys())}"
    for name in reference:
        difference = first_difference(filled[name], reference[name]) if filled[name] != reference[name] else ""
        assert not difference, f"{name} differs from the reference after filling, at {difference}"


@pytest.mark.real_model
@pytest.mark.parametrize("lesson", [pytest.param(m, marks=NEEDS_COMPILER.get(m, ())) for m in WALKED])
def test_a_skeleton_filled_with_the_reference_bodies_passes_every_step(lesson, tmp_path):
    """The path can be walked to its end: a learner who writes each stub as the reference does passes every step.
    The lesson first: with the optional steps' functions still stubs (EXTRAS=1), the core steps before them pass;
    then those are filled too, and the steps from the first optional one on pass."""
    package, steps = tmp_path / lesson, LESSONS[lesson]
    write_skeleton(lesson, package)
    optional = [number for number, step in enumerate(steps, 1) if step.optional]
    first = optional[0] if optional else len(steps) + 1
    walks = [(set(range(1, first)), f"-{first - 1}"), (set(range(first, len(steps) + 1)), f"{first}-")]
    for numbers, chosen in walks if optional else [(set(range(1, len(steps) + 1)), "-")]:
        fill_steps(lesson, package, numbers)
        result = subprocess.run([sys.executable, "-m", "milestones.exercise", "check", lesson, "--impl", str(package),
                                 "--steps", chosen], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
        assert result.returncode == 0 and f"{len(numbers)} of {len(numbers)} steps pass" in result.stdout, (
            f"{lesson}, steps {chosen}, filled (the steps after them still stubs) do not pass (rc "
            f"{result.returncode}):\n{result.stdout}\n{result.stderr}")


@pytest.mark.parametrize("lesson", sorted(LESSONS))
def test_the_build_it_yourself_page_names_each_milestones_functions_and_steps(lesson):
    """docs/exercises.md says what each milestone asks of a learner, step by step: what milestones/course/ declares."""
    page = (REPO_ROOT / "docs" / "exercises.md").read_text()
    declared = {name: number for number, step in enumerate(LESSONS[lesson], 1)
                for exercise in step.exercises for name in exercise.functions}
    counts = f"{len(declared)} functions, {len(LESSONS[lesson])} steps"
    row = next((line for line in page.splitlines() if line.startswith(f"| [{lesson}](")), None)
    assert row is not None, f"docs/exercises.md: no row for {lesson} in the table of the path"
    assert counts in row, f"docs/exercises.md's row for {lesson} should say {counts!r}: {row}"
    section = re.search(rf"^### {lesson}: .*?(?=^##)", page, re.MULTILINE | re.DOTALL)
    assert section, f"docs/exercises.md: no section '### {lesson}: ...'"
    bullet = re.search(r"^- \*\*You write:\*\*(.*?)(?=^- \*\*)", section.group(), re.MULTILINE | re.DOTALL)
    assert bullet, f"docs/exercises.md: {lesson}'s section has no '- **You write:**' item"
    # "`A.f` and `g` (step 1), `h` (step 2): ..." names each function before the step that first checks it
    pieces = re.split(r"\(step (\d+)\)", bullet.group(1))
    named = {name: int(number) for text, number in zip(pieces[::2], pieces[1::2])
             for name in re.findall(r"`([\w.]+)`", text)}
    stray = re.findall(r"`([\w.]+)`", pieces[-1])
    assert named == declared and not stray, (
        f"docs/exercises.md, {lesson}'s 'You write' says {named} (and {stray} with no step); "
        f"milestones/course/{lesson}.py declares {declared}"
    )


INCLUDE = re.compile(r'(?P<indent> *)--8<-- "milestones/(?P<package>m\d+|serving)/(?P<file>[\w.]+)'
                     r'(?::(?P<section>[\w-]+))?"')


@pytest.mark.parametrize("lesson", sorted(LESSONS))
def test_the_chapter_folds_every_listing_of_a_lesson_function(lesson):
    """A listing that shows a function the learner writes is the answer: it stays folded until opened on purpose."""
    lines = (REPO_ROOT / "docs" / f"{lesson}.md").read_text().splitlines()
    written = {(exercise.file, name) for step in LESSONS[lesson] for exercise in step.exercises
               for name in exercise.functions}
    for number, line in enumerate(lines):
        include = INCLUDE.fullmatch(line)
        if not include or include["package"] not in (lesson, "serving"):
            continue
        file = include["file"] if include["package"] == lesson else f"serving/{include['file']}"  # the shared layer's
        source = reference_path(lesson, file).read_text()
        first, last = section_lines(source, include["section"]) if include["section"] else (0, 1 << 30)
        shown = sorted(name for name, node in functions(ast.parse(source)).items()
                       if (file, name) in written and first < node.lineno < last)
        if not shown:
            continue
        above = number - 1
        while above > 0 and (not lines[above].strip() or lines[above].startswith("    ")):
            above -= 1
        folded = (include["indent"] == "    " and lines[above].startswith('??? example "The reference ')
                  and lines[above].endswith('(open once you have written yours)"'))
        assert folded, (f"docs/{lesson}.md line {number + 1} shows {shown}, which the learner writes, in the open: "
                        f"fold it in a '??? example \"The reference ... (open once you have written yours)\"' block")
