"""Own the model and its KV cache; turn a scheduled batch into tensors, run it, sample.

m1 runs exactly one sequence per step, so the "batch" is that sequence's new tokens:
the whole prompt at prefill, the last sampled token at decode.
"""

from __future__ import annotations

from pathlib import Path

import torch

from milestones.kernels import attention_backend_for, fuse_layers_for, kv_cache_zeros, pack_linear_layers_for
from milestones.serving.logits_processors import LogitsProcessors

from .attention import AttentionContext, attention
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
        # One contiguous cache row per position, for every layer, allocated once up front.
        shape = (model_config.num_layers, config.max_model_len, model_config.num_kv_heads, model_config.head_dim)
        # torch.zeros; on a CPU in 2 MiB pages, read faster (a platform speed-up, attention_backend not "torch")
        self.k_cache = kv_cache_zeros(shape, config.dtype, config.device, config.attention_backend)
        self.v_cache = kv_cache_zeros(shape, config.dtype, config.device, config.attention_backend)
        self.sampler = Sampler(config.device)
        self.features = LogitsProcessors(config.device)  # the serving features on its logits (milestones.serving)
        # A platform speed-up, not the lesson: on a CPU, linear layers packed for oneDNN (None: plain F.linear).
        self.packed_lm_head = pack_linear_layers_for(config.linear_backend, self.model, config.device, config.dtype,
                                                     config.quantization)
        self.compute_logits = self.model.compute_logits if self.packed_lm_head is None else self.packed_lm_head
        # Another: the attention the model calls, selected once: attention.py's, or on a CPU a decode step's in one
        # compiled call (milestones/kernels/attention_backends.py)
        self.attention = attention_backend_for(config, model_config, attention, "contiguous")
        self.model.use_attention(self.attention.forward)
        fuse_layers_for(config, self.model, self.attention)  # a platform speed-up: decode steps' layers fused

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes reserved for keys and values, whether filled or not."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token across all layers."""
        num_layers, _, num_kv_heads, head_dim = self.k_cache.shape
        return 2 * num_layers * num_kv_heads * head_dim * self.k_cache.element_size()

    # --8<-- [start:execute]
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Compute the batch's new tokens in one forward pass and sample one token per sequence."""
        inputs = self.prepare_inputs(batch)
        self.attention.prepare_metadata(inputs.ctx)  # nothing, or what a kernel reads (a platform speed-up)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.ctx)
        logits = self.compute_logits(hidden[inputs.sample_rows])
        sampled = self.features.sample(self.sampler, logits, inputs.sample_seqs).as_list()
        return StepOutput(sampled, self.features.prompt_logprobs(self.compute_logits, hidden, inputs.prompt_rows))
    # --8<-- [end:execute]

    # --8<-- [start:prepare_inputs]
    def prepare_inputs(self, batch: ScheduledBatch) -> ModelInputs:
        """The one sequence's new tokens, their positions, and the cache rows they fill."""
        (seq,), (num_new,) = batch.seqs, batch.num_new_tokens
        start = seq.num_computed_tokens
        input_ids = torch.tensor(seq.token_ids[start : start + num_new], device=self.device)
        positions = torch.arange(start, start + num_new, device=self.device)
        ctx = AttentionContext(self.k_cache, self.v_cache, slot_mapping=positions, context_len=start + num_new)
        return ModelInputs(input_ids, positions, ctx, sample_rows=[num_new - 1], sample_seqs=[seq],  # the last predicts
                           prompt_rows=PromptLogprobRows.of(seq, 0, start, start + num_new))
    # --8<-- [end:prepare_inputs]
