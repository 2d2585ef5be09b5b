"""The engine loop: accept requests, run one scheduled step at a time, stream the results.

``LLMEngine`` is the level beneath ``LLM``: ``add_request`` queues a prompt,
``step`` runs one forward pass and returns the requests it advanced, and
``abort_request`` drops a request wherever it is. Bad input is refused in
``add_request`` with a ``ValueError`` before anything is queued, so it can never
disturb the requests already running. Calls from several threads take turns on
the engine's lock (``LLM.generate`` holds it for its whole run).
"""

from __future__ import annotations

import functools
import random
import threading
import time

from transformers import AutoConfig, AutoTokenizer

from milestones.model_store import resolve_model
from milestones.serving.outputs import RequestOutput, keep_logprobs, keep_prompt_logprobs
from milestones.serving.parallel_sampling import ParentRequest, ParentRequests
from milestones.serving.prompts import Prompt, check_length, eos_token_ids, tokenize_prompt
from milestones.serving.reports import kv_usage
from milestones.serving.sampling_params import SamplingParams, checked_params
from milestones.serving.structured_output import StructuredOutputManager

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .model import ModelConfig
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence


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
        self.runner = ModelRunner(self.config, self.model_config, path)
        self.scheduler = Scheduler(self.config)
        self._seeds = random.Random(self.config.seed)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.parents = ParentRequests()  # requests with n > 1, each made of a child request per sample
        self.num_steps = 0
        self.lock = threading.RLock()  # re-entrant: LLM.generate holds it around its own calls

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
        samples = [self._sequence(child, prompt, token_ids, ParentRequest.child_params(params, index))
                   for index, child in enumerate(children)]  # all checked (a grammar compiled) before any is queued
        self.parents.add(ParentRequest(request_id, children))  # n samples: a request each, one output for all
        for seq in samples:
            self.scheduler.add(seq)
        return request_id
    # --8<-- [end:add_request]

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
        """Run one forward pass; return an output for every request that gained a token or finished."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        now = time.perf_counter()
        for seq in batch.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        output = self.runner.execute(batch)
        self.num_steps += 1
        outputs = []
        for seq, num_new, sampled in zip(batch.seqs, batch.num_new_tokens, output.sampled):
            keep_prompt_logprobs(seq, seq.num_computed_tokens + 1, output.prompt_logprobs)  # if it asked for them
            seq.num_computed_tokens += num_new
            if sampled is None:  # part of a prompt that is still being prefilled
                continue
            keep_logprobs(seq, sampled.logprobs)  # if it asked for them
            self._append_token(seq, sampled.token_id)
            if seq.is_finished:
                self.scheduler.finish(seq)
            outputs.append(RequestOutput.from_sequence(seq))
        return self.parents.merge(outputs)  # a sample's output is its parent's (n > 1)
    # --8<-- [end:step]

    # --8<-- [start:stop_rules]
    def _append_token(self, seq: Sequence, token: int) -> None:
        """Record a sampled token and apply the stop rules, in vLLM's order."""
        now = time.perf_counter()
        seq.token_ids.append(token)
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
        elif seq.num_tokens >= self.config.max_model_len:
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
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        seq.finish("abort")
        self.scheduler.finish(seq)
        return RequestOutput.from_sequence(seq)

    @serialized
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @serialized
    def close(self) -> None:
        """Nothing to release: the engine runs in the caller's thread. (m6's engine stops its forward worker here.)"""

    @serialized
    def check_integrity(self) -> None:
        """Raise AssertionError if any request's state, or the KV bookkeeping, is inconsistent."""
        self.scheduler.check_integrity()

    @serialized
    def kv_usage(self) -> dict[str, int | float]:
        """KV bytes reserved vs filled; from m3 the pool's blocks, from m4 the prefix cache's (milestones.serving)."""
        return kv_usage(self.scheduler, self.runner)
