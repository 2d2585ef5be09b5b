"""Packed weights and the KV cache in 2 MiB pages: the memory a decode step streams, read with fewer page walks.

A decode step at batch 1 reads every weight once, front to back, so it runs at the
speed memory streams. Memory comes in pages; with Linux's default 4 KiB pages a
step of SmolLM2-135M in float32 crosses 130,000 of them, and each crossing costs a
lookup in the page tables and restarts the CPU's prefetcher, which does not follow
a stream across a page. Linux backs memory with 2 MiB pages where a program asks
for them (``madvise(MADV_HUGEPAGE)``; "transparent huge pages" is usually set to
honour only such requests). This module copies the packed weights of every layer
into one block of memory that asked for them, in the order a step reads them: the
same numbers, read faster. Measured on the benchmarks page. The KV pool is allocated in
such memory from the start (``zeros_in_huge_pages``): decode attention reads a block of
one head's keys (4 KiB in float32 at SmolLM2's sizes) wherever the block table says.

Off Linux the weights stay where they are. On Linux they are copied even where the
request for huge pages is refused or cannot be met (THP turned off, no free 2 MiB
page): they then sit in ordinary pages. The numbers are the same either way.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line


# --8<-- [start:arena]
def huge_page_mapping(num_bytes: int) -> tuple[mmap.mmap, int, bool]:
    """A fresh mapping with ``num_bytes`` from a 2 MiB boundary on: the mapping, that boundary's offset in it, and
    whether Linux took the request for huge pages.

    Linux only (``mmap.MADV_HUGEPAGE``). The memory is mapped afresh, private and anonymous
    (a shared mapping would be shared memory, which has its own huge-page setting), and the
    request made before it is first written, so that its pages are huge from the start;
    Linux may still give small ones where it has no free 2 MiB page (the numbers are the
    same, only slower to read). A tensor made from the mapping keeps it alive.
    """
    padded = -(-num_bytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, padded + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
        advised = True
    except OSError:  # a kernel built without transparent huge pages
        advised = False
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return mapping, -address % HUGE_PAGE, advised


def huge_page_arena(num_bytes: int) -> tuple[torch.Tensor, bool]:
    """A ``num_bytes`` uint8 tensor starting on a 2 MiB boundary, and whether Linux took the request for huge pages."""
    mapping, start, advised = huge_page_mapping(num_bytes)
    return torch.frombuffer(mapping, dtype=torch.uint8, offset=start, count=num_bytes), advised
# --8<-- [end:arena]


def move_to_huge_pages(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """Copies of ``tensors`` laid one after another in a huge-page arena (in this order), and whether it was advised.

    Where huge pages cannot be asked for (off Linux) the tensors come back as they are.
    Each copy is a contiguous view of the arena with its tensor's dtype, shape and values.
    """
    if not hasattr(mmap, "MADV_HUGEPAGE") or not tensors:
        return tensors, False
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
    arena, advised = huge_page_arena(sum(sizes))
    copies, offset = [], 0
    for tensor, size in zip(tensors, sizes):
        view = arena[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        copies.append(view)
        offset += size
    return copies, advised


# --8<-- [start:zeros]
def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, in memory that asked Linux for 2 MiB pages (off Linux, zeros).

    A fresh anonymous mapping reads as zeros, and its pages are only taken when first written.
    """
    numel = math.prod(shape)
    if not hasattr(mmap, "MADV_HUGEPAGE") or numel == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping, start, _ = huge_page_mapping(numel * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(mapping, dtype=dtype, offset=start, count=numel).view(shape)
# --8<-- [end:zeros]
