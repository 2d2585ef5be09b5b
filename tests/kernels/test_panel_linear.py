"""The compiled panel linear kernel against torch's arithmetic on the same numbers, and its batch invariance.

In bfloat16 it is held to torch's float32 product rounded once (one bfloat16 unit). In float32 a
sum of k products in another order may differ from torch's by more than one unit in the last
place, so each output is held to the float64 product within the bound any order of float32
sums keeps: k * 2**-24 * sum(|x_i w_i|) (plus a unit for the bias's add).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from milestones import m1, m2
from milestones.kernels import PackedLinear, PanelLinear
from milestones.kernels.panel_linear import FusedMLP, bf16_pairs, load_panel_linear, pack_weight
from tests.conftest import needs_compiler
from tests.kernels import assert_one_opaque_op_to_torch_compile

pytestmark = needs_compiler
BF16_UNIT = 2**-7  # the largest gap between neighbouring bfloat16 numbers, relative (8 significant bits)


FLOAT32_UNIT = 2**-24  # relative rounding of one float32 operation


@pytest.fixture(scope="module")
def panel_linear():
    load_panel_linear()
    return torch.ops.milestones.panel_linear


@pytest.fixture(params=[False, True], ids=["bf16-widened", "bf16-pairs"])
def pairs(request, panel_linear) -> bool:
    """Both bfloat16 layouts: widened to float32 as loaded, and in pairs for the dot product (AVX-512 BF16 only)."""
    if request.param and not bf16_pairs():
        pytest.skip("this CPU (or this build) has no AVX-512 BF16 dot product")
    return request.param


def assert_within_float32_sum_bound(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                    bias: torch.Tensor | None) -> None:
    """Every output within k * 2**-24 * sum |x_i w_i| (+ 2**-24 |y|) of the float64 result; the margin if not."""
    exact = x.double() @ weight.double().T
    bound = weight.shape[1] * FLOAT32_UNIT * (x.double().abs() @ weight.double().abs().T)
    if bias is not None:
        exact = exact + bias.double()
        bound = bound + FLOAT32_UNIT * exact.abs()
    excess = ((out.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"an output is {excess:.3g} beyond the float32 summation bound"


def float32_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same bfloat16 numbers multiplied and summed in float32 by torch, rounded once to bfloat16."""
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("out_features, in_features", [(100, 77), (192, 576)])  # 100: a panel of 4 columns and 12 pad
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_equals_float32_arithmetic_rounded_once(panel_linear, pairs, rows, out_features, in_features,
                                                         bias):
    torch.manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    x = torch.randn(rows, in_features).bfloat16()
    out = panel_linear(x, pack_weight(weight, pairs), b, out_features)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # float32 sums in another order can round to the neighbouring bfloat16
    torch.testing.assert_close(out, float32_reference(x, weight, b), rtol=BF16_UNIT, atol=BF16_UNIT)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 16, 64])
