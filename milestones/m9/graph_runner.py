"""Capture the decode step once per batch size, then replay it: m5's lesson.

A decode step at small batch is hundreds of small operators, each launched by Python:
the device finishes each one before the host has launched the next, and waits. So the
step is captured once per batch-size *bucket* and replayed:

* on CUDA, ``torch.cuda.CUDAGraph`` records every kernel the step launches; a replay
  launches them all with one call;
* on a CPU, which has no graphs, ``torch.compile(dynamic=False)`` turns the step into
  generated code per bucket (SGLang's CPU graph runner does the same); a replay calls it.

Both read their inputs from *static buffers*, allocated once for the largest bucket: a
capture remembers addresses, so every replay must find its inputs at the same ones. A
batch is padded up to the smallest bucket that holds it. Padding rows write their keys
and values into a scratch block that belongs to no request, and read one harmless
position of it, and every unused table entry is reset to that block, so a small batch
after a large one can never read another request's stale blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from milestones.kernels import AttentionBackend
from milestones.kernels.cpu_graphs import compiled_replay, own_method
from milestones.transfer import HostStaging

from .attention import AttentionContext, DecodeBatch
from .future_map import FutureMap
from .model import CausalLM
from .step import DecodeInputs


class GraphRunner:
    def __init__(self, model: CausalLM, k_cache: torch.Tensor, v_cache: torch.Tensor, attention: AttentionBackend,
                 sizes: list[int], max_blocks: int) -> None:
        self.model, self.k_cache, self.v_cache, self.attention = model, k_cache, v_cache, attention
        # One input per layer: torch.compile writes into a whole input in place, but a write into a slice of
        # one input ([layers, ...] indexed by layer) makes it copy the whole pool, every step.
        self.k_layers, self.v_layers = list(k_cache.unbind(0)), list(v_cache.unbind(0))
        self.sizes = sorted(sizes)
        self.scratch_block = k_cache.shape[2] - 1  # the pool's last block: the block manager never hands it out
        self.scratch_slot = self.scratch_block * k_cache.shape[3]
        largest, device = self.sizes[-1], k_cache.device
        # --8<-- [start:static_buffers]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((largest, max_blocks), self.scratch_block, dtype=torch.long, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.long, device=device)
        self.rows = torch.arange(largest, device=device)
        # --8<-- [end:static_buffers]
        # Host twins of the buffers a step fills: written through numpy, copied up in place (milestones.transfer).
        self.staging = HostStaging([self.input_ids, self.positions, self.slot_mapping, self.block_tables,
                                    self.context_lens])
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}  # bucket -> a call that runs the captured step
        self.num_replays = self.num_padded_rows = 0
        self.capture_seconds = 0.0

    def buffers(self, size: int) -> tuple[torch.Tensor, ...]:
        """The first ``size`` rows of every static buffer: the inputs of the bucket's step."""
        return (self.input_ids[:size], self.positions[:size], self.slot_mapping[:size], self.block_tables[:size],
                self.context_lens[:size], self.rows[:size], self.k_layers, self.v_layers)

    # --8<-- [start:forward]
    def forward(self, input_ids, positions, slot_mapping, block_tables, context_lens, rows, k_layers, v_layers):
        """The decode step as a function of tensors alone: every row is one request's one new token."""
        ctx = AttentionContext(k_layers, v_layers, slot_mapping, block_tables[:0, 0], [],
                               DecodeBatch(rows, block_tables, context_lens))
        self.attention.prepare_metadata(ctx)  # a kernel backend takes the rows (a platform speed-up)
        return self.model(input_ids, positions, ctx)
    # --8<-- [end:forward]

    # --8<-- [start:capture]
    def capture(self) -> None:
        """Capture every bucket, the largest first (on CUDA all share one memory pool, sized by the first)."""
        start, pool = time.perf_counter(), None
        forward = own_method(self.forward) if self.k_cache.device.type == "cpu" else None  # what torch.compile takes
        for size in tqdm(self.sizes[::-1], desc="Capturing the decode step", unit="batch size"):
            buffers = self.buffers(size)
            if self.k_cache.device.type == "cuda":
                self.forward(*buffers)  # one eager warm-up: lazy initialisation must not happen inside a capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self.forward(*buffers)
                pool = graph.pool()
                self.replays[size] = _graph_replay(graph, output)
            else:  # torch.compile for this bucket's buffers (its CPU tuning: milestones/kernels/cpu_graphs.py)
                self.replays[size] = compiled_replay(forward, buffers)
        self.capture_seconds = time.perf_counter() - start
    # --8<-- [end:capture]

    # --8<-- [start:run]
    def run(self, inputs: DecodeInputs, future_map: FutureMap) -> torch.Tensor:
        """Pad the batch to its bucket, fill the static buffers, replay; the hidden states of the real rows."""
        num_rows = len(inputs.token_ids)
        size = next(s for s in self.sizes if s >= num_rows)
        pad = size - num_rows
        self._fill(self.input_ids, size, inputs.token_ids + [0] * pad)
        if min(inputs.token_ids) < 0:  # future ids: tokens the previous step sampled, already on the device
            future_map.resolve_(self.input_ids[:size])
        self._fill(self.positions, size, inputs.positions + [0] * pad)
        self._fill(self.slot_mapping, size, inputs.slots + [self.scratch_slot] * pad)  # padding writes to scratch
        self._fill_tables(size, inputs.block_tables)  # every entry past a table, and padding rows': scratch
        self._fill(self.context_lens, size, inputs.context_lens + [1] * pad)  # padding reads one scratch slot
        self.num_replays += 1
        self.num_padded_rows += pad
        return self.replays[size]()[:num_rows]
    # --8<-- [end:run]

    def _fill(self, buffer: torch.Tensor, size: int, values: list) -> None:
        """Copy into the first ``size`` rows of the static buffer: through its host twin, without waiting for the step
        before (on a CPU the twin is the buffer itself)."""
        self.staging.host(buffer)[:size] = values
        self.staging.upload(buffer, size)

    def _fill_tables(self, size: int, tables: list[list[int]]) -> None:
        """Each table from the start of its row, every other entry of the first ``size`` rows the scratch block: a
        small batch after a large one never reads a stale block."""
        rows = self.staging.host(self.block_tables)
        rows[:size] = self.scratch_block
        for row, table in enumerate(tables):
            rows[row, : len(table)] = table
        self.staging.upload(self.block_tables, size)


def _graph_replay(graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        graph.replay()
        return output  # the captured step always writes its result here
    return replay

