"""The GPU runbook: the CUDA checks and the GPU benchmark as separate steps, each writing only under OUT.

A GPU machine comes rarely and briefly here (minutes per command, a handful of commands, results
back only from one output folder, no package registry), so every step is its own command that
finishes in a few minutes, writes its files as it goes, and fails on its own without losing the
others' results. Run from the repository root with the machine's own python3; nothing is installed
(the repository root is on the path, as ``python3 -m`` puts it there):

# --8<-- [start:all]
python3 -m tests.gpu_runbook all OUT --budget 560 --pack PACKED.tar.gz  # every step below, in one command
# --8<-- [end:all]
# --8<-- [start:steps]
python3 -m tests.gpu_runbook preflight OUT             # GPU, versions, the model: refuses early, says why
python3 -m tests.gpu_runbook tests OUT --group reference  # m1 against transformers, defaults
python3 -m tests.gpu_runbook tests OUT --group chain   # m2-m4 against the milestone before, float32
python3 -m tests.gpu_runbook tests OUT --group graphs  # m5 against m4, m6 against m5
python3 -m tests.gpu_runbook tests OUT --group speculative  # m7 against m6, the model as its own draft
python3 -m tests.gpu_runbook bench OUT --group graphs  # m5, m6 against their switches turned off
python3 -m tests.gpu_runbook bench OUT --group hf      # m6 against transformers, in one run
python3 -m tests.gpu_runbook bench OUT --group speculative  # m7's guesses (ngram, a draft) against m6, batch 1
python3 -m tests.gpu_runbook bench OUT --group eager   # m1-m4
# --8<-- [end:steps]

``all`` is the form for a loan of minutes: the test groups run side by side, then the bench groups one at a
time, each phase stopped at its share of what is left of ``--budget`` seconds, and ``--pack`` writes one archive
of OUT at the end (a loan may hand back only a few files). Then ``python examples/gpu_figures.py DIR...``
(here, on the returned folders) puts the figures in the docs. ``--device cpu`` rehearses every step on a tiny
model and tiny workloads (CI runs it: tests/test_gpu_runbook.py), which checks the plumbing, not the speed.
Every step sets HF_HUB_OFFLINE=1: the model is a seeded random checkpoint of SmolLM2-135M's exact shape, made
on the machine by tests/checkpoints.py (the bundled model's package is not there), which runs at the same speed
as the real weights.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_MODEL = Path("/tmp/milestones-smollm2-135m-random")
CPU_MODEL = Path("/tmp/milestones-runbook-tiny-llama")  # the rehearsal's: a tiny checkpoint, made in a second
MIN_VERSIONS = {  # what the code and the tests need, and why
    "torch": ("2.5", "scaled_dot_product_attention(enable_gqa=...)"),
    "transformers": ("5.0", "the test checkpoints set only rope_parameters, which 4.x does not read"),
    "pytest": ("7.0", "the CUDA tests"),
    "safetensors": ("0.4", "loading checkpoints"),
}
# Used where present: without it the CUDA tests run the workload's structured-output requests as plain ones.
OPTIONAL = {"llguidance": "structured output (milestones/*/structured_output.py)"}

# The CUDA tests in groups of a few minutes each (pytest -k expressions over tests/cuda/test_cuda.py).
TEST_GROUPS = {
    "reference": "m1_matches_transformers or m1_in_bfloat16 or cuda_and_cpu_agree or defaults_on_a_gpu",
    "chain": "the_chain_holds",
    "graphs": "m5_ or m6_",
    "speculative": "m7_",
}


@dataclass(frozen=True, slots=True)
class BenchGroup:
    engines: str
    workloads: str
    flags: tuple[str, ...]  # on the GPU: sized to finish in a minute or two on an H100
    seconds: int  # its weight in ``all``'s budget: about what it should take on an H100, with room


# Sized from the first H100 run (2026-11-27, whose graphs, hf and eager groups were stopped unfinished) and the first
# H200 run (2026-11-27: graphs, hf and speculative about a minute each; eager stopped in m3 after four minutes, and
# m4 alone took 105 s, half of it batch 64, where an eager step took 300 ms). 64 forced tokens, two timed runs and 32
# requests of at most 128 tokens keep most groups near a minute.
SHORTER = ("--decode-tokens", "64", "--runs", "2", "--num-requests", "32", "--output-len-range", "32,128")
TESTS_SECONDS = 120  # the four test groups side by side took 95 s on the H100: their share of ``all``'s budget
MIN_STEP_SECONDS = 5  # a phase left less than this is not started
BENCH_GROUPS = {  # in ``all``'s order: the groups with the issue's targets first
    # The graphs and overlap lessons, each against its own switch turned off (decode is batch 1). Three passes of the
    # small workload (the first on the row's loaded engine, the others each on a new one): in the H200 run its one
    # pass ran 4-5x faster in the last row than in the first three, and three say whether a first pass pays once.
    "graphs": BenchGroup("m5,m5@eager,m6,m6@sync", "decode,batch,small",
                         ("--batch-sizes", "4,8", "--max-num-seqs", "64", "--mixed-runs", "3", *SHORTER), 120),
    # m6 and transformers in one run: the ratio is taken inside it.
    "hf": BenchGroup("m6,hf-generate,hf-static", "decode,mixed", ("--mixed-runs", "1", *SHORTER), 80),
    # m7 against m6 at batch 1 (in the H200 run the random model repeated itself: most n-gram guesses were kept).
    "speculative": BenchGroup("m6,m7@ngram,m7@draft", "grounded,open",
                              ("--max-num-seqs", "1", "--chat-requests", "8", "--draft-layers", "8"), 70),
    "eager": BenchGroup("m1,m2,m3,m4", "decode,batch,mixed",
                        ("--batch-sizes", "8,32", "--max-num-seqs", "64", "--m1-requests", "8", *SHORTER), 240),
}
CPU_REHEARSAL_FLAGS = ("--runs", "1", "--threads", "1", "--decode-tokens", "4", "--decode-prompt-len", "8",
                       "--batch-sizes", "2", "--num-requests", "3", "--prompt-len-range", "4,12",
                       "--output-len-range", "2,6", "--hf-batch-size", "2", "--m1-requests", "3",
                       "--chat-requests", "2", "--draft-layers", "1")


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def preflight(out: Path, device: str, model: Path) -> int:
    """Check the machine before spending its minutes: a clear list of what is missing, or the model made ready."""
    problems, facts = [], {"python": platform.python_version(), "device": device}
    for package, (least, why) in MIN_VERSIONS.items():
        try:
            found = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{package} is not installed (needed for {why})")
            continue
        facts[package] = found
        if version_tuple(found) < version_tuple(least):
            problems.append(f"{package} {found} is older than {least} (needed for {why})")
    for package, why in OPTIONAL.items():
        try:
            facts[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            facts[package] = f"missing: {why} left out of the CUDA tests' workloads"
    if not problems:
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda={torch.version.cuda})")
        elif device == "cuda":
            props = torch.cuda.get_device_properties(0)
            facts["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
            facts["cuda"] = torch.version.cuda
    if not problems:
        facts["model"] = str(ensure_model(model, device))
    report = {"ok": not problems, "problems": problems, "facts": facts}
    (out / "preflight.json").write_text(json.dumps(report, indent=2) + "\n")
    for name, value in facts.items():
        print(f"{name:>13}: {value}")
    for problem in problems:
        print(f"missing: {problem}", file=sys.stderr)
    return 1 if problems else 0


def ensure_model(model: Path, device: str) -> Path:
    """The random checkpoint the GPU steps use (SmolLM2-135M's shape; a tiny llama for the CPU rehearsal)."""
    if not (model / "model.safetensors").is_file():
        from tests.checkpoints import make_checkpoint

        make_checkpoint("smollm2-135m" if device == "cuda" else "llama", model)
    return model


def tests_command(out: Path, group: str) -> list[str]:
    """One group of the CUDA tests, with a JUnit XML and the whole log under OUT (on a CPU they skip)."""
    return [sys.executable, "-m", "pytest", "tests/cuda", "-m", "cuda", "-k", TEST_GROUPS[group], "-v", "-rA",
            "-s", "-p", "no:cacheprovider", f"--junitxml={out / f'tests-{group}.xml'}"]


def bench_command(out: Path, group: str, device: str, model: Path, engines: str | None = None) -> list[str]:
    """One group of benchmark rows; the JSON is rewritten after every row, and a failed row fails the step."""
    spec = BENCH_GROUPS[group]
    return [sys.executable, "examples/benchmark.py", "--model", str(ensure_model(model, device)),
            "--device", device, "--engines", engines or spec.engines, "--workloads", spec.workloads,
            *(spec.flags if device == "cuda" else CPU_REHEARSAL_FLAGS), "--out", str(out / f"bench-{group}.json")]


@dataclass(slots=True)
class Step:
    """A command running from the repository root, its output copied into its log as it comes (a step stopped at
    its time limit keeps what it printed), and to the terminal if ``echo``."""

    process: subprocess.Popen
    copier: threading.Thread
    log: Path

    @classmethod
    def start(cls, command: list[str], log: Path, echo: bool = True) -> Step:
        print("$", " ".join(command), flush=True)
        sink = log.open("w")
        sink.write("$ " + " ".join(command) + "\n")
        sink.flush()
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)  # its own group: stopped with its children

        def copy() -> None:
            with sink:
                for line in process.stdout:
                    if echo:
                        sys.stdout.write(line)
                    sink.write(line)
                    sink.flush()

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()
        return cls(process, copier, log)

    def stop(self) -> None:
        """Kill it and its children if it is still running."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def finish(self, deadline: float | None = None) -> int:
        """Its exit status; at ``deadline`` (time.monotonic()) it is stopped, says so in its log, and gives 124."""
        try:
            status = self.process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            status = 124
        self.copier.join()
        if status == 124:
            with self.log.open("a") as sink:
                sink.write("runbook: stopped at its time limit (what it wrote so far is kept)\n")
        return status


def run_all(out: Path, device: str, model: Path, budget: float | None, pack: Path | None) -> int:
    """Every step in one command, for a loan of minutes: the preflight; the test groups side by side (they check
    correctness, and one GPU has room for four small processes); the bench groups one at a time (timings want the
    GPU alone). With ``budget``, each phase gets a share of the seconds left, in proportion to what it should take on
    an H100 (TESTS_SECONDS, BenchGroup.seconds), so time a phase leaves goes to the next; a phase with nothing left is
    not started. With ``pack``, one archive of OUT at the end, whatever happened (SIGTERM included). Exits non-zero
    if any step failed, was stopped or did not run; ``summary.txt`` says which."""
    end = None if budget is None else time.monotonic() + budget
    phases = {"tests": TESTS_SECONDS, **{group: spec.seconds for group, spec in BENCH_GROUPS.items()}}

    def deadline(phase: str) -> float | None:
        """Now plus this phase's share of the time left (None: no budget)."""
        if end is None:
            return None
        later = list(phases)[list(phases).index(phase):]
        return time.monotonic() + (end - time.monotonic()) * phases[phase] / sum(phases[p] for p in later)

    results: dict[str, int | str] = {}
    live: list[Step] = []
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        results["preflight"] = preflight(out, device, model)
        if results["preflight"] == 0:
            until = deadline("tests")
            if until is not None and until - time.monotonic() < MIN_STEP_SECONDS:
                results.update({f"tests {group}": "not run (no time left)" for group in TEST_GROUPS})
            else:
                live += [Step.start(tests_command(out, group), out / f"tests-{group}.log", echo=False)
                         for group in TEST_GROUPS]
                for group, step in zip(TEST_GROUPS, live):
                    results[f"tests {group}"] = step.finish(until)
            for group in BENCH_GROUPS:
                until = deadline(group)
                if until is not None and until - time.monotonic() < MIN_STEP_SECONDS:
                    results[f"bench {group}"] = "not run (no time left)"
                    continue
                live.append(Step.start(bench_command(out, group, device, model), out / f"bench-{group}.log"))
                results[f"bench {group}"] = live[-1].finish(until)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for step in live:
            step.stop()  # a step still running when something broke: no orphan holds the GPU
        lines = [f"{name}: {describe(status)}" for name, status in results.items()]
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        if pack is not None:
            pack.parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(pack, "w:gz") as archive:
                archive.add(out, arcname=out.name)
            print(f"packed {out} into {pack}")
    return int(any(status != 0 for status in results.values()))


