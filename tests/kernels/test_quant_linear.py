"""The quantized linear kernel: its weights are the file's, its sums the factored form within float32's bound.

Q4_1 and Q8_0 de-quantize exactly (``d * q`` is exact in float32, ``+ m`` rounds once): the de-quantized weights are
held to gguf-py's (the reference transformers uses when it loads a GGUF file), with no tolerance. The kernel sums a
block as ``d * (x . q) + m * sum(x)``, the factored form llama.cpp uses, which rounds otherwise than ``x . w``: its
outputs are held to the float64 product with the de-quantized weights within float32's summation bound on the
terms it sums, ``in_features * 2**-24 * sum_k |x_k| (|d q_k| + |m|)``; and, with no tolerance, to themselves: a row
gets the same bits whatever its batch, and the AVX2 build the AVX-512 build's. int8 is an approximation: held to
its own de-quantized weights within the float32 summation bound, and to the float weights within half a step of its
scale.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from milestones.kernels import check_quantization
from milestones.kernels.quant_blocks import QuantWeight, dequantize, pack_gguf, quantize_int8
from milestones.kernels.quant_linear import FORMATS, load_quant_linear
from tests.conftest import needs_compiler
from tests.kernels import assert_one_opaque_op_to_torch_compile
from tests.kernels.test_panel_linear import assert_within_float32_sum_bound

pytestmark = needs_compiler
ROWS = [1, 2, 5, 6, 7, 12, 13, 33, 64]  # one row (four panels at once), one tile, and panels made float32 once


@pytest.fixture(scope="module")
def kernels():
    load_quant_linear()


def random_blocks(kind: str, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """GGUF blocks ``[out, in / 32, bytes]`` with random integers and realistic float16 scales (and minimums)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (out_features, in_features // 32, 20 if kind == "Q4_1" else 34), generator=g,
                           dtype=torch.uint8)
    shape = blocks.shape[:2]
    blocks[..., 0:2] = (torch.rand(shape, generator=g) * 0.02).half().view(torch.uint8).view(*shape, 2)
    if kind == "Q4_1":
        blocks[..., 2:4] = (-torch.rand(shape, generator=g) * 0.1).half().view(torch.uint8).view(*shape, 2)
    return blocks


def gguf_reference(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """gguf-py's de-quantization of the same blocks (what transformers loads), as float32 ``[out, in]``."""
    import gguf

    rows = blocks.numpy().reshape(blocks.shape[0], -1)
    return torch.from_numpy(gguf.quants.dequantize(rows, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float32))


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.milestones.quant_linear(x, weight.packed, weight.scale, bias, weight.out_features,
                                             FORMATS[weight.format])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(40, 64), (576, 576), (100, 1536)], ids=str)
def test_packed_blocks_de_quantize_to_gguf_py_s_weights(kind, shape):
    blocks = random_blocks(kind, *shape)
    found, expected = dequantize(pack_gguf([(kind, blocks)])), gguf_reference(kind, blocks)
    assert torch.equal(found, expected), f"up to {(found - expected).abs().max().item():.3g} from gguf-py's weights"


def test_a_q4_1_block_s_nibbles_go_low_first_then_high():
    """One known block: byte i holds weight i in its low 4 bits and weight i + 16 in its high 4; w = d * q + m."""
    block = torch.zeros(1, 1, 20, dtype=torch.uint8)
    block[0, 0, 0:2] = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)
    block[0, 0, 2:4] = torch.tensor([-1.0], dtype=torch.float16).view(torch.uint8)
    q = torch.arange(32) % 16  # weight i: q = i % 16
    block[0, 0, 4:] = (q[:16] | (q[16:] << 4)).to(torch.uint8)
    assert dequantize(pack_gguf([("Q4_1", block)])).tolist() == [[0.5 * (i % 16) - 1.0 for i in range(32)]]


def factored_magnitudes(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """|d q| + |m| for every weight ``[out, in]``: the size of the terms the factored sum adds (Q8_0: no m)."""
    scales = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [out, in / 32, 1]
    plain = blocks.clone()
    plain[..., 0:2] = scales.abs().half().view(torch.uint8)
    if kind == "Q4_1":
        minimums = blocks[..., 2:4].contiguous().view(torch.float16).float()
        plain[..., 2:4] = 0  # d q alone (q >= 0: already its magnitude)
        return dequantize(pack_gguf([(kind, plain)])) + minimums.abs().repeat_interleave(32, dim=1)[..., 0]
    return dequantize(pack_gguf([(kind, plain)])).abs()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", ROWS)
def test_outputs_are_the_product_with_the_de_quantized_weights_within_the_factored_sum_s_bound(kernels, kind, rows,
                                                                                               threads):
    blocks = random_blocks(kind, 200, 576, seed=rows)  # 13 panels: four at once, then one, the last part-filled
    weight = pack_gguf([(kind, blocks)])
    x, bias = torch.randn(rows, 576), torch.randn(200)
    exact = x.double() @ dequantize(weight).double().T
    bound = 576 * 2**-24 * (x.double().abs() @ factored_magnitudes(kind, blocks).double().T)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            found = quant_linear(x, weight, b).double()
            expected = exact if b is None else exact + b.double()
            limit = bound if b is None else bound + 2**-24 * expected.abs()
            excess = ((found - expected).abs() - limit).max().item()
            assert excess <= 0, f"an output is {excess:.3g} beyond the factored sum's float32 bound"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "int8"])
