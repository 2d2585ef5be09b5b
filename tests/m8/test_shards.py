"""m8's shards, rank by rank, with no process group: what each rank reads of every checkpoint tensor, and what its
part of the embedding looks up.

Loading a shard runs no collective, so a ``TensorParallel(rank, size)`` without groups builds
any rank's shard in this process, one after the other; each is compared with the slices of
the whole model (one rank) that it should hold, bit for bit. The sharded forward, with its
all-reduces, is test_sharding.py's.
"""

from __future__ import annotations

import pytest
import torch

from milestones.m8.distributed import TensorParallel
from milestones.m8.model import VocabParallelEmbedding
from tests.m8.conftest import load_shard


def rows_of_heads(tensor: torch.Tensor, heads: range, head_dim: int, dim: int = 0) -> torch.Tensor:
    """The rows (or columns, ``dim=1``) of ``heads``, each head ``head_dim`` of them."""
    return tensor.narrow(dim, heads.start * head_dim, len(heads) * head_dim)


def expected_shard(name: str, whole: torch.Tensor, tp: TensorParallel, cfg) -> torch.Tensor:
    """What rank ``tp.rank`` of ``tp.size`` should hold of the whole model's parameter ``name``."""
    d = cfg.head_dim
    if ".qkv_proj." in name:  # q's rows of this rank's query heads, then k's and v's of its KV heads
        q, k, v = whole.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
        heads, kv_heads = tp.part(cfg.num_heads), tp.kv_part(cfg.num_kv_heads)
        return torch.cat([rows_of_heads(q, heads, d), rows_of_heads(k, kv_heads, d), rows_of_heads(v, kv_heads, d)])
    if name.endswith("o_proj.weight"):  # the columns of its query heads
        return rows_of_heads(whole, tp.part(cfg.num_heads), d, dim=1)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):  # its rows of the MLP's width
        return whole[tp.part(cfg.intermediate_size).start : tp.part(cfg.intermediate_size).stop]
    if name.endswith("down_proj.weight"):  # its columns of the width
        return whole[:, tp.part(cfg.intermediate_size).start : tp.part(cfg.intermediate_size).stop]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # its token ids' rows, then zeros (the padding)
        ids = tp.vocab_part(cfg.vocab_size)
        shard = torch.zeros(tp.vocab_rows(cfg.vocab_size), whole.shape[1], dtype=whole.dtype)
        shard[: len(ids)] = whole[ids.start : ids.stop]
        return shard
    return whole  # the norms, whole on every rank


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_each_rank_reads_its_rows_and_columns_of_every_tensor(tiny_model_factory, kind):
    """llama: separate LM head; qwen2: q, k and v with biases, a tied head; qwen3: q and k norms. With 4 ranks over
    their 2 KV heads, ranks 0 and 1 both hold KV head 0, ranks 2 and 3 KV head 1."""
    path = tiny_model_factory(kind)
    reference = load_shard(path, TensorParallel())
    cfg, whole = reference.config, dict(reference.named_parameters())
    for size in (2, 4):
        for rank in range(size):
            tp = TensorParallel(rank, size)
            shard = dict(load_shard(path, tp).named_parameters())
            assert shard.keys() == whole.keys()
            for name, param in shard.items():
                want = expected_shard(name, whole[name].data, tp, cfg)
                assert param.shape == want.shape, f"{kind}, rank {rank} of {size}: {name} is {list(param.shape)}"
                assert torch.equal(param.data, want), (
                    f"{kind}, rank {rank} of {size}: {name} holds other rows or columns than its share of the "
                    "checkpoint's tensor")


def test_a_rank_looks_up_its_own_token_ids_and_zeros_for_the_others():
    """10 token ids over 3 ranks, 4 rows each: ids 0-3, 4-7 and 8-9 (the last rank's 2 rows of padding are never
    read). Every rank's lookup added up is the whole embedding's."""
    torch.manual_seed(0)
    vocab, hidden, size = 10, 3, 3
    whole = torch.randn(vocab, hidden)
    input_ids = torch.tensor([0, 9, 3, 4, 7, 8, 5, 0, 2, 6])
    total = torch.zeros(len(input_ids), hidden)
    for rank in range(size):
        tp = TensorParallel(rank, size)
        embedding = VocabParallelEmbedding(vocab, hidden, tp)
        ids = tp.vocab_part(vocab)
        with torch.no_grad():
            embedding.weight.fill_(1000.0)  # the padding rows: a lookup that reads one shows it
            embedding.weight[: len(ids)] = whole[ids.start : ids.stop]
            got = embedding(input_ids)
        assert got.shape == (len(input_ids), hidden)
        mine = (input_ids >= ids.start) & (input_ids < ids.stop)
        assert torch.equal(got[mine], whole[input_ids[mine]]), f"rank {rank}: its own token ids' rows are wrong"
        assert not got[~mine].any(), f"rank {rank}: another rank's token ids must look up zeros here"
        total += got
    assert torch.equal(total, whole[input_ids])


def test_one_rank_looks_up_every_token_id():
    torch.manual_seed(1)
    embedding = VocabParallelEmbedding(7, 4, TensorParallel())
    input_ids = torch.tensor([6, 0, 3, 3])
    with torch.no_grad():
        assert torch.equal(embedding(input_ids), embedding.weight[input_ids])
