"""m1, step 2: rotary position embedding against transformers' LlamaRotaryEmbedding and apply_rotary_pos_emb.

The tables hold the cos and sin of every (position, dimension) angle, in float32 like
transformers, with the angles of dimensions i and i + head_dim/2 equal (the two halves
of a pair); ``apply_rope`` rotates each (i, i + head_dim/2) pair of a query or key.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half

from milestones.m1.model import ModelConfig, RotaryEmbedding, apply_rope, rotate_half
from tests.checkpoints import checkpoint_config

from .closeness import EXACT, FLOAT32, Tolerance, expect_close

BFLOAT16 = Tolerance(0.0, rtol=2**-7)  # a value rounded to bfloat16 from a float32 within FLOAT32: one step at most
# SmolLM2 (theta 100,000, head_dim 64), Llama 3's scaled frequencies, and Qwen3 (head_dim 32, not hidden / heads)
KINDS = ["smollm2", "llama3_rope", "qwen3"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_tables_match_transformers(smollm2, kind):
    hf_config = smollm2.hf_config if kind == "smollm2" else checkpoint_config(kind)
    positions = hf_config.max_position_embeddings
    rope = RotaryEmbedding(ModelConfig.from_hf(hf_config), positions)
    cos, sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1), torch.arange(positions)[None])  # [1, positions, dim]
    for name, table, expected in (("cos", rope.cos, cos[0]), ("sin", rope.sin, sin[0])):
        expect_close(f"RotaryEmbedding.{name} ({kind}, [{positions} positions, head_dim])", table, expected, FLOAT32)


def test_the_tables_build_inside_the_meta_device_as_from_pretrained_builds_them(smollm2):
    """from_pretrained builds the model inside `with torch.device("meta")` (no memory, no random weights), so
    RotaryEmbedding.__init__ calls build_tables there, and then again with the real device once the weights are in:
    each tensor it makes must say where it lives, or the meta device takes it. The tables end on the device given,
    and are no part of the checkpoint."""
    expected = RotaryEmbedding(smollm2.config, 64)
    try:
        with torch.device("meta"):
            rope = RotaryEmbedding(smollm2.config, 64)
        rope.build_tables(torch.device("cpu"))
    except (RuntimeError, NotImplementedError) as error:
        if isinstance(error, NotImplementedError) and "yours to write" in str(error):
            raise
        raise AssertionError(
            "RotaryEmbedding built inside `with torch.device(\"meta\")` (as CausalLM.from_pretrained builds it), then "
            f"build_tables(cpu): {type(error).__name__}: {error}. Inside that block every tensor made without a device "
            "(torch.arange(n), torch.zeros(...)) is a meta tensor, which cannot be combined with rope_inv_freq's CPU "
            "tensor: make the positions with device=\"cpu\", then move the tables to `device`") from None
    for name in ("cos", "sin"):
        expect_close(f"RotaryEmbedding.{name} built under the meta device, then on the CPU", getattr(rope, name),
                     getattr(expected, name), EXACT, source="the same tables built outside it")
    rope.build_tables(torch.device("meta"))  # a device other than the CPU that every machine has
    found = {name: getattr(rope, name).device.type for name in ("cos", "sin")}
    assert found == {"cos": "meta", "sin": "meta"}, (
        f"build_tables(device) left the tables on {found}: register them on the device given, `angles.cos()"
        ".to(device)` (on a GPU they would stay on the CPU)")
    saved = sorted(rope.state_dict())
    assert not saved, (f"the tables are in the module's state_dict ({saved}): they are computed, not loaded from the "
                       "checkpoint, so register them with `persistent=False`")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_looks_up_the_positions_for_every_head(smollm2, dtype):
    rope = RotaryEmbedding(smollm2.config, 8192)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 8191])
    cos, sin = LlamaRotaryEmbedding(smollm2.hf_config)(torch.zeros(1, dtype=dtype), positions[None])
    ours = rope(positions, dtype)
    tolerance = FLOAT32 if dtype == torch.float32 else BFLOAT16
    for name, got, expected in zip(("cos", "sin"), ours, (cos, sin)):
        expect_close(f"RotaryEmbedding.forward's {name} of positions {positions.tolist()} in {dtype}, "
                     "[positions, 1, head_dim]", got, expected[0][:, None, :], tolerance)


def test_rotate_half_matches_transformers():
    x = torch.randn(5, 9, 64, generator=torch.Generator().manual_seed(0))
    expect_close("rotate_half(x) of x [5, 9, 64]", rotate_half(x), hf_rotate_half(x), EXACT)


def test_apply_rope_matches_apply_rotary_pos_emb(smollm2):
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(6, 9, 64, generator=generator), torch.randn(6, 3, 64, generator=generator)
    positions = torch.tensor([0, 1, 2, 3, 500, 8000])
    cos, sin = LlamaRotaryEmbedding(smollm2.hf_config)(q, positions[None])  # [1, tokens, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # m1's layout: [tokens, 1, head_dim], shared by the heads
    expect_close("apply_rope(q) for 9 query heads", apply_rope(q, cos, sin), q_ref[0].transpose(0, 1), FLOAT32)
    expect_close("apply_rope(k) for 3 key heads", apply_rope(k, cos, sin), k_ref[0].transpose(0, 1), FLOAT32)


def test_a_rotated_dot_product_depends_only_on_the_distance(smollm2):
    """The chapter's reason for RoPE: q at p and k at p' score the same as q at p + s and k at p' + s."""
    rope = RotaryEmbedding(smollm2.config, 8192)
    generator = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 9, 64, generator=generator), torch.randn(1, 9, 64, generator=generator)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)  # unit vectors: scores in [-1, 1]

    def scores(query_position: int, key_position: int) -> torch.Tensor:
        cos_q, sin_q = rope(torch.tensor([query_position]), torch.float32)
        cos_k, sin_k = rope(torch.tensor([key_position]), torch.float32)
        return (apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)).sum(-1)

    for shift in (1, 20, 37):
        # float32 angles round differently at other positions: the scores moved by at most 2e-7 (measured)
        expect_close(f"the 9 heads' scores of q at 9, k at 3 when both move by {shift}", scores(9 + shift, 3 + shift),
                     scores(9, 3), Tolerance(1e-5), source="the unshifted scores")
