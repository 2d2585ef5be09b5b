"""The diff is the lesson: a milestone changes only the files it declares, the rest are byte-identical copies."""

from __future__ import annotations

import ast
import filecmp
from pathlib import Path

import pytest

import milestones
from milestones import CHANGED_FILES, MILESTONES

ROOT = Path(milestones.__file__).parent


SOURCE_SUFFIXES = (".py", ".cpp")


def source_files(milestone: str) -> set[str]:
    """The milestone's source files (a C++ file would count too; the shared kernel lives in milestones/kernels)."""
    return {p.name for p in (ROOT / milestone).iterdir() if p.suffix in SOURCE_SUFFIXES}


@pytest.mark.parametrize("previous, current", list(zip(MILESTONES, MILESTONES[1:])))
def test_undeclared_files_are_identical_to_the_previous_milestone(previous, current):
    declared = CHANGED_FILES[current]
    changed = {name for name in source_files(current) if name not in source_files(previous)}
    changed |= {
        name for name in source_files(current) & source_files(previous)
        if not filecmp.cmp(ROOT / previous / name, ROOT / current / name, shallow=False)
    }
    assert changed <= declared, (
        f"{current} changes {sorted(changed - declared)} without declaring it in milestones.CHANGED_FILES"
    )
    assert declared <= changed, (
        f"{current} declares {sorted(declared - changed)} as changed, but they are identical: drop them"
    )
    assert source_files(previous) <= source_files(current), f"{current} lost files of {previous}"


def test_every_milestone_is_declared():
    assert set(CHANGED_FILES) == set(MILESTONES)
    assert all((ROOT / m / "__init__.py").is_file() for m in MILESTONES)


def test_milestones_never_import_each_other():
    for milestone in MILESTONES:
        for path in (ROOT / milestone).glob("*.py"):
            text = path.read_text()
            others = [m for m in MILESTONES if m != milestone and f"milestones.{m}" in text]
            assert not others, f"{path} imports {others}: each milestone must stand alone"


def module_imports(path: Path) -> set[str]:
    """The sibling modules a module imports (``from .x import ...``), type-only imports included."""
    return {node.module.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}


def test_imports_inside_a_milestone_point_one_way(milestone):  # parametrized by conftest.py
    """No import cycle, not even through a type hint: a reader can follow the package from the top down."""
    graph = {path.stem: module_imports(path) for path in (ROOT / milestone).glob("*.py")}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError(f"{milestone}: import cycle {' -> '.join((*path[path.index(module):], module))}")
        if module not in done:
            for imported in graph.get(module, ()):
                visit(imported, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())
