"""Linear layers packed for oneDNN against plain F.linear, and the linear_backend switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import milestones.kernels.linear_layers as linear_layers
import milestones.kernels.packed_linear as packed_linear
import milestones.kernels.panel_linear as panel_linear
import milestones.kernels.rms_norm as rms_norm
from milestones import m1, m2
from milestones.kernels import PackedLinear
from tests.chain import assert_same_outputs, mixed_workload, run

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not packed_linear.onednn_available(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(576, 192, bias=bias)
    x = torch.randn(rows, 576)
    expected = F.linear(x, linear.weight, linear.bias)
    # The same products summed in oneDNN's order: equal up to float32 rounding, not bit for bit.
    torch.testing.assert_close(PackedLinear(linear)(x), expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packing_swaps_every_decoder_linear_and_keeps_the_head(tiny_model_path):
    llm = m2.LLM(tiny_model_path, device="cpu", max_model_len=128, linear_backend="onednn")
    model = llm.engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.model.modules()), "an unpacked linear layer is left"
    packed = sum(isinstance(m, PackedLinear) for m in model.model.modules())
    assert packed == 5 * model.config.num_layers  # qkv, o, gate, up, down
    head = llm.engine.runner.compute_logits
    assert head is llm.engine.runner.packed_lm_head
    assert isinstance(head, PackedLinear) and isinstance(model.lm_head, nn.Linear)
    hidden = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(head(hidden), model.compute_logits(hidden), rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v projections with a bias
def test_the_backends_give_the_same_tokens(tiny_model_factory, kind):
    path = tiny_model_factory(kind)
    prompts, settings = mixed_workload(12, seed=11, max_prompt=90, max_output=40)
    limits = dict(device="cpu", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=24)
    reference = run(m2, m2.LLM(path, linear_backend="torch", **limits), prompts, settings)
    llm = m2.LLM(path, linear_backend="onednn", **limits)
    assert isinstance(llm.engine.runner.compute_logits, PackedLinear)
    assert_same_outputs(run(m2, llm, prompts, settings), reference)


@needs_onednn
def test_m1_packs_too_and_gives_the_same_tokens(tiny_model_path):
    prompts, settings = mixed_workload(6, seed=13, max_prompt=60, max_output=24)
    plain = m1.LLM(tiny_model_path, device="cpu", max_model_len=128, linear_backend="torch")
    reference = run(m1, plain, prompts, settings)
    llm = m1.LLM(tiny_model_path, device="cpu", max_model_len=128, linear_backend="onednn")
    assert isinstance(llm.engine.runner.compute_logits, PackedLinear)
    assert_same_outputs(run(m1, llm, prompts, settings), reference)


def test_auto_picks_the_fast_path_for_the_device_and_dtype(monkeypatch):
    """The compiled kernel in both dtypes (with bfloat16 instructions too); oneDNN's packed weights where the kernel
    cannot be built and oneDNN packs the dtype."""
    bf16_instructions, kernel_builds = False, True

    def load_kernel():
        if not kernel_builds:
            raise OSError("no C++ compiler found")

    monkeypatch.setattr(packed_linear, "onednn_available",
                        lambda dtype=torch.float32: dtype == torch.float32 or bf16_instructions)
    monkeypatch.setattr(panel_linear, "load_panel_linear", load_kernel)
    monkeypatch.setattr(linear_layers, "swap_linear_layers", lambda model, fast_layer: fast_layer.__name__)
    monkeypatch.setattr(linear_layers, "place_in_huge_pages", lambda model, head: head)
    monkeypatch.setattr(rms_norm, "load_rms_norm", load_kernel)
    monkeypatch.setattr(rms_norm, "swap_rms_norms", lambda model: 0)
    monkeypatch.setattr(panel_linear, "swap_mlps", lambda model: 0)
    model = object()
    assert linear_layers.pack_linear_layers_for("auto", model, CPU, torch.float32) == "PanelLinear"
    assert linear_layers.pack_linear_layers_for("onednn", model, CPU, torch.float32) == "PackedLinear"
    assert linear_layers.pack_linear_layers_for("auto", model, CPU, torch.bfloat16) == "PanelLinear"
    assert linear_layers.pack_linear_layers_for("cpp", model, CPU, torch.bfloat16) == "PanelLinear"
    bf16_instructions = True
    assert linear_layers.pack_linear_layers_for("auto", model, CPU, torch.bfloat16) == "PanelLinear"
    assert linear_layers.pack_linear_layers_for("cpp", model, CPU, torch.bfloat16) == "PanelLinear"
    assert linear_layers.pack_linear_layers_for("onednn", model, CPU, torch.bfloat16) == "PackedLinear"
    kernel_builds = False
    with pytest.warns(UserWarning, match="use weights packed for oneDNN"):
        assert linear_layers.pack_linear_layers_for("auto", model, CPU, torch.bfloat16) == "PackedLinear"
    with pytest.warns(UserWarning, match="use weights packed for oneDNN"):
        assert linear_layers.pack_linear_layers_for("auto", model, CPU, torch.float32) == "PackedLinear"
    with pytest.raises(RuntimeError, match="could not build the C\\+\\+ linear kernel"):
        linear_layers.pack_linear_layers_for("cpp", model, CPU, torch.float32)
    assert linear_layers.pack_linear_layers_for("auto", model, CPU, torch.float16) is None
    assert linear_layers.pack_linear_layers_for("auto", model, torch.device("cuda"), torch.float32) is None
    assert linear_layers.pack_linear_layers_for("torch", model, CPU, torch.float32) is None


def test_auto_falls_back_to_f_linear_without_onednn_or_the_kernel(monkeypatch, tiny_model_path):
    def broken():
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(packed_linear, "onednn_available", lambda dtype=torch.float32: False)
    monkeypatch.setattr(panel_linear, "load_panel_linear", broken)
    with pytest.raises(RuntimeError, match="linear_backend='cpp' or 'torch'"):
        linear_layers.pack_linear_layers_for("onednn", object(), CPU, torch.float32)
    with pytest.warns(UserWarning, match="plain F.linear"):
        llm = m2.LLM(tiny_model_path, device="cpu", max_model_len=128, linear_backend="auto")
    assert llm.engine.runner.packed_lm_head is None
    assert not any(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules())
    out = llm.generate([[5, 6, 7]], m2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("mod", [m1, m2], ids=["m1", "m2"])
def test_linear_backend_option_is_checked(tiny_model_path, mod):
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        mod.LLM(tiny_model_path, device="cpu", linear_backend="mkl")
    with pytest.raises(ValueError, match="runs on the CPU in float32, or in bfloat16 on a CPU with"):
        mod.LLM(tiny_model_path, device="cpu", dtype="float16", linear_backend="onednn")
    with pytest.raises(ValueError, match="'cpp' runs on the CPU in float32 or bfloat16 only"):
        mod.LLM(tiny_model_path, device="cpu", dtype="float16", linear_backend="cpp")


@pytest.mark.skipif(not packed_linear.onednn_available(torch.bfloat16),
                    reason="oneDNN packs bfloat16 only on a CPU with AVX-512 BF16, AMX or AVX-NE-CONVERT")
@pytest.mark.parametrize("rows", [1, 64])
def test_packed_bfloat16_equals_float32_arithmetic_rounded_once(tiny_model_path, rows):
    """Where this CPU has bfloat16 instructions, "onednn" packs bfloat16 weights too."""
    torch.manual_seed(rows)
    linear = nn.Linear(576, 192).to(torch.bfloat16)
    x = torch.randn(rows, 576).bfloat16()
    expected = F.linear(x.float(), linear.weight.float(), linear.bias.float()).bfloat16()
    torch.testing.assert_close(PackedLinear(linear)(x), expected, rtol=2**-7, atol=2**-7)  # one bfloat16 unit
    llm = m1.LLM(tiny_model_path, device="cpu", dtype="bfloat16", max_model_len=128, linear_backend="onednn")
    head = llm.engine.runner.compute_logits
    assert isinstance(head, PackedLinear)
    assert head(torch.randn(3, llm.engine.runner.model.config.hidden_size).bfloat16()).dtype == torch.float32