@pytest.mark.parametrize("out_features, in_features", [(100, 77), (192, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_is_within_the_bound_of_any_order_of_sums(panel_linear, rows, out_features, in_features, bias):
    torch.manual_seed(rows * out_features + 1)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    b = torch.randn(out_features) if bias else None
    out = panel_linear(x, pack_weight(weight), b, out_features)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    assert_within_float32_sum_bound(out, x, weight, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_single_row_over_four_panels_at_once_ends_in_a_part_filled_panel(panel_linear, pairs, threads):
    """59 outputs: four panels, the last with 11 columns; one thread takes all four in one go."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(threads)
        weight, x = torch.randn(59, 40), torch.randn(1, 40)
        out = panel_linear(x.bfloat16(), pack_weight(weight.bfloat16(), pairs), None, 59)
        out32 = panel_linear(x, pack_weight(weight), None, 59)
    finally:
        torch.set_num_threads(previous)
    reference = float32_reference(x.bfloat16(), weight.bfloat16(), None)
    torch.testing.assert_close(out, reference, rtol=BF16_UNIT, atol=BF16_UNIT)
    assert_within_float32_sum_bound(out32, x, weight, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leading_dimensions_are_kept(panel_linear, dtype):
    weight, x = torch.randn(40, 24).to(dtype), torch.randn(2, 3, 24).to(dtype)
    out = panel_linear(x, pack_weight(weight), None, 40)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, panel_linear(x.reshape(6, 24), pack_weight(weight), None, 40).reshape(2, 3, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_batch_it_is_in(panel_linear, pairs, dtype):
    """One order of summation per output: alone, in a tile of 6 or 8, in one wide tile of 3 to 16 (float32 with
    AVX-512; without it those sizes take tiles of 6), or among 70 rows (bfloat16: panels widened first, or in
    pairs)."""
    if dtype == torch.float32 and pairs:
        pytest.skip("pairs are a bfloat16 layout")
    torch.manual_seed(0)
    weight, x = pack_weight(torch.randn(1530, 576).to(dtype), pairs), torch.randn(70, 576).to(dtype)
    together = panel_linear(x, weight, None, 1530)
    for size in (1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 17):
        assert torch.equal(panel_linear(x[:size], weight, None, 1530), together[:size]), f"a batch of {size} differs"
    for row in (0, 41, 69):
        assert torch.equal(panel_linear(x[row : row + 1], weight, None, 1530), together[row : row + 1])


def test_packing_puts_sixteen_output_columns_side_by_side():
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    packed = pack_weight(weight.bfloat16(), pairs=False).float()  # small integers: exact in bfloat16
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0, 1], weight[:16, 1]) and torch.equal(packed[1, 2, :4], weight[16:, 2])
    assert not packed[1, :, 4:].any(), "the padding columns are zero"
    packed = pack_weight(weight)  # float32: a panel's even columns, then its odd ones
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0, 1, :8], weight[0:16:2, 1]) and torch.equal(packed[0, 1, 8:], weight[1:16:2, 1])
    assert torch.equal(packed[1, 2, :2], weight[16:20:2, 2]) and torch.equal(packed[1, 2, 8:10], weight[17:20:2, 2])
    assert packed[1, :, 2:8].eq(0).all() and packed[1, :, 10:].eq(0).all(), "the padding columns are zero"
    packed = pack_weight(weight.bfloat16(), pairs=True).float()  # pairs: k = 0 and 1 of a column, side by side
    assert packed.shape == (2, 2, 32)  # 3 k: two pairs, the second padded with a zero k
    assert torch.equal(packed[0, 0, 0:32:2], weight[:16, 0]) and torch.equal(packed[0, 0, 1:32:2], weight[:16, 1])
    assert torch.equal(packed[1, 1, 0:8:2], weight[16:, 2]) and not packed[:, 1, 1::2].any(), "k = 3 is zero"
    assert not packed[1, :, 8:].any(), "the padding columns are zero"


def test_kernel_refuses_bad_input_with_a_clear_error(panel_linear):
    weight, x = pack_weight(torch.randn(20, 8).bfloat16(), pairs=False), torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="both in float32 or both in bfloat16, got Float and BFloat16"):
        panel_linear(x.float(), weight, None, 20)
    with pytest.raises(RuntimeError, match="both in float32 or both in bfloat16, got Half and Half"):
        panel_linear(x.half(), weight.half(), None, 20)
    with pytest.raises(RuntimeError, match="packed by panel_linear.pack_weight"):
        panel_linear(x, torch.randn(20, 8).bfloat16(), None, 20)
    with pytest.raises(RuntimeError, match="in_features \\(8\\), got 9"):
        panel_linear(torch.randn(3, 9).bfloat16(), weight, None, 20)
    paired = pack_weight(torch.randn(20, 8).bfloat16(), pairs=True)
    message = "packed in 4 pairs\\), got 10" if bf16_pairs() else "needs a CPU with AVX-512 BF16"
    with pytest.raises(RuntimeError, match=message):
        panel_linear(torch.randn(3, 10).bfloat16(), paired, None, 20)
    with pytest.raises(RuntimeError, match="does not fit 2 panels"):
        panel_linear(x, weight, None, 40)
    with pytest.raises(RuntimeError, match="vector of out_features \\(20\\) numbers in the weight's dtype"):
        panel_linear(x, weight, torch.zeros(19).bfloat16(), 20)
    with pytest.raises(RuntimeError, match="in the weight's dtype"):
        panel_linear(x, weight, torch.zeros(20), 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_one_opaque_op_to_torch_compile(panel_linear, dtype):
    args = (torch.randn(5, 24).to(dtype), pack_weight(torch.randn(40, 24).to(dtype)), torch.randn(40).to(dtype), 40)
    assert_one_opaque_op_to_torch_compile(torch.ops.milestones.panel_linear, args, "milestones.panel_linear")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mod", [m1, m2], ids=["m1", "m2"])
def test_engines_swap_every_linear_and_keep_the_head(tiny_model_path, mod, dtype):
    llm = mod.LLM(tiny_model_path, device="cpu", dtype=dtype, max_model_len=128, linear_backend="cpp")
    model = llm.engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.model.modules()), "an unswapped linear layer is left"
    layers = model.config.num_layers  # qkv, o and down each a PanelLinear; gate and up one FusedMLP
    assert sum(isinstance(m, PanelLinear) for m in model.model.modules()) == 3 * layers
    assert sum(isinstance(m, FusedMLP) for m in model.model.modules()) == layers
    head = llm.engine.runner.compute_logits
    assert isinstance(head, PanelLinear) and isinstance(model.lm_head, nn.Linear)
    hidden = torch.randn(5, model.config.hidden_size).to(getattr(torch, dtype))
    logits = head(hidden)
    assert logits.dtype == torch.float32
    unit = BF16_UNIT if dtype == "bfloat16" else 1e-5
    torch.testing.assert_close(logits, model.compute_logits(hidden), rtol=unit, atol=unit)


def test_a_failed_build_is_an_error_with_cpp_and_a_fall_back_with_auto(monkeypatch, tiny_model_path):
    import milestones.kernels.packed_linear as packed_linear
    import milestones.kernels.panel_linear as panel_module

    def broken():
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(panel_module, "load_panel_linear", broken)
    monkeypatch.setattr(packed_linear, "onednn_available", lambda dtype=torch.float32: dtype == torch.float32)
    with pytest.raises(RuntimeError, match="linear_backend='torch'"):
        m1.LLM(tiny_model_path, device="cpu", dtype="bfloat16", max_model_len=128, linear_backend="cpp")
    with pytest.warns(UserWarning, match="plain F.linear"):
        llm = m1.LLM(tiny_model_path, device="cpu", dtype="bfloat16", max_model_len=128, linear_backend="auto")
    assert llm.engine.runner.packed_lm_head is None
    with pytest.warns(UserWarning, match="use weights packed for oneDNN"):
        llm = m1.LLM(tiny_model_path, device="cpu", dtype="float32", max_model_len=128, linear_backend="auto")
    assert isinstance(llm.engine.runner.packed_lm_head, PackedLinear)
