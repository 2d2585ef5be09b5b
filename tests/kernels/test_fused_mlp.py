"""The MLP's gate and up in one call of the panel kernel (``FusedMLP``) against the lesson's MLP, and the swap.

The fused MLP claims the lesson's numbers bit for bit: the same panel kernel sums every gate and
up column in the same order wherever its panel sits, and SiLU and the product are torch's own.
So these tests compare with ``torch.equal``, against the lesson's ``MLP`` whose three projections
run through ``PanelLinear`` (the kernel's own numbers for each, tested in test_panel_linear.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from milestones import m1, m2
from milestones.kernels import PanelLinear
from milestones.kernels.panel_linear import FusedMLP, bf16_pairs, load_panel_linear, pack_gate_up, pack_weight
from milestones.m1.model import MLP
from tests.conftest import needs_compiler
from tests.kernels import assert_one_opaque_op_to_torch_compile

pytestmark = needs_compiler


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_panel_linear()


def lesson_mlp(hidden: int, intermediate: int, dtype: torch.dtype, seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate)).to(dtype)


def panel(linear: torch.nn.Linear, pairs: bool | None) -> PanelLinear:
    layer = PanelLinear(linear)
    layer.packed_weight = pack_weight(linear.weight.detach(), pairs)
    return layer


LAYOUTS = {"float32": None, "bf16-widened": False, "bf16-pairs": True}  # pairs: pack_weight's argument


def fused_and_lesson(layout: str, intermediate: int, seed: int) -> tuple[FusedMLP, MLP]:
    """A FusedMLP, and the lesson's MLP over PanelLinear layers with the same weights, packed in ``layout``."""
    pairs = LAYOUTS[layout]
    if pairs and not bf16_pairs():
        pytest.skip("this CPU (or this build) has no AVX-512 BF16 dot product")
    mlp = lesson_mlp(96, intermediate, torch.float32 if layout == "float32" else torch.bfloat16, seed)
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    fused = FusedMLP(mlp)
    fused.packed_weight = pack_gate_up(gate.weight.detach(), up.weight.detach(), pairs)
    fused.down_proj = reference_down = panel(down, pairs)
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = panel(gate, pairs), panel(up, pairs), reference_down
    return fused, mlp


def assert_same_bits(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape
    differ = (out != expected).sum().item()
    assert differ == 0, f"{differ} of {out.numel()} outputs differ from the lesson's MLP over PanelLinear layers"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("intermediate", [1536, 40])  # 40: the last panel of gate and of up part-filled
@pytest.mark.parametrize("rows", [1, 3, 7, 20])  # a single row takes four panels at once; more go in tiles
@pytest.mark.parametrize("threads", [1, 2])  # one thread: a single row's four panels span gate and up (40)
def test_the_fused_mlp_gives_the_lesson_mlps_bits(layout, intermediate, rows, threads):
    fused, mlp = fused_and_lesson(layout, intermediate, seed=rows)
    x = torch.randn(rows, 96).to(mlp.down_proj.packed_weight.dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_same_bits(fused(x), mlp(x))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_leading_dimensions_are_kept(layout):
    fused, mlp = fused_and_lesson(layout, 40, seed=0)
    x = torch.randn(2, 3, 96).to(mlp.down_proj.packed_weight.dtype)
    out = fused(x)
    assert out.shape == (2, 3, 96)
    assert_same_bits(out, mlp(x))


def test_a_row_gets_the_same_bits_whatever_batch_it_is_in():
    """Up to torch's SiLU, which runs whole vectors and a scalar tail that can differ in the last bit: with 192
    intermediate columns every row is whole vectors, in float32 (16 a vector) and bfloat16 (32)."""
    fused, _ = fused_and_lesson("float32", 192, seed=0)
    x = torch.randn(30, 96)
    together = fused(x)
    for size in (1, 2, 7, 9):
        assert torch.equal(fused(x[:size]), together[:size]), f"a batch of {size} differs"


def test_packing_puts_the_gates_panels_then_ups():
    gate = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    up = -gate
    packed = pack_gate_up(gate.bfloat16(), up.bfloat16(), pairs=False).float()  # small integers: exact
    assert packed.shape == (4, 3, 16)  # gate 0-15, gate 16-19 (+ 12 zero), up 0-15, up 16-19 (+ 12 zero)
    assert torch.equal(packed[0].T, gate[:16]) and torch.equal(packed[1, :, :4].T, gate[16:])
    assert torch.equal(packed[2].T, up[:16]) and torch.equal(packed[3, :, :4].T, up[16:])
    assert not packed[1, :, 4:].any() and not packed[3, :, 4:].any(), "the padding columns are zero"


def test_the_op_refuses_a_weight_not_packed_for_it():
    x, gate = torch.randn(2, 8), torch.randn(40, 8)
    with pytest.raises(RuntimeError, match="must come from panel_linear.pack_gate_up"):
        torch.ops.milestones.panel_silu_mul(x, pack_weight(gate), 40)  # 3 panels: the gate alone
    with pytest.raises(RuntimeError, match="must come from panel_linear.pack_gate_up"):
        torch.ops.milestones.panel_silu_mul(x, pack_gate_up(gate, gate), 60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_is_opaque_to_torch_compile(dtype):
    gate, up = torch.randn(40, 24).to(dtype), torch.randn(40, 24).to(dtype)
    args = (torch.randn(5, 24).to(dtype), pack_gate_up(gate, up), 40)
    assert_one_opaque_op_to_torch_compile(torch.ops.milestones.panel_silu_mul, args, "milestones.panel_silu_mul")


@pytest.mark.parametrize("mod", [m1, m2], ids=["m1", "m2"])
def test_engines_fuse_every_mlp_only_with_the_compiled_kernels(tiny_model_path, mod):
    model = mod.LLM(tiny_model_path, device="cpu", max_model_len=64, linear_backend="cpp").engine.runner.model
    fused = [m for m in model.modules() if isinstance(m, FusedMLP)]
    assert len(fused) == model.config.num_layers and all(isinstance(m.down_proj, PanelLinear) for m in fused)
    plain = mod.LLM(tiny_model_path, device="cpu", max_model_len=64, linear_backend="torch").engine.runner.model
    assert not any(isinstance(m, FusedMLP) for m in plain.modules()), "'torch' keeps the lesson's MLPs"
