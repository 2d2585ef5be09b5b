"""m8's tools: every rank of a tensor-parallel group in one process, a thread each, over real gloo groups.

The sharding tests need no worker processes: a thread per rank builds its shard of the model and
runs it, and their collectives meet as the processes' would (gloo does not care whether its peers
are threads). A rank that raises leaves the others waiting in a collective until its timeout, so
the first error is re-raised after all have ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from transformers import AutoConfig

from milestones.m8.attention import AttentionContext, RequestSpan
from milestones.m8.distributed import TensorParallel, join
from milestones.m8.model import CausalLM, ModelConfig

T = TypeVar("T")


def run_ranks(size: int, work: Callable[[TensorParallel], T]) -> list[T]:
    """``work(tp)`` as every rank of a group of ``size`` at once; each rank's result, by rank."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    results: list = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, size, is_master=False)
            results[rank] = work(join(client, rank, size, torch.device("cpu")))
        except BaseException as error:  # re-raised below, once every rank has ended
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def load_shard(path: Path, tp: TensorParallel, dtype: torch.dtype = torch.float32) -> CausalLM:
    """This rank's shard of the checkpoint at ``path``."""
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    return CausalLM.from_pretrained(path, cfg, 256, torch.device("cpu"), dtype, tp)


@torch.inference_mode()
def prompt_logits(model: CausalLM, tp: TensorParallel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Teacher-forced: the logits after every token of ``token_ids`` (one prefill), the whole vocabulary's."""
    cfg, n = model.config, len(token_ids)
    blocks = -(-n // block_size)
    shape = (cfg.num_layers, len(tp.kv_part(cfg.num_kv_heads)), blocks, block_size, cfg.head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    ctx = AttentionContext(k_cache, v_cache, torch.arange(n), torch.arange(blocks),
                           [RequestSpan(0, n, list(range(blocks)), n)])
    hidden = model(torch.tensor(token_ids), torch.arange(n), ctx)
    return tp.gather_logits(model.compute_logits(hidden))[:, : cfg.vocab_size]
