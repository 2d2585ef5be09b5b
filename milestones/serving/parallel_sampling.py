"""Several samples of one prompt (``SamplingParams.n``): a child request per sample, one output for them all.

Each sample is a request of its own to the scheduler, a *child* with ``n=1`` and, when the
parent has a seed, the seed ``seed + i``: vLLM's rule, so the i-th sample of a seeded request
is the answer of that request alone with that seed. The engine hands back the parent's
output, whose ``outputs`` hold one completion per sample, in sample order.

From m4 on the samples share their prompt through the prefix cache. Admitted together, each
would compute the prompt, since blocks enter the cache once computed; so m4's engine adds the
first sample alone and hands the others to ``ParentRequest.held``, and they are released when
the first has its first token, to find the whole prompt cached and compute only its last token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SEED_RANGE, SamplingParams


@dataclass(slots=True)
class ParentRequest:
    """A request with n > 1 samples: its children's ids, their latest outputs, and the ones held back."""

    request_id: str
    child_ids: list[str]
    latest: dict[str, RequestOutput] = field(default_factory=dict)  # by child id: its latest output
    held: list[Any] = field(default_factory=list)  # m4 on: the later samples' sequences, until the prompt is cached

    # --8<-- [start:children]
    @staticmethod
    def child_id(request_id: str, index: int) -> str:
        return f"{index}_{request_id}"  # vLLM's naming

    @staticmethod
    def child_params(params: SamplingParams, index: int) -> SamplingParams:
        """One sample's rules: the parent's, with n=1 and the seed moved on by the sample's index."""
        seed = params.seed
        if seed is not None:
            seed += index
            if seed >= SEED_RANGE[1]:
                seed -= SEED_RANGE[1]  # wraps within 64 bits
        return replace(params, n=1, seed=seed)
    # --8<-- [end:children]

    @property
    def finished(self) -> bool:
        return len(self.latest) == len(self.child_ids) and all(out.finished for out in self.latest.values())

    def output(self) -> RequestOutput:
        """The parent's output so far: each child's latest completion under its sample index (empty if none yet)."""
        first = self.latest.get(self.child_ids[0]) or next(iter(self.latest.values()))
        completions = [
            replace(self.latest[child].outputs[0], index=index) if child in self.latest
            else CompletionOutput(index, "", [], None)
            for index, child in enumerate(self.child_ids)
        ]
        metrics = merged_metrics([out.metrics for out in self.latest.values()], len(self.child_ids))
        return replace(first, request_id=self.request_id, outputs=completions, finished=self.finished, metrics=metrics)


def merged_metrics(samples: list[RequestMetrics], n: int) -> RequestMetrics:
    """The n samples' metrics (of those that have any) as one request's: the earliest arrival, scheduling and first
    token, the latest token and the end once all n have ended, every count summed."""
    merged = {}
    for name in (f.name for f in fields(RequestMetrics)):
        values = [getattr(m, name) for m in samples if getattr(m, name) is not None]
        if name.startswith("num_"):
            merged[name] = sum(values)
        elif name == "finished_time":
            merged[name] = max(values) if len(values) == n else None
        elif name == "last_token_time":
            merged[name] = max(values, default=None)
        else:
            merged[name] = min(values, default=None)
    return RequestMetrics(**merged)


class ParentRequests:
    """The engine's unfinished requests with n > 1, found by their own id or by a child's; and new requests' ids."""

    def __init__(self) -> None:
        self.by_id: dict[str, ParentRequest] = {}
        self.by_child: dict[str, ParentRequest] = {}
        self._ids = itertools.count()  # the automatic request ids: "0", "1", ...

    def claim_ids(self, request_id: str | None, n: int, find: Callable[[str], object]) -> tuple[str, list[str]]:
        """A new request's id (None: the next automatic one no unfinished request uses: a caller may have picked
        "7" already) and, for n > 1, its samples'; an id an unfinished request holds (``find`` finds it in the
        scheduler, or a parent or sample uses it) is refused."""
        def in_use(name: str) -> bool:
            return find(name) is not None or self.uses(name)

        if request_id is None:
            request_id = str(next(self._ids))
            while in_use(request_id):
                request_id = str(next(self._ids))
        request_id = str(request_id)
        children = [ParentRequest.child_id(request_id, index) for index in range(n)] if n > 1 else []
        if any(in_use(name) for name in [request_id, *children]):
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        return request_id, children

    def add(self, parent: ParentRequest) -> None:
        self.by_id[parent.request_id] = parent
        self.by_child.update((child, parent) for child in parent.child_ids)

    def uses(self, request_id: str) -> bool:
        """Is this id a parent's or a child's?"""
        return request_id in self.by_id or request_id in self.by_child

    # --8<-- [start:release_held]
    def release_held(self, outputs: list[RequestOutput]) -> list[Any]:
        """m4 on: the samples held back by each parent whose first sample has an output among these: its prompt is
        computed, so they will find it in the prefix cache."""
        if not self.by_child:
            return []
        released = []
        for out in outputs:
            parent = self.by_child.get(out.request_id)
            if parent is not None and out.request_id == parent.child_ids[0]:
                released += parent.held
                parent.held = []
        return released
    # --8<-- [end:release_held]

    def take_held(self, request_id: str) -> Any | None:
        """m4 on: a sample still held back, taken out (to abort it); None if it is not held."""
        parent = self.by_child.get(request_id)
        for seq in parent.held if parent is not None else []:
            if seq.request_id == request_id:
                parent.held.remove(seq)
                return seq
        return None

    # --8<-- [start:merge]
    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs with the children's replaced by their parents': one per parent, where its first child
        stood; a finished parent is forgotten."""
        if not self.by_child:  # no request has n > 1: every step but those of such requests
            return outputs
        merged: dict[str, RequestOutput | ParentRequest] = {}  # by request id, in the order of the outputs
        for out in outputs:
            parent = self.by_child.get(out.request_id)
            if parent is None:
                merged[out.request_id] = out
            else:
                parent.latest[out.request_id] = out
                merged.setdefault(parent.request_id, parent)
        for item in merged.values():
            if isinstance(item, ParentRequest) and item.finished:
                self.forget(item)
        return [item.output() if isinstance(item, ParentRequest) else item for item in merged.values()]
    # --8<-- [end:merge]

    def forget(self, parent: ParentRequest) -> None:
        del self.by_id[parent.request_id]
        for child in parent.child_ids:
            del self.by_child[child]
