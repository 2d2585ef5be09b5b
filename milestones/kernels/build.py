"""Compile a C++ kernel library once per machine, cache it on disk, and load it (torch's ``cpp_extension``).

Each kernel (``decode_attention.cpp``, ``panel_linear.cpp``) is one source file that
registers its torch ops when loaded. torch builds it with the machine's C++ compiler
the first time and caches it under ``~/.cache/torch_extensions``; the build's name
carries a hash of the source, the flags, the CPU and the torch installation, so a
changed source, other flags, another CPU or another environment sharing the cache
builds anew (two virtual environments sharing one build would each rebuild it in turn,
since the build's commands name their own torch's headers).
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
from pathlib import Path

STALE_LOCK_SECONDS = 300  # a build takes ~30 s: a lock this old is taken to be left by a process killed mid-build


def _cpu_identity() -> bytes:
    """What -march=native compiles for: a cache shared with another CPU must not load this build."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}".encode()


_build_errors: dict[tuple[Path, tuple[str, ...]], Exception] = {}  # why a build failed in this process


def compile_library(source: Path, flags: tuple[str, ...]) -> str:
    """Compile ``source`` (once per machine: the result is cached on disk) and load it; return the library's path.

    Raises if it cannot be built, and at once on later calls: a failing build is tried once per process.
    """
    if (source, flags) in _build_errors:
        raise _build_errors[source, flags]
    try:
        return _compile(source, flags)
    except Exception as error:
        _build_errors[source, flags] = error
        raise


@functools.cache
def _compile(source: Path, flags: tuple[str, ...]) -> str:
    import torch
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # pip's ninja sits next to this interpreter, maybe not on PATH
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    installation = f"{torch.__version__} {Path(torch.__file__).parent}".encode()
    digest = hashlib.sha1(source.read_bytes() + " ".join(flags).encode() + _cpu_identity() + installation).hexdigest()
    name = f"milestones_{source.stem}_{digest[:12]}"  # a changed source, flag, CPU or torch builds anew
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # where torch builds and locks
    wait_for_build_lock(build_dir / "lock")
    if not (build_dir / f"{name}.so").exists():
        print(f"building the C++ kernel {source.name} (once per machine, ~30 s) ...", file=sys.stderr, flush=True)
    return cpp_extension.load_inline(  # loading the library defines its ops under torch.ops.milestones
        name=name,
        cpp_sources=[source.read_text()],
        extra_cflags=list(flags),
        extra_ldflags=["-fopenmp"],  # the same libgomp torch already loaded
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


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
