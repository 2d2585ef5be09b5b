"""The engine a user holds when prefill and decode run apart (m9): the router's process, in front of the workers.

``LLM(num_prefill_workers=P, num_decode_workers=D)`` makes this instead of m8's ``LLMEngine``,
with the same methods, so ``generate``, ``chat`` and the server work unchanged. It loads no
model: it checks and tokenizes requests (m8's errors, raised here before anything is sent),
starts the P + D workers (each a process with m8's engine in a role, joined in one gloo group
for the transfers), routes each request (``router.py``), relays the hand-shake between the
two workers of a request (``disaggregation.py``), and streams their outputs: the first token
from the prefill worker, the rest from the decode worker. A worker that dies fails the
requests it held, with its name; the others go on.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from milestones.model_store import resolve_model
from milestones.runtime.processes import WorkerProcesses
from milestones.serving.outputs import CompletionOutput, RequestMetrics, RequestOutput
from milestones.serving.parallel_sampling import ParentRequest, ParentRequests
from milestones.serving.prompts import Prompt, check_length, eos_token_ids, tokenize_prompt
from milestones.serving.sampling_params import SamplingParams, checked_params
from milestones.serving.structured_output import StructuredOutputManager

from .block_manager import BlockManager
from .config import EngineConfig
from .disaggregation import Abort, NewRequest, Outputs, Prefilled, Query, Reply, Reserved, load_worker
from .engine import LLMEngine, serialized
from .model import ModelConfig
from .router import Router
from .scheduler import check_fits

STEP_WAIT = 0.05  # seconds step() waits for a worker's message before it returns with none


@dataclass(slots=True)
class Routed:
    """A request as the router follows it: its two workers, and the last output it passed on."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill: int
    decode: int
    prefilled: bool = False  # the prefill worker has handed it off: its decode worker holds it
    last: RequestOutput | None = None


@dataclass(slots=True)
class Workers(WorkerProcesses):
    """The router's handles on its workers: prefill workers first, then decode; a message pipe each."""

    pipes_out: list[Connection] = field(default_factory=list)  # the router's ends of the message pipes

    def tell_stop(self) -> None:
        for pipe in self.pipes_out:
            try:
                pipe.send(None)
            except OSError:  # gone already
                pass


def make_engine(config: EngineConfig) -> object:
    """m8's engine, or with prefill and decode workers asked for, the router in front of them."""
    if config.num_prefill_workers or config.num_decode_workers:
        return DisaggregatedEngine(config)
    return LLMEngine(config)


