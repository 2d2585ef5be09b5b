"""The CUDA path: the correctness chain again, on the GPU (skipped without one; tests/gpu_runbook.py runs it).

m1 against transformers' ``generate`` on the same GPU in float32; in bfloat16 (CUDA's default),
where greedy tokens may part ways, m1 and transformers fed the same tokens, with float32 as the
yardstick; then every milestone against the one before in float32, token for token, on the tiny
checkpoints and on a seeded random model of SmolLM2-135M's exact shape. The chain is not compared
token for token in bfloat16: there SDPA's flash kernel for whole prompts and its masked kernel for
chunks, and cuBLAS's kernels chosen by batch size, round differently, so tokens part at near-ties
(tests/test_bfloat16.py shows it on a CPU). bfloat16 is judged by the teacher-forced check, and
every milestone's default (bfloat16, graphs captured) must run. Prints the largest logit
differences it saw, so a GPU run leaves a record of how close the two implementations are.
"""

from __future__ import annotations

import importlib.util
import socket
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from milestones import m1, m2, m3, m4, m5, m6, m7, m8
from milestones.kernels import batched_attention_for
from milestones.kernels.batched_attention import BatchedAttention, PaddedBatch, VarlenBatch
from milestones.trace import hidden_host_share
from tests.chain import assert_same_outputs, mixed_workload, run
from tests.kernels.test_batched_attention import STEP, Heads, assert_matches_request_by_request, paged_step
from tests.m1.test_vs_transformers import RecordingSampler, varied_prompts
from tests.m4.test_vs_m3 import shared_prefix_workload
from tests.test_bfloat16 import check_agreement, teacher_forced_logits

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LOGIT_ATOL = 1e-3  # fp32 on the GPU: other kernels, other summation orders than transformers' (CPU: 1e-4)
# The chain's log-probabilities on the GPU, for the same reason: cuBLAS picks its kernel by row count, so one batch
# shape sums in another order than another (the first H100 run: up to 1.5e-4 apart in float32; CPU: LOGPROB_ATOL).
CUDA_LOGPROB_ATOL = LOGIT_ATOL
HAS_LLGUIDANCE = importlib.util.find_spec("llguidance") is not None


def gpu_workload(count: int, **kwargs) -> tuple[list, list[dict]]:
    """The chain's mixed workload. A GPU machine's own python may lack llguidance (and nothing can be installed
    there): then its structured-output requests go as plain ones, with a warning, and the rest is tested."""
    prompts, settings = mixed_workload(count, **kwargs)
    if not HAS_LLGUIDANCE:
        warnings.warn("llguidance is not installed: the structured-output requests run as plain ones", stacklevel=2)
        settings = [{k: v for k, v in s.items() if k != "structured_outputs"} for s in settings]
    return prompts, settings


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """TF32 would round fp32 products to 10 bits of mantissa; keep fp32 meaning fp32 in these tests."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2", "qwen3", "smollm2-135m"])
def test_m1_matches_transformers_on_cuda_in_float32(tiny_model_factory, kind):
    path = tiny_model_factory(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    llm = m1.LLM(path, device="cuda", dtype="float32", max_model_len=512)
    recorder = llm.engine.runner.sampler = RecordingSampler(llm.engine.runner.sampler)
    worst = 0.0
    for prompt in varied_prompts(8):
        recorder.logits.clear()
        ours = llm.generate(prompt, m1.SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
        out = hf.generate(
            torch.tensor([prompt], device="cuda"),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
            max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True,
        )
        ref_tokens, ref_logits = out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].float()
        assert ours.token_ids == ref_tokens, f"{kind}, prompt of {len(prompt)} tokens"
        our_logits = torch.cat(recorder.logits).float()
        worst = max(worst, (our_logits - ref_logits).abs().max().item())
        torch.testing.assert_close(our_logits, ref_logits, atol=LOGIT_ATOL, rtol=0)
    print(f"\n{kind} float32: largest logit difference to transformers {worst:.2e}")


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2", "qwen3", "smollm2-135m"])
def test_m1_in_bfloat16_is_as_close_to_float32_as_transformers_on_cuda(tiny_model_factory, kind, report):
    """The CPU's bfloat16 check (tests/test_bfloat16.py) on the GPU: the same tokens fed to both, logits compared."""
    path = tiny_model_factory(kind)
    tokens = [t for prompt in varied_prompts(8, seed=1)[5:] for t in prompt][:300]
    check_agreement(teacher_forced_logits(path, tokens, device="cuda"), False, report, f"{kind} on CUDA")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "smollm2-135m"])
