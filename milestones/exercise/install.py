"""A learner's package in the place of ``milestones.mK``, for ``make check``: every import that follows finds it.

Kept apart from the rest, and light (no torch, no course), since ``milestones/__init__.py`` imports it in every
process of a check.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from milestones.exercise import SHARED

IMPL_VARIABLE = "MILESTONE_IMPL"  # "m3=/path/to/package": the tests use that package as milestones.m3


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