class DisaggregatedEngine:
    def __init__(self, config: EngineConfig) -> None:
        path = resolve_model(config.model)
        self.model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
        self.config = config.resolve(self.model_config.max_position_embeddings)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, eos_token_ids(path))
        self.num_prefill, self.num_decode = config.num_prefill_workers, config.num_decode_workers
        self.requests: dict[str, Routed] = {}
        self.parents = ParentRequests()
        self._seeds = random.Random(self.config.seed)
        self._tags = 0
        self.num_steps = 0
        self.lock = threading.RLock()
        self.dead: dict[int, str] = {}  # worker number -> what happened to it
        self.replies: dict[int, list[Reply]] = {}  # answers to queries, by worker
        self.early: dict[int, list[object]] = {}  # other messages read while waiting for an answer
        self.carried: list[RequestOutput] = []  # outputs of a step that raised, returned by the next
        self.aborted_decode: dict[str, int] = {}  # aborted before its hand-off: its decode worker, should one come
        self.workers = self._start(config)
        self._stop_workers = weakref.finalize(self, self.workers.close)
        try:
            pools = [self._ask(w, "pool") for w in range(self.num_prefill + self.num_decode)]
        except BaseException:
            self._stop_workers()
            raise
        self.smallest_pool = BlockManager(min(pools), self.config.block_size)  # what a request must fit in
        self.router = Router(self.config.router_policy, self.num_prefill, self.num_decode, self.config.block_size,
                             min(pools))

    # --8<-- [start:start]
    def _start(self, config: EngineConfig) -> Workers:
        """Start the prefill workers (ranks 0 to P - 1 of the transfer group), then the decode workers."""
        size = self.num_prefill + self.num_decode
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)  # the group meets here
        workers = Workers("worker", first=0)
        device = self.config.device  # on CUDA worker w runs on the w-th GPU from the one given
        threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else torch.get_num_threads()
        try:
            for rank in range(size):
                prefill = rank < self.num_prefill
                role = replace(config, num_prefill_workers=0, num_decode_workers=0,
                               disaggregation_mode="prefill" if prefill else "decode",
                               device=device if device.type == "cpu" else torch.device("cuda", (device.index or 0)
                                                                                      + rank))
                if prefill:  # it computes prompts and their first token: nothing to guess, nothing to overlap
                    role = replace(role, speculative_config=None, async_scheduling=False)
                mine, theirs = multiprocessing.get_context("spawn").Pipe()
                workers.start(load_worker, rank, size, store.port, role, theirs, threads)
                theirs.close()
                workers.pipes_out.append(mine)
            workers.wait_for("started")
            workers.wait_for("ready", None)
            workers.share_threads(1)  # the router only waits for messages
        except BaseException:
            workers.close()
            raise
        return workers
    # --8<-- [end:start]

    def name(self, worker: int) -> str:
        if worker < self.num_prefill:
            return f"prefill worker {worker}"
        return f"decode worker {worker - self.num_prefill}"

    # --8<-- [start:add_request]
    @serialized
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """m8's checks, then each sample to a prefill worker and a decode worker."""
        params = checked_params(params)
        token_ids = tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size)
        check_length(len(token_ids), params.max_tokens, self.config.max_model_len)
        check_fits(len(token_ids), params.max_tokens, self.config.max_model_len, self.smallest_pool)
        if params.structured_outputs:
            self.structured.grammar(params.structured_outputs)  # a bad format is refused here, as m8 does
        if not self.router.alive_prefill or not self.router.alive_decode:
            raise RuntimeError(f"no worker of a role is left ({'; '.join(self.dead.values())}): close this LLM and "
                               "create a new one")
        request_id, children = self.parents.claim_ids(request_id, params.n, self.requests.get)
        text = prompt if isinstance(prompt, str) else None
        if not children:
            self._send(request_id, text, token_ids, params)
            return request_id
        for index, child in enumerate(children):  # seeds drawn in m8's order: the samples', one after the other
            self._send(child, text, token_ids, ParentRequest.child_params(params, index))
        self.parents.add(ParentRequest(request_id, children, held=[]))
        return request_id

    def _send(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams) -> None:
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        prefill, decode = self.router.prefill(token_ids).worker, self.router.decode()
        self._tags += 1
        now = time.perf_counter()
        self.pipe(prefill).send(NewRequest(request_id, prompt, token_ids, params, seed, now,
                                           self.num_prefill + decode, self._tags))
        self.pipe(self.num_prefill + decode).send(NewRequest(request_id, prompt, token_ids, params, seed, now,
                                                             prefill, self._tags))
        self.router.prefill_load[prefill] += 1
        self.router.decode_load[decode] += 1
        self.requests[request_id] = Routed(request_id, prompt, token_ids, params, prefill, decode)
    # --8<-- [end:add_request]

    def pipe(self, worker: int) -> Connection:
        return self.workers.pipes_out[worker]

    # --8<-- [start:step]
    @serialized
    def step(self) -> list[RequestOutput]:
        """Pass on what the workers sent since the last call (waiting up to STEP_WAIT s for something): the hand-shake
        to the other worker of each request, the outputs to the caller. A dead worker's requests fail here."""
        carried, self.carried = self.carried, []
        if not self.requests:
            return carried
        self.num_steps += 1
        alive = [w for w in range(len(self.workers.pipes_out)) if w not in self.dead]
        sentinels = {self.workers.processes[w].sentinel: w for w in alive}
        ready = wait([*(self.pipe(w) for w in alive), *sentinels], STEP_WAIT)
        outputs: list[RequestOutput] = []
        errors: list[str] = []
        for worker in alive:
            for message in self._drain(worker):
                outputs += self._take(worker, message, errors)
        errors += [self._fail_worker(sentinels[s]) for s in ready if s in sentinels]
        merged = carried + self.parents.merge(outputs)
        if errors:  # the others' outputs come with the next step
            self.carried = merged
            raise RuntimeError("; ".join(errors) + "; the other requests go on")
        return merged
    # --8<-- [end:step]

    def _drain(self, worker: int) -> list[object]:
        """Every message the worker has sent so far (its replies kept apart)."""
        pipe, messages = self.pipe(worker), self.early.pop(worker, [])
        try:
            while pipe.poll():
                message = pipe.recv()
                if isinstance(message, Reply):
                    self.replies.setdefault(worker, []).append(message)
                else:
                    messages.append(message)
        except (EOFError, OSError):  # it died: the sentinel says how
            pass
        return messages

    def _take(self, worker: int, message: object, errors: list[str]) -> list[RequestOutput]:
        if isinstance(message, Reserved):  # decode -> prefill: where the prompt's keys and values go
            routed = self.requests.get(message.request_id)
            if routed is not None and routed.prefill not in self.dead:
                self.pipe(routed.prefill).send(message)
            return []
        if isinstance(message, Prefilled):  # prefill -> decode: sent; even if aborted, the decode worker takes it
            routed = self.requests.get(message.request_id)
            decode = routed.decode if routed is not None else self.aborted_decode.pop(message.request_id, None)
            if routed is not None:
                routed.prefilled = True
                self.router.prefill_load[routed.prefill] -= 1
            if decode is not None and self.num_prefill + decode not in self.dead:
                self.pipe(self.num_prefill + decode).send(message)
            return []
        assert isinstance(message, Outputs), message
        outputs = []
        for output in message.outputs:
            routed = self.requests.get(output.request_id)
            if routed is None:  # aborted meanwhile
                continue
            routed.last = output
            outputs.append(output)
            if output.finished:
                self._forget(routed, tell_decode=worker < self.num_prefill)
        for failure in message.failures:
            routed = self.requests.get(failure.request_id)
            if routed is not None:
                self._abort_routed(routed)
                errors.append(f"{self.name(worker)}: request {failure.request_id!r} failed: {failure.error}")
        return outputs

    def _forget(self, routed: Routed, tell_decode: bool) -> None:
        """The request is done: it leaves the router's books. One that finished on its prefill worker (its first
        token was its last) gives its decode worker's reservation back."""
        del self.requests[routed.request_id]
        if not routed.prefilled:
            self.router.prefill_load[routed.prefill] -= 1
        self.router.decode_load[routed.decode] -= 1
        if tell_decode and self.num_prefill + routed.decode not in self.dead:
            self.pipe(self.num_prefill + routed.decode).send(Abort(routed.request_id))

    def _fail_worker(self, worker: int) -> str:
        """The worker has died: fail the requests it held, route around it; what to tell the caller."""
        self.workers.processes[worker].join(1.0)  # its exit code, a moment after its sentinel
        self.dead[worker] = f"{self.name(worker)} has exited (code {self.workers.processes[worker].exitcode})"
        prefill = worker < self.num_prefill
        if prefill:
            self.router.alive_prefill.discard(worker)
        else:
            self.router.alive_decode.discard(worker - self.num_prefill)
        lost = [routed for routed in self.requests.values()
                if (routed.prefill == worker and not routed.prefilled) or self.num_prefill + routed.decode == worker]
        for routed in lost:
            self._abort_routed(routed)
        return f"{self.dead[worker]}: its request(s) {[r.request_id for r in lost]} failed"

    @serialized
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is, on both its workers (each sample of one with n > 1)."""
        parent = self.parents.by_id.get(str(request_id))
        aborted = [self._abort(r) for r in (parent.child_ids if parent is not None else [str(request_id)])]
        merged = self.parents.merge([out for out in aborted if out is not None])
        return merged[0] if merged else None

    def _abort(self, request_id: str) -> RequestOutput | None:
        routed = self.requests.get(request_id)
        return self._abort_routed(routed) if routed is not None else None

    def _abort_routed(self, routed: Routed) -> RequestOutput:
        self._forget(routed, tell_decode=False)
        for worker in (routed.prefill, self.num_prefill + routed.decode):
            if worker not in self.dead:
                self.pipe(worker).send(Abort(routed.request_id))
        if not routed.prefilled and routed.prefill not in self.dead:
            self.aborted_decode[routed.request_id] = routed.decode  # its Prefilled may still come: relay it
        last = routed.last
        completion = CompletionOutput(0, "", [], "abort", [] if routed.params.logprobs is not None else None)
        if last is not None:
            completion = replace(last.outputs[0], finish_reason="abort")
            return replace(last, outputs=[completion], finished=True)
        return RequestOutput(routed.request_id, routed.prompt, routed.prompt_token_ids, [completion], True,
                             RequestMetrics())

    @serialized
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _ask(self, worker: int, what: str, arg: object = None) -> object:
        """A worker's answer to a query; its other messages wait for the next step."""
        if what != "pool":
            self.pipe(worker).send(Query(what, arg))
        pending = self.replies.setdefault(worker, [])
        while not any(r.what == what for r in pending):
            heard = wait([self.pipe(worker), self.workers.processes[worker].sentinel], 60)
            if not heard or self.workers.processes[worker].exitcode is not None:
                raise RuntimeError(f"{self.name(worker)} did not answer {what!r}: "
                                   f"{self.workers.stopped() or 'silent for 60 s'}")
            try:
                self._keep(worker, self.pipe(worker).recv())
            except (EOFError, OSError):  # it died as it answered
                self.workers.processes[worker].join(1.0)
                raise RuntimeError(f"{self.name(worker)} did not answer {what!r}: it has exited (code "
                                   f"{self.workers.processes[worker].exitcode})") from None
        reply = next(r for r in pending if r.what == what)
        pending.remove(reply)
        return reply.value

    def _keep(self, worker: int, message: object) -> None:
        if isinstance(message, Reply):
            self.replies.setdefault(worker, []).append(message)
        else:
            self.early.setdefault(worker, []).append(message)

    @serialized
    def check_integrity(self) -> None:
        """Every live worker's engine checks its own books (m8's checks, and the reservations)."""
        for worker in range(len(self.workers.pipes_out)):
            if worker not in self.dead and (error := self._ask(worker, "integrity")) is not None:
                raise AssertionError(f"{self.name(worker)}: {error}")

    @serialized
    def kv_usage(self) -> dict[str, int | float]:
        """The workers' pools, added up."""
        total: dict[str, int | float] = {}
        for worker in range(len(self.workers.pipes_out)):
            if worker not in self.dead:
                for key, value in self._ask(worker, "kv_usage").items():
                    if key not in ("prefix_hit_rate", "new_token_ratio"):
                        total[key] = total.get(key, 0) + value
        return total

    @serialized
    def disaggregation_stats(self) -> dict[str, object]:
        """Per worker: prompt tokens admitted and found cached, transfers, bytes moved and (decode) their time."""
        return {self.name(w): self._ask(w, "stats") for w in range(len(self.workers.pipes_out)) if w not in self.dead}

    @serialized
    def prompt_kv(self, worker: int, which: str | list[int]) -> torch.Tensor | None:
        """Tests: the keys and values a worker holds for a running request's prompt (by id) or a cached prompt."""
        return self._ask(worker, "prompt_kv", which)

    @serialized
    def spec_stats(self) -> dict[str, int | float]:
        """m7 on the decode workers: guesses made and kept, added up over them."""
        totals: dict[str, int] = {}
        for worker in range(self.num_prefill, len(self.workers.pipes_out)):
            if worker not in self.dead:
                for key, count in self._ask(worker, "spec_stats").items():
                    totals[key] = totals.get(key, 0) + count
        drafted, accepted, guessing = (totals.get(k, 0) for k in ("num_draft_tokens", "num_accepted_tokens",
                                                                  "num_guessing"))
        return {"num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                "acceptance_rate": accepted / max(1, drafted), "mean_tokens_per_step": 1 + accepted / max(1, guessing)}

    @serialized
    def close(self) -> None:
        """Stop every worker (each finishes what it does, or is killed after STOP_TIMEOUT s)."""
        self._stop_workers()

