"""Build every C++ kernel side by side, one process each, before the first engine asks for one.

An engine builds the kernels it needs the first time it needs them, one after the other: about 30 s each with the
machine's compiler, two minutes for all of them, spent inside whatever ran first (a demo, a test). ``make model``
runs this module instead, so the builds share the machine's cores: each build is one compiler process, and a
loader that finds its build cached returns at once. Best effort, like the engines' own builds: a kernel that
cannot be built is reported, and the engines fall back as they do without it.

    python -m milestones.kernels.prebuild
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

# module -> the function that builds and loads its kernel (every caller of build.compile_library; a test checks)
LOADERS = {
    "milestones.kernels.decode_attention": "load_decode_kernel",
    "milestones.kernels.panel_linear": "load_panel_linear",
    "milestones.kernels.quant_linear": "load_quant_linear",
    "milestones.kernels.rms_norm": "load_rms_norm",
    "milestones.kernels.fused_layers": "load_rope",
}


def build(module: str) -> tuple[str, float, str | None]:
    """Build one kernel in this process: its module, the seconds it took, and why it failed (None: it did not)."""
    start = time.perf_counter()
    try:
        getattr(importlib.import_module(module), LOADERS[module])()
    except Exception as error:  # no compiler, a failing build: the engines warn and fall back, so do we
        return module, time.perf_counter() - start, f"{type(error).__name__}: {error}"
    return module, time.perf_counter() - start, None


def main() -> int:
    from .cpu_graphs import cpp_compiler_available

    if not cpp_compiler_available():
        print("no C++ compiler: the kernels are not built (the engines fall back to plain torch)", file=sys.stderr)
        return 0
    start, workers = time.perf_counter(), min(len(LOADERS), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:  # spawn: no torch state forked
        for module, seconds, error in pool.map(build, LOADERS):
            name = module.rsplit(".", 1)[-1]
            print(f"  {name}: {'failed: ' + error if error else 'ready'} ({seconds:.0f} s)", file=sys.stderr)
    print(f"C++ kernels built side by side in {time.perf_counter() - start:.0f} s ({workers} at a time)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
