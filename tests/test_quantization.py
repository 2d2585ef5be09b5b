"""``LLM(quantization=...)`` in every milestone: the bundled file's blocks give the float32 engine's tokens.

Q4_1 and Q8_0 de-quantize exactly to the float32 weights the chain runs on, and the kernel sums each block in the
factored form llama.cpp uses (tests/kernels/test_quant_linear.py), which rounds otherwise than the float32 product:
so with ``quantization="gguf"`` the bundled model's tokens are the float32 engine's on the chain's mixed workload,
and its log-probabilities are within the chain's tolerance (LOGPROB_ATOL; the largest gap is printed). int8 is an
approximation (per-channel, made at load time): its agreement with float32 is measured on the benchmarks page; here
it must swap every linear layer, keep the engine's bookkeeping sound and stay close on the tiny model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from milestones import m1, m6, m8
from milestones.kernels.quant_linear import QuantEmbedding, QuantLinear, QuantMLP
from milestones.kernels.quantized import weight_bytes
from tests.chain import LIMITS, LOGPROB_ATOL, Completion, assert_same_outputs, mixed_workload, run
from tests.conftest import needs_compiler

pytestmark = needs_compiler
MiB = 2**20


def logprob_pairs(got, want):
    """The (ours, reference) log-probability of every token both rows scored, outputs' and prompts' alike."""
    got, want = Completion(*got), Completion(*want)
    for ours, theirs in zip([*(got.logprobs or []), *(got.prompt_logprobs or [])],
                            [*(want.logprobs or []), *(want.prompt_logprobs or [])]):
        for token in set(ours or {}) & set(theirs or {}):
            yield ours[token].logprob, theirs[token].logprob


def limits(mod) -> dict:
    """The chain's engine limits this milestone takes (m1 runs one request at a time: no batch limits)."""
    return {k: v for k, v in LIMITS.items() if k in mod.EngineConfig.__dataclass_fields__}


def quantized_layers(model: nn.Module) -> tuple[int, int, int]:
    """(plain linear layers left, quantized linear layers, quantized MLPs) in the decoder."""
    modules = list(model.model.modules())
    return (sum(isinstance(m, nn.Linear) for m in modules), sum(isinstance(m, QuantLinear) for m in modules),
            sum(isinstance(m, QuantMLP) for m in modules))


def test_int8_swaps_every_linear_layer_and_keeps_the_bookkeeping_sound(mod, tiny_model_path):
    """Every milestone takes the option; the chain's checked run finishes every request of a mixed workload."""
    llm = mod.LLM(tiny_model_path, quantization="int8", **limits(mod))
    model = llm.engine.runner.model
    layers = model.config.num_layers
    assert quantized_layers(model) == (0, 3 * layers, layers)  # qkv, o and down; gate and up in one QuantMLP
    assert isinstance(model.lm_head, QuantLinear) and llm.engine.runner.compute_logits is model.lm_head
    prompts, settings = mixed_workload(8, seed=5, max_prompt=40, max_output=12)
    outs = run(mod, llm, prompts, settings)
    assert all(len(o.token_ids) >= 1 for o in outs)


def test_int8_logits_stay_within_half_a_step_of_each_weight(tiny_model_path):
    """The int8 head's logits are within the bound half a step of each weight puts on a product: sum |x| * step / 2."""
    ref = m1.LLM(tiny_model_path, max_model_len=128)
    q = m1.LLM(tiny_model_path, max_model_len=128, quantization="int8")
    hidden = torch.randn(4, ref.engine.runner.model.config.hidden_size)
    head = ref.engine.runner.model.lm_head.weight
    step = head.abs().amax(dim=1) / 127
    bound = hidden.abs().sum(dim=1, keepdim=True) * step / 2 * (1 + 1e-4) + 1e-5
    margin = ((q.engine.runner.compute_logits(hidden) - hidden @ head.T).abs() - bound).max().item()
    assert margin <= 0, f"an int8 logit is {margin:.3g} beyond half a step of its weights"


def test_gguf_refuses_a_model_the_file_does_not_hold(tiny_model_path):
    with pytest.raises(ValueError, match="the file does not hold this model; use quantization='int8' or None"):
        m1.LLM(tiny_model_path, max_model_len=128, quantization="gguf")


def test_a_quantization_that_cannot_run_is_refused_before_loading(tiny_model_path):
    with pytest.raises(ValueError, match="CPU in float32 only"):
        m1.LLM(tiny_model_path, dtype="bfloat16", quantization="int8")
    with pytest.raises(ValueError, match="one process: each rank would need its own slice"):
        m8.LLM(tiny_model_path, tensor_parallel_size=2, quantization="int8")


@pytest.mark.real_model
@pytest.mark.parametrize("mod", [m1, m6], ids=["m1", "m6-captured"])
def test_gguf_gives_the_float32_engine_s_tokens_and_logprobs(mod, bundled_model_path):
    """The bundled model, float32 against its own Q4_1/Q8_0 blocks, on the chain's mixed workload (greedy, seeded,
    penalties, structured output, logprobs of outputs and prompts): the same tokens, and log-probabilities within
    the chain's tolerance (LOGPROB_ATOL), in m1 (eager) and in m6, whose decode steps replay the captured step
    (torch.compile on a CPU, two requests at most and one captured size, so that every decode is captured, a lone
    request's padded to two rows) with the kernel's op inside."""
    options = dict(limits(mod), max_num_seqs=2, cudagraph_capture_sizes=[2]) if mod is m6 else limits(mod)
    prompts, settings = mixed_workload(8, seed=11, max_prompt=60, max_output=24)
    reference = run(mod, mod.LLM(bundled_model_path, **options), prompts, settings)
    llm = mod.LLM(bundled_model_path, quantization="gguf", **options)
    outputs = run(mod, llm, prompts, settings)
    gaps = [abs(a - b) for got, want in zip(outputs, reference) for a, b in logprob_pairs(got, want)]
    print(f"\n{mod.__name__} gguf against float32: largest log-probability gap {max(gaps, default=0):.2e} "
          f"over {len(gaps)} (tolerance {LOGPROB_ATOL})")
    assert_same_outputs(outputs, reference, settings, atol=LOGPROB_ATOL)
    model = llm.engine.runner.model
    assert quantized_layers(model)[0] == 0 and isinstance(model.model.embed_tokens, QuantEmbedding)
    resident = weight_bytes(model)
    assert resident < 100 * MiB, f"{resident / MiB:.1f} MiB of weights: a float32 copy of a layer is left"
    float32 = max(t.numel() for t in [*model.parameters(), *model.buffers()] if t.dtype == torch.float32)
    assert float32 < 576 * 1536, f"a float32 tensor of {float32} numbers (a layer's size) is still held"
