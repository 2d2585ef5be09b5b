"""m8's messages: what rank 0 sends the other ranks before each step (``send_step``) reaches every one of them, whole
and in order (``receive_step``), and one rank sends nothing.

Every rank is a thread of this process over a real gloo group, as in conftest.run_ranks, but
the group waits 10 seconds at most (the engine's waits as long as the engine stays idle): a
rank that receives less or more than rank 0 sent fails the test rather than hanging it.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from milestones.m8.attention import RequestSpan
from milestones.m8.dispatcher import Dispatch, GraphMode
from milestones.m8.distributed import SINGLE, TensorParallel
from milestones.m8.step import DecodeInputs, ModelInputs, ShardStep

TIMEOUT = timedelta(seconds=10)


def message_ranks(size: int, work) -> list:
    """``work(tp)`` on every rank of a group of ``size``, with a messages group alone; each rank's result, by rank."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    results: list = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, size, is_master=False)
            messages = dist.ProcessGroupGloo(dist.PrefixStore("messages", client), rank, size, TIMEOUT)
            results[rank] = work(TensorParallel(rank, size, None, messages))
        except BaseException as error:  # re-raised below, once every rank has ended
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def steps() -> list:
    """Steps of every kind and size, as rank 0 sends them: a decode step, a prefill, a long one, then None (stop)."""
    decode = ShardStep(DecodeInputs([5, -3], [7, 12], [7, 28], [[0], [1, 2]], [8, 13]), Dispatch(GraphMode.FULL, 2),
                       [-1, -2])
    prefill = ShardStep(ModelInputs([11, 12, 13], [0, 1, 2], [16, 17, 18], [1], [RequestSpan(0, 3, [1], 3)], [2],
                                    [], []), Dispatch(GraphMode.PIECEWISE, 8), [-3])
    long = ShardStep(DecodeInputs(list(range(5000)), list(range(5000)), list(range(5000)), [[0]] * 5000,
                                  [1] * 5000), Dispatch(GraphMode.NONE, 5000, "5000 tokens: more than the largest "
                                                                             "piecewise capture (512)"), [])
    return [decode, prefill, long, decode, None]


def test_every_rank_receives_rank_0s_steps_whole_and_in_order():
    sent = steps()

    def work(tp: TensorParallel) -> list:
        if tp.rank == 0:
            for step in sent:
                tp.send_step(step)
            return sent
        received = []
        while (step := tp.receive_step()) is not None:
            received.append(step)
        return [*received, None]

    for rank, received in enumerate(message_ranks(3, work)):
        assert received == sent, f"rank {rank} received {len(received)} steps, or other ones than rank 0 sent"


def test_one_rank_sends_nothing():
    assert SINGLE.send_step(steps()[0]) is None  # no group, no other rank: nothing to send, and no error
