"""The runbook's profile step: where a step of m5 and m6 spends its time, on the host and on the device.

On a GPU a replayed decode step of the 135M shape takes 4-5 ms while its weights stream in 0.07 ms (issue 55): the
time is the host's, and this says where, so that the work on it can be done on a CPU. For each row (m5; m6,
overlapped; m6@sync, m5's loop in m6; m6@fused, its layers fused; m6@no-pieces, its steps with prefill eager) and
each scenario (decode at batch 1 and 8, replayed whole; mixed steps, each with a new request's prefill beside the
other requests' decodes, replayed in pieces on CUDA, eager on a CPU and in m6@no-pieces), N steps run
three times on one engine, each time on fresh requests past a warm-up:

1. timed alone: the wall time per step, and the CPU time of the calling thread, of m6's forward worker and of
   the whole process;
2. under cProfile: the host's time per function (the calling thread's up to Python 3.11; from 3.12 cProfile
   sees every thread, so the overlapped m6 row mixes in the worker's calls and its cumulative times blur);
3. on CUDA, under torch.profiler with CUDA activity only: the device's busy time per step, the union of the
   intervals of its kernels, copies and fills (overlaps count once), set against the mean wall time of 1.

Each scenario's files are written under OUT/profile/ as it ends (a stopped step keeps those before it):
ROW-SCENARIO.txt and .json, and summary.txt and summary.json, a line per scenario so far.
``--device cpu`` rehearses it on a tiny model, without the device pass.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TOP = 40  # functions listed, by cumulative and by own time
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}  # what the device does, in torch.profiler's trace


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    milestone: str
    options: dict  # EngineConfig fields, explicit on both devices (m6 overlaps by default on CUDA only)
    cuda_options: dict | None = None  # on CUDA, in their place

    def options_for(self, device: str) -> dict:
        return self.cuda_options if self.cuda_options is not None and device == "cuda" else self.options


# m6@fused: each decode step's layers in about ten calls (kernels/fused_layers.py), on CUDA with the Triton kernels
# (attention_backend="triton"): its kernels-per-layer census is the decode scenarios' -kernels.txt (issue 70).
# m6@no-pieces: steps with prefill eager, as before m5 captured them in pieces: the mixed scenario's other side.
ROWS = {row.name: row for row in (Row("m5", "m5", {}), Row("m6", "m6", {"async_scheduling": True}),
                                  Row("m6@sync", "m6", {"async_scheduling": False}),
                                  Row("m6@fused", "m6", {"async_scheduling": True, "fuse_layers": True},
                                      {"async_scheduling": True, "attention_backend": "triton", "fuse_layers": True}),
                                  Row("m6@no-pieces", "m6", {"async_scheduling": True, "piecewise_capture_sizes": []}))}


@dataclass(frozen=True, slots=True)
class Sizes:
    steps: int  # decode steps per pass
    mixed_steps: int  # mixed steps per pass
    warmup: int  # decode steps before a pass (the prompts' prefill, and the first decodes)
    batch_sizes: tuple[int, ...]  # the decode scenarios
    prompt_len: int  # of the decoding requests
    mixed_prompt_len: int  # of the request prefilled in each mixed step
    mixed_output_len: int  # tokens each of those asks: that many rows share a mixed step (one in prefill)
    enforce_eager: bool  # no captured decode step


# On the GPU about 0.25 s a pass at 5 ms a step. The CPU's tiny sizes only check the plumbing, eagerly: there each
# captured batch size is a torch.compile, 20 s cold on two cores (the graphs bench group rehearses the capture).
GPU_SIZES = Sizes(steps=50, mixed_steps=25, warmup=8, batch_sizes=(1, 8), prompt_len=32, mixed_prompt_len=64,
                  mixed_output_len=7, enforce_eager=False)
CPU_SIZES = Sizes(steps=4, mixed_steps=3, warmup=2, batch_sizes=(1, 2), prompt_len=8, mixed_prompt_len=8,
                  mixed_output_len=2, enforce_eager=True)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    batch: int  # requests decoding at once (mixed: the rows of a step, one of them a prefill)
    mixed: bool


@dataclass(frozen=True, slots=True)
class Timing:
    """Milliseconds per step of the unprofiled pass."""

    wall_mean: float
    wall_median: float
    wall_p90: float
    host_thread_cpu: float  # the thread that calls engine.step()
    worker_thread_cpu: float | None  # m6's forward worker, where it has a thread of its own
    process_cpu: float


@dataclass(frozen=True, slots=True)
class FunctionTime:
    function: str  # path:line(name), the path from the repository or site-packages
    calls_per_step: float
    own_ms: float  # per step
    cumulative_ms: float  # per step


@dataclass(frozen=True, slots=True)
class DeviceTime:
    """From torch.profiler's trace of a pass (CUPTI): what the device did, per step."""

    busy_ms: float  # the union of the kernels', copies' and fills' intervals
    kernel_sum_ms: float  # their durations summed (above busy_ms where streams overlap)
    events_per_step: float
    share_of_wall: float  # busy_ms over the unprofiled pass's mean wall time
    profiled_wall_ms: float  # the profiled pass's own wall time per step
    top_kernels: dict[str, tuple[float, float]]  # name (cut to 100 characters) -> (launches, ms) per step, the 40
    # longest: the third run's step was 1,764 kernels of 1-5 us, so how many of each matters as much as how long
    last_step: list[str]  # the last step's kernels in launch order, "us name": a layer's sequence, to fuse from


