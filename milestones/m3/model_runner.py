"""Own the model and its KV pool; turn a scheduled batch into tensors, run it, sample.

As in m2, every scheduled token of every request goes into one flat batch. What
changes is addressing: the KV cache is a pool of blocks sized from a memory
budget, and each request reaches its keys and values through its block table.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .attention import AttentionContext, KernelBatch
from .config import EngineConfig
from .decode_kernel import decode_kernel_for
from .model import CausalLM, ModelConfig
from .packed_linear import pack_linear_layers, use_packed_linear
from .sampler import Sampler
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path) -> None:
        self.config = config
        self.device = config.device
        self.model = CausalLM.from_pretrained(model_path, model_config, config.max_model_len, config.device, config.dtype)
        element_size = torch.empty((), dtype=config.dtype).element_size()
        bytes_per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * element_size
        if config.num_kv_blocks is None:  # size the pool from the memory budget; the scheduler reads it back
            budget = config.kv_cache_memory_bytes or config.max_num_seqs * config.max_model_len * bytes_per_token
            config.num_kv_blocks = max(1, budget // (bytes_per_token * config.block_size))
        shape = (model_config.num_layers, model_config.num_kv_heads, config.num_kv_blocks, config.block_size, model_config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self.v_cache = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self.sampler = Sampler(config.device)
        self.decode_kernel = decode_kernel_for(config.attention_backend, config.device, config.dtype)
        self.packed_linear = use_packed_linear(config.linear_backend, config.device, config.dtype)
        # The LM head, for the rows that sample: the packed copy's logits are fp32 already (it runs in fp32 only).
        self.compute_logits = pack_linear_layers(self.model) if self.packed_linear else self.model.compute_logits

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
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Compute every scheduled token in one forward pass; sample for requests whose prompt is done."""
        block_size = self.config.block_size
        input_ids, positions, slot_mapping, block_tables, requests = [], [], [], [], []
        kernel_rows, kernel_tables, kernel_lens = [], [], []  # decoding requests, when the kernel takes them
        last_rows, sampled = [], []  # the rows that predict a new token, and their sequences
        for seq, num_new, table in zip(batch.seqs, batch.num_new_tokens, batch.block_tables):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row = len(input_ids)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            if num_new == 1 and self.decode_kernel is not None:  # a decode: the kernel reads its blocks in place
                kernel_rows.append(row)
                kernel_tables.append(table[: -(-end // block_size)])
                kernel_lens.append(end)
            else:
                requests.append((row, row + num_new, len(block_tables) * block_size, end))
                block_tables += table[: -(-end // block_size)]
            if end == seq.num_tokens:  # the chunk reaches the end: its last token predicts the next one
                last_rows.append(row + num_new - 1)
                sampled.append(seq)
        ctx = AttentionContext(self.k_cache, self.v_cache, self._tensor(slot_mapping), self._tensor(block_tables), requests)
        if kernel_rows:
            width = max(map(len, kernel_tables))
            padded = [table + [0] * (width - len(table)) for table in kernel_tables]
            ctx.kernel_batch = KernelBatch(self.decode_kernel, *map(self._tensor, (kernel_rows, padded, kernel_lens)))
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), ctx)
        tokens = iter(self.sampler(self.compute_logits(hidden[last_rows]), sampled)) if sampled else iter(())
        done = {seq.request_id for seq in sampled}
        return [next(tokens) if seq.request_id in done else None for seq in batch.seqs]
    # --8<-- [end:execute]

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
