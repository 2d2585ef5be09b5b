"""The engine loop: accept requests, run one scheduled step at a time, stream the results.

``LLMEngine`` is the level beneath ``LLM``: ``add_request`` queues a prompt,
``step`` runs one forward pass and returns the requests it advanced, and
``abort_request`` drops a request wherever it is. Bad input is refused in
``add_request`` with a ``ValueError`` before anything is queued, so it can never
disturb the requests already running. Calls from several threads take turns on
the engine's lock (``LLM.generate`` holds it for its whole run).

m7: with ``speculative_config`` a step has one more phase, before launching: the proposer
guesses each request's next tokens into room the scheduler kept, the step checks them a row
each (``speculation.py``), and the rows whose guess the model agreed with count: m6's tokens.

m6: with ``async_scheduling`` a step is launched on the forward worker and processed
one ``step()`` later, after the next one has been scheduled and launched: the host's
work happens while the device computes. A request that finishes in step N is already
in step N+1; that extra token is dropped. It is on by default on CUDA only: on a CPU
the worker's threads compete with the caller's for the same cores.
"""

from __future__ import annotations

import functools
import random
import threading
import time
import weakref
from collections.abc import Callable

from transformers import AutoConfig, AutoTokenizer

from milestones import options
from milestones.model_store import resolve_model
from milestones.serving.outputs import RequestMetrics, RequestOutput, keep_logprobs, keep_prompt_logprobs
from milestones.serving.parallel_sampling import ParentRequest, ParentRequests
from milestones.serving.prompts import Prompt, check_length, eos_token_ids, tokenize_prompt
from milestones.serving.reports import graph_stats, kv_usage
from milestones.serving.sampling_params import SamplingParams, checked_params
from milestones.serving.structured_output import StructuredOutputManager
from milestones.trace import Tracer

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .distributed import SINGLE
from .drafter import make_proposer
from .executor import start_ranks
from .model import ModelConfig
from .model_runner import ModelRunner
from .rollback import drop_pending_tokens, roll_back
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .speculation import Speculator
from .step import LaunchedRow, LaunchedStep, ScheduledBatch
from .worker import ForwardWorker


