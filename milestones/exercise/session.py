"""One step of a check: a pytest session over the step's tests, in this process, its report kept to be read.

In this process, so that torch and the tests are imported once for all the steps; kept rather than printed, so that
the check prints one line a step and the first failure alone.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass
from pathlib import Path

from milestones.course import Step

# Each step is one pytest session: -x, its first failure ends it; no cache of failures kept between the checks.
PYTEST_OPTIONS = ("-x", "-q", "--tb=short", "-p", "no:cacheprovider", "-p", "no:logging")


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
