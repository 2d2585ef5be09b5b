"""Print what a CI run meets: the versions and CPU features that decide which code paths the tests take.

A red run on a new machine then says which machine it met: the compiler that builds the kernels,
the Chromium that renders the site, and the CPU flags behind the kernels' and oneDNN's choices.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

# CPU flags that change a path: the compiled kernels (-march=native), oneDNN's bfloat16 packing, torch's kernels.
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx_ne_convert",
         "neon", "asimd")


def first_line(command: list[str]) -> str:
    """The first line a program prints about itself, or why there is none."""
    if shutil.which(command[0]) is None:
        return "not found"
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"did not answer: {error}"
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[0] if lines else f"printed nothing (exit {result.returncode})"


def cpu() -> tuple[str, list[str]]:
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine(), []
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith(("flags", "Features"))), [])
    return model, [flag for flag in FLAGS if flag in flags]


def main() -> None:
    import torch
    import transformers

    model, flags = cpu()
    venv_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # pip's ninja sits in the venv
    rows = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "system": f"{platform.platform()}, {os.cpu_count()} cores",
        "cpu": f"{model}; flags: {' '.join(flags) or 'none of ' + ', '.join(FLAGS)}",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads, oneDNN bf16: "
                 f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, CUDA: {torch.cuda.is_available()}",
        "transformers": transformers.__version__,
        "c++ compiler": first_line([os.environ.get("CXX", "c++"), "--version"]),
        "ninja": first_line([shutil.which("ninja", path=venv_path) or "ninja", "--version"]),
        "chromium": first_line([shutil.which("chromium") or "chromium-browser", "--version"]),
        "CI": os.environ.get("CI", "(unset)"),
    }
    for name, value in rows.items():
        print(f"{name:>13}: {value}")


if __name__ == "__main__":
    main()
