"""Host-to-device copies that do not wait: how every milestone moves a step's lists to the device.

A platform matter, not a lesson: until m6 nothing runs while a step is prepared, so waiting would cost
nothing; from m6 on the host prepares the next step while the device computes, and a copy that waits for
the device would undo the overlap.
"""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``values`` on ``device``. On CUDA the copy goes through pinned memory and does not wait for the
    stream: a plain copy from a list would block the worker until the step before has finished computing."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostStaging:
    """Host twins of a step's static device buffers: a step's lists reach the buffers with no new tensor, written
    through numpy views, then copied up without waiting (a tensor made from a list per buffer per step cost more
    than the rest of a replayed step's host work at batch 64).

    On CUDA each buffer has two pinned twins, used in turn: a twin is written again only once the copy out of it,
    two steps back, is done (an event says so; by then it always is). On a CPU each buffer is its own twin."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.twins: dict[int, list[torch.Tensor]] = {}  # by the buffer's address
        self.copied: dict[int, list[torch.cuda.Event | None]] = {}  # each twin's last copy to the device
        self.turn: dict[int, int] = {}  # which twin the next step writes
        for buffer in buffers:
            key = buffer.data_ptr()
            if buffer.is_cuda:
                self.twins[key] = [torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True) for _ in range(2)]
                self.copied[key] = [None, None]
            else:
                self.twins[key] = [buffer]
            self.turn[key] = 0
        self.arrays = {key: [twin.numpy() for twin in twins] for key, twins in self.twins.items()}

    def host(self, buffer: torch.Tensor):
        """The numpy array to write the buffer's values into this step (its own memory on a CPU)."""
        key = buffer.data_ptr()
        turn = self.turn[key]
        if buffer.is_cuda and (event := self.copied[key][turn]) is not None:
            event.synchronize()  # the copy out of this twin, two steps back
        return self.arrays[key][turn]

    def upload(self, buffer: torch.Tensor, rows: int) -> None:
        """Copy the first ``rows`` rows written into ``host(buffer)`` to the buffer (nothing to do on a CPU)."""
        if not buffer.is_cuda:
            return
        key = buffer.data_ptr()
        turn = self.turn[key]
        buffer[:rows].copy_(self.twins[key][turn][:rows], non_blocking=True)
        event = self.copied[key][turn] = torch.cuda.Event()
        event.record()
        self.turn[key] = 1 - turn
