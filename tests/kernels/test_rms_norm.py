"""The compiled RMS norm against the lesson's RMSNorm, its batch invariance, and the swap into an engine.

float32: the squares are summed in another order than torch's, so each output is held to the lesson's within the
bound any order of float32 sums keeps on the mean square (dim * 2**-24 relative), halved by the square root, plus
a few roundings. bfloat16: the normalised number is rounded to bfloat16 before the weight multiplies it, so a hair's
difference in float32 can land it on the neighbouring bfloat16: within one bfloat16 unit.
"""

from __future__ import annotations

import pytest
import torch

from milestones import m1, m2
from milestones.kernels.rms_norm import FusedRMSNorm, load_rms_norm
from tests.conftest import needs_compiler
from tests.kernels import assert_one_opaque_op_to_torch_compile

pytestmark = needs_compiler
FLOAT32_UNIT = 2**-24
BF16_UNIT = 2**-7


@pytest.fixture(scope="module")
def rms_norm():
    load_rms_norm()
    return torch.ops.milestones.rms_norm


def lesson_norm(dim: int, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    norm = m1.model.RMSNorm(dim, 1e-5)
    norm.weight.data.copy_(torch.randn(dim))
    return norm.to(dtype)


@pytest.mark.parametrize("dim", [576, 64, 37])  # 37: a row that ends in a part of 16 lanes
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 9)])  # (3, 9): a leading dimension, like Qwen3's q/k norm
def test_float32_is_within_the_bound_of_any_order_of_sums(rms_norm, dim, shape):
    norm = lesson_norm(dim, torch.float32, dim)
    x = torch.randn(*shape, dim) * 3
    out, expected = rms_norm(x, norm.weight, norm.eps), norm(x)
    assert out.shape == expected.shape and out.dtype == torch.float32
    bound = (dim / 2 + 4) * FLOAT32_UNIT * expected.abs()
    excess = ((out - expected).abs() - bound).max().item()
    assert excess <= 0, f"an output is {excess:.3g} beyond the bound"


@pytest.mark.parametrize("dim", [576, 37])
def test_bfloat16_is_within_one_unit_of_the_lesson(rms_norm, dim):
    norm = lesson_norm(dim, torch.bfloat16, dim + 1)
    x = (torch.randn(40, dim) * 3).bfloat16()
    out, expected = rms_norm(x, norm.weight, norm.eps), norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=BF16_UNIT, atol=BF16_UNIT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_batch_it_is_in(rms_norm, dtype):
    norm = lesson_norm(576, dtype, 3)
    x = torch.randn(70, 576).to(dtype)
    together = rms_norm(x, norm.weight, norm.eps)
    for row in (0, 33, 69):
        assert torch.equal(rms_norm(x[row:row + 1], norm.weight, norm.eps), together[row:row + 1])
    assert torch.equal(rms_norm(x[:17], norm.weight, norm.eps), together[:17])


def test_the_op_refuses_bad_input_with_a_clear_error(rms_norm):
    with pytest.raises(RuntimeError, match="both in float32 or both in bfloat16"):
        rms_norm(torch.randn(2, 8), torch.randn(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="as long as x's last dimension \\(8\\)"):
        rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)


def test_the_op_is_opaque_to_torch_compile_and_the_module_traces_the_lesson(rms_norm):
    assert_one_opaque_op_to_torch_compile(rms_norm, (torch.randn(3, 8), torch.randn(8), 1e-5), "milestones.rms_norm")
    fused = FusedRMSNorm(lesson_norm(8, torch.float32, 0))
    x = torch.randn(3, 8)
    traced = torch.compile(fused, fullgraph=True, backend="eager")(x)  # is_compiling: the lesson's own operators
    assert torch.equal(traced, fused.norm(x))


@pytest.mark.parametrize("mod", [m1, m2], ids=["m1", "m2"])
def test_engines_swap_every_norm_only_with_the_compiled_kernels(tiny_model_path, mod):
    model = mod.LLM(tiny_model_path, device="cpu", max_model_len=64, linear_backend="cpp").engine.runner.model
    fused = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(fused) == 2 * model.config.num_layers + 1
    plain = mod.LLM(tiny_model_path, device="cpu", max_model_len=64, linear_backend="torch").engine.runner.model
    assert not any(isinstance(m, FusedRMSNorm) for m in plain.modules()), "'torch' keeps the lesson's norms"

