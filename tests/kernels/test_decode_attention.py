"""The compiled decode kernel against the plain-torch decode attention, and the attention_backend switch (m1, m2)."""

from __future__ import annotations

import os
import random
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import milestones.kernels.build as kernel_build
import milestones.kernels.decode_attention as decode_attention_build
from milestones import m1, m2
from milestones.kernels.attention_backends import attention_backend_for
from milestones.m1.attention import AttentionContext, attention
from milestones.m2.attention import decode_attention
from tests.chain import assert_same_outputs, mixed_workload, run
from tests.conftest import needs_compiler
from tests.kernels import assert_one_opaque_op_to_torch_compile

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel():
    return decode_attention_build.load_decode_kernel()


@needs_compiler
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (4, 4, 24)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_equals_torch_decode_on_ragged_slots(kernel, heads, kv_heads, dim, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_slots, max_len = 8, 300
    k_cache, v_cache = torch.randn(num_slots, kv_heads, max_len, dim), torch.randn(num_slots, kv_heads, max_len, dim)
    slots = rng.sample(range(num_slots), 6)  # out of order, some slots idle
    lengths = [1, max_len] + [rng.randint(1, max_len) for _ in range(4)]
    q = torch.randn(len(slots), heads, dim)
    out = kernel(q, k_cache, v_cache, torch.tensor(slots)[:, None], torch.tensor(lengths), dim**-0.5)
    for i, (slot, length) in enumerate(zip(slots, lengths)):
        expected = decode_attention(q[i : i + 1], k_cache[slot, :, :length], v_cache[slot, :, :length])
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 24)])
def test_kernel_in_bfloat16_reads_the_cache_as_stored_and_sums_in_float32(kernel, heads, kv_heads, dim):
    """bfloat16 in, bfloat16 out, float32 inside: the float32 result on the same numbers, rounded once."""
    torch.manual_seed(dim)
    k_cache, v_cache = (torch.randn(4, kv_heads, 200, dim).bfloat16() for _ in range(2))
    q, lengths = torch.randn(3, heads, dim).bfloat16(), [1, 200, 77]
    out = kernel(q, k_cache, v_cache, torch.tensor([[2], [0], [3]]), torch.tensor(lengths), dim**-0.5)
    assert out.dtype == torch.bfloat16
    for i, (slot, length) in enumerate(zip([2, 0, 3], lengths)):
        keys, values = k_cache[slot, :, :length].float(), v_cache[slot, :, :length].float()
        expected = decode_attention(q[i : i + 1].float(), keys, values).bfloat16()
        # float32 sums in another order can round to the neighbouring bfloat16: at most 2**-7 apart, relative
        torch.testing.assert_close(out[i : i + 1], expected, atol=2**-9, rtol=2**-7)


@needs_compiler
def test_kernel_refuses_bad_input_with_a_clear_error(kernel):
    k = v = torch.zeros(2, 1, 8, 16)
    q, table, lengths = torch.zeros(1, 2, 16), torch.tensor([[1]]), torch.tensor([8])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(q.double(), k, v, table, lengths, 1.0)
    with pytest.raises(RuntimeError, match="in the same dtype"):
        kernel(q.bfloat16(), k, v, table, lengths, 1.0)
    with pytest.raises(RuntimeError, match="no more than its block table covers"):
        kernel(q, k, v, table, torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, k, v, torch.tensor([[2]]), lengths, 1.0)
    with pytest.raises(RuntimeError, match="at least one token"):
        kernel(q, k, v, table, torch.tensor([0]), 1.0)


@needs_compiler
def test_the_kernel_is_one_opaque_op_to_torch_compile(kernel):
    """A registered op with a shape rule: torch.compile traces through it without a graph break."""
    k = v = torch.randn(3, 2, 8, 16)
    args = (torch.randn(2, 4, 16), k, v, torch.tensor([[2, 0], [1, 2]]), torch.tensor([5, 16]), 0.25)
    assert_one_opaque_op_to_torch_compile(torch.ops.milestones.decode_attention, args, "milestones.decode_attention")


@needs_compiler
@pytest.mark.parametrize("filled", [1, 37, 64])  # the first row alone, some, every row of the cache
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
def test_m1_hands_a_decode_step_to_the_kernel_with_its_cache_as_blocks_of_one_row(kernel, dtype, tolerance, filled):
    """m1's contiguous cache, [max_model_len, kv_heads, dim] a layer, read through the block table 0, 1, 2, ...

    The same keys and values are written as without the kernel; the output is the lesson's within float32 sums in
    another order (bfloat16: the float32 result rounded once, so at most the neighbouring bfloat16).
    """
    torch.manual_seed(5)
    layers, max_len, heads, kv_heads, dim = 2, 64, 9, 3, 64
    caches = [torch.randn(layers, max_len, kv_heads, dim).to(dtype) for _ in range(2)]
    q, k, v = torch.randn(1, heads, dim).to(dtype), *(torch.randn(1, kv_heads, dim).to(dtype) for _ in range(2))
    row = torch.tensor([filled - 1])
    lesson = AttentionContext(*(c.clone() for c in caches), slot_mapping=row, context_len=filled)
    ours = AttentionContext(*(c.clone() for c in caches), slot_mapping=row, context_len=filled)
    config = SimpleNamespace(attention_backend="cpp", device=CPU, dtype=dtype, max_model_len=max_len)
    backend = attention_backend_for(config, None, attention, "contiguous")
    calls = []  # the kernel through a stand-in that counts its calls: the backend must not fall back to torch
    backend.kernel = lambda *args: calls.append(args) or kernel(*args)
    backend.prepare_metadata(ours)
    expected, out = attention(q, k, v, 1, lesson), backend.forward(q, k, v, 1, ours)
    assert len(calls) == 1, "m1's kernel backend attends to a decode step in one call of its kernel"
    assert calls[0][1].shape == (max_len, kv_heads, 1, dim), "m1's cache rows, seen as blocks of one position"
    assert calls[0][3].tolist() == [list(range(filled))], "the block table 0, 1, ..., context_len - 1"
    assert out.dtype == dtype
    assert torch.equal(ours.k_cache, lesson.k_cache) and torch.equal(ours.v_cache, lesson.v_cache)
    torch.testing.assert_close(out, expected, atol=tolerance / 4, rtol=tolerance)


