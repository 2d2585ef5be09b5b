"""``milestones.runtime.threads.InOrderThread``: results in the order items were put, on a thread of its own or
inline; the caller's torch thread count passed on; a dead thread reported, not waited for; closed, it refuses."""

from __future__ import annotations

import threading

import pytest
import torch

from milestones.runtime.threads import InOrderThread


@pytest.mark.parametrize("threaded", [True, False])
def test_results_come_out_in_the_order_items_went_in(threaded):
    seen = []
    steps = InOrderThread(lambda n: (seen.append(threading.current_thread().name), n * n)[1], "squarer", threaded)
    for n in range(20):
        steps.put(n)
    assert [steps.get() for _ in range(20)] == [n * n for n in range(20)]
    assert set(seen) == ({"squarer"} if threaded else {threading.current_thread().name})
    steps.close()
    assert steps.thread is None or not steps.thread.is_alive()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        steps.put(1)


def test_the_thread_runs_with_the_callers_torch_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = InOrderThread(lambda _: torch.get_num_threads(), "counter", True)
        steps.put(None)
        assert steps.get() == 1
        steps.close()
    finally:
        torch.set_num_threads(before)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_dead_thread_is_reported_not_waited_for():
    def dies(_):
        raise SystemExit

    steps = InOrderThread(dies, "dying worker", True)
    steps.put(None)
    with pytest.raises(RuntimeError, match="the dying worker has stopped"):
        steps.get()
