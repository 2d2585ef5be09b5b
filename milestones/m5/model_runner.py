"""Own the model and its KV pool; turn a scheduled batch into tensors, run it, sample.

As in m4, every scheduled token of every request goes into one flat batch, and each request reaches its keys
and values through its block table. What m5 adds: the dispatcher sends every step one of three ways. A step in
which every request decodes one token, and whose batch fits a captured size, is not run operator by operator but
replayed whole by the ``GraphRunner``; on CUDA, any other step that fits a captured token count is replayed in
pieces, attention eager between them (``PiecewiseRunner``); the rest run eagerly, as in m4, each for a reason the
runner counts (``enforce_eager``, too large, a CPU's steps with prefill).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from milestones.kernels import attention_backend_for, fuse_layers_for, kv_cache_zeros, pack_linear_layers_for
from milestones.kernels.cpu_graphs import cpp_compiler_available
from milestones.serving.logits_processors import LogitsProcessors
from milestones.transfer import to_device

from .attention import AttentionContext, RequestSpan, attention
from .config import EngineConfig
from .dispatcher import BatchDescriptor, Dispatch, GraphDispatcher, GraphMode
from .graph_runner import GraphRunner
from .model import CausalLM, ModelConfig
from .piecewise import PiecewiseRunner
from .sampler import Sampler
from .step import DecodeInputs, ModelInputs, PromptLogprobRows, ScheduledBatch, StepOutput


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path) -> None:
        self.config = config
        self.device = config.device
        self.model = CausalLM.from_pretrained(
            model_path, model_config, config.max_model_len, config.device, config.dtype
        )
        element_size = torch.empty((), dtype=config.dtype).element_size()
        bytes_per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * element_size
        if config.num_kv_blocks is None:  # size the pool from the memory budget; the scheduler reads it back
            budget = config.kv_cache_memory_bytes or config.max_num_seqs * config.max_model_len * bytes_per_token
            config.num_kv_blocks = budget // (bytes_per_token * config.block_size)
            if config.num_kv_blocks == 0:
                raise ValueError(
                    f"kv_cache_memory_bytes ({budget}) holds no block of {config.block_size} tokens "
                    f"({bytes_per_token * config.block_size} bytes): raise it, or lower block_size"
                )
        # One block more than the block manager hands out: where the padding rows of a replayed step write.
        shape = (model_config.num_layers, model_config.num_kv_heads, config.num_kv_blocks + 1, config.block_size,
                 model_config.head_dim)
        # torch.zeros; on a CPU in 2 MiB pages, read faster (a platform speed-up, attention_backend not "torch")
        self.k_cache = kv_cache_zeros(shape, config.dtype, config.device, config.attention_backend)
        self.v_cache = kv_cache_zeros(shape, config.dtype, config.device, config.attention_backend)
        self.sampler = Sampler(config.device)
        self.features = LogitsProcessors(config.device)  # the serving features on its logits (milestones.serving)
        # A platform speed-up, not the lesson: on a CPU, linear layers packed for oneDNN (None: plain F.linear).
        self.packed_lm_head = pack_linear_layers_for(config.linear_backend, self.model, config.device, config.dtype,
                                                     config.quantization)
        self.compute_logits = self.model.compute_logits if self.packed_lm_head is None else self.packed_lm_head
        # Another: the attention the model calls, selected once: attention.py's, or on a CPU one compiled call for every
        # decoding request, on CUDA every request in one call (milestones/kernels/attention_backends.py)
        self.attention = attention_backend_for(config, model_config, attention, "paged")
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
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Compute every scheduled token in one forward pass; sample for requests whose prompt is done."""
        dispatch = self.dispatch(batch)
        if dispatch.mode is GraphMode.FULL:
            hidden = self.graph_runner.run(self.decode_inputs(batch))
            return StepOutput(self.features.sample(self.sampler, self.compute_logits(hidden), batch.seqs).as_list(), {})
        inputs = self.prepare_inputs(batch)
        self.attention.prepare_metadata(inputs.ctx)  # nothing, or what a kernel reads (a platform speed-up)
        hidden = self.run_model(inputs.input_ids, inputs.positions, inputs.ctx, dispatch)
        prompt_logprobs = self.features.prompt_logprobs(self.compute_logits, hidden, inputs.prompt_rows)
        if not inputs.sample_seqs:  # every request is in the middle of its prompt
            return StepOutput([None] * len(batch.seqs), prompt_logprobs)
        logits = self.compute_logits(hidden[inputs.sample_rows])
        sampled = self.features.sample(self.sampler, logits, inputs.sample_seqs).as_list()
        token_of = {seq.request_id: token for seq, token in zip(inputs.sample_seqs, sampled)}
        # None: a chunk of a prompt that predicts nothing yet
        return StepOutput([token_of.get(seq.request_id) for seq in batch.seqs], prompt_logprobs)
    # --8<-- [end:execute]

    # --8<-- [start:prepare_inputs]
    def prepare_inputs(self, batch: ScheduledBatch) -> ModelInputs:
        """Every request's new tokens, one after the other in one flat batch, and where their keys and values go."""
        block_size = self.config.block_size
        input_ids, positions, slot_mapping = [], [], []  # one entry per token
        requests = []  # one span per request, attended one by one
        sample_rows, sample_seqs, prompt_rows = [], [], []
        for seq, num_new, table in zip(batch.seqs, batch.num_new_tokens, batch.block_tables):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row = len(input_ids)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            span = RequestSpan(row, row + num_new, table[: -(-end // block_size)], end)
            requests.append(span)
            prompt_rows += PromptLogprobRows.of(seq, row, start, end)
            if end == seq.num_tokens:  # the chunk reaches the end: its last token predicts the next one
                sample_rows.append(row + num_new - 1)
                sample_seqs.append(seq)
        block_tables = []  # the torch path gathers every request's blocks in one copy per layer
        for span in requests:
            span.first = len(block_tables) * block_size
            block_tables += span.block_table
        ctx = AttentionContext(self.k_cache, self.v_cache, self._tensor(slot_mapping), self._tensor(block_tables),
                               requests)
        return ModelInputs(self._tensor(input_ids), self._tensor(positions), ctx, sample_rows, sample_seqs,
                           prompt_rows)
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
        """Does every request compute exactly its last token (and so sample the next one)?"""
        return all(num_new == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
                   for seq, num_new in zip(batch.seqs, batch.num_new_tokens))

    # --8<-- [start:decode_inputs]
    def decode_inputs(self, batch: ScheduledBatch) -> DecodeInputs:
        """Each request's one new token, where its key and value go, and the blocks it reads."""
        block_size = self.config.block_size
        inputs = DecodeInputs([], [], [], [], [])
        for seq, table in zip(batch.seqs, batch.block_tables):
            position = seq.num_computed_tokens
            inputs.token_ids.append(seq.token_ids[position])
            inputs.positions.append(position)
            inputs.slots.append(table[position // block_size] * block_size + position % block_size)
            inputs.block_tables.append(table)
            inputs.context_lens.append(position + 1)
        return inputs
    # --8<-- [end:decode_inputs]

    def _tensor(self, values: list) -> torch.Tensor:
        return to_device(values, torch.long, self.device)

