"""``milestones.runtime.processes``: a worker that fails, exits or stays silent while starting is named and none is
left; one told to stop ends by itself; a step that fails midway kills them all at once; closing twice is harmless."""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass, field

import pytest

from milestones.runtime import processes
from milestones.runtime.processes import WorkerProcesses


def load_failing() -> None:
    raise ValueError("no shard for this rank")


def load_exiting() -> None:
    os._exit(3)


def load_silent() -> None:
    time.sleep(60)


def load_waiting(stop) -> object:
    return stop.wait  # serves until the parent sets the event


@dataclass(slots=True)
class Waiters(WorkerProcesses):
    stop: object = field(default_factory=lambda: multiprocessing.get_context("spawn").Event())

    def tell_stop(self) -> None:
        self.stop.set()


@pytest.mark.parametrize("load, message", [
    (load_failing, "(?s)test worker 1 failed while starting:\n.*ValueError: no shard for this rank"),
    (load_exiting, "test worker 1 exited with code 3 while starting"),
    (load_silent, "test worker 1 did not report 'ready' within 1.0 s"),
])
def test_a_worker_that_does_not_get_ready_is_named_and_none_is_left(load, message, monkeypatch):
    monkeypatch.setattr(processes, "STOP_TIMEOUT", 1.0)  # the silent one is killed after it
    workers = Waiters("test worker")
    workers.start(load)
    workers.wait_for("started")
    with pytest.raises(RuntimeError, match=message):
        workers.wait_for("ready", 1.0)
    assert workers.closed and not multiprocessing.active_children()


def test_workers_told_to_stop_end_by_themselves_and_closing_again_does_nothing():
    workers = Waiters("test worker")
    for _ in range(2):
        workers.start(load_waiting, workers.stop)
    workers.wait_for("started")
    workers.wait_for("ready")
    assert workers.stopped() is None
    workers.close()
    assert [process.exitcode for process in workers.processes] == [0, 0]  # not killed
    workers.close()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("error, raised", [(ValueError("sampler broke"), RuntimeError), (KeyboardInterrupt(),
                                                                                           KeyboardInterrupt)])
def test_abandon_kills_every_worker_at_once_and_says_why(error, raised):
    workers = Waiters("test worker")
    workers.start(load_waiting, workers.stop)
    workers.wait_for("started")
    workers.wait_for("ready")
    start = time.monotonic()
    with pytest.raises(raised) as caught:
        workers.abandon(error, "a test step")
    assert time.monotonic() - start < 5  # killed, not given STOP_TIMEOUT
    assert not workers.stop.is_set() and workers.processes[0].exitcode is not None
    if raised is RuntimeError:
        assert "a test step failed, so every test worker was stopped" in str(caught.value)
        assert caught.value.__cause__ is error


def test_a_worker_that_died_is_named_by_stopped():
    workers = Waiters("test worker")
    workers.start(load_waiting, workers.stop)
    workers.wait_for("started")
    workers.wait_for("ready")
    workers.processes[0].kill()
    workers.processes[0].join()
    assert workers.stopped() == "test worker 1 has exited (code -9)"
    workers.close()
    assert not multiprocessing.active_children()