def test_the_chain_holds_on_cuda(tiny_model_factory, kind):
    """m2 == m1 (queueing, chunked prefill), m3 == m2 (a pool small enough to preempt), m4 == m3 (prefix hits)."""
    path = tiny_model_factory(kind)
    limits = dict(device="cuda", dtype="float32", max_model_len=256)
    batching = dict(max_num_seqs=5, max_num_batched_tokens=24)
    prompts, settings = gpu_workload(16, seed=3, max_prompt=120, max_output=40)
    reference = run(m1, m1.LLM(path, **limits), prompts, settings)
    batched = m2.LLM(path, **limits, **batching)
    assert_same_outputs(run(m2, batched, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
    paged = m3.LLM(path, **limits, **batching, block_size=4, num_kv_blocks=60)
    assert_same_outputs(run(m3, paged, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
    assert paged.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for every request at once"
    shared_prompts, shared_settings = shared_prefix_workload(10, prefix_len=70, seed=1)
    shared_reference = run(m3, m3.LLM(path, **limits, **batching), shared_prompts, shared_settings)
    cached = m4.LLM(path, **limits, **batching)
    assert_same_outputs(run(m4, cached, shared_prompts, shared_settings), shared_reference, atol=CUDA_LOGPROB_ATOL)
    assert cached.engine.kv_usage()["prefix_hit_rate"] > 0.5
    cached.engine.scheduler.check_integrity()


@pytest.mark.parametrize("kind", ["llama", "smollm2-135m"])
def test_m5_cuda_graphs_match_m4(tiny_model_factory, kind):
    """m5's replayed CUDA graphs == m4, on batches that fit a bucket and batches that need padding.

    Buckets 1 and 4: with 1, 2 and 4 no replayed step of this workload is padded (its schedule replayed on a CPU:
    22 replays, 0 padded rows), with 1 and 4 the same 22 replays pad 22 rows.
    """
    path = tiny_model_factory(kind)
    limits = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=24)
    prompts, settings = gpu_workload(16, seed=3, max_prompt=90, max_output=40)
    reference = run(m4, m4.LLM(path, **limits), prompts, settings)
    captured = m5.LLM(path, **limits, cudagraph_capture_sizes=[1, 4])
    assert_same_outputs(run(m5, captured, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
    stats = captured.engine.graph_stats()
    assert stats["replays"] > 0 and stats["padded_rows"] > 0, stats
    assert stats["piecewise_replays"] > 0 and stats["eager_steps"] == 0, stats  # every step fits 24 tokens
    print(f"\n{kind}: {stats}")
    captured.engine.check_integrity()
    eager = m5.LLM(path, **limits, enforce_eager=True)
    assert_same_outputs(run(m5, eager, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)


@pytest.mark.parametrize("mod", [m5, m6])
def test_m5_and_m6_steps_with_prefill_replayed_in_pieces_give_the_eager_tokens(tiny_model_factory, mod):
    """Chunks beside decodes, replayed in pieces padded to 8, 16 or 24 tokens (attention eager between them), give
    the tokens of the same engine with the pieces off; in float32, SmolLM2-135M's shape, with the default attention
    (batched on CUDA) and with the lesson's."""
    path = tiny_model_factory("smollm2-135m")
    limits = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=24,
                  cudagraph_capture_sizes=[1, 4])
    prompts, settings = gpu_workload(16, seed=3, max_prompt=90, max_output=40)
    for backend in ("auto", "torch"):
        with mod.LLM(path, **limits, attention_backend=backend, piecewise_capture_sizes=[]) as llm:
            reference = run(mod, llm, prompts, settings)
            assert "piecewise_capture_sizes=[]" in llm.engine.graph_stats()["eager_reasons"]
        with mod.LLM(path, **limits, attention_backend=backend, piecewise_capture_sizes=[8, 16, 24]) as llm:
            assert_same_outputs(run(mod, llm, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
            llm.engine.check_integrity()
            stats = llm.engine.graph_stats()
        assert stats["piecewise_sizes"] == [8, 16, 24] and stats["eager_steps"] == 0, stats
        assert stats["piecewise_replays"] > 0 and stats["padded_tokens"] > 0, stats
        print(f"\n{mod.__name__} ({backend}) in pieces: {stats}")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_m6_matches_m5_on_cuda(tiny_model_factory, async_scheduling, tmp_path):
    """m6 == m5 on the GPU: the worker's stream, pinned copies, future ids resolved on the device, graphs replayed."""
    path = tiny_model_factory("smollm2-135m")
    limits = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=24)
    prompts, settings = gpu_workload(16, seed=3, max_prompt=90, max_output=40)
    reference = run(m5, m5.LLM(path, **limits, cudagraph_capture_sizes=[1, 4]), prompts, settings)
    trace = tmp_path / "trace.json"
    with m6.LLM(path, **limits, cudagraph_capture_sizes=[1, 4], async_scheduling=async_scheduling,
                trace_file=str(trace)) as llm:
        assert_same_outputs(run(m6, llm, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
        llm.engine.check_integrity()
        assert llm.engine.graph_stats()["replays"] > 0
        share = hidden_host_share(llm.engine.tracer.events)
    print(f"\nm6 async={async_scheduling}: hidden host share {100 * share:.0f}%")
    assert trace.exists()


def test_m7_with_the_model_as_its_own_draft_gives_m6s_tokens_on_cuda(tiny_model_factory):
    """m7 == m6 on the GPU in float32: guesses checked in one forward, the draft's KV pool under the requests' block
    tables, decode steps without guesses replayed. On the CPU the model as its own draft keeps every guess
    (tests/m7); here cuBLAS may pick other kernels for other row counts, so a near-tie may part the two: at least
    90% kept, and the rate printed."""
    path = tiny_model_factory("smollm2-135m")
    limits = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=32)
    prompts, settings = mixed_workload(16, seed=3, max_prompt=90, max_output=40)
    settings = [dict({k: v for k, v in s.items() if k != "structured_outputs"}, ignore_eos=True) for s in settings]
    reference = run(m6, m6.LLM(path, **limits, cudagraph_capture_sizes=[1, 4]), prompts, settings)
    draft = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    with m7.LLM(path, **limits, cudagraph_capture_sizes=[1, 4], speculative_config=draft) as llm:
        assert_same_outputs(run(m7, llm, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
        llm.engine.check_integrity()
        stats = llm.engine.spec_stats()
    print(f"\nm7 on cuda, the model as its own draft: {stats}")
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] >= 0.9, stats


def test_m8_one_rank_over_nccl_gives_m7s_tokens_on_cuda(tiny_model_factory, monkeypatch):
    """m8 in a group of one over NCCL, as ``torchrun --nproc-per-node 1`` starts it: its all-reduces, the gather of
    the logits and the broadcast of the tokens are real NCCL calls, captured in the decode step's CUDA graphs, and
    the tokens are m7's in float32."""
    path = tiny_model_factory("smollm2-135m")
    limits = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=32,
                  cudagraph_capture_sizes=[1, 4])
    prompts, settings = gpu_workload(16, seed=3, max_prompt=90, max_output=40)
    reference = run(m7, m7.LLM(path, **limits), prompts, settings)
    with socket.socket() as probe:  # a free port for the group's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    with m8.LLM(path, **limits) as llm:
        assert llm.engine.workers.tp.compute is not None  # a group of one over NCCL, not the single rank's no-ops
        assert_same_outputs(run(m8, llm, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
        assert llm.engine.graph_stats()["replays"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the loans so far have one): run "
                    "`python3 -m tests.gpu_runbook tests OUT --group parallel` on a machine with two")
def test_m8_two_ranks_on_two_gpus_give_m7s_tokens(tiny_model_factory):
    """Two ranks over NCCL, a GPU each, graphs captured with their collectives: m7's tokens in float32."""
    path = tiny_model_factory("llama")  # 4 heads and 2 KV heads: two ranks (SmolLM2's 9 heads split in 3 or 9)
    limits = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=32,
                  cudagraph_capture_sizes=[1, 4])
    prompts, settings = gpu_workload(16, seed=3, max_prompt=90, max_output=40)
    reference = run(m7, m7.LLM(path, **limits), prompts, settings)
    with m8.LLM(path, **limits, tensor_parallel_size=2) as llm:
        assert_same_outputs(run(m8, llm, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
        assert llm.engine.graph_stats()["replays"] > 0


def test_m6_survives_a_failed_step_on_cuda(tiny_model_path):
    prompts, settings = gpu_workload(8, seed=4, max_prompt=60, max_output=24)
    limits = dict(device="cuda", max_model_len=256, max_num_seqs=4)
    reference = run(m5, m5.LLM(tiny_model_path, **limits), prompts, settings)
    with m6.LLM(tiny_model_path, **limits) as llm:
        real_run, calls = llm.engine.runner.execute, []

        def fails_once(inputs):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("injected failure in the forward")
            return real_run(inputs)

        llm.engine.runner.execute = fails_once
        with pytest.raises(RuntimeError, match="injected"):
            run(m6, llm, prompts, settings)
        llm.engine.check_integrity()
        assert_same_outputs(run(m6, llm, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
    assert not llm.engine.worker.steps.thread.is_alive()


def test_m5_default_capture_sizes_on_cuda(tiny_model_path):
    llm = m5.LLM(tiny_model_path, device="cuda", max_model_len=128, max_num_seqs=40)
    assert llm.engine.graph_stats()["captured_sizes"] == [1, 2, 4, 8, 16, 32, 40]
    out = llm.generate(["Hello"] * 3, m5.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    assert llm.engine.graph_stats()["padded_rows"] > 0


def test_cuda_and_cpu_agree_in_float32(tiny_model_path):
    prompts, settings = gpu_workload(12, seed=7, max_prompt=100, max_output=32)
    greedy = [dict(s, temperature=0) for s in settings]
    # The CPU side on torch's own products and attention: the compiled CPU kernels are checked against these in the
    # CPU suite, and building them took 90 s of the first H200 run's GPU minutes (stopping this group unfinished).
    cpu_llm = m4.LLM(tiny_model_path, device="cpu", max_model_len=256, max_num_seqs=4, linear_backend="torch",
                     attention_backend="torch")
    on_cpu = run(m4, cpu_llm, prompts, greedy)
    gpu_llm = m4.LLM(tiny_model_path, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4)
    on_gpu = run(m4, gpu_llm, prompts, greedy)
    assert_same_outputs(on_gpu, on_cpu, atol=CUDA_LOGPROB_ATOL)


def test_defaults_on_a_gpu_are_cuda_bfloat16_without_cpu_fast_paths(tiny_model_path, mod):
    llm = mod.LLM(tiny_model_path, max_model_len=128)
    config, runner = llm.engine.config, llm.engine.runner
    assert config.device.type == "cuda" and config.dtype == torch.bfloat16
    assert runner.packed_lm_head is None and runner.attention.name not in ("cpp", "triton")
    out = llm.generate(["Hello there"], mod.SamplingParams(temperature=0.8, seed=5, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (8, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_attention_matches_per_request_on_cuda(dtype, heads):
    """The layout "auto" picks on the GPU (varlen_attn in bfloat16, the padded SDPA call in float32, where flash does
    not run) and the padded one, against the lesson's per-request path on the same step: whole prompts, chunks ending
    a context, decodes and guesses, over shuffled blocks; the CPU tests' tolerance (tests/kernels)."""
    cuda = torch.device("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = batched_attention_for("auto", cuda, dtype, Heads(*heads))
    expected = "varlen" if dtype == torch.bfloat16 else "padded"
    assert chosen.name == expected, f"{chosen.name}, not {expected}: {[str(w.message) for w in caught]}"
    for layout in (chosen, BatchedAttention("padded", None)):
        for seed in (0, 1):
            step = paged_step(STEP, dtype, cuda, *heads, seed=seed)
            assert_matches_request_by_request(step, layout, f"{layout.name}, {dtype}, heads {heads}, seed {seed}")
    print(f"\nbatched attention on cuda, {dtype}, heads {heads}: {chosen.name} within the per-request path's tolerance")


def counted_calls(monkeypatch) -> list[int]:
    """Every call of a batched layout (attention of one layer of one eager step), across threads."""
    calls = []
    for layout in (PaddedBatch, VarlenBatch):
        def counted(self, q, pool_k, pool_v, real=layout.__call__):
            calls.append(len(q))
            return real(self, q, pool_k, pool_v)
        monkeypatch.setattr(layout, "__call__", counted)
    return calls


@pytest.mark.parametrize("mod", [m5, m6])
def test_batched_attention_chain_on_cuda_in_float32(tiny_model_factory, mod, monkeypatch):
    """m5 and m6 with batched attention (on the GPU in float32: the padded layout) give the tokens of the lesson's
    request-by-request attention, and call attention once per layer in every eager step (chunks beside decodes)."""
    path = tiny_model_factory("smollm2-135m")
    limits = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=24,
                  cudagraph_capture_sizes=[1, 4])
    prompts, settings = gpu_workload(16, seed=3, max_prompt=90, max_output=40)
    with mod.LLM(path, **limits, attention_backend="torch") as llm:
        reference = run(mod, llm, prompts, settings)
    calls = counted_calls(monkeypatch)
    with mod.LLM(path, **limits, attention_backend="batched") as llm:
        runner = llm.engine.runner
        assert runner.attention.name == "padded"
        assert_same_outputs(run(mod, llm, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
        num_layers, stats = len(runner.model.model.layers), llm.engine.graph_stats()
    not_whole = stats["eager_steps"] + stats["piecewise_replays"]  # every step not replayed whole attends eagerly
    assert not_whole > 0 and len(calls) == num_layers * not_whole, (len(calls), num_layers, stats)


def prompt_scores(mod, path, **options) -> torch.Tensor:
    """The log-probability of every prompt token but the first: teacher-forced, scored by the eager steps' chunks."""
    prompts, _ = mixed_workload(12, seed=3, max_prompt=120, max_output=1)
    params = mod.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    with mod.LLM(path, device="cuda", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=48, **options) as llm:
        outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    return torch.tensor([next(iter(scored.values())).logprob for out in outs for scored in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("mod", [m5, m6])
def test_batched_attention_in_bfloat16_is_as_close_to_float32_on_cuda(tiny_model_factory, mod):
    """In bfloat16 tokens may part at near-ties (see the module's note), so the yardstick is float32: with varlen_attn
    (the GPU's default) the prompts' log-probabilities are as close to float32's as the lesson's attention makes them
    in bfloat16 (mean error within 25%, as tests/test_bfloat16.py asks of m1 against transformers). Rehearsed on a
    CPU with the padded layout, every step eager: m5 0.640 against the lesson's 0.634 (largest 2.76 both)."""
    path = tiny_model_factory("smollm2-135m")
    truth = prompt_scores(mod, path, dtype="float32", attention_backend="torch")
    lessons = (prompt_scores(mod, path, dtype="bfloat16", attention_backend="torch") - truth).abs()
    ours = (prompt_scores(mod, path, dtype="bfloat16") - truth).abs()
    print(f"\n{mod.__name__} bfloat16 prompt log-probabilities against float32: varlen mean {ours.mean():.4f} max "
          f"{ours.max():.3f}, the lesson's attention mean {lessons.mean():.4f} max {lessons.max():.3f}")
    assert ours.mean() <= 1.25 * lessons.mean()


@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (4, 4, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_triton_decode_matches_paged_decode_attention_on_cuda(dtype, heads):
    """The Triton decode kernel, compiled for this GPU, against the lesson's paged_decode_attention on random paged
    caches (ragged contexts from 1 to 100, tables padded with a scratch block): the CPU tests' tolerance. Imported
    here: tests/kernels/test_triton_decode.py skips itself (and so these) where triton is not installed."""
    from milestones.m5.attention import paged_decode_attention
    from tests.kernels.test_triton_decode import CONTEXTS, assert_close_to_lesson, paged_decode, triton_decode

    worst = 0.0
    for seed in (0, 1):
        step = paged_decode(CONTEXTS, *heads, dtype, max_blocks=64, seed=seed, device=torch.device("cuda"))
        got, expected = triton_decode.paged_decode_attention(*step.args()), paged_decode_attention(*step.args())
        assert_close_to_lesson(got, expected, f"{dtype}, heads {heads}, seed {seed}")
        worst = max(worst, (got.float() - expected.float()).abs().max().item())
    print(f"\ntriton decode on cuda, {dtype}, heads {heads}: max error {worst:.2e} against paged_decode_attention")


def test_triton_fused_kernels_match_the_lesson_on_cuda():
    """The fused norm, activation and RoPE-with-KV-write kernels compiled for this GPU: the CPU tests' cases and
    tolerance (tests/kernels/test_triton_fused.py: on CUDA, bfloat16 rounds to nearest, so the skip connection's
    sum is exact), every dtype, head grouping and block size."""
    from tests.kernels import test_triton_fused as fused

    for dtype in fused.DTYPES:
        for n in (576, 4096, 100):
            for residual in (False, True):
                fused.test_rms_norm_is_the_lesson_s_norm_of_the_skip_connection(dtype, n, residual)
        for n in (1536, 14336, 100):
            fused.test_silu_and_mul_is_the_lesson_s_activation(dtype, n)
        for heads in fused.HEADS:
            for block_size in fused.BLOCK_SIZES:
                fused.test_rope_and_write_kv_rotates_as_the_lesson_and_writes_only_the_new_slots(dtype, heads,
                                                                                                block_size)


def test_triton_fused_kernels_in_a_cuda_graph_read_each_replay_s_angles_and_slots():
    """Captured once, replayed with new inputs, angles and slots copied into the same buffers: each replay
    writes the new slots and rotates by the new angles (the kernels read them on the device)."""
    from milestones.kernels import triton_fused

    cuda, dtype = torch.device("cuda"), torch.bfloat16
    n, heads, kv_heads, dim, block_size = 4, 9, 3, 64, 16
    cos, sin = (torch.zeros(n, dim, device=cuda, dtype=dtype) for _ in range(2))
    x, q = torch.zeros(n, 576, device=cuda, dtype=dtype), torch.zeros(n, heads, dim, device=cuda, dtype=dtype)
    k, v = (torch.zeros(n, kv_heads, dim, device=cuda, dtype=dtype) for _ in range(2))
    slots = torch.zeros(n, dtype=torch.long, device=cuda)
    weight = torch.ones(576, device=cuda, dtype=dtype)
    pool_k, pool_v = (torch.zeros(10, kv_heads, block_size, dim, device=cuda, dtype=dtype) for _ in range(2))

    def step():
        normed, _ = triton_fused.rms_norm(x, weight, 1e-5)
        return normed, triton_fused.rope_and_write_kv(q, k, v, cos, sin, pool_k, pool_v, slots)

    step()  # compiled before the capture, as the graph runner warms up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_norm, out_q = step()
    for replay in range(3):
        for buffer in (x, q, k, v):
            buffer.copy_(torch.randn(buffer.shape, device=cuda))
        angles = torch.rand(n, dim // 2, device=cuda).repeat(1, 2) * 50
        cos.copy_(angles.cos())
        sin.copy_(angles.sin())
        slots.copy_(torch.randperm(10 * block_size, device=cuda)[:n])
        pool_k.zero_()
        graph.replay()
        expected_norm, expected_q = (t.clone() for t in step())
        expected_k = pool_k.clone()
        assert torch.equal(out_norm, expected_norm) and torch.equal(out_q, expected_q), f"replay {replay}"
        pool_k.zero_()
        graph.replay()
        assert torch.equal(pool_k, expected_k), f"replay {replay} wrote other slots than an eager call"


def test_triton_decode_in_a_cuda_graph_reads_the_lengths_and_tables_of_each_replay():
    """Captured once, replayed over new context lengths and tables written into the same buffers: each replay gives
    what the lesson's function gives on them (so the kernel reads them on the device, and captures without a sync)."""
    from milestones.m5.attention import paged_decode_attention
    from tests.kernels.test_triton_decode import assert_close_to_lesson, paged_decode, triton_decode

    cuda = torch.device("cuda")
    first = paged_decode([1, 16, 17, 40], 9, 3, 64, torch.bfloat16, max_blocks=8, pool_blocks=40, device=cuda)
    triton_decode.paged_decode_attention(*first.args())  # compiled before the capture, as the graph runner warms up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = triton_decode.paged_decode_attention(*first.args())
    for seed, contexts in ((1, [100, 3, 64, 1]), (2, [33, 33, 1, 128])):
        step = paged_decode(contexts, 9, 3, 64, torch.bfloat16, max_blocks=8, pool_blocks=40, seed=seed, device=cuda)
        for static, new in zip(first.args()[:5], step.args()[:5]):
            static.copy_(new)
        graph.replay()
        assert_close_to_lesson(output, paged_decode_attention(*first.args()), f"replay with contexts {contexts}")


def test_triton_decode_engine_captures_it_and_matches_torch_on_cuda(tiny_model_factory):
    """m5 with attention_backend="triton" (float32, SmolLM2-135M's shape: 9 query heads over 3 kv heads) gives the
    lesson's tokens, with the kernel in its captured decode steps (replayed) and its eager decodes."""
    from tests.kernels.test_triton_decode import triton_decode

    path = tiny_model_factory("smollm2-135m")
    limits = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=5, max_num_batched_tokens=24,
                  cudagraph_capture_sizes=[1, 4])
    prompts, settings = gpu_workload(16, seed=3, max_prompt=90, max_output=40)
    with m5.LLM(path, **limits, attention_backend="torch") as llm:
        reference = run(m5, llm, prompts, settings)
    with m5.LLM(path, **limits, attention_backend="triton") as llm:
        runner = llm.engine.runner
        assert runner.attention.name == "triton" and runner.attention.kernel is triton_decode.paged_decode_attention
        assert runner.graph_runner.attention is runner.attention
        assert_same_outputs(run(m5, llm, prompts, settings), reference, atol=CUDA_LOGPROB_ATOL)
        llm.engine.check_integrity()
        stats = llm.engine.graph_stats()
    assert stats["replays"] > 0 and stats["piecewise_replays"] > 0, stats  # decodes of 5 rows: in pieces
    print(f"\nm5 with the triton decode kernel: {stats}")
