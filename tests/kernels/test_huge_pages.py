"""Packed weights moved into 2 MiB pages keep their numbers, sit in the order a step reads them, and get the pages;
the KV cache is allocated there, as zeros."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from milestones import m2, m3
from milestones.kernels import PanelLinear, decode_attention, kv_cache_zeros
from milestones.kernels.huge_pages import HUGE_PAGE, move_to_huge_pages, zeros_in_huge_pages
from milestones.kernels.panel_linear import FusedMLP
from tests.conftest import needs_compiler

LINUX = sys.platform.startswith("linux")
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages_on() -> bool:
    return LINUX and THP_SETTING.is_file() and "[never]" not in THP_SETTING.read_text()


def anon_huge_bytes(address: int) -> int:
    """The bytes of 2 MiB pages backing the mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: "start-end perms offset dev inode [path]"
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) * 1024
    return 0


def test_copies_keep_dtype_shape_values_and_order():
    tensors = [torch.randn(3, 5), torch.randn(7).bfloat16(), torch.arange(12, dtype=torch.float32).view(2, 3, 2)]
    copies, advised = move_to_huge_pages(tensors)
    for tensor, copy in zip(tensors, copies):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape and copy.is_contiguous()
        assert torch.equal(copy, tensor)
    if not LINUX:
        assert copies == tensors and not advised
        return
    pointers = [copy.data_ptr() for copy in copies]
    assert pointers == sorted(pointers) and pointers[0] % HUGE_PAGE == 0, "one arena, 2 MiB aligned, in this order"
    assert all(pointer % 64 == 0 for pointer in pointers), "each tensor starts on a cache line"


@pytest.mark.skipif(not transparent_huge_pages_on(), reason="Linux's transparent huge pages are off or absent here")
def test_the_arena_gets_huge_pages():
    (copy,), advised = move_to_huge_pages([torch.ones(3 * HUGE_PAGE // 4)])  # 6 MiB: at least two whole 2 MiB pages
    assert advised, "madvise(MADV_HUGEPAGE) was refused"
    huge = anon_huge_bytes(copy.data_ptr())
    if huge == 0:
        pytest.skip("Linux took the request but had no free 2 MiB page to give (memory fragmented)")
    assert huge >= HUGE_PAGE


@needs_compiler
def test_an_engine_reads_its_packed_weights_front_to_back(tiny_model_path):
    """The panel kernel's weights lie in the order a step reads them: layer by layer, then the LM head."""
    runner = m2.LLM(model=str(tiny_model_path), linear_backend="cpp").engine.runner
    layers = [module for module in runner.model.model.modules() if isinstance(module, (PanelLinear, FusedMLP))]
    layers.append(runner.packed_lm_head)
    pointers = [layer.packed_weight.data_ptr() for layer in layers]
    assert len(layers) == 4 * len(runner.model.model.layers) + 1  # qkv, o, gate and up as one, down
    if LINUX:
        assert pointers == sorted(pointers)


@pytest.fixture
def asked(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes kv_cache_zeros asks zeros_in_huge_pages for, which still makes them."""
    shapes: list[tuple[int, ...]] = []
    monkeypatch.setattr(decode_attention, "zeros_in_huge_pages",
                        lambda shape, dtype: shapes.append(shape) or zeros_in_huge_pages(shape, dtype))
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_is_zeros_in_huge_pages_unless_the_backend_is_torch(dtype, asked):
    """The same zeros whatever the backend, taking writes like any tensor; off "torch" they come from a mapping of
    their own (on Linux starting on a 2 MiB boundary, and with no larger tensor behind them), with "torch" from
    torch.zeros."""
    cpu = torch.device("cpu")
    for shape in ((2, 3, 5, 16, 8), (0, 3, 16, 8)):
        for backend in ("auto", "cpp", "torch"):
            asked.clear()
            cache = kv_cache_zeros(shape, dtype, cpu, backend)
            assert asked == ([] if backend == "torch" else [shape])
            assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
            assert torch.equal(cache, torch.zeros(shape, dtype=dtype))
            if LINUX and backend != "torch" and cache.numel():
                assert cache.data_ptr() % HUGE_PAGE == 0 and cache.untyped_storage().nbytes() == cache.nbytes
                assert cache._base is None or cache._base.dtype == dtype  # no uint8 arena behind it
            if cache.numel():
                cache[1, 2, 4] = 1.5
                assert cache.sum().item() == 1.5 * 16 * 8


@pytest.mark.skipif(not transparent_huge_pages_on(), reason="Linux's transparent huge pages are off or absent here")
def test_a_written_kv_cache_gets_huge_pages():
    cache = zeros_in_huge_pages((3, HUGE_PAGE // 4), torch.float32)  # 6 MiB: at least two whole 2 MiB pages
    cache.fill_(1.0)  # the pages are only taken when written
    huge = anon_huge_bytes(cache.data_ptr())
    if huge == 0:
        pytest.skip("Linux took the request but had no free 2 MiB page to give (memory fragmented)")
    assert huge >= HUGE_PAGE


def test_an_engine_asks_for_its_kv_pool_in_huge_pages_unless_attention_is_torch(tiny_model_path, asked):
    """m3's runner (every milestone's allocates its pool the same way) takes its keys and values from
    zeros_in_huge_pages, and with attention_backend="torch" from torch.zeros."""
    runner = m3.LLM(model=str(tiny_model_path), device="cpu", linear_backend="torch").engine.runner
    assert asked == [tuple(runner.k_cache.shape)] * 2
    if LINUX:
        assert runner.k_cache.data_ptr() % HUGE_PAGE == 0 and runner.v_cache.data_ptr() % HUGE_PAGE == 0
    asked.clear()
    m3.LLM(model=str(tiny_model_path), device="cpu", linear_backend="torch", attention_backend="torch")
    assert asked == []
