"""Host-to-device copies that do not wait: the one helper every part of a launched step uses to move lists over."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``values`` on ``device``. On CUDA the copy goes through pinned memory and does not wait for the
    stream: a plain copy from a list would block the worker until the step before has finished computing."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
