"""The GPU runbook's steps as processes: started, logged as they print, stopped at a deadline, and what each came to.

A step of tests/gpu_runbook.py is a command run from the repository root in a process group of its own, so that a
step past its share of a loan is stopped with its children and keeps what it printed.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

REPO_ROOT = Path(__file__).resolve().parents[1]
STOPPED = 124  # a step stopped at its time limit, as timeout(1) says it
NO_TESTS = 5  # pytest: the -k expression selected no test


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a step came to, as summary.txt says it; ``ok`` is whether ``all`` still exits 0."""

    text: str
    ok: bool


NOT_RUN = Outcome("not run (no time left)", False)


def outcome(status: int, tests: bool = False) -> Outcome:
    """A step's exit status in words; for a test group, pytest's 'no test selected' is not a failure."""
    if status == 0:
        return Outcome("ok", True)
    if tests and status == NO_TESTS:
        return Outcome("no tests (none selected)", True)
    if status == STOPPED:
        return Outcome("stopped at its time limit", False)
    return Outcome(f"killed by signal {-status}" if status < 0 else f"failed (exit status {status})", False)


def chained(commands: list[list[str]]) -> list[str]:
    """One command that runs ``commands`` in turn and stops at the first that fails (a step's log keeps them all)."""
    return commands[0] if len(commands) == 1 else ["sh", "-c", " && ".join(shlex.join(c) for c in commands)]


@dataclass(slots=True)
class Step:
    """A command running from the repository root, its output copied into its log as it comes (a step stopped at
    its time limit keeps what it printed), and to the terminal if ``echo``."""

    process: subprocess.Popen
    log: Path
    began: float  # time.monotonic() when it started
    ended: float | None = None  # when its output closed: it exited, or was stopped
    copier: threading.Thread | None = None

    @classmethod
    def start(cls, command: list[str], log: Path, echo: bool = True) -> Step:
        print("$", shlex.join(command), flush=True)
        sink = log.open("w")
        sink.write("$ " + shlex.join(command) + "\n")
        sink.flush()
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)  # its own group: stopped with its children
        step = cls(process, log, time.monotonic())
        step.copier = threading.Thread(target=step._copy, args=(sink, echo), daemon=True)
        step.copier.start()
        return step

    def _copy(self, sink: TextIO, echo: bool) -> None:
        with sink:
            for line in self.process.stdout:
                if echo:
                    sys.stdout.write(line)
                sink.write(line)
                sink.flush()
        self.ended = time.monotonic()

    @property
    def seconds(self) -> float:
        """How long it ran (so far, while it runs)."""
        return (self.ended or time.monotonic()) - self.began

    def stop(self) -> None:
        """Kill it and its children if it is still running."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def finish(self, deadline: float | None = None) -> int:
        """Its exit status; at ``deadline`` (time.monotonic()) it is stopped, says so in its log, and gives 124."""
        try:
            status = self.process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            status = STOPPED
        self.copier.join()
        if status == STOPPED:
            with self.log.open("a") as sink:
                sink.write("runbook: stopped at its time limit (what it wrote so far is kept)\n")
        return status
