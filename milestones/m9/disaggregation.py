"""Prefill on one worker, decode on another, and each prompt's keys and values moved between them: m9's lesson.

A worker is one process running m8's engine in a role (``disaggregation_mode``). The router
(``router.py``) sends each request to a prefill worker and a decode worker at once, and the
two meet through it in SGLang's hand-shake:

1. the decode worker keeps the request in its *prealloc* queue until its pool has blocks for
   the prompt, reserves them, and says which (``Reserved``);
2. the prefill worker keeps it in its *bootstrap* queue until that reservation arrives, so no
   prompt is computed whose keys and values would have nowhere to go; then it schedules it like
   any request (prefix cache, chunked prefill, preemption);
3. once the prompt is computed and its first token sampled, the prefill worker copies the
   prompt's blocks out of its pool and sends them, with the reserved block ids, over
   torch.distributed (``KVTransfer``); the send waits in its *inflight* queue while its own
   blocks go back to its pool (and its prefix cache) at once. It says so (``Prefilled``, with
   the first token), and the request is off its hands;
4. the decode worker posts the matching receive (its *transfer* queue), and when the blocks
   have arrived, writes them into the reserved blocks and runs the request from its first
   output token on, as if it had computed the prompt itself.

Everything that passes between the router and a worker is one of the records below, pickled
over the worker's pipe; only keys and values travel over torch.distributed.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from milestones.runtime.processes import START_TIMEOUT
from milestones.serving.outputs import Logprob, RequestMetrics, RequestOutput
from milestones.serving.sampling_params import SamplingParams

if TYPE_CHECKING:  # only for type hints
    from .engine import LLMEngine
    from .sequence import Sequence

TRANSFER_TIMEOUT = 30.0  # seconds a prompt's keys and values may take to arrive before the request fails
IDLE_POLL = 0.002  # seconds an idle worker waits for a message while a transfer is under way


# --8<-- [start:messages]
@dataclass(slots=True, frozen=True)
class NewRequest:
    """The router to both workers of a request: it is yours. ``peer`` is the other worker's rank in the transfer
    group, ``tag`` the number both sides give its transfer."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved by the router in m8's order, so the noise of every token is m8's
    arrival_time: float
    peer: int
    tag: int


@dataclass(slots=True, frozen=True)
class Reserved:
    """A decode worker to the prefill worker (through the router): the prompt's keys and values go into these."""

    request_id: str
    blocks: list[int]


@dataclass(slots=True, frozen=True)
class Prefilled:
    """A prefill worker to the decode worker (through the router): the prompt is computed and on its way; its first
    token, and the scores the request asked for."""

    request_id: str
    token: int
    output_logprobs: list[dict[int, Logprob]]
    prompt_logprobs: list[dict[int, Logprob] | None]
    num_cached_tokens: int  # prompt tokens the prefill worker found in its prefix cache
    metrics: RequestMetrics  # when it was scheduled and its first token sampled (perf_counter: one clock a machine)
    sent_time: float  # when the prefill worker started the send


@dataclass(slots=True, frozen=True)
class Abort:
    request_id: str


@dataclass(slots=True, frozen=True)
class Failure:
    request_id: str
    error: str


@dataclass(slots=True)
class Outputs:
    """A worker to the router, after each step: the outputs of the requests it advanced, and those that failed."""

    outputs: list[RequestOutput] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class Query:
    """The router to a worker: report ``what`` (``"integrity"``, ``"pool"``, ``"kv_usage"``, ``"stats"``,
    ``"prompt_kv"`` with the request id or prompt tokens as ``arg``)."""

    what: str
    arg: object = None


@dataclass(slots=True, frozen=True)
class Reply:
    what: str
    value: object
# --8<-- [end:messages]


