"""The ranks of a tensor-parallel engine and what passes between them: m8's lesson, on torch.distributed.

Every rank holds a shard of every layer and computes it; the ranks meet where a layer's
partial sums must be added up (``all_reduce``, twice a layer) and where rank 0 gathers the
logits of the whole vocabulary (``gather_logits``). Rank 0 alone schedules and samples: it
tells the other ranks what each step computes (``send_step``) and which tokens it sampled
(``broadcast``). Two process groups, as vLLM keeps them: ``compute`` for the tensors (gloo on
a CPU, NCCL on GPUs), with a short timeout so that a rank that hangs is an error within
seconds; ``messages`` (always gloo, host memory) for a step's plain lists, on which the other
ranks may wait for the next request as long as the engine stays idle (rank 0's sends time out). One rank (``SINGLE``)
has no group at all and every collective is nothing: m7 exactly. (A torchrun job of one process
joins a group of one, and its collectives run: that is how one GPU checks the NCCL path.)
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=20)  # the longest a rank waits for the others inside a step
IDLE_TIMEOUT = timedelta(days=365)  # the other ranks wait for the next step as long as the engine is idle


# --8<-- [start:shares]
@dataclass(slots=True, frozen=True)
class TensorParallel:
    """This process's rank among ``size``, the collectives the model and the runner call, and which share of a
    split dimension (heads, the MLP's width, the vocabulary) is this rank's."""

    rank: int = 0
    size: int = 1
    compute: dist.Backend | None = None  # the tensors: gloo on a CPU, NCCL on CUDA
    messages: dist.Backend | None = None  # a step's host lists, pickled: gloo

    def part(self, total: int) -> range:
        """This rank's equal share of ``total`` heads or columns; rank r takes the r-th."""
        per = total // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_part(self, num_kv_heads: int) -> range:
        """This rank's KV heads: its share, or where ranks outnumber KV heads, the one head its query heads read,
        which other ranks hold too (replicated, as vLLM does)."""
        if self.size <= num_kv_heads:
            return self.part(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return range(head, head + 1)

    def vocab_part(self, vocab_size: int) -> range:
        """This rank's token ids. Each rank has ``vocab_rows`` rows; the last one's extra rows (padding) stay zero."""
        per = self.vocab_rows(vocab_size)
        return range(min(vocab_size, self.rank * per), min(vocab_size, (self.rank + 1) * per))

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of each rank's embedding and LM head: the vocabulary's share, rounded up."""
        return -(-vocab_size // self.size)
    # --8<-- [end:shares]

    # --8<-- [start:collectives]
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Add up every rank's ``x`` (a layer's partial output), in place; every rank gets the sum."""
        if self.compute is not None:
            self.compute.allreduce(x).wait()
        return x

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's logits of its part of the vocabulary, side by side, ``[rows, vocab_rows * size]``: the whole
        vocabulary (and the last rank's padding) on every rank; rank 0 samples from them."""
        if self.compute is None:
            return logits
        rows, columns = logits.shape
        parts = torch.empty((self.size * rows, columns), dtype=logits.dtype, device=logits.device)  # rank by rank
        self.compute._allgather_base(parts, logits.contiguous()).wait()
        return parts.view(self.size, rows, columns).permute(1, 0, 2).reshape(rows, -1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (the tokens it sampled), in place."""
        if self.compute is not None:
            self.compute.broadcast(x, 0).wait()
        return x
    # --8<-- [end:collectives]

    # --8<-- [start:messages]
    def send_step(self, step: object) -> None:
        """Rank 0: tell the other ranks what to compute next (plain data, pickled); None tells them to stop. A rank
        that does not take it within the collective timeout fails the step."""
        if self.messages is not None:
            payload = torch.frombuffer(bytearray(pickle.dumps(step)), dtype=torch.uint8)
            self.messages.broadcast(torch.tensor([payload.numel()]), 0, COLLECTIVE_TIMEOUT).wait()
            self.messages.broadcast(payload, 0, COLLECTIVE_TIMEOUT).wait()

    def receive_step(self) -> object:
        """The other ranks: wait for rank 0's next step (or None), however long the engine stays idle."""
        length = torch.zeros(1, dtype=torch.long)
        self.messages.broadcast(length, 0).wait()
        payload = torch.empty(int(length), dtype=torch.uint8)
        self.messages.broadcast(payload, 0).wait()
        return pickle.loads(payload.numpy().tobytes())
    # --8<-- [end:messages]


SINGLE = TensorParallel()  # one rank: no process group, nothing to send


# --8<-- [start:join]
def join(store: dist.Store, rank: int, size: int, device: torch.device) -> TensorParallel:
    """Make this rank's two groups (every rank calls this; it returns once all have)."""
    messages = dist.ProcessGroupGloo(dist.PrefixStore("messages", store), rank, size, IDLE_TIMEOUT)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, size, options)
    else:
        compute = dist.ProcessGroupGloo(dist.PrefixStore("compute", store), rank, size, COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, compute, messages)
# --8<-- [end:join]

