"""A step-by-step record of an engine run, for the replay page: a tool around the lessons, not one of them.

``LLM(record_file=PATH)`` (any milestone) attaches a ``Recorder`` to the engine and writes the file after each
``generate`` and when the engine is closed. The recorder wraps the model runner's entry from outside, as the
benchmark's clocks wrap the runner's calls, so no lesson function knows of it and an engine without it runs exactly
as before. When a step's batch reaches the runner it keeps what was planned and the state the planning left: the
step's requests with their new tokens (a prompt's chunk or a decode), the waiting queue, from m3 every running
request's block table and the pool's free count, from m4 the radix tree's nodes with their blocks and lock counts,
m7's guesses, and the preemptions so far. m6 plans step N + 1 while step N runs, so a record is the state at the
moment a step is handed to the runner, in every milestone alike.

The file is compact JSON: request ids become small numbers in order of first sight (``requests`` maps them back),
and a block table is written only in the steps where it changed.
"""

from __future__ import annotations

import itertools
import json
import weakref
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


class Recorder:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[dict] = []
        self.requests: dict[str, int] = {}  # request id -> its number in the file
        self._tables: dict[int, list[int]] = {}  # the tables as last written
        self._node_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a tree node -> its number
        self._next_node = itertools.count()
        # Where a step's batch is final: the runner's first call with it (m6 on ``prepare``, before: ``execute``),
        # after the scheduler planned it and, in m7, the proposer added its guesses.
        runner = engine.runner
        name = "prepare" if hasattr(runner, "prepare") else "execute"
        entry = getattr(runner, name)

        def recorded(batch, *args, **kwargs):
            self.steps.append(self.snapshot(batch))
            return entry(batch, *args, **kwargs)

        setattr(runner, name, recorded)  # an attribute of this runner only: the class is left as it is

    def number(self, request_id: str) -> int:
        return self.requests.setdefault(request_id, len(self.requests))

    def snapshot(self, batch: Any | None) -> dict:
        """What one schedule decided (None: no step, the state alone), and the bookkeeping it left."""
        scheduler = self.engine.scheduler
        step: dict[str, Any] = {
            # [request, tokens computed before the step, new tokens, guesses among them (m7)]
            "batch": [[self.number(seq.request_id), seq.num_computed_tokens, num_new, _guesses(seq)]
                      for seq, num_new in zip(batch.seqs, batch.num_new_tokens)] if batch is not None else [],
            "waiting": [self.number(seq.request_id) for seq in scheduler.waiting],
            "preemptions": getattr(scheduler, "num_preemptions", 0),
        }
        blocks = getattr(scheduler, "block_manager", None)
        if blocks is not None:  # m3 on: a paged pool
            tables = {self.number(rid): list(table) for rid, table in blocks.block_tables.items()}
            step["free"] = blocks.num_free_blocks
            step["tables"] = {str(r): t for r, t in tables.items() if self._tables.get(r) != t}
            step["gone"] = sorted(r for r in self._tables if r not in tables)  # tables let go since the last step
            self._tables = tables
        tree = getattr(scheduler, "tree", None)
        if tree is not None:  # m4 on: [node, parent (-1: the root), blocks, lock count]
            step["tree"] = [[self._node_id(node), self._node_id(node.parent) if node.parent is not tree.root else -1,
                             list(node.blocks), node.lock_ref] for node in _nodes(tree.root)]
        return step

    def _node_id(self, node: Any) -> int:
        """A node's number for as long as it lives (weakly held: an evicted node's number is never reused)."""
        if node not in self._node_ids:
            self._node_ids[node] = next(self._next_node)
        return self._node_ids[node]

    def as_json(self) -> dict:
        scheduler, config = self.engine.scheduler, self.engine.config
        blocks = getattr(scheduler, "block_manager", None)
        last_written = self._tables
        end = self.snapshot(None)  # the bookkeeping as the run left it: a pool with nothing in use
        self._tables = last_written  # the next step's changes are against the last step's, not the end's
        return {
            "version": FORMAT_VERSION,
            "milestone": type(self.engine).__module__.split(".")[-2],
            "num_blocks": blocks.num_blocks if blocks is not None else None,
            "block_size": getattr(config, "block_size", None),
            "max_num_batched_tokens": getattr(config, "max_num_batched_tokens", None),
            "requests": list(self.requests),
            "steps": self.steps,
            "end": end,
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_json(), separators=(",", ":")))


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