@dataclass(slots=True)
class ScenarioProfile:
    row: str
    scenario: str
    steps: int
    timing: Timing
    graphs: dict[str, int]  # over the timed pass: steps replayed whole, in pieces, run eagerly; padding rows
    device: DeviceTime | None
    functions: dict[str, list[FunctionTime]]  # "cumulative" and "own": the top TOP by each

    def summary_line(self) -> str:
        t, d = self.timing, self.device
        worker = "-" if t.worker_thread_cpu is None else f"{t.worker_thread_cpu:.2f}"
        device = "-" if d is None else f"{d.busy_ms:.3f}"
        share = "-" if d is None else f"{d.share_of_wall:.0%}"
        return (f"{self.row:<9}{self.scenario:<10}{t.wall_mean:>9.2f}{t.wall_median:>9.2f}{t.host_thread_cpu:>9.2f}"
                f"{worker:>9}{t.process_cpu:>9.2f}{device:>10}{share:>7}{self.graphs['replays']:>8}"
                f"{self.graphs['piecewise_replays']:>7}{self.graphs['eager_steps']:>7}")


SUMMARY_HEADER = (f"{'row':<9}{'scenario':<10}{'wall ms':>9}{'median':>9}{'host cpu':>9}{'worker':>9}{'process':>9}"
                  f"{'device ms':>10}{'busy':>7}{'replays':>8}{'pieces':>7}{'eager':>7}")


def scenarios(sizes: Sizes) -> list[Scenario]:
    return [*(Scenario(f"decode-{b}", b, False) for b in sizes.batch_sizes),
            Scenario("mixed", sizes.mixed_output_len, True)]


@dataclass(slots=True)
class Driver:
    """One engine, given fresh requests for each pass of a scenario (random prompts: no prefix-cache hits)."""

    mod: object  # the milestone's package
    engine: object
    sizes: Sizes
    rng: random.Random
    request_ids: list[str]

    def add(self, prompt_len: int, max_tokens: int) -> None:
        prompt = [self.rng.randrange(3, self.engine.model_config.vocab_size) for _ in range(prompt_len)]
        params = self.mod.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.request_ids.append(self.engine.add_request(prompt, params))

    def run(self, scenario: Scenario, measure: Callable[[Callable[[], object], int], object]) -> object:
        """Warm up, then ``measure(step, number_of_steps)``; every request is gone afterwards."""
        sizes, engine = self.sizes, self.engine
        if scenario.mixed:
            steps = sizes.mixed_steps

            def step() -> object:  # a new request each step: its prefill beside the decodes of those before it
                self.add(sizes.mixed_prompt_len, scenario.batch)
                return engine.step()

            warmup = scenario.batch + 2
        else:
            steps, step, warmup = sizes.steps, engine.step, sizes.warmup
            for _ in range(scenario.batch):
                self.add(sizes.prompt_len, sizes.warmup + sizes.steps + 4)
        for _ in range(warmup):
            step()
        try:
            return measure(step, steps)
        finally:
            for request_id in self.request_ids:
                engine.abort_request(request_id)
            self.request_ids.clear()
            engine.step()  # m6 overlapped: the step still in flight


