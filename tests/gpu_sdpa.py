"""The runbook's sdpa step: does a new thread pay again for the prefill attention's first call? (issue 55, item 5)

In the H200 run the small workload's one pass took 1.7 s in m5 and 2.2 s in m6 but 0.44 s in m6@sync, the row
after them. One hypothesis to settle before anything else: cuDNN's attention plans are cached per thread, and m6
makes a forward worker thread per engine, so it builds again every prefill shape that the main thread built.
This times the small workload's prefill shapes (bfloat16, 9 query heads over 3 KV heads, head_dim 64,
``enable_gqa=True``; whole prompts of 4-32 tokens with ``is_causal``, and chunks under a mask as after a prefix-cache
hit): the first call of each shape on the main thread (cold), its median of 5 calls (warm), the first calls in a
new thread (and its warm ones), in a second one on a CUDA stream of its own (as m6's forward worker runs), and
again on the main thread. Each mode runs in a process of its own, so that every cold call is cold: torch's own
choice (cuDNN allowed), cuDNN attention disabled (``torch.backends.cuda.enable_cudnn_sdp(False)``), and cuDNN
attention only (``torch.nn.attention.sdpa_kernel``). The backend torch picks is printed per shape
(``torch._fused_sdp_choice``), and on CUDA the kernels a warm call launched (torch.profiler).

Written into OUT/sdpa.txt and OUT/sdpa.json. On a CPU (the rehearsal) the cuDNN-only mode is skipped, with a line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

MODES = {"default": "torch's choice, cuDNN allowed", "no-cudnn": "cuDNN attention disabled",
         "cudnn": "cuDNN attention only"}
PHASES = ("main cold", "main warm", "thread cold", "thread warm", "thread2 cold", "main again")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention


@dataclass(frozen=True, slots=True)
class Shape:
    queries: int
    keys: int  # queries == keys: a whole prompt (is_causal); fewer queries: a chunk at the end, under a mask

    @property
    def name(self) -> str:
        return f"causal {self.keys}" if self.queries == self.keys else f"mask {self.queries}/{self.keys}"


SHAPES = [*(Shape(n, n) for n in (4, 8, 12, 16, 24, 32)), Shape(8, 16), Shape(16, 32)]


@dataclass(slots=True)
class ModeResult:
    mode: str
    first_call_ms: float  # the process's first attention call, on a shape of its own: libraries, context
    backend: dict[str, str]  # shape -> the backend torch picks for it
    kernels: list[str]  # launched by one warm call of the first shape (CUDA only)
    ms: dict[str, dict[str, float]]  # phase -> shape -> milliseconds (NaN: it raised)
    error: str | None = None  # what raised, by shape


def mode_context(mode: str) -> AbstractContextManager:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if mode == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if mode == "cudnn" else nullcontext()


def run_mode(mode: str, device: str) -> ModeResult:
    """Every phase of one mode in this process (a fresh one: the runbook starts a process per mode)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    names = {member.value: name for name, member in SDPBackend.__members__.items()}
    generator = torch.Generator(device).manual_seed(0)

    def tensors(shape: Shape) -> tuple[torch.Tensor, ...]:
        q = torch.randn(1, HEADS, shape.queries, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=generator)
        k, v = (torch.randn(1, KV_HEADS, shape.keys, HEAD_DIM, device=device, dtype=torch.bfloat16,
                            generator=generator) for _ in range(2))
        positions = torch.arange(shape.keys - shape.queries, shape.keys, device=device)
        mask = None if shape.queries == shape.keys else torch.arange(shape.keys, device=device) <= positions[:, None]
        return q, k, v, mask

    inputs = {shape.name: tensors(shape) for shape in SHAPES}

    errors: dict[str, str] = {}  # shape -> why no backend ran it (cuDNN alone may refuse some)

    def call(name: str) -> float:
        q, k, v, mask = inputs[name]
        start = time.perf_counter()
        try:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        except RuntimeError as error:
            errors[name] = str(error).strip().splitlines()[0][:200]
            return float("nan")
        if device == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start)

    def phase(warm: bool) -> dict[str, float]:
        with mode_context(mode):
            return {name: statistics.median(call(name) for _ in range(5)) if warm else call(name) for name in inputs}

    def in_new_thread(phases: list[bool], own_stream: bool = False) -> list[dict[str, float]]:
        """The phases (warm or cold) in a new thread; on CUDA with ``own_stream`` on a stream of its own, as m6's
        forward worker runs."""
        found: list = []

        def work() -> None:
            with torch.cuda.stream(torch.cuda.Stream()) if own_stream and device == "cuda" else nullcontext():
                found.extend(phase(warm) for warm in phases)

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return found

    def chosen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str:
        """The backend torch picks for these inputs under this mode's switches."""
        try:
            return names.get(torch._fused_sdp_choice(q, k, v, mask, 0.0, mask is None, enable_gqa=True), "?")
        except RuntimeError:  # no backend allowed can run it
            return "none"

    inputs["first"] = tensors(Shape(40, 40))  # a shape of its own: what the process's first call costs
    with mode_context(mode):
        first = call("first")
        backend = {name: chosen(*given) for name, given in inputs.items()}
    del inputs["first"], backend["first"]
    ms = dict(zip(PHASES[:2], [phase(False), phase(True)]))
    ms.update(zip(PHASES[2:4], in_new_thread([False, True])))
    ms[PHASES[4]] = in_new_thread([False], own_stream=True)[0]
    ms[PHASES[5]] = phase(False)
    kernels = warm_kernels(call, SHAPES[0].name) if device == "cuda" else []
    return ModeResult(mode, first, backend, kernels, ms, "; ".join(f"{k}: {e}" for k, e in errors.items()) or None)