# --8<-- [start:transfer]
@dataclass(slots=True)
class PendingTransfer:
    """A send or a receive under way, and the tensors it reads or fills. gloo's point-to-point works report they are
    complete only to a ``wait()``, so a thread of its own waits for them while the worker goes on stepping."""

    destination: torch.Tensor  # the reserved block ids, sent ahead of the keys and values
    kv: torch.Tensor  # [2, layers, kv heads, blocks, block_size, head_dim]: keys, then values
    started: float = field(default_factory=time.perf_counter)
    finished: threading.Event = field(default_factory=threading.Event)

    def wait_for(self, works: list[dist.Work]) -> PendingTransfer:
        def waiting() -> None:
            for work in works:
                work.wait()  # a peer that never sends leaves this thread waiting: TRANSFER_TIMEOUT fails the request
            self.finished.set()
        threading.Thread(target=waiting, name="kv transfer", daemon=True).start()
        return self

    def done(self) -> bool:
        return self.finished.is_set()


class KVTransfer:
    """Moves a prompt's blocks between two workers' pools, a block table's worth at a time: gathered into one tensor
    on the sender, sent with the receiver's block ids, written into those blocks on the receiver. Over gloo, in host
    memory (on CUDA through a copy to the host: the step that RDMA transfer engines such as Mooncake or NIXL avoid)."""

    def __init__(self, group: dist.ProcessGroup, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.group, self.k_cache, self.v_cache = group, k_cache, v_cache
        self.num_bytes = 0

    def send(self, peer: int, tag: int, blocks: list[int], destination: list[int]) -> PendingTransfer:
        """Copy ``blocks`` out of this pool and send them to ``peer``, for its blocks ``destination``."""
        kv = torch.stack((self.k_cache[:, :, blocks], self.v_cache[:, :, blocks])).cpu()  # a copy: blocks move on
        ids = torch.tensor(destination, dtype=torch.long)
        works = [self.group.send([ids], peer, 2 * tag), self.group.send([kv], peer, 2 * tag + 1)]
        self.num_bytes += kv.numel() * kv.element_size()
        return PendingTransfer(ids, kv).wait_for(works)

    def receive(self, peer: int, tag: int, num_blocks: int) -> PendingTransfer:
        """Post the receive of ``num_blocks`` blocks from ``peer``; ``place`` writes them once ``done``."""
        layers, heads, _, block_size, head_dim = self.k_cache.shape
        kv = torch.empty((2, layers, heads, num_blocks, block_size, head_dim), dtype=self.k_cache.dtype)
        ids = torch.empty(num_blocks, dtype=torch.long)
        works = [self.group.recv([ids], peer, 2 * tag), self.group.recv([kv], peer, 2 * tag + 1)]
        return PendingTransfer(ids, kv).wait_for(works)

    def place(self, received: PendingTransfer, table: list[int]) -> None:
        """Write the arrived blocks where the sender was told to put them, which must be this request's."""
        destination = received.destination.tolist()
        if destination != table:
            raise RuntimeError(f"keys and values arrived for blocks {destination}, but the request reserved {table}")
        kv = received.kv.to(self.k_cache.device)
        self.k_cache[:, :, table] = kv[0]
        self.v_cache[:, :, table] = kv[1]
        self.num_bytes += kv.numel() * kv.element_size()
# --8<-- [end:transfer]


@dataclass(slots=True)
class Binding:
    """What a worker knows of a request's other half: the peer's rank, the transfer's tag, the reserved blocks."""

    seq: Sequence
    peer: int
    tag: int
    blocks: list[int] = field(default_factory=list)
    prefilled: Prefilled | None = None
    received: PendingTransfer | None = None


@dataclass(slots=True, frozen=True)
class Drain:
    """Where the blocks of an aborted request would come from, should the prefill worker have sent them already."""

    peer: int
    tag: int
    num_blocks: int


# --8<-- [start:prefill_side]
class PrefillSide:
    """A prefill worker's two queues: requests waiting for their reservation (bootstrap), and sends under way
    (inflight)."""

    def __init__(self, engine: LLMEngine, transfer: KVTransfer, outbox: Outputs) -> None:
        self.engine, self.transfer, self.outbox = engine, transfer, outbox
        self.bootstrap: dict[str, Binding] = {}  # waiting for the decode worker's reservation
        self.bound: dict[str, Binding] = {}  # reserved: scheduled here like any request
        self.inflight: deque[PendingTransfer] = deque()
        self.notices: list[Prefilled] = []  # for the router, after this step's outputs
        self.num_transfers = 0
        engine.hand_off = self.hand_off  # the engine calls it once a request's first token is out

    def add(self, request: NewRequest) -> None:
        self.bootstrap[request.request_id] = Binding(new_sequence(self.engine, request), request.peer, request.tag)

    def reserved(self, message: Reserved) -> None:
        binding = self.bootstrap.pop(message.request_id, None)
        if binding is None:  # aborted meanwhile
            return
        binding.blocks = message.blocks
        self.bound[message.request_id] = binding
        with self.engine.lock:
            self.engine.scheduler.add(binding.seq)

    def hand_off(self, seq: Sequence) -> None:
        """The prompt is computed and its first token sampled: send its blocks, let them go here, tell the router."""
        binding = self.bound.pop(seq.request_id)
        table = self.engine.scheduler.block_manager.block_tables[seq.request_id][: len(binding.blocks)]
        self.inflight.append(self.transfer.send(binding.peer, binding.tag, table, binding.blocks))
        self.num_transfers += 1
        self.engine.scheduler.finish(seq)  # its full blocks stay in the prefix cache, the rest are free at once
        self.notices.append(Prefilled(seq.request_id, seq.token_ids[-1], list(seq.output_logprobs),
                                      list(seq.prompt_logprobs), seq.num_cached_tokens, seq.metrics,
                                      time.perf_counter()))

    def abort(self, request_id: str) -> None:
        self.bootstrap.pop(request_id, None)
        if self.bound.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def advance(self) -> None:
        """Forget the sends that completed (their copies of the blocks)."""
        while self.inflight and self.inflight[0].done():
            self.inflight.popleft()

    def busy(self) -> bool:
        return bool(self.inflight)

    def queues(self) -> dict[str, list[str]]:
        return {"bootstrap": list(self.bootstrap), "prefilling": list(self.bound), "inflight": len(self.inflight)}

    def stats(self) -> dict[str, object]:
        return {"transfers": self.num_transfers, "transfer_bytes": self.transfer.num_bytes, "queues": self.queues()}
# --8<-- [end:prefill_side]


# --8<-- [start:decode_side]
class DecodeSide:
    """A decode worker's two queues: requests waiting for blocks (prealloc), and reserved ones whose keys and values
    are on their way (transfer)."""

    def __init__(self, engine: LLMEngine, transfer: KVTransfer, outbox: Outputs) -> None:
        self.engine, self.transfer, self.outbox = engine, transfer, outbox
        self.prealloc: deque[Binding] = deque()
        self.transfers: dict[str, Binding] = {}  # reserved; its receive posted once the prefill worker sent
        self.drains: list[PendingTransfer] = []  # receives of aborted requests: taken, and thrown away
        self.aborted: dict[str, Drain] = {}  # reserved, then aborted before the prefill worker said it sent
        self.notices: list[Reserved] = []  # for the router
        self.num_transfers = 0
        self.transfer_seconds = 0.0  # from the prefill worker's send to the blocks written here, summed
        self.num_prompt_tokens = 0  # of the requests whose blocks arrived

    def add(self, request: NewRequest) -> None:
        binding = Binding(new_sequence(self.engine, request), request.peer, request.tag)
        self.prealloc.append(binding)

    def prefilled(self, message: Prefilled) -> None:
        binding = self.transfers.get(message.request_id)
        if binding is None:  # aborted after its reservation: take what the prefill worker sent, and drop it
            drain = self.aborted.pop(message.request_id)
            self.drains.append(self.transfer.receive(drain.peer, drain.tag, drain.num_blocks))
            return
        binding.prefilled = message
        binding.received = self.transfer.receive(binding.peer, binding.tag, len(binding.blocks))

    def abort(self, request_id: str) -> None:
        for binding in self.prealloc:
            if binding.seq.request_id == request_id:
                self.prealloc.remove(binding)
                return
        binding = self.transfers.pop(request_id, None)
        if binding is None:
            self.engine.abort_request(request_id)  # running here, or already finished
            return
        if binding.received is not None:
            self.drains.append(binding.received)  # the send must still be taken, or the prefill worker's never ends
        else:
            self.aborted[request_id] = Drain(binding.peer, binding.tag, len(binding.blocks))  # they may yet be sent
        with self.engine.lock:
            binding.seq.finish("abort")
            self.engine.scheduler.finish(binding.seq)  # its reserved blocks go back at once

    def advance(self) -> None:
        """Reserve blocks for waiting requests in arrival order; start the requests whose blocks have arrived."""
        scheduler = self.engine.scheduler
        with self.engine.lock:
            while self.prealloc and (blocks := scheduler.reserve(self.prealloc[0].seq)) is not None:
                binding = self.prealloc.popleft()
                binding.blocks = blocks
                self.transfers[binding.seq.request_id] = binding
                self.notices.append(Reserved(binding.seq.request_id, blocks))
            now = time.perf_counter()
            for request_id, binding in list(self.transfers.items()):
                if binding.received is None:
                    continue
                if binding.received.done():
                    del self.transfers[request_id]
                    self._start(binding)
                elif now - binding.received.started > TRANSFER_TIMEOUT:
                    del self.transfers[request_id]
                    binding.seq.finish("abort")
                    scheduler.finish(binding.seq)
                    self.outbox.failures.append(Failure(request_id, f"its keys and values did not arrive within "
                                                                    f"{TRANSFER_TIMEOUT:.0f} s (TRANSFER_TIMEOUT)"))
        self.drains = [pending for pending in self.drains if not pending.done()]

    def _start(self, binding: Binding) -> None:
        self.transfer.place(binding.received, binding.blocks)
        message, seq = binding.prefilled, binding.seq
        self.num_transfers += 1
        self.num_prompt_tokens += seq.num_prompt_tokens
        self.transfer_seconds += time.perf_counter() - message.sent_time
        seq.num_cached_tokens = message.num_cached_tokens
        self.engine.arrive(seq, message.token, message.output_logprobs, message.prompt_logprobs, message.metrics)

    def busy(self) -> bool:
        return any(b.received is not None for b in self.transfers.values()) or bool(self.drains or self.prealloc)

    def queues(self) -> dict[str, list[str]]:
        return {"prealloc": [b.seq.request_id for b in self.prealloc], "transfer": list(self.transfers),
                "decoding": [seq.request_id for seq in self.engine.scheduler.running]}

    def stats(self) -> dict[str, object]:
        return {"transfers": self.num_transfers, "transfer_bytes": self.transfer.num_bytes,
                "transfer_seconds": self.transfer_seconds, "transferred_prompt_tokens": self.num_prompt_tokens,
                "queues": self.queues()}
# --8<-- [end:decode_side]


def new_sequence(engine: LLMEngine, request: NewRequest) -> Sequence:
    """The worker's own record of a request the router checked."""
    return engine.sequence_for(request.request_id, request.prompt, request.prompt_token_ids, request.params,
                               request.seed, request.arrival_time)


# --8<-- [start:worker_loop]
class WorkerLoop:
    """A worker's life after loading: take the router's messages, move its queues on, step its engine, report."""

    def __init__(self, engine: LLMEngine, group: dist.ProcessGroup, pipe: Connection) -> None:
        self.engine, self.pipe, self.outbox = engine, pipe, Outputs()
        transfer = KVTransfer(group, engine.runner.k_cache, engine.runner.v_cache)
        side = PrefillSide if engine.config.disaggregation_mode == "prefill" else DecodeSide
        self.side = side(engine, transfer, self.outbox)

    def serve(self) -> None:
        self.pipe.send(Reply("pool", self.engine.config.num_kv_blocks))
        while True:
            working = self.engine.has_unfinished_requests()
            wait = 0 if working else IDLE_POLL if self.side.busy() else None  # None: nothing to do until told
            while self.pipe.poll(wait):
                message = self.pipe.recv()
                if message is None:  # the router closes
                    return
                self.handle(message)
                wait = 0
            self.side.advance()
            if self.engine.has_unfinished_requests():
                self.outbox.outputs += self.engine.step()
            self.report()

    def handle(self, message: object) -> None:
        if isinstance(message, NewRequest):
            self.side.add(message)
        elif isinstance(message, Reserved):
            self.side.reserved(message)
        elif isinstance(message, Prefilled):
            self.side.prefilled(message)
        elif isinstance(message, Abort):
            self.side.abort(message.request_id)
        elif isinstance(message, Query):
            self.pipe.send(Reply(message.what, self.answer(message)))

    def report(self) -> None:
        """Send the router what happened: outputs and failures, then the hand-shake's notices (a request's first
        token reaches the router before its decode worker hears of it)."""
        if self.outbox.outputs or self.outbox.failures:
            self.pipe.send(Outputs(self.outbox.outputs, self.outbox.failures))
            self.outbox.outputs, self.outbox.failures = [], []
        for notice in self.side.notices:
            self.pipe.send(notice)
        self.side.notices.clear()

    def answer(self, query: Query) -> object:
        engine = self.engine
        if query.what == "integrity":
            try:
                engine.check_integrity()
            except AssertionError as error:
                return str(error)
            return None
        if query.what == "kv_usage":
            return engine.kv_usage()
        if query.what == "stats":
            scheduler = engine.scheduler
            return {"prompt_tokens": scheduler.num_prompt_tokens, "cached_tokens": scheduler.num_cached_tokens,
                    **self.side.stats()}
        if query.what == "spec_stats":  # the counters, added up by the router
            speculator = engine.speculator
            return {"num_draft_tokens": speculator.num_draft_tokens,
                    "num_accepted_tokens": speculator.num_accepted_tokens, "num_guessing": speculator.num_guessing}
        if query.what == "prompt_kv":  # tests: a running request's prompt (by id) or a cached prompt (by tokens)
            return prompt_kv(engine, query.arg)
        raise ValueError(f"unknown query {query.what!r}")
# --8<-- [end:worker_loop]


def prompt_kv(engine: LLMEngine, which: str | list[int]) -> torch.Tensor | None:
    """The keys and values of a prompt's blocks in this worker's pool, ``[2, layers, heads, blocks, block_size,
    head_dim]``: a running request's (by id), or those the prefix cache holds for these tokens; None if neither."""
    scheduler = engine.scheduler
    if isinstance(which, str):
        seq = scheduler.find(which)
        if seq is None or seq.request_id not in scheduler.block_manager.block_tables:
            return None
        blocks = scheduler.block_manager.block_tables[which][: scheduler.block_manager.blocks_needed(
            seq.num_prompt_tokens)]
    else:
        blocks, _ = scheduler.tree.match_prefix(which)
    runner = engine.runner
    return torch.stack((runner.k_cache[:, :, blocks], runner.v_cache[:, :, blocks])).cpu()


def load_worker(rank: int, world_size: int, port: int, config: object, pipe: Connection,
                threads: int) -> Callable[[], None]:
    """In a worker process: load this worker's engine and join the transfer group; then it serves (``WorkerLoop``)."""
    from .engine import LLMEngine  # the engine imports this module

    torch.set_num_threads(threads)
    cores = sorted(os.sched_getaffinity(0))
    if config.device.type == "cpu" and world_size * threads <= len(cores):  # each worker on cores of its own
        os.sched_setaffinity(0, cores[rank * threads : (rank + 1) * threads])
    engine = LLMEngine(config)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=START_TIMEOUT))
    group = dist.ProcessGroupGloo(dist.PrefixStore("kv", store), rank, world_size, timedelta(days=365))
    return WorkerLoop(engine, group, pipe).serve
