"""The compiled bfloat16 linear kernel against float32 arithmetic on the same numbers, and its batch invariance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from milestones import m1, m2
from milestones.kernels import Bf16Linear
from milestones.kernels.bf16_linear import load_bf16_linear, pack_weight
from tests.conftest import needs_compiler
from tests.kernels import assert_one_opaque_op_to_torch_compile

pytestmark = needs_compiler
BF16_UNIT = 2**-7  # the largest gap between neighbouring bfloat16 numbers, relative (8 significant bits)


@pytest.fixture(scope="module")
def bf16_linear():
    load_bf16_linear()
    return torch.ops.milestones.bf16_linear


def float32_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same bfloat16 numbers multiplied and summed in float32 by torch, rounded once to bfloat16."""
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("out_features, in_features", [(100, 77), (192, 576)])  # 100: a panel of 4 columns and 12 pad
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_float32_arithmetic_rounded_once(bf16_linear, rows, out_features, in_features, bias):
    torch.manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    x = torch.randn(rows, in_features).bfloat16()
    out = bf16_linear(x, pack_weight(weight), b, out_features)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # float32 sums in another order can round to the neighbouring bfloat16
    torch.testing.assert_close(out, float32_reference(x, weight, b), rtol=BF16_UNIT, atol=BF16_UNIT)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_single_row_over_four_panels_at_once_ends_in_a_part_filled_panel(bf16_linear, threads):
    """59 outputs: four panels, the last with 11 columns; one thread takes all four in one go."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(threads)
        weight, x = torch.randn(59, 40).bfloat16(), torch.randn(1, 40).bfloat16()
        out = bf16_linear(x, pack_weight(weight), None, 59)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, float32_reference(x, weight, None), rtol=BF16_UNIT, atol=BF16_UNIT)


def test_leading_dimensions_are_kept(bf16_linear):
    weight, x = torch.randn(40, 24).bfloat16(), torch.randn(2, 3, 24).bfloat16()
    out = bf16_linear(x, pack_weight(weight), None, 40)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, bf16_linear(x.reshape(6, 24), pack_weight(weight), None, 40).reshape(2, 3, 40))


def test_a_row_gets_the_same_bits_whatever_batch_it_is_in(bf16_linear):
    """One order of summation per output: alone, in a tile of 6, or among 70 rows (panels widened first)."""
    torch.manual_seed(0)
    weight, x = pack_weight(torch.randn(1530, 576).bfloat16()), torch.randn(70, 576).bfloat16()
    together = bf16_linear(x, weight, None, 1530)
    for size in (1, 2, 5, 6, 7, 13):
        assert torch.equal(bf16_linear(x[:size], weight, None, 1530), together[:size]), f"a batch of {size} differs"
    for row in (0, 41, 69):
        assert torch.equal(bf16_linear(x[row : row + 1], weight, None, 1530), together[row : row + 1])


def test_packing_puts_sixteen_output_columns_side_by_side():
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3).bfloat16()
    packed = pack_weight(weight)
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0, 1], weight[:16, 1]) and torch.equal(packed[1, 2, :4], weight[16:, 2])
    assert not packed[1, :, 4:].any(), "the padding columns are zero"


def test_kernel_refuses_bad_input_with_a_clear_error(bf16_linear):
    weight, x = pack_weight(torch.randn(20, 8).bfloat16()), torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16 x and weight"):
        bf16_linear(x.float(), weight, None, 20)
    with pytest.raises(RuntimeError, match="packed by bf16_linear.pack_weight"):
        bf16_linear(x, torch.randn(20, 8).bfloat16(), None, 20)
    with pytest.raises(RuntimeError, match="in_features \\(8\\), got 9"):
        bf16_linear(torch.randn(3, 9).bfloat16(), weight, None, 20)
    with pytest.raises(RuntimeError, match="does not fit 2 panels"):
        bf16_linear(x, weight, None, 40)
    with pytest.raises(RuntimeError, match="vector of out_features \\(20\\)"):
        bf16_linear(x, weight, torch.zeros(19).bfloat16(), 20)


def test_the_kernel_is_one_opaque_op_to_torch_compile(bf16_linear):
    args = (torch.randn(5, 24).bfloat16(), pack_weight(torch.randn(40, 24).bfloat16()), torch.randn(40).bfloat16(), 40)
    assert_one_opaque_op_to_torch_compile(torch.ops.milestones.bf16_linear, args, "milestones.bf16_linear")


@pytest.mark.parametrize("mod", [m1, m2], ids=["m1", "m2"])
def test_bfloat16_engines_swap_every_linear_and_keep_the_head(tiny_model_path, mod):
    llm = mod.LLM(tiny_model_path, device="cpu", dtype="bfloat16", max_model_len=128, linear_backend="cpp")
    model = llm.engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.model.modules()), "an unswapped linear layer is left"
    assert sum(isinstance(m, Bf16Linear) for m in model.model.modules()) == 7 * model.config.num_layers
    head = llm.engine.runner.compute_logits
    assert isinstance(head, Bf16Linear) and isinstance(model.lm_head, nn.Linear)
    hidden = torch.randn(5, model.config.hidden_size).bfloat16()
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, model.compute_logits(hidden), rtol=BF16_UNIT, atol=BF16_UNIT)


def test_a_failed_build_is_an_error_with_cpp_and_a_fall_back_with_auto(monkeypatch, tiny_model_path):
    import milestones.kernels.bf16_linear as bf16_module
    import milestones.kernels.packed_linear as packed_linear

    def broken():
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(bf16_module, "load_bf16_linear", broken)
    monkeypatch.setattr(packed_linear, "onednn_available", lambda dtype=torch.float32: dtype == torch.float32)
    with pytest.raises(RuntimeError, match="linear_backend='torch'"):
        m1.LLM(tiny_model_path, device="cpu", dtype="bfloat16", max_model_len=128, linear_backend="cpp")
    with pytest.warns(UserWarning, match="plain F.linear"):
        llm = m1.LLM(tiny_model_path, device="cpu", dtype="bfloat16", max_model_len=128, linear_backend="auto")
    assert llm.engine.runner.packed_lm_head is None
