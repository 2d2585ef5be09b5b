"""A prompt prefilled in one forward pass, then one token per step: the chunks, their masks and their names.

Shared by m1's attention and decoder-layer tests, which run m1's module and transformers'
(with its own cache) over the same chunks and compare them after every one.
"""

from __future__ import annotations

import torch

ROWS = 32  # the cache's rows per layer (max_model_len)


def chunks(prompt_len: int, total: int) -> list[tuple[int, int]]:
    """The prefill of the prompt, then one decode step per token: (start, end) of the tokens each computes."""
    return [(0, prompt_len), *((p, p + 1) for p in range(prompt_len, total))]


def causal_mask(start: int, end: int) -> torch.Tensor | None:
    """transformers' additive mask for tokens start..end-1 over rows 0..end-1 (None for one token: it sees all)."""
    if end - start == 1:
        return None
    rows, columns = torch.arange(start, end)[:, None], torch.arange(end)[None, :]
    return torch.zeros(end - start, end).masked_fill(columns > rows, float("-inf"))[None, None]


def what(start: int, end: int) -> str:
    """The chunk, as a failure message names it."""
    if start == 0:
        return f"the prefill of {end} tokens (token i sees rows 0..i)"
    return f"the decode step at position {start} (reading rows 0..{start})"
