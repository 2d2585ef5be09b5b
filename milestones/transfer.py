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