def worker_clock(engine: object) -> Callable[[], float] | None:
    """CPU seconds of m6's forward worker thread so far (None: no thread of its own, or no per-thread clock here)."""
    thread = getattr(getattr(getattr(engine, "worker", None), "steps", None), "thread", None)
    if thread is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    clock = time.pthread_getcpuclockid(thread.ident)
    return lambda: time.clock_gettime(clock)


COUNTERS = ("replays", "piecewise_replays", "eager_steps", "padded_rows", "padded_tokens")  # graph_stats' counts


def timed(engine: object, step: Callable[[], object], steps: int) -> tuple[Timing, dict[str, int]]:
    before = engine.graph_stats()
    worker = worker_clock(engine)
    walls = []
    host, process, worker_start = time.thread_time(), time.process_time(), worker() if worker else 0.0
    for _ in range(steps):
        start = time.perf_counter()
        step()
        walls.append(1e3 * (time.perf_counter() - start))
    per_step = 1e3 / steps
    timing = Timing(statistics.fmean(walls), statistics.median(walls), sorted(walls)[int(0.9 * (steps - 1))],
                    (time.thread_time() - host) * per_step, (worker() - worker_start) * per_step if worker else None,
                    (time.process_time() - process) * per_step)
    after = engine.graph_stats()
    return timing, {key: after[key] - before[key] for key in COUNTERS}


def short_path(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/", f"{REPO_ROOT}/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def profiled(step: Callable[[], object], steps: int) -> dict[str, list[FunctionTime]]:
    """The host's functions over ``steps`` steps under cProfile, in milliseconds per step: the top TOP by each time."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(steps):
            step()
    finally:
        profiler.disable()
    rows = [FunctionTime(name if path == "~" else f"{short_path(path)}:{line}({name})", calls / steps,
                         1e3 * own / steps, 1e3 * cumulative / steps)
            for (path, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items()]
    return {"cumulative": sorted(rows, key=lambda r: -r.cumulative_ms)[:TOP],
            "own": sorted(rows, key=lambda r: -r.own_ms)[:TOP]}


def busy_time(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def device_time(step: Callable[[], object], steps: int, wall_mean_ms: float) -> DeviceTime:
    """The device's work over ``steps`` steps, from a torch.profiler trace with CUDA activity only."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        trace.export_chrome_trace(f"{folder}/trace.json")
        events = json.loads(Path(f"{folder}/trace.json").read_text())["traceEvents"]
    work = [e for e in events if str(e.get("cat", "")).lower() in DEVICE_CATEGORIES and "dur" in e]
    by_name: dict[str, tuple[float, float]] = {}
    for event in work:
        launches, ms = by_name.get(event["name"][:100], (0.0, 0.0))
        by_name[event["name"][:100]] = (launches + 1 / steps, ms + event["dur"] / 1e3 / steps)
    busy = busy_time([(e["ts"], e["ts"] + e["dur"]) for e in work]) / 1e3 / steps
    return DeviceTime(busy, sum(ms for _, ms in by_name.values()), len(work) / steps, busy / wall_mean_ms,
                      1e3 * wall / steps, dict(sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]),
                      last_step(work, steps))


def last_step(work: list[dict], steps: int) -> list[str]:
    """The last of ``steps`` steps' device events in the order they started, each "duration us  name" (the name cut
    to 100 characters); the steps are taken to be of equal length, as replayed ones are."""
    events = sorted(work, key=lambda e: e["ts"])[-round(len(work) / steps):] if work and steps else []
    return [f"{e['dur']:7.1f} us  {e['name'][:100]}" for e in events]


