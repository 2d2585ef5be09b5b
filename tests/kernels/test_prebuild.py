"""make model's side-by-side build of the C++ kernels (milestones/kernels/prebuild.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from milestones.kernels import prebuild

KERNELS = Path(prebuild.__file__).parent


def test_every_kernel_the_engines_build_is_prebuilt():
    """Each function of milestones/kernels that calls compile_library is a loader the prebuild runs: a new kernel
    left out would be built one by one inside the first run again."""
    callers = set()
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name != "compile_library" and any(
                    isinstance(call, ast.Call) and getattr(call.func, "id", None) == "compile_library"
                    for call in ast.walk(node)):
                callers.add((f"milestones.kernels.{path.stem}", node.name))
    assert callers == set(prebuild.LOADERS.items())


def test_a_kernel_that_fails_to_build_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(prebuild.LOADERS, "milestones.kernels.build", "no_such_loader")
    module, seconds, error = prebuild.build("milestones.kernels.build")
    assert module == "milestones.kernels.build" and seconds >= 0 and "no_such_loader" in error
