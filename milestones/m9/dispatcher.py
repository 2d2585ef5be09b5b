"""How a step runs, decided from three numbers before it runs: m5's dispatcher (vLLM's ``CudagraphDispatcher``).

A captured graph replays fixed shapes, so a step is first described by what fixes its shapes, a
``BatchDescriptor`` (its tokens, its requests, and whether every request decodes exactly one token), and then
sent one of three ways:

* FULL: a step of decodes whose rows (a token each) fit a captured batch size replays the whole step, attention
  included (``graph_runner.py``), padded up to the smallest captured size that holds it;
* PIECEWISE: any other step whose tokens fit a captured token count replays everything but attention, padded up
  to that count, and runs each layer's attention eagerly between the pieces (``piecewise.py``): prefill chunks of
  any lengths share the same graphs, for attention is the one part whose work depends on them;
* NONE: the step runs eagerly, as in m4, for a reason the dispatcher gives (and the engine counts).

Torch-free, like the scheduler: tested with numbers alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class GraphMode(Enum):
    FULL = "full"  # the whole step replayed
    PIECEWISE = "piecewise"  # the pieces between attention calls replayed, attention eager
    NONE = "none"  # eager


# --8<-- [start:records]
@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """What decides how a step can run: the shapes a graph would have to match."""

    num_tokens: int  # tokens computed this step
    num_reqs: int  # requests in the step
    uniform_decode: bool  # every request computes exactly one token, its last


@dataclass(frozen=True, slots=True)
class Dispatch:
    """How one step runs, and at which captured size."""

    mode: GraphMode
    size: int  # FULL: the padded batch of rows; PIECEWISE: the padded token count; NONE: the step's own tokens
    reason: str = ""  # NONE: why the step runs eagerly
# --8<-- [end:records]


# --8<-- [start:dispatcher]
class GraphDispatcher:
    """Sends each step to the full graphs, the pieces, or the eager path (with the reason)."""

    def __init__(self, decode: list[int] | str, tokens: list[int] | str) -> None:
        """``decode``: the captured decode batch sizes, or why none were captured; ``tokens``: the token counts the
        pieces were captured for, or why none were."""
        self.decode, self.tokens = decode, tokens

    def dispatch(self, batch: BatchDescriptor) -> Dispatch:
        no_full = ""
        if batch.uniform_decode:
            if isinstance(self.decode, str):
                no_full = self.decode
            elif batch.num_tokens <= self.decode[-1]:  # a row a token
                return Dispatch(GraphMode.FULL, smallest_holding(self.decode, batch.num_tokens))
            else:
                no_full = (f"a decode step of {batch.num_tokens} rows ({batch.num_reqs} requests): more than the "
                           f"largest captured batch ({self.decode[-1]})")
        if isinstance(self.tokens, str):
            return Dispatch(GraphMode.NONE, batch.num_tokens, no_full or self.tokens)
        if batch.num_tokens > self.tokens[-1]:
            return Dispatch(GraphMode.NONE, batch.num_tokens,
                            f"{batch.num_tokens} tokens: more than the largest piecewise capture ({self.tokens[-1]})")
        return Dispatch(GraphMode.PIECEWISE, smallest_holding(self.tokens, batch.num_tokens))
# --8<-- [end:dispatcher]


def smallest_holding(sizes: list[int], count: int) -> int:
    """The smallest of the sorted ``sizes`` that is at least ``count``: what a step of ``count`` is padded to."""
    return next(size for size in sizes if size >= count)
