"""Own the model and its KV cache; turn a scheduled batch into tensors, run it, sample.

m2 packs every scheduled token of every request into one flat batch: the linear
layers run once over all of them, attention keeps each request to its own KV slot,
and only each request's last position goes through the LM head.
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
        # One contiguous slot of max_model_len positions per running request, allocated up front:
        # simple, and wasteful on purpose (m3 fixes it).
        shape = (model_config.num_layers, config.max_num_seqs, model_config.num_kv_heads, config.max_model_len,
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
        self.attention = attention_backend_for(config, model_config, attention, "slots")
        self.model.use_attention(self.attention.forward)
        fuse_layers_for(config, self.model, self.attention)  # a platform speed-up: decode steps' layers fused

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes reserved for keys and values, whether filled or not."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token across all layers."""
        num_layers, _, num_kv_heads, _, head_dim = self.k_cache.shape
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
        input_ids, positions, token_slots = [], [], []  # one entry per token
        requests = []  # one span per request, attended one by one
        sample_rows, sample_seqs, prompt_rows = [], [], []
        for seq, num_new, slot in zip(batch.seqs, batch.num_new_tokens, batch.kv_slots):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row = len(input_ids)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            token_slots += [slot] * num_new
            span = RequestSpan(row, row + num_new, slot, end)
            requests.append(span)
            prompt_rows += PromptLogprobRows.of(seq, row, start, end)
            if end == seq.num_tokens:  # the chunk reaches the end: its last token predicts the next one
                sample_rows.append(row + num_new - 1)
                sample_seqs.append(seq)
        ctx = AttentionContext(self.k_cache, self.v_cache, self._tensor(token_slots), self._tensor(positions), requests)
        return ModelInputs(self._tensor(input_ids), ctx.positions, ctx, sample_rows, sample_seqs,
                           prompt_rows)
    # --8<-- [end:prepare_inputs]

    def _tensor(self, values: list) -> torch.Tensor:
        return to_device(values, torch.long, self.device)
