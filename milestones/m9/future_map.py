"""Future ids: tokens the host has not seen yet, stood for by negative numbers until the device resolves them.

The host launches step N+1 before it has seen step N's tokens, so step N+1's inputs
cannot hold them: each token a step samples is given a *future id* (a negative number)
when the step is launched. The host writes that id where the token will go, and the
``FutureMap`` resolves it on the device, where the token already is, just before the
step that reads it runs (SGLang's future map). ``allocate`` runs on the host when a
step is prepared; ``resolve_`` and ``store`` run on the device, as part of the step.
"""

from __future__ import annotations

import torch

from milestones.transfer import to_device


# --8<-- [start:future_map]
class FutureMap:
    """The tokens sampled on the device, found by the future ids that stand for them on the host."""

    def __init__(self, size: int, device: torch.device) -> None:
        # A step's futures are read only by the step launched right after it, and at most max_num_seqs
        # rows sample per step, so a ring of two steps' worth is never overwritten before it is read.
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.next = 0

    def allocate(self, count: int) -> list[int]:
        """Future ids for ``count`` tokens about to be sampled (host side): -1, -2, ... wrapping around the ring."""
        size = self.tokens.shape[0]
        ids = [-1 - (self.next + i) % size for i in range(count)]
        self.next = (self.next + count) % size
        return ids

    def resolve_(self, input_ids: torch.Tensor) -> None:
        """Replace, in place and on the device, every future id in ``input_ids`` by the token it stands for."""
        found = self.tokens[(-1 - input_ids).clamp(min=0)]
        input_ids.copy_(torch.where(input_ids < 0, found, input_ids))

    def store(self, future_ids: list[int], tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens where the next step will look for them."""
        if future_ids:
            self.tokens[to_device([-1 - future for future in future_ids], torch.long, self.tokens.device)] = tokens
# --8<-- [end:future_map]