def describe(status: int | str) -> str:
    if isinstance(status, str):
        return status
    if status == 0:
        return "ok"
    if status == 124:
        return "stopped at its time limit"
    return f"killed by signal {-status}" if status < 0 else f"failed (exit status {status})"


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # so that ``run_all``'s cleanup, summary and archive still happen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["preflight", "tests", "bench", "all"])
    parser.add_argument("out", type=Path, help="the folder to write into (the one that comes back)")
    parser.add_argument("--group", help=f"tests: {', '.join(TEST_GROUPS)}; bench: {', '.join(BENCH_GROUPS)}")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: rehearse on a tiny model")
    parser.add_argument("--model", type=Path, default=None, help="the checkpoint (made if missing)")
    parser.add_argument("--engines", default=None, help="bench: these rows instead of the group's (re-running one)")
    parser.add_argument("--budget", type=float, default=None, help="all: stop every step by this many seconds")
    parser.add_argument("--pack", type=Path, default=None, help="all: then write OUT into this .tar.gz")
    args = parser.parse_args(argv)
    groups = {"tests": TEST_GROUPS, "bench": BENCH_GROUPS}.get(args.step, {})
    if groups and args.group not in groups:
        parser.error(f"{args.step} needs --group, one of: {', '.join(groups)}")
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from a hub, for this process and every step it starts
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or (GPU_MODEL if args.device == "cuda" else CPU_MODEL)
    if args.step == "preflight":
        return preflight(args.out, args.device, model)
    if args.step == "all":
        return run_all(args.out, args.device, model, args.budget, args.pack)
    if args.step == "tests":
        return Step.start(tests_command(args.out, args.group), args.out / f"tests-{args.group}.log").finish()
    return Step.start(bench_command(args.out, args.group, args.device, model, args.engines),
                      args.out / f"bench-{args.group}.log").finish()


if __name__ == "__main__":
    sys.exit(main())
