"""Own the model and its KV pool; turn a scheduled batch into tensors, run it, sample.

As in m2, every scheduled token of every request goes into one flat batch. What
changes is addressing: the KV cache is a pool of blocks sized from a memory
budget, and each request reaches its keys and values through its block table.
"""

from __future__ import annotations

from pathlib import Path

import torch

from milestones.kernels import attention_backend_for, fuse_layers_for, kv_cache_zeros, pack_linear_layers_for
from milestones.serving.logits_processors import LogitsProcessors
from milestones.transfer import to_device

from .attention import AttentionContext, RequestSpan, attention
from .config import EngineConfig
from .model import CausalLM, ModelConfig
from .sampler import Sampler
from .step import ModelInputs, PromptLogprobRows, ScheduledBatch, StepOutput


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
        shape = (model_config.num_layers, model_config.num_kv_heads, config.num_kv_blocks, config.block_size,
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
        inputs = self.prepare_inputs(batch)
        self.attention.prepare_metadata(inputs.ctx)  # nothing, or what a kernel reads (a platform speed-up)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.ctx)
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

    def _tensor(self, values: list) -> torch.Tensor:
        return to_device(values, torch.long, self.device)
