"""A compact decoder for the Llama family: Llama / SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm).

Every forward works on a *flat* batch: ``input_ids`` and ``positions`` are 1-D
tensors of the tokens being computed this step. How those tokens find their keys
and values is the job of ``attention.py``.

m8: a rank holds a shard of every layer, Megatron's way. Attention is split by heads: q, k and v
are column-parallel (a rank's heads' rows of each), o_proj row-parallel (their columns). The MLP
is split by its width: gate and up column-parallel, down row-parallel. A row-parallel product
gives each rank a partial sum of the whole output, so each decoder layer adds them up twice
(``tp.all_reduce``). The embedding and the LM head are split by the vocabulary. Each rank reads
only its shard of each tensor from the checkpoint (``checkpoint_tensors``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from milestones.hf_checkpoint import ModelConfig, Shard, copy_shard, load_checkpoint

from .attention import AttentionContext, attention
from .distributed import SINGLE, TensorParallel


# --8<-- [start:rmsnorm]
class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned weight (computed in fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
# --8<-- [end:rmsnorm]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotation speed of each pair of dimensions, with Llama-3 style scaling when configured."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device="cpu").float() / cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta**exponents
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"rope scaling {scaling!r} is not supported; only 'default' and 'llama3'")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


# --8<-- [start:rope]
class RotaryEmbedding(nn.Module):
    """Rotate query and key pairs by an angle proportional to the token's position."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        self.build_tables()

    def build_tables(self, device: torch.device | None = None) -> None:
        """cos and sin of every (position, dimension) angle, in fp32 like transformers."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        angles = torch.outer(positions, rope_inv_freq(self.cfg))
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of this step's positions, [T, 1, head_dim] (shared by all heads).

        Looked up once per forward pass and handed to every layer: a lookup per layer
        costs a measurable share of a CPU decode step (see the benchmarks page).
        """
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) pair of x by its position's angle."""
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
# --8<-- [end:rope]


# --8<-- [start:self_attention]
class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.attend = attention  # attention.py's; a runner may give it a kernel backend's (CausalLM.use_attention)
        # m8: this rank's query heads and KV heads, and so its rows of q, k and v and its columns of o_proj
        self.q_heads, self.kv_heads = tp.part(cfg.num_heads), tp.kv_part(cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = len(self.q_heads), len(self.kv_heads), cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        # q, k and v projected by one product, as vLLM's qkv_proj: the input is read once, one call instead of three.
        # A checkpoint stores them apart; load_weights copies each into its rows (q's, then k's, then v's).
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)  # a partial sum: the layer adds them up
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k, v = k.view(n, self.num_kv_heads, self.head_dim), v.view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, self.layer_index, ctx)  # [n, num_heads, head_dim]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
# --8<-- [end:self_attention]


# --8<-- [start:mlp]
class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.columns = tp.part(cfg.intermediate_size)  # m8: this rank's share of the MLP's width
        width = len(self.columns)
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)  # a partial sum, like o_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
# --8<-- [end:mlp]


# --8<-- [start:decoder_layer]
class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        # m8: the two all-reduces of a layer, each rank's partial sums of o_proj's and down_proj's outputs added up
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))
# --8<-- [end:decoder_layer]