def warm_kernels(call, name: str) -> list[str]:
    """The names of the kernels one call launches, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        call(name)
    return sorted({event.name[:120] for event in trace.events() if event.device_type.name == "CUDA"})


def table(result: ModeResult) -> list[str]:
    lines = [f"{result.mode}: {MODES[result.mode]}; the process's first call {result.first_call_ms:.1f} ms",
             f"{'ms':<14}" + "".join(f"{name:>14}" for name in PHASES)]
    for shape in SHAPES:
        lines.append(f"{shape.name:<14}" + "".join(f"{result.ms[p][shape.name]:>14.3f}" for p in PHASES)
                     + f"  {result.backend[shape.name]}")
    lines.append(f"{'all shapes':<14}" + "".join(f"{sum(result.ms[p].values()):>14.3f}" for p in PHASES))
    return lines + [f"kernels of a warm call: {', '.join(result.kernels) or '-'}",
                    *([f"raised: {result.error}"] if result.error else []), ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="writes OUT/sdpa.txt and OUT/sdpa.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process, print its JSON (the runbook's)")
    args = parser.parse_args(argv)
    if args.mode is not None:
        print(json.dumps(asdict(run_mode(args.mode, args.device))))
        return 0
    if args.out is None:
        parser.error("OUT is needed, unless --mode is given")
    args.out.mkdir(parents=True, exist_ok=True)
    lines, results = [], []
    for mode in MODES:
        if mode == "cudnn" and args.device != "cuda":
            found = [f"{mode}: {MODES[mode]}: skipped, CUDA only", ""]
        else:
            proc = subprocess.run([sys.executable, "-m", "tests.gpu_sdpa", "--device", args.device, "--mode", mode],
                                  capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
            if proc.returncode == 0:
                results.append(ModeResult(**json.loads(proc.stdout.strip().splitlines()[-1])))
                found = table(results[-1])
            else:  # cuDNN alone may refuse these shapes: that is an answer too
                error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                results.append(ModeResult(mode, 0.0, {}, [], {}, error=f"exit status {proc.returncode}: {error}"))
                found = [f"{mode}: {MODES[mode]}: failed: {results[-1].error}", ""]
        print("\n".join(found), flush=True)
        lines += found
        (args.out / "sdpa.txt").write_text("\n".join(lines) + "\n")
        (args.out / "sdpa.json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