@needs_compiler
@pytest.mark.parametrize("mod", [m1, m2], ids=["m1", "m2"])
def test_the_backends_give_the_same_tokens(tiny_model_path, mod):
    prompts, settings = mixed_workload(12, seed=7, max_prompt=90, max_output=40)
    limits = dict(device="cpu", max_model_len=256)
    if mod is m2:
        limits |= dict(max_num_seqs=5, max_num_batched_tokens=24)
    reference = run(mod, mod.LLM(tiny_model_path, attention_backend="torch", **limits), prompts, settings)
    llm = mod.LLM(tiny_model_path, attention_backend="cpp", **limits)
    backend, calls = llm.engine.runner.attention, []
    kernel = backend.kernel
    backend.kernel = lambda *args: calls.append(len(args[0])) or kernel(*args)
    assert_same_outputs(run(mod, llm, prompts, settings), reference)
    assert len(calls) > 100, "the decodes did not go to the kernel"


@pytest.mark.parametrize("mod", [m1, m2], ids=["m1", "m2"])
def test_auto_falls_back_to_torch_when_the_kernel_cannot_be_built(monkeypatch, tiny_model_path, mod):
    def broken():
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(decode_attention_build, "load_decode_kernel", broken)
    assert decode_attention_build.decode_kernel_for("torch", CPU, torch.float32) is None
    with pytest.raises(RuntimeError, match="attention_backend='torch'"):
        decode_attention_build.decode_kernel_for("cpp", CPU, torch.float32)
    with pytest.warns(UserWarning, match="plain-torch attention"):
        llm = mod.LLM(tiny_model_path, device="cpu", max_model_len=128, attention_backend="auto")
    assert llm.engine.runner.attention.name == "torch"
    out = llm.generate([[5, 6, 7]], mod.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("mod", [m1, m2], ids=["m1", "m2"])
def test_backend_option_is_checked(tiny_model_path, mod):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        mod.LLM(tiny_model_path, device="cpu", attention_backend="flash")
    with pytest.raises(ValueError, match="CPU in float32 or bfloat16 only"):
        mod.LLM(tiny_model_path, device="cpu", dtype="float16", attention_backend="cpp")


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    long_ago = time.time() - kernel_build.STALE_LOCK_SECONDS - 1
    os.utime(lock, (long_ago, long_ago))
    with pytest.warns(UserWarning, match="did not finish"):
        kernel_build.wait_for_build_lock(lock)
    assert not lock.exists()


def test_a_build_under_way_is_waited_for_and_a_hung_one_removed_after_max_age(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    other_build = threading.Timer(0.3, lock.unlink)  # another process finishing its build
    other_build.start()
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its lock is left alone
        kernel_build.wait_for_build_lock(lock, poll=0.02)
    other_build.join()
    assert time.monotonic() - start >= 0.25

    lock.touch()  # a build that never finishes
    start = time.monotonic()
    with pytest.warns(UserWarning, match="did not finish"):
        kernel_build.wait_for_build_lock(lock, max_age=0.3, poll=0.02)
    assert not lock.exists() and time.monotonic() - start >= 0.25


def test_the_build_waits_on_the_lock_torch_takes(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dirs = []

    def load_inline(name, build_directory, **kwargs):  # stands in for the compiler
        assert build_directory == cpp_extension._get_build_directory(name, verbose=False)
        assert not os.path.exists(os.path.join(build_directory, "lock")), "torch would wait on this lock forever"
        build_dirs.append(build_directory)
        return "the library"

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)

    def build():  # __wrapped__: past the per-process cache
        return kernel_build._compile.__wrapped__(decode_attention_build.SOURCE, decode_attention_build.FLAGS)

    assert build() == "the library"
    lock = Path(build_dirs[0]) / "lock"
    assert lock.parent.parent == tmp_path
    lock.touch()  # left by a build that was killed long ago
    long_ago = time.time() - kernel_build.STALE_LOCK_SECONDS - 1
    os.utime(lock, (long_ago, long_ago))
    with pytest.warns(UserWarning, match="did not finish"):
        assert build() == "the library"


def test_a_stale_lock_replaced_by_a_new_build_is_left_alone(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    stale = lock.stat()
    lock.unlink()  # another process removed the stale lock ...
    lock.touch()  # ... and started its own build
    os.utime(lock, ns=(stale.st_mtime_ns + 10**9, stale.st_mtime_ns + 10**9))
    assert not kernel_build._remove_if_unchanged(lock, stale)
    assert lock.exists()


def test_a_failing_build_is_tried_once_per_process(monkeypatch):
    """Every engine of a process without a compiler gets the first build's error at once, not another ~30 s try."""
    tries = []

    def broken(source, flags):
        tries.append(source)
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(kernel_build, "_compile", broken)
    monkeypatch.setattr(kernel_build, "_build_errors", {})
    for _ in range(3):
        with pytest.raises(OSError, match="no C\\+\\+ compiler"):
            kernel_build.compile_library(decode_attention_build.SOURCE, decode_attention_build.FLAGS)
    assert len(tries) == 1
