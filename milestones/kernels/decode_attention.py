"""Build, load and register the compiled decode-attention kernel (``decode_attention.cpp``).

The plain-torch attention in each milestone's ``attention.py`` is the reference: it
is what the lesson reads and what runs on CUDA. On the CPU its per-request operators
cost more in dispatch than in arithmetic, so ``attention_backend="cpp"`` (and
``"auto"`` on a CPU in float32) hands every decoding request of a step to one
compiled call instead. torch builds it with the machine's C++ compiler the first
time and caches it under ``~/.cache/torch_extensions``. The library registers the
op ``torch.ops.milestones.decode_attention``; its fake (shape-only) implementation
below lets ``torch.compile`` trace through it as one opaque call.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # fast-math lets the compiler vectorise the dot products

STALE_LOCK_SECONDS = 300  # a build takes ~30 s: a lock this old is taken to be left by a process killed mid-build
DecodeKernel = Callable[..., torch.Tensor]  # (q, k, v, block_tables, context_lens, scale) -> out
_build_error: Exception | None = None  # why the build failed in this process, if it did


def _cpu_identity() -> bytes:
    """What -march=native compiles for: a cache shared with another CPU must not load this build."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}".encode()


def load_decode_kernel() -> DecodeKernel:
    """The compiled kernel; raises if it cannot be built, and at once on later calls: a failing build is tried once."""
    global _build_error
    if _build_error is None:
        try:
            _build()
            return _registered_op()
        except Exception as error:
            _build_error = error
    raise _build_error


@functools.cache
def _build() -> str:
    """Compile (once per machine: the result is cached on disk) and load the library; return its path."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # pip's ninja sits next to this interpreter, maybe not on PATH
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    digest = hashlib.sha1(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_identity()).hexdigest()[:12]
    name = f"milestones_decode_attention_{digest}"  # a changed source, flag or CPU builds anew
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # where torch builds and locks
    wait_for_build_lock(build_dir / "lock")
    if not (build_dir / f"{name}.so").exists():
        print("building the C++ decode-attention kernel (once per machine, ~30 s) ...", file=sys.stderr, flush=True)
    return cpp_extension.load_inline(  # loading the library defines the op torch.ops.milestones.decode_attention
        name=name,
        cpp_sources=[SOURCE.read_text()],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],  # the same libgomp torch already loaded
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


@functools.cache
def _registered_op() -> DecodeKernel:
    """The op the library defined, with its shape rule registered (once) for tracing."""
    torch.library.register_fake("milestones::decode_attention", _decode_attention_shape)
    return torch.ops.milestones.decode_attention.default


def _decode_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """What the op returns, for tracing without running it: one output row per query, like q."""
    return q.new_empty(q.shape)


def wait_for_build_lock(lock: Path, max_age: float = STALE_LOCK_SECONDS, poll: float = 1.0) -> None:
    """torch waits forever on a build's lock file; wait here instead, and remove one older than ``max_age``.

    torch never touches the lock while it builds, so its age is the time since
    the build started: a build slower than ``max_age`` would be taken for dead.
    """
    announced = False
    while True:
        try:
            seen = lock.stat()
        except FileNotFoundError:
            return  # no build under way, or the other build finished
        age = time.time() - seen.st_mtime
        if age >= max_age:
            if _remove_if_unchanged(lock, seen):
                warnings.warn(f"removed {lock}, left {age:.0f} s ago by a kernel build that did not finish",
                              stacklevel=1)
            return
        if not announced:
            print(f"waiting for another process's kernel build ({lock}) ...", file=sys.stderr, flush=True)
            announced = True
        time.sleep(poll)


def _remove_if_unchanged(lock: Path, seen: os.stat_result) -> bool:
    """Remove the stale lock, unless another process has already removed or replaced it."""
    try:
        now = lock.stat()
        if (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
            return False
        lock.unlink()
        return True
    except FileNotFoundError:
        return False


def decode_kernel_for(backend: str, device: torch.device, dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel an engine with this (already checked) ``attention_backend`` uses, or None for plain torch.

    ``"auto"`` falls back to torch with a warning when the kernel cannot be built
    (no compiler, say); ``"cpp"`` turns that into an error.
    """
    if backend == "torch" or device.type != "cpu" or dtype != torch.float32:
        return None  # the engine's config already refused "cpp" for anything but CPU float32
    try:
        return load_decode_kernel()
    except Exception as error:  # a compiler error arrives as one of several exception types
        if backend == "cpp":
            raise RuntimeError(
                f"could not build the C++ decode-attention kernel ({error}); use attention_backend='torch'"
            ) from error
        warnings.warn(f"C++ decode-attention kernel unavailable ({error}); using plain-torch attention", stacklevel=2)
        return None