def test_a_row_gets_the_same_bits_whatever_batch_it_is_in(kernels, kind):
    if kind == "int8":
        weight = quantize_int8(torch.randn(72, 128))
    else:
        weight = pack_gguf([(kind, random_blocks(kind, 72, 128))])
    x = torch.randn(64, 128)
    alone = quant_linear(x[:1], weight)
    for rows in (2, 5, 12, 13, 64):
        assert torch.equal(quant_linear(x[:rows], weight)[:1], alone), f"row 0 changed among {rows} rows"


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_is_its_de_quantized_weights_within_the_float32_bound(kernels, rows):
    w = torch.randn(100, 256)
    weight = quantize_int8(w)
    float32 = dequantize(weight)
    step = weight.scale[:100, None]
    assert ((float32 - w).abs() <= step / 2 * (1 + 1e-6)).all(), "a weight moved more than half a step of its scale"
    x, bias = torch.randn(rows, 256), torch.randn(100)
    assert_within_float32_sum_bound(quant_linear(x, weight, bias), x, float32, bias)


def test_int8_refuses_an_input_width_that_is_no_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32, got 24"):
        quantize_int8(torch.randn(8, 24))


def test_the_kernel_refuses_bad_input_with_a_clear_error(kernels):
    weight = pack_gguf([("Q4_1", random_blocks("Q4_1", 40, 64))])
    with pytest.raises(RuntimeError, match="last dimension must be the weight's in_features \\(64\\), got 32"):
        quant_linear(torch.randn(2, 32), weight)
    with pytest.raises(RuntimeError, match="float32 x"):
        quant_linear(torch.randn(2, 64).bfloat16(), weight)
    with pytest.raises(RuntimeError, match="uint8 \\[panels, in_features / 32, 544\\]"):
        torch.ops.milestones.quant_linear(torch.randn(2, 64), weight.packed, None, None, 40, FORMATS["Q8_0"])
    with pytest.raises(RuntimeError, match="int8 weights take a scale per column"):
        torch.ops.milestones.quant_linear(torch.randn(2, 64), quantize_int8(torch.randn(40, 64)).packed, None, None,
                                          40, FORMATS["int8"])


def test_the_kernel_is_one_opaque_op_to_torch_compile(kernels):
    weight = pack_gguf([("Q4_1", random_blocks("Q4_1", 40, 64))])
    args = (torch.randn(5, 64), weight.packed, None, None, 40, FORMATS["Q4_1"])
    assert_one_opaque_op_to_torch_compile(torch.ops.milestones.quant_linear, args, "milestones.quant_linear")


@pytest.mark.parametrize(("options", "message"), [
    (("q4", "cpu", torch.float32, "auto"), "one of \\('gguf', 'int8'\\)"),
    (("gguf", "cpu", torch.bfloat16, "auto"), "CPU in float32 only"),
    (("int8", "cuda", torch.float32, "auto"), "CPU in float32 only"),
    (("gguf", "cpu", torch.float32, "torch"), "linear_backend='auto' or 'cpp'"),
])
def test_a_quantization_that_cannot_run_is_refused(options, message):
    quantization, device, dtype, backend = options
    with pytest.raises(ValueError, match=message):
        check_quantization(quantization, torch.device(device), dtype, backend)
    check_quantization(None, torch.device(device), dtype, backend)  # no quantization: nothing to refuse


AVX2_CHECK = """
import json, sys, torch
import milestones.kernels.quant_linear as layer
from milestones.kernels.quant_blocks import pack_gguf, quantize_int8
from tests.kernels.test_quant_linear import random_blocks
layer.FLAGS = layer.FLAGS + ("-mno-avx512f",)
layer.load_quant_linear()
out = {}
for kind in ("Q4_1", "Q8_0", "int8"):
    torch.manual_seed(0)
    w = quantize_int8(torch.randn(200, 576)) if kind == "int8" else pack_gguf([(kind, random_blocks(kind, 200, 576))])
    for rows in (1, 5, 33):
        x = torch.randn(rows, 576)
        y = torch.ops.milestones.quant_linear(x, w.packed, w.scale, None, 200, layer.FORMATS[kind])
        out[f"{kind}/{rows}"] = y.view(torch.int32).flatten().tolist()
json.dump(out, sys.stdout)
"""


@pytest.mark.skipif(not (hasattr(torch.backends.cpu, "get_cpu_capability")
                         and torch.backends.cpu.get_cpu_capability() == "AVX512"),
                    reason="the AVX2 path is compared with the AVX-512 one: this CPU has no AVX-512")
def test_the_avx2_build_gives_the_avx512_build_s_bits(kernels):
    """The same source built without AVX-512 (in another process: the ops' names are taken here) gives the same bits."""
    result = subprocess.run([sys.executable, "-c", AVX2_CHECK], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    avx2 = json.loads(result.stdout)
    for kind in ("Q4_1", "Q8_0", "int8"):
        torch.manual_seed(0)
        w = quantize_int8(torch.randn(200, 576)) if kind == "int8" else pack_gguf([(kind, random_blocks(kind, 200,
                                                                                                      576))])
        for rows in (1, 5, 33):
            y = quant_linear(torch.randn(rows, 576), w)
            assert y.view(torch.int32).flatten().tolist() == avx2[f"{kind}/{rows}"], f"{kind}, {rows} rows differ"