# --8<-- [start:vocab_parallel_embedding]
class VocabParallelEmbedding(nn.Embedding):
    """m8: the embedding rows of this rank's token ids (``tp.vocab_part``); a token of another rank's part looks up
    zeros here, so adding up every rank's lookup (an all-reduce) gives each token its row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(tp.vocab_rows(vocab_size), hidden_size)
        self.token_ids, self.vocab_size = tp.vocab_part(vocab_size), vocab_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if len(self.token_ids) == self.vocab_size:  # one rank holds every token: m7's lookup
            return super().forward(input_ids)
        local = input_ids - self.token_ids.start
        mine = (local >= 0) & (local < len(self.token_ids))
        return torch.where(mine[:, None], F.embedding(local * mine, self.weight), 0)
# --8<-- [end:vocab_parallel_embedding]


class Backbone(nn.Module):
    """Named like transformers' ``model.*`` so checkpoints load without renaming."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = Backbone(cfg, tp)
        self.rope = RotaryEmbedding(cfg, max_positions)
        # m8: the logits of this rank's token ids (the embedding's rows); the runner gathers every rank's
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_rows(cfg.vocab_size), bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(
        cls, folder: Path, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
    ) -> CausalLM:
        """Build the model without random initialisation (on the meta device), then load the weights (m8: this
        rank's shard of them)."""
        with torch.device("meta"):
            model = cls(cfg, max_positions, tp)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives every parameter its own storage
        with torch.no_grad():  # m8: the last rank's padding rows of the vocabulary, which no checkpoint fills
            model.model.embed_tokens.weight.zero_()
            model.lm_head.weight.zero_()
        model.load_weights(folder)
        model.to(dtype=dtype)
        model.rope.build_tables(device)  # to_empty left the tables uninitialised
        return model.eval()

    # --8<-- [start:forward]
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Hidden states of every token in the flat batch: [num_tokens, hidden_size]."""
        x = self.tp.all_reduce(self.model.embed_tokens(input_ids))  # m8: each rank looked up its own token ids
        cos, sin = self.rope(positions, x.dtype)  # RoPE's angles for every token, shared by all layers
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)
    # --8<-- [end:forward]

    def use_attention(self, attend: Callable[..., torch.Tensor]) -> None:
        """Attend with ``attend(q, k, v, layer, ctx)`` in every layer: the attention backend the runner selected."""
        for layer in self.model.layers:
            layer.self_attn.attend = attend

    # --8<-- [start:compute_logits]
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the rows we sample from (only each request's last token), in fp32 (m8: of this rank's token
        ids, gathered by the runner)."""
        return self.lm_head(hidden).float()
    # --8<-- [end:compute_logits]

    # --8<-- [start:load_weights]
    def load_weights(self, folder: Path) -> None:
        """Copy every ``*.safetensors`` tensor in ``folder`` into the module of that name (q, k and v: qkv_proj).
        m8: only this rank's shard of each is read from the file."""
        load_checkpoint(folder, self.checkpoint_tensors(), self.config, copy=copy_shard)
    # --8<-- [end:load_weights]

    # --8<-- [start:checkpoint_tensors]
    def checkpoint_tensors(self) -> dict[str, Shard]:
        """Every tensor a checkpoint names, as what this rank copies of it, and where: a parameter's data, or for q,
        k and v their rows of ``qkv_proj``'s (vLLM's stacked parameters). m8: a rank's rows or columns of each."""
        cfg, head_dim, tensors = self.config, self.config.head_dim, {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if ".qkv_proj." in name:
                attn = self.get_submodule(name.rsplit(".", 2)[0])
                rows = param.data.split([attn.q_size, attn.kv_size, attn.kv_size])
                heads = (attn.q_heads, attn.kv_heads, attn.kv_heads)
                totals = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
                for part, part_rows, part_heads, total in zip(("q_proj", "k_proj", "v_proj"), rows, heads, totals):
                    tensors[name.replace("qkv_proj", part)] = Shard(
                        part_rows, 0, part_heads.start * head_dim, part_heads.stop * head_dim,
                        [total * head_dim, *part_rows.shape[1:]])
            elif name.endswith("o_proj.weight"):  # row-parallel: the columns of this rank's heads
                heads = self.get_submodule(name.rsplit(".", 2)[0]).q_heads
                tensors[name] = Shard(param.data, 1, heads.start * head_dim, heads.stop * head_dim,
                                      [cfg.hidden_size, cfg.num_heads * head_dim])
            elif name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
                columns = self.get_submodule(name.rsplit(".", 2)[0]).columns
                dim = 1 if "down_proj" in name else 0  # down is row-parallel: the columns of this rank's width
                full = [cfg.hidden_size] * 2
                full[dim] = cfg.intermediate_size
                tensors[name] = Shard(param.data, dim, columns.start, columns.stop, full)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):  # this rank's token ids' rows
                token_ids = self.model.embed_tokens.token_ids
                tensors[name] = Shard(param.data[: len(token_ids)], 0, token_ids.start, token_ids.stop,
                                      [cfg.vocab_size, cfg.hidden_size])
            else:  # the norms: every rank holds them whole
                tensors[name] = Shard(param.data, 0, 0, None, list(param.shape))
        return tensors
    # --8<-- [end:checkpoint_tensors]
