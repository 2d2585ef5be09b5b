"""A step-by-step record of an engine run, for the replay page: a tool around the lessons, not one of them.

``LLM(record_file=PATH)`` (any milestone) attaches a ``Recorder`` to the engine and writes the file after each
``generate`` and when the engine is closed. The recorder wraps the model runner's entry from outside, as the
benchmark's clocks wrap the runner's calls, so no lesson function knows of it and an engine without it runs exactly
as before. When a step's batch reaches the runner it keeps what was planned and the state the planning left: the
step's requests with their new tokens (a prompt's chunk or a decode), the waiting queue, from m3 every running
request's block table and the pool's free count, from m4 the radix tree's nodes with their blocks and lock counts,
m7's guesses and (once known) how many were kept, and the preemptions so far; from m6 on, with its trace on, each
step's host and device spans. m6 plans step N + 1 while step N runs, so a record is the state at the moment a step
is handed to the runner, in every milestone alike.

The file is compact JSON: request ids become small numbers in order of first sight (``requests`` maps them back), a
block table is written only in the steps where it changed and the tree only where it did, and a record costs what
changed: the recorder compares the tables of the step's own requests and watches the block manager's and the tree's
other calls that change them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


class Recorder:
    def __init__(self, engine: Any) -> None:
        if not hasattr(engine, "scheduler"):  # m9's router: its steps are its workers'
            raise ValueError("record_file records one engine's steps; a disaggregated engine's are its workers': pass "
                             "record_file=None, or record without num_prefill_workers and num_decode_workers")
        self.engine = engine
        self.steps: list[dict] = []
        self.requests: dict[str, int] = {}  # request id -> its number in the file
        self._written: dict[int, list[int]] = {}  # the block tables as the file has them so far
        self._changed: set[str] = set()  # requests whose table may have changed since the last record
        self._tree_changed = True  # whether the tree may have changed since the last record
        # m7: the last step's entries that check guesses, each with its request and the guesses it had kept before
        self._checking: list[tuple[list, Any, int]] = []
        # A tree node -> its number. Held for the recorder's life, so that an evicted node's number is never given
        # to another: a recording's run is short, and a weak dictionary's lookups made the tree's records slow.
        self._node_ids: dict[Any, int] = {}
        scheduler = engine.scheduler
        # Where a step's batch is final: the runner's first call with it (m6 on ``prepare``, before: ``execute``),
        # after the scheduler planned it and, in m7, the proposer added its guesses.
        runner = engine.runner
        self._wrap(runner, "prepare" if hasattr(runner, "prepare") else "execute", self._before_step)
        # What changes the bookkeeping, watched so that a record costs what changed, not the whole pool and tree:
        # the block manager's calls that change a request's table, the tree's that change its nodes or locks. A
        # table grows only for a request the step runs, so ``grow`` (called for every one, every step) is not
        # watched: the step's own requests are compared anyway.
        blocks = getattr(scheduler, "block_manager", None)
        if blocks is not None:  # m3 on (``shrink``: m7 on)
            for name in ("shrink", "share", "use_cached", "free"):
                if hasattr(blocks, name):
                    self._wrap(blocks, name, lambda request_id, *args, **kwargs: self._changed.add(request_id))
        tree = getattr(scheduler, "tree", None)
        if tree is not None:  # m4 on
            for name in ("insert", "lock", "unlock", "evict"):
                self._wrap(tree, name, lambda *args, **kwargs: setattr(self, "_tree_changed", True))

    @staticmethod
    def _wrap(obj: Any, name: str, before) -> None:
        """Call ``before`` with a method's arguments, then the method: an attribute of this object only (its class
        is left as it is)."""
        method = getattr(obj, name)

        def watched(*args, **kwargs):
            before(*args, **kwargs)
            return method(*args, **kwargs)

        setattr(obj, name, watched)

    def _before_step(self, batch: Any, *args, **kwargs) -> None:
        self._note_kept_guesses()
        step = self.snapshot(batch)
        self.steps.append(step)
        self._checking = [(entry, seq, _kept(seq)) for entry, seq in zip(step["batch"], batch.seqs) if entry[3]]

    def _note_kept_guesses(self) -> None:
        """m7: how many of each request's guesses the last step kept, known once that step is processed (the step
        after is planned only then, when guessing), written as the last field of the step's entry."""
        for entry, seq, kept_before in self._checking:
            entry[4:] = [_kept(seq) - kept_before]

    def number(self, request_id: str) -> int:
        return self.requests.setdefault(request_id, len(self.requests))

    def snapshot(self, batch: Any | None) -> dict:
        """What one step does (None: no step, the state alone) and the bookkeeping that changed since the last
        record: the tables that changed or went, the tree if it changed (absent: as in the record before)."""
        scheduler = self.engine.scheduler
        step: dict[str, Any] = {
            # [request, tokens computed before the step, new tokens, guesses among them (m7)[, guesses kept]]
            "batch": [[self.number(seq.request_id), seq.num_computed_tokens, num_new, _guesses(seq)]
                      for seq, num_new in zip(batch.seqs, batch.num_new_tokens)] if batch is not None else [],
            "waiting": [self.number(seq.request_id) for seq in scheduler.waiting],
            "preemptions": getattr(scheduler, "num_preemptions", 0),
        }
        blocks = getattr(scheduler, "block_manager", None)
        if blocks is not None:  # m3 on: a paged pool
            if batch is not None:
                self._changed.update(seq.request_id for seq in batch.seqs)
            step["free"] = blocks.num_free_blocks
            step["tables"], step["gone"] = {}, []
            for request_id in self._changed:
                number, table = self.number(request_id), blocks.block_tables.get(request_id)
                if table is None and number in self._written:
                    step["gone"].append(number)
                    del self._written[number]
                elif table is not None and self._written.get(number) != table:
                    step["tables"][str(number)] = self._written[number] = list(table)
            step["gone"].sort()
            self._changed.clear()
        tree = getattr(scheduler, "tree", None)
        if tree is not None and self._tree_changed:  # m4 on: [node, parent (-1: the root), blocks, lock count]
            ids, root = self._node_ids, tree.root
            nodes = _nodes(root)
            for node in nodes:  # parents before children: a parent has its number when its children ask for it
                if node not in ids:
                    ids[node] = len(ids)
            step["tree"] = [[ids[node], ids[node.parent] if node.parent is not root else -1, list(node.blocks),
                             node.lock_ref] for node in nodes]
            self._tree_changed = False
        return step

    def as_json(self) -> dict:
        scheduler, config = self.engine.scheduler, self.engine.config
        blocks = getattr(scheduler, "block_manager", None)
        # The state as the run left it (a pool with nothing in use), its changes against the last step's, kept out
        # of the bookkeeping of what is written: a later generate's first step is against the last step too.
        self._note_kept_guesses()  # the last step's, the run being over (again, the same, if more steps follow)
        written, changed, tree_changed = dict(self._written), set(self._changed), self._tree_changed
        self._tree_changed = True
        end = self.snapshot(None)
        self._written, self._changed, self._tree_changed = written, changed, tree_changed
        return {
            "version": FORMAT_VERSION,
            "milestone": type(self.engine).__module__.split(".")[-2],
            "num_blocks": blocks.num_blocks if blocks is not None else None,
            "block_size": getattr(config, "block_size", None),
            "max_num_batched_tokens": getattr(config, "max_num_batched_tokens", None),
            "requests": list(self.requests),
            "steps": self.steps,
            "end": end,
            "spans": self.spans(),
        }

    def spans(self) -> list[list]:
        """m6 on, with its trace on (``trace_file``): each step's host and device work as [record, kind, start ms,
        milliseconds], kind "schedule" or "process" (the host) or "forward" (the device's, on the worker). The
        trace numbers its steps as they are launched, the order the records are made in."""
        tracer = getattr(self.engine, "tracer", None)
        if tracer is None or not tracer.enabled:
            return []
        events = [e for e in tracer.events if e.get("ph") == "X"]
        launched = [e["args"]["step"] for e in events if e["name"] == "schedule"]
        record_of = {number: index for index, number in enumerate(launched[: len(self.steps)])}
        return [[record_of[e["args"]["step"]], e["name"], round(e["ts"] / 1e3, 3), round(e["dur"] / 1e3, 3)]
                for e in events if e["args"]["step"] in record_of]

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_json(), separators=(",", ":")))


def _kept(seq: Any) -> int:
    return seq.metrics.num_accepted_tokens


def _guesses(seq: Any) -> int:
    spec = getattr(seq, "spec", None)
    return len(spec.draft_token_ids) if spec is not None else 0


def _nodes(root: Any) -> list[Any]:
    """Every node below the root, parents before their children (an explicit stack: trees can be deep)."""
    found, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.children.values())
    return found