# --8<-- [start:serialized]
def serialized(method):
    """Run an engine method under the engine's lock, so calls from several threads never interleave."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return locked
# --8<-- [end:serialized]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        path = resolve_model(config.model)
        self.model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
        self.config = config.resolve(self.model_config.max_position_embeddings)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos_token_ids = eos_token_ids(path)
        options.check_tensor_parallel(self.config.tensor_parallel_size, self.model_config, self.config.device)
        self.workers = start_ranks(self.config, self.model_config, path)  # m8: the other ranks, loading their shards
        self._stop_workers = weakref.finalize(self, self.workers.close) if self.workers else None
        try:
            self.runner = ModelRunner(self.config, self.model_config, path, self.workers.tp if self.workers else SINGLE)
            if self.workers is not None:
                self.workers.wait_until_loaded()
        except BaseException:
            if self._stop_workers is not None:
                self._stop_workers()
            raise
        self.scheduler = Scheduler(self.config)
        proposer = make_proposer(self.config, self.tokenizer, self.model_config)  # m7: None without speculation
        self.speculator = Speculator(proposer, self.scheduler, self.config.speculative_config)
        self._seeds = random.Random(self.config.seed)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.parents = ParentRequests()  # requests with n > 1, each made of a child request per sample
        self.num_steps = 0  # steps processed
        self.num_launched = 0  # steps handed to the forward worker
        self.pending: LaunchedStep | None = None  # with async scheduling: launched last step, processed this one
        self.lock = threading.RLock()  # re-entrant: LLM.generate holds it around its own calls
        self.tracer = Tracer(self.config.trace_file is not None, self.scheduler.admission.refusals)
        self.worker = ForwardWorker(self.runner, self.config.device, self.config.async_scheduling, self.tracer)
        self.hand_off: Callable[[Sequence], None] | None = None  # m9, a prefill worker: where a request goes next
        self._stop_worker = weakref.finalize(self, self.worker.close)  # no thread outlives a forgotten engine

    # --8<-- [start:add_request]
    @serialized
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue one request; return its id."""
        params = checked_params(params)
        token_ids = tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size)
        check_length(len(token_ids), params.max_tokens, self.config.max_model_len)
        request_id, children = self.parents.claim_ids(request_id, params.n, self.scheduler.find)  # n > 1: an id each
        if not children:
            self.scheduler.add(self._sequence(request_id, prompt, token_ids, params))
            return request_id
        first, *others = [self._sequence(child, prompt, token_ids, ParentRequest.child_params(params, index))
                          for index, child in enumerate(children)]
        self.parents.add(ParentRequest(request_id, children, held=others))  # n samples: a request each, one output
        self.scheduler.add(first)  # m4: the others follow once its prompt is cached, and share it
        return request_id
    # --8<-- [end:add_request]

    def sequence_for(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                     seed: int, arrival_time: float) -> Sequence:
        """m9: a worker's record of a request the router has checked, with the router's seed (drawn in m8's order)
        and arrival time."""
        seq = self._sequence(request_id, prompt, token_ids, params)
        seq.seed, seq.metrics.arrival_time = seed, arrival_time
        return seq

    # --8<-- [start:arrive]
    def arrive(self, seq: Sequence, token: int, output_logprobs: list, prompt_logprobs: list,
               prefilled: RequestMetrics) -> None:
        """m9, a decode worker: the prompt's keys and values are in the request's blocks, and its first token is the
        prefill worker's (with when it was scheduled and sampled there): take the token as if this engine had sampled
        it, then decode from there."""
        seq.output_logprobs, seq.prompt_logprobs = output_logprobs, prompt_logprobs
        seq.metrics.first_scheduled_time = prefilled.first_scheduled_time
        seq.metrics.first_token_time = prefilled.first_token_time
        seq.token_ids.append(token)
        seq.num_pending_tokens += 1
        self._accept_token(seq, seq.num_tokens - 1, token)  # the stop rules, the text, the metrics: m8's
        if seq.grammar is not None:
            seq.grammar.accept(token)  # the prefill worker's grammar read it; this one reads it here
        self.scheduler.start_decoding(seq)
    # --8<-- [end:arrive]

    def _sequence(self, request_id: str, prompt: Prompt, token_ids: list[int], params: SamplingParams) -> Sequence:
        return Sequence(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            params=params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.stop),
            grammar=self.structured.grammar(params.structured_outputs) if params.structured_outputs else None,
        )

    # --8<-- [start:step]
    @serialized
    def step(self) -> list[RequestOutput]:
        """Schedule and launch step N+1, then process step N: the host's work while N+1 computes."""
        start = self.tracer.now()
        batch = self.scheduler.schedule()  # with overlap: while step N is still computing
        if batch is not None:
            self.speculator.propose(batch)  # m7: guesses fill the room kept for them; a draft model runs every step
        ongoing = self._launch(batch, start) if batch is not None else None
        if self.config.async_scheduling and self.speculator.proposer is None:
            last, self.pending = self.pending, ongoing  # the lag: this call processes the step launched by the last
        else:  # m5's loop: wait for the step just launched (m7: always when guessing, the proposer reads its tokens)
            last = ongoing
        return self._process(last) if last is not None else []
    # --8<-- [end:step]

    # --8<-- [start:launch]
    def _launch(self, batch: ScheduledBatch, start: float) -> LaunchedStep:
        """Hand the step to the worker, and book now what it will do: its tokens computed, a future id per sample."""
        now = time.perf_counter()
        for seq in batch.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        inputs = self.runner.prepare(batch)
        self.num_launched += 1
        before = [seq.num_computed_tokens for seq in batch.seqs]
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new  # steps run in launch order: whatever is launched next sees them
        launched = LaunchedStep(self.num_launched, batch.seqs, before, [seq.num_computed_tokens for seq in batch.seqs],
                                rows=[])
        for seq, future_id in zip(inputs.sample_seqs, inputs.future_ids):
            guess = seq.spec.draft_token_ids.pop(0) if seq.spec.draft_token_ids else None  # m7: what the next row reads
            launched.rows.append(LaunchedRow(seq, seq.num_tokens, guess))  # where its token will go
            seq.token_ids.append(future_id)  # the token stays on the device, where the next step reads it
            seq.num_pending_tokens += 1
        self.tracer.record("schedule", start, launched.number, len(batch.seqs))  # the host's work up to the launch
        self.worker.submit(launched.number, inputs)
        return launched
    # --8<-- [end:launch]

    # --8<-- [start:process]
    def _process(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Put a computed step's tokens in place, apply the stop rules, finish requests; their outputs."""
        try:
            output = self.worker.result(launched.number)
        except BaseException as error:  # the step raised, or the wait for it was interrupted (Ctrl-C)
            roll_back(launched, self.pending, self.scheduler)
            self.pending = None
            if self.workers is not None:  # m8: the ranks may have stopped at different points of the step, so the
                # engine takes no more steps, and every rank is stopped: none waits in a collective that will not come
                self._stop_worker()
                self.workers.abandon(error, "a tensor-parallel step")
            raise
        start = self.tracer.now()
        self.num_steps += 1
        for seq, before, computed in zip(launched.seqs, launched.num_computed_before, launched.num_computed_after):
            if seq.status is SequenceStatus.RUNNING:  # not preempted or finished since: the blocks are still its own
                seq.num_processed_tokens = computed  # written: from now on the prefix cache may share them
                keep_prompt_logprobs(seq, before + 1, output.prompt_logprobs)  # its rows read from ``before`` on
        changed: dict[str, Sequence] = {}
        for row, token, logprobs in zip(launched.rows, output.tokens.tolist(), output.logprobs):
            seq = row.seq
            if seq.is_finished or row.index >= seq.num_tokens:  # finished meanwhile, or (m7) past a rejected guess
                continue
            keep_logprobs(seq, logprobs)  # if it asked for them
            self._accept_token(seq, row.index, token)
            if seq.is_finished:
                drop_pending_tokens(seq)  # the step in flight computes one token too many for it
                self.scheduler.finish(seq)
            elif row.guess is not None:
                self.speculator.check(seq, token, row.guess)
            elif self.hand_off is not None:  # m9, a prefill worker: its first token is out, its KV goes to decode
                self.hand_off(seq)
            changed[seq.request_id] = seq
        outputs = [RequestOutput.from_sequence(seq) for seq in changed.values()]
        for seq in self.parents.release_held(outputs):  # m4: the first sample's prompt is computed
            self.scheduler.add(seq)
        self.tracer.record("process", start, launched.number, len(launched.seqs))
        return self.parents.merge(outputs)  # a sample's output is its parent's (n > 1)
    # --8<-- [end:process]

    # --8<-- [start:stop_rules]
    def _accept_token(self, seq: Sequence, index: int, token: int) -> None:
        """Put a sampled token where its future id was and apply the stop rules, in vLLM's order."""
        now = time.perf_counter()
        seq.token_ids[index] = token
        seq.num_pending_tokens -= 1  # any tokens after it belong to a step still in flight: not known, not counted
        seq.metrics.first_token_time = seq.metrics.first_token_time or now
        seq.metrics.last_token_time = now
        seq.metrics.num_output_tokens = seq.num_output_tokens
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.finish("stop")  # the stop token stays in token_ids but adds no text
        elif seq.detokenizer.add_token(token) is not None:
            seq.finish("stop")
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.finish("length")
        elif seq.num_tokens - seq.num_pending_tokens >= self.config.max_model_len:
            seq.finish("length")
    # --8<-- [end:stop_rules]

    @serialized
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a waiting or running request now (each sample of one with n > 1); its partial output is returned."""
        parent = self.parents.by_id.get(str(request_id))
        aborted = [self._abort(r) for r in (parent.child_ids if parent is not None else [str(request_id)])]
        merged = self.parents.merge([out for out in aborted if out is not None])
        return merged[0] if merged else None

    def _abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.find(request_id) or self.parents.take_held(request_id)
        if seq is None:
            return None
        seq.finish("abort")
        drop_pending_tokens(seq)
        self.scheduler.finish(seq)
        return RequestOutput.from_sequence(seq)

    @serialized
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @serialized
    def close(self) -> None:
        """Process the step still in flight, stop the forward worker, write the trace if one was asked for."""
        try:
            last, self.pending = self.pending, None
            if last is not None:
                self._process(last)  # a step that raises here still lets the worker stop
        finally:
            self._stop_worker()
            if self._stop_workers is not None:  # m8: and the other ranks' processes
                self._stop_workers()
            if self.config.trace_file is not None:
                self.tracer.write(self.config.trace_file)

    @serialized
    def check_integrity(self) -> None:
        """Raise AssertionError if any request's state, or the KV bookkeeping, is inconsistent."""
        self.scheduler.check_integrity()

    @serialized
    def graph_stats(self) -> dict[str, object]:
        """Captured batch sizes, decode steps replayed, padding rows run, eager steps, seconds spent capturing."""
        return graph_stats(self.runner)

    @serialized
    def spec_stats(self) -> dict[str, int | float]:
        """m7: guesses made and kept, and the tokens a request gained in a step that checked guesses, on average."""
        return self.speculator.stats()

    @serialized
    def kv_usage(self) -> dict[str, int | float]:
        """KV bytes reserved vs filled; from m3 the pool's blocks, from m4 the prefix cache's (milestones.serving)."""
        return kv_usage(self.scheduler, self.runner)
