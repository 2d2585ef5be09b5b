"""Own the model and its KV pool; turn a scheduled batch into tensors, run it, sample.

As in m4, every scheduled token of every request goes into one flat batch, and each request reaches its keys
and values through its block table. What m5 adds: the dispatcher sends every step one of three ways. A step in
which every request decodes one token, and whose batch fits a captured size, is not run operator by operator but
replayed whole by the ``GraphRunner``; on CUDA, any other step that fits a captured token count is replayed in
pieces, attention eager between them (``PiecewiseRunner``); the rest run eagerly, as in m4, each for a reason the
runner counts (``enforce_eager``, too large, a CPU's steps with prefill).

m6: the host ``prepare``s a step as plain lists (the host changes the sequences while
it runs) and the forward worker ``execute``s it: tensors, future ids resolved, forward,
sampling, the tokens left on the device for the step after.

m8: every rank has a runner of its own, with its shard of the model and its heads' part of the
KV pool; one block table serves them all. Rank 0's ``execute`` sends each step to the other
ranks (their ``execute_shard``), computes its own shard with them, samples alone from the
gathered logits and sends them the tokens, which they keep for the next step as it does.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import torch

from milestones.kernels import attention_backend_for, fuse_layers_for, kv_cache_zeros, pack_linear_layers_for
from milestones.kernels.cpu_graphs import cpp_compiler_available
from milestones.serving.logits_processors import LogitsProcessors
from milestones.transfer import to_device

from .attention import AttentionContext, RequestSpan, attention
from .config import EngineConfig
from .dispatcher import BatchDescriptor, Dispatch, GraphDispatcher, GraphMode
from .distributed import SINGLE, TensorParallel
from .future_map import FutureMap
from .graph_runner import GraphRunner
from .model import CausalLM, ModelConfig
from .piecewise import PiecewiseRunner
from .sampler import Sampler
from .sequence import Sequence
from .step import (
    DecodeInputs,
    ModelInputs,
    PromptLogprobRows,
    SamplingRow,
    ScheduledBatch,
    ShardStep,
    StepInputs,
    StepOutput,
)


class ModelRunner:
    """Two threads use it: the host calls ``prepare`` (with ``prepare_inputs`` and ``decode_inputs``), the forward
    worker calls ``execute`` and everything that calls (``device_inputs``, the attention's ``prepare_metadata``, the
    graph runner, the sampler, the future map's ``resolve_`` and ``store``)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 tp: TensorParallel = SINGLE) -> None:
        self.config, self.tp = config, tp
        self.device = config.device
        self.model = CausalLM.from_pretrained(
            model_path, model_config, config.max_model_len, config.device, config.dtype, tp
        )
        # m8: this rank's heads, which its KV pool holds (the same count on every rank, so the same number of blocks)
        heads = replace(model_config, num_heads=len(tp.part(model_config.num_heads)),
                        num_kv_heads=len(tp.kv_part(model_config.num_kv_heads)))
        element_size = torch.empty((), dtype=config.dtype).element_size()
        bytes_per_token = 2 * heads.num_layers * heads.num_kv_heads * heads.head_dim * element_size
        if config.num_kv_blocks is None:  # size the pool from the memory budget; the scheduler reads it back
            budget = config.kv_cache_memory_bytes or config.max_num_seqs * config.max_model_len * bytes_per_token
            config.num_kv_blocks = budget // (bytes_per_token * config.block_size)
            if config.num_kv_blocks == 0:
                raise ValueError(
                    f"kv_cache_memory_bytes ({budget}) holds no block of {config.block_size} tokens "
                    f"({bytes_per_token * config.block_size} bytes): raise it, or lower block_size"
                )
        # One block more than the block manager hands out: where the padding rows of a replayed step write.
        shape = (heads.num_layers, heads.num_kv_heads, config.num_kv_blocks + 1, config.block_size, heads.head_dim)
        # torch.zeros; on a CPU in 2 MiB pages, read faster (a platform speed-up, attention_backend not "torch")
        self.k_cache = kv_cache_zeros(shape, config.dtype, config.device, config.attention_backend)
        self.v_cache = kv_cache_zeros(shape, config.dtype, config.device, config.attention_backend)
        speculative = config.speculative_config  # m7: a request samples after its last token and after each guess
        rows_per_seq = 1 + (speculative.num_speculative_tokens if speculative is not None else 0)
        self.future_map = FutureMap(2 * config.max_num_seqs * rows_per_seq, config.device)
        self.sampler = Sampler(config.device)
        # the serving features on its logits (milestones.serving); m6: a penalty's history may end in future ids
        self.features = LogitsProcessors(config.device, resolve=self.future_map.resolve_)
        self.rejection = speculative is not None and speculative.acceptance == "rejection"  # m7: how guesses are judged
        # A platform speed-up, not the lesson: on a CPU, linear layers packed for oneDNN (None: plain F.linear).
        self.packed_lm_head = pack_linear_layers_for(config.linear_backend, self.model, config.device, config.dtype,
                                                     config.quantization)
        self.compute_logits = self.model.compute_logits if self.packed_lm_head is None else self.packed_lm_head
        # Another: the attention the model calls, selected once: attention.py's, or on a CPU one compiled call for every
        # decoding request, on CUDA every request in one call (milestones/kernels/attention_backends.py)
        self.attention = attention_backend_for(config, heads, attention, "paged")
        self.model.use_attention(self.attention.forward)
        fuse_layers_for(config, self.model, self.attention)  # a platform speed-up: decode steps' layers fused
        full, pieces = self.capture_decode_step(), self.capture_pieces()  # each the graphs, or why there are none
        self.graph_runner = None if isinstance(full, str) else full
        self.piecewise = None if isinstance(pieces, str) else pieces
        self.dispatcher = GraphDispatcher(full if isinstance(full, str) else full.sizes,
                                          pieces if isinstance(pieces, str) else pieces.sizes)
        self.eager_reasons: dict[str, int] = {}  # why steps ran eagerly: the dispatcher's reason -> steps

    def capture_decode_step(self) -> GraphRunner | str:
        """Capture the decode step for every configured batch size, or say why it is not captured here."""
        if self.config.enforce_eager:
            return "enforce_eager=True"
        if self.device.type == "cpu" and not cpp_compiler_available():
            warnings.warn("no C++ compiler for torch.compile: m5 decodes eagerly (install g++ or clang, or pass "
                          "enforce_eager=True to silence this)", stacklevel=3)
            return "no C++ compiler for torch.compile"
        max_blocks = -(-self.config.max_model_len // self.config.block_size)
        graph_runner = GraphRunner(self.model, self.k_cache, self.v_cache, self.attention,
                                   self.config.cudagraph_capture_sizes, max_blocks)
        with torch.inference_mode():
            graph_runner.capture()
        return graph_runner

    def capture_pieces(self) -> PiecewiseRunner | str:
        """Capture the steps with prefill in pieces for every configured token count, or say why not here."""
        if self.config.enforce_eager:
            return "enforce_eager=True"
        if self.device.type != "cuda":
            return "a step with prefill on a CPU: no graphs to cut around attention"
        if not self.config.piecewise_capture_sizes:
            return "piecewise_capture_sizes=[]"
        pieces = PiecewiseRunner(self.model, self.attention, self.config.piecewise_capture_sizes, self.device)
        with torch.inference_mode():
            pieces.capture()
        return pieces

    @property
    def num_eager_steps(self) -> int:
        return sum(self.eager_reasons.values())

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes reserved for keys and values, whether filled or not."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token across all layers."""
        num_layers, num_kv_heads, _, _, head_dim = self.k_cache.shape
        return 2 * num_layers * num_kv_heads * head_dim * self.k_cache.element_size()

    # --8<-- [start:execute]
    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The host's half of a step: what to compute, as plain lists, and a future id for every token to sample."""
        # m7: a decode step has a row per token, so a checking step needs 1 + guesses rows a request
        dispatch = self.dispatch(batch)
        if dispatch.mode is GraphMode.FULL:
            forward, sample_seqs = self.decode_inputs(batch)
            positions = forward.positions
        else:
            forward = self.prepare_inputs(batch)
            sample_seqs, positions = forward.sample_seqs, [forward.positions[row] for row in forward.sample_rows]
        rows = [SamplingRow.of(seq, p, self.rejection, batch.guess_probs) for seq, p in zip(sample_seqs, positions)]
        return StepInputs(forward, dispatch, rows, self.future_map.allocate(len(sample_seqs)), sample_seqs,
                          len(batch.seqs))

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> StepOutput:
        """The device's half: compute the scheduled tokens in one forward pass and sample; tokens stay on the device.
        m8: rank 0's half; the other ranks compute their shards of the same step with it (``execute_shard``)."""
        forward = replace(step.forward, sample_seqs=[]) if isinstance(step.forward, ModelInputs) else step.forward
        self.tp.send_step(ShardStep(forward, step.dispatch, step.future_ids))  # the host's sequences stay here
        hidden, prompt_logprobs = self.forward(step.forward, step.dispatch)
        if not step.samples:  # every request is in the middle of its prompt
            return StepOutput(torch.empty(0, dtype=torch.long, device=self.device), [], prompt_logprobs)
        picked = self.features.sample(self.sampler, self.logits(hidden), step.samples)  # on the worker
        tokens = picked.tokens
        self.future_map.store(step.future_ids, tokens)
        self.tp.broadcast(tokens)  # m8: the other ranks keep them too, where the next step's inputs look for them
        return StepOutput(tokens, picked.logprobs, prompt_logprobs)

    @torch.inference_mode()
    def execute_shard(self, step: ShardStep) -> None:
        """m8, every rank but 0: compute this rank's shard of the step rank 0 sent, take part in its logits, and keep
        the tokens rank 0 sampled where the next step's inputs look for them."""
        hidden, _ = self.forward(step.forward, step.dispatch)
        if step.future_ids:
            self.logits(hidden)
            tokens = torch.empty(len(step.future_ids), dtype=torch.long, device=self.device)
            self.future_map.store(step.future_ids, self.tp.broadcast(tokens))

    def serve(self) -> None:
        """m8, every rank but 0: run the steps rank 0 sends until it sends None."""
        while (step := self.tp.receive_step()) is not None:
            self.execute_shard(step)

    def forward(self, forward: DecodeInputs | ModelInputs, dispatch: Dispatch) -> tuple[torch.Tensor, dict[str, list]]:
        """Every rank: the hidden states of the rows that sample, and the prompt scores of the requests that ask."""
        if dispatch.mode is GraphMode.FULL:
            return self.graph_runner.run(forward, self.future_map), {}
        input_ids, positions, ctx = self.device_inputs(forward)
        self.attention.prepare_metadata(ctx)  # nothing, or what a kernel reads (a platform speed-up)
        hidden = self.run_model(input_ids, positions, ctx, dispatch)
        prompt_logprobs = self.features.prompt_logprobs(self.logits, hidden, forward.prompt_rows)
        rows = self._tensor(forward.sample_rows)  # a tensor from pinned memory: a list index would
        return hidden[rows], prompt_logprobs  # copy to the GPU and wait for the forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every rank: the logits of its part of the vocabulary, gathered; the whole vocabulary's, in fp32."""
        return self.tp.gather_logits(self.compute_logits(hidden))[:, : self.model.config.vocab_size]
    # --8<-- [end:execute]

    # --8<-- [start:prepare_inputs]
    def prepare_inputs(self, batch: ScheduledBatch) -> ModelInputs:
        """Every request's new tokens, one after the other in one flat batch, and where their keys and values go."""
        block_size = self.config.block_size
        input_ids, positions, slot_mapping = [], [], []  # one entry per token
        requests = []  # one span per request (m7: per guessed row), attended one by one
        sample_rows, sample_seqs, prompt_rows = [], [], []
        for seq, num_new, table in zip(batch.seqs, batch.num_new_tokens, batch.block_tables):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row = len(input_ids)
            tokens = seq.token_ids + seq.spec.draft_token_ids  # m7: the guesses ride after the last token, like a chunk
            input_ids += tokens[start:end]
            positions += range(start, end)
            slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            span = RequestSpan(row, row + num_new, table[: -(-end // block_size)], end)
            if start + 1 < len(seq.token_ids):  # a chunk of a prompt
                requests.append(span)
            else:  # m7: the last token and its guesses, a row apiece as in a replayed step, each seeing the rows before
                requests += [RequestSpan(row + i, row + i + 1, span.block_table, start + i + 1) for i in range(num_new)]
            prompt_rows += PromptLogprobRows.of(seq, row, start, end)
            if end == len(tokens):  # the chunk reaches the end: its last token, and each guess, predicts the next one
                num_rows = 1 + len(seq.spec.draft_token_ids)
                sample_rows += range(row + num_new - num_rows, row + num_new)
                sample_seqs += [seq] * num_rows
        block_tables = []  # the torch path gathers every request's blocks in one copy per layer
        for span in requests:
            span.first = len(block_tables) * block_size
            block_tables += span.block_table
        return ModelInputs(input_ids, positions, slot_mapping, block_tables, requests, sample_rows, sample_seqs,
                           prompt_rows)

    def device_inputs(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """The eager step's tensors, made on the worker; future ids resolved to the tokens they stand for."""
        input_ids = self._tensor(inputs.input_ids)
        self.future_map.resolve_(input_ids)
        ctx = AttentionContext(self.k_cache, self.v_cache, self._tensor(inputs.slot_mapping),
                               self._tensor(inputs.block_tables), inputs.requests)
        return input_ids, self._tensor(inputs.positions), ctx
    # --8<-- [end:prepare_inputs]

    # --8<-- [start:run_model]
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                  dispatch: Dispatch) -> torch.Tensor:
        """A step not replayed whole: replayed in pieces, or run eagerly."""
        if dispatch.mode is GraphMode.PIECEWISE:
            return self.piecewise.run(input_ids, positions, ctx, dispatch.size)
        return self.model(input_ids, positions, ctx)
    # --8<-- [end:run_model]

    # --8<-- [start:dispatch]
    def dispatch(self, batch: ScheduledBatch) -> Dispatch:
        """How this step runs: the full graphs, the pieces, or eagerly (its reason counted), from its descriptor."""
        descriptor = BatchDescriptor(sum(batch.num_new_tokens), len(batch.seqs), self.is_decode_step(batch))
        dispatch = self.dispatcher.dispatch(descriptor)
        if dispatch.mode is GraphMode.NONE:
            self.eager_reasons[dispatch.reason] = self.eager_reasons.get(dispatch.reason, 0) + 1
        return dispatch
    # --8<-- [end:dispatch]

    @staticmethod
    def is_decode_step(batch: ScheduledBatch) -> bool:
        """Does every request compute exactly its last token (m7: and its guesses), and so sample after each?"""
        return all(seq.num_computed_tokens + 1 == seq.num_tokens and num_new == 1 + len(seq.spec.draft_token_ids)
                   for seq, num_new in zip(batch.seqs, batch.num_new_tokens))

    # --8<-- [start:decode_inputs]
    def decode_inputs(self, batch: ScheduledBatch) -> tuple[DecodeInputs, list[Sequence]]:
        """Each request's one new token (m7: and each guess, a row apiece), where its key and value go, and the
        blocks it reads; who samples after each row. A guess's row reads the rows before it, as it would in a
        chunk: each row's keys and values are written before any row attends, and its context ends at itself."""
        block_size = self.config.block_size
        inputs, sample_seqs = DecodeInputs([], [], [], [], []), []
        for seq, table in zip(batch.seqs, batch.block_tables):
            tokens = (seq.token_ids + seq.spec.draft_token_ids)[seq.num_computed_tokens:]  # m7: a token and its guesses
            table = list(table)  # a copy: the host grows the live table while the step runs
            for position, token in enumerate(tokens, seq.num_computed_tokens):
                inputs.token_ids.append(token)
                inputs.positions.append(position)
                inputs.slots.append(table[position // block_size] * block_size + position % block_size)
                inputs.block_tables.append(table)
                inputs.context_lens.append(position + 1)
                sample_seqs.append(seq)
        return inputs, sample_seqs
    # --8<-- [end:decode_inputs]

    def _tensor(self, values: list) -> torch.Tensor:
        return to_device(values, torch.long, self.device)