def report(profile: ScenarioProfile, notes: list[str]) -> str:
    """The scenario's text file: the figures first, then the two tables."""
    lines = [SUMMARY_HEADER, profile.summary_line(), *notes]
    if profile.device is not None:
        lines += ["", f"device: {profile.device.events_per_step:.0f} kernels/copies per step, summed "
                      f"{profile.device.kernel_sum_ms:.3f} ms, profiled wall {profile.device.profiled_wall_ms:.2f} ms",
                  *(f"{ms:>10.3f} ms {launches:>6.1f}x  {name}"
                    for name, (launches, ms) in profile.device.top_kernels.items())]
    for order, rows in profile.functions.items():
        lines += ["", f"top {TOP} by {order} time, ms per step (calls per step):",
                  *(f"{r.cumulative_ms:>9.3f} cum {r.own_ms:>9.3f} own {r.calls_per_step:>8.1f}x  {r.function}"
                    for r in rows)]
    return "\n".join(lines) + "\n"


def profile_row(row: Row, args: argparse.Namespace, sizes: Sizes, out: Path, done: list[ScenarioProfile],
                notes: list[str]) -> None:
    mod = importlib.import_module(f"milestones.{row.milestone}")
    longest = max(sizes.prompt_len + sizes.warmup + sizes.steps + 4, sizes.mixed_prompt_len + sizes.mixed_output_len)
    llm = mod.LLM(model=str(args.model), device=args.device, seed=0, max_model_len=-(-longest // 16) * 16,
                  max_num_seqs=max(*sizes.batch_sizes, sizes.mixed_output_len + 1),
                  enforce_eager=sizes.enforce_eager, **row.options_for(args.device))
    driver = Driver(mod, llm.engine, sizes, random.Random(0), [])
    try:
        for scenario in scenarios(sizes):
            timing, graphs = driver.run(scenario, partial(timed, llm.engine))
            functions = driver.run(scenario, profiled)
            device = driver.run(scenario, partial(device_time, wall_mean_ms=timing.wall_mean)) \
                if args.device == "cuda" else None
            result = ScenarioProfile(row.name, scenario.name, sizes.mixed_steps if scenario.mixed else sizes.steps,
                                     timing, graphs, device, functions)
            done.append(result)
            stem = f"{row.name.replace('@', '-')}-{scenario.name}"
            (out / f"{stem}.txt").write_text(report(result, notes))
            (out / f"{stem}.json").write_text(json.dumps(asdict(result), indent=1) + "\n")
            if device is not None:  # a layer's kernels in order, read without the JSON's bulk
                (out / f"{stem}-kernels.txt").write_text("\n".join(device.last_step) + "\n")
            (out / "summary.txt").write_text("\n".join([SUMMARY_HEADER, *(p.summary_line() for p in done),
                                                        *notes]) + "\n")
            (out / "summary.json").write_text(json.dumps({"notes": notes, "sizes": asdict(sizes), "scenarios": [
                {k: v for k, v in asdict(p).items() if k != "functions"} for p in done]}, indent=1) + "\n")
            print(result.summary_line(), flush=True)
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="writes into OUT/profile/")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (the CPU rehearsal: 1)")
    args = parser.parse_args(argv)
    if unknown := set(args.rows.split(",")) - set(ROWS):
        parser.error(f"unknown row(s) {', '.join(sorted(unknown))}; choose from {', '.join(ROWS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = GPU_SIZES if args.device == "cuda" else CPU_SIZES
    out = args.out / "profile"
    out.mkdir(parents=True, exist_ok=True)
    threads = "every thread (sys.monitoring)" if sys.version_info >= (3, 12) else "the calling thread only"
    notes = [f"python {platform.python_version()}, torch {torch.__version__}, device {args.device}"
             + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""),
             f"cProfile saw {threads}; the times above are of the unprofiled pass",
             "device: torch.profiler (CUDA activity), the union of kernel, copy and fill intervals per step"
             if args.device == "cuda" else "device: not measured (no CUDA device; the device pass is CUDA only)"]
    print(SUMMARY_HEADER, *notes, sep="\n", flush=True)
    done: list[ScenarioProfile] = []
    failed = []
    for name in args.rows.split(","):
        try:
            profile_row(ROWS[name], args, sizes, out, done, notes)
        except Exception as error:  # the next row still runs; the step fails at the end
            failed.append(name)
            traceback.print_exc()
            print(f"{name}: failed: {type(error).__name__}: {error}", flush=True)
    if failed:
        print(f"row(s) failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
