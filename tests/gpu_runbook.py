"""The GPU runbook: the CUDA checks and the GPU benchmark as separate steps, each writing only under OUT.

A GPU machine comes rarely and briefly here (minutes per command, a handful of commands, results
back only from one output folder, no package registry), so every step is its own command that
finishes in a few minutes, writes its files as it goes, and fails on its own without losing the
others' results. Run from the repository root with the machine's own python3; nothing is installed
(the repository root is on the path, as ``python3 -m`` puts it there):

# --8<-- [start:all]
python3 -m tests.gpu_runbook all OUT --budget 530 --pack PACKED.tar.gz  # every step below, in one command
# --8<-- [end:all]
# --8<-- [start:steps]
python3 -m tests.gpu_runbook preflight OUT             # GPU, versions, the model: refuses early, says why
python3 -m tests.gpu_runbook profile OUT               # m5, m6, m6@sync, m6@fused, m6@no-pieces: time a step
python3 -m tests.gpu_runbook sdpa OUT                  # prefill attention cold, warm, in a new thread; cuDNN on, off
python3 -m tests.gpu_runbook tests OUT --group reference  # m1 against transformers, defaults
python3 -m tests.gpu_runbook tests OUT --group chain   # m2-m4 against the milestone before, float32
python3 -m tests.gpu_runbook tests OUT --group graphs  # m5 against m4, m6 against m5
python3 -m tests.gpu_runbook tests OUT --group speculative  # m7 against m6, the model as its own draft
python3 -m tests.gpu_runbook tests OUT --group parallel  # m8 over NCCL: one rank; two on a machine with two GPUs
python3 -m tests.gpu_runbook tests OUT --group attention  # batched attention, the Triton decode and fused kernels
python3 -m tests.gpu_runbook bench OUT --group graphs  # m6@sync, m6, m6@triton (fused), m5, m5@eager; small thrice
python3 -m tests.gpu_runbook bench OUT --group host    # the engine's own work per step: a tiny model, batch 1-64
python3 -m tests.gpu_runbook bench OUT --group 8b      # m6 against m6@sync on Llama-3.1-8B's shape (--layers N)
python3 -m tests.gpu_runbook bench OUT --group hf      # m6 against transformers, in one run
python3 -m tests.gpu_runbook bench OUT --group speculative  # m7's guesses (ngram, a draft) against m6, batch 1
python3 -m tests.gpu_runbook bench OUT --group eager   # m1-m4, a short reference
# --8<-- [end:steps]

``all`` is the form for a loan of minutes: the profile and the attention diagnostic, the test groups side by side,
then the bench groups one at a time, each phase stopped at its share of what is left of ``--budget`` seconds, and
``--pack`` writes one archive of OUT at the end (a loan may hand back only a few files). Then
``python examples/gpu_figures.py DIR...`` (here, on the returned folders) puts the figures in the docs.
``--device cpu`` rehearses every step on a tiny model and tiny workloads (CI runs it: tests/test_gpu_runbook.py),
which checks the plumbing, not the speed. Every step sets HF_HUB_OFFLINE=1: the model is a seeded random
checkpoint of SmolLM2-135M's exact shape, made on the machine by tests/checkpoints.py (the bundled model's package
is not there), which runs at the same speed as the real weights; the 8b group makes its own, of Llama-3.1-8B's
shape (16 GB, timed in its log).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.gpu_steps import NOT_RUN, Outcome, Step, chained, outcome

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

# The CUDA tests in groups of a few minutes each (pytest -k expressions over tests/cuda). The attention paths' tests
# (batched attention, the Triton decode kernel, the fused Triton kernels) are a group of their own whatever else
# their names say; a group that selects none is no failure.
ATTENTION_TESTS = "batched_attention or triton_decode or triton_fused"
TEST_GROUPS = {group: f"({expression}) and not ({ATTENTION_TESTS})" for group, expression in {
    "reference": "m1_matches_transformers or m1_in_bfloat16 or cuda_and_cpu_agree or defaults_on_a_gpu",
    "chain": "the_chain_holds",
    "graphs": "m5_ or m6_",
    "speculative": "m7_",
    "parallel": "m8_",
}.items()} | {"attention": ATTENTION_TESTS}


@dataclass(frozen=True, slots=True)
class BenchGroup:
    engines: str
    workloads: str
    flags: tuple[str, ...]  # on the GPU: sized to finish in a minute or two on an H100
    seconds: int  # its weight in ``all``'s budget: about what it should take on an H100, with room
    checkpoint: str | None = None  # a checkpoint kind of its own, made by its step (the CPU rehearsal: KIND-tiny)
    cpu_engines: str | None = None  # the CPU rehearsal's rows, where the group's own would compile for a minute

    def rows(self, device: str) -> str:
        """The engines it runs on ``device``."""
        return self.cpu_engines if device == "cpu" and self.cpu_engines else self.engines


# Sized from the first H100 run (2026-11-27, whose graphs, hf and eager groups were stopped unfinished) and the first
# H200 run (2026-11-27: graphs, hf and speculative about a minute each; eager stopped in m3 after four minutes, and
# m4 alone took 105 s, half of it batch 64, where an eager step took 300 ms). 64 forced tokens, two timed runs and 32
# requests of at most 128 tokens keep most groups near a minute.
SHORTER = ("--decode-tokens", "64", "--runs", "2", "--num-requests", "32", "--output-len-range", "32,128")
# ``all``'s weights, in its order (issue 55, item 7): the questions first (where a step's time goes; whether a new
# thread pays again for attention's first calls), then the checks, the graphs and overlap lessons, the 8B shape where
# overlap can pay, the comparison with transformers, speculation, and the eager rows, which have no target, last and
# short. Set from the third run (H200, 2026-11-28, ``--budget 545``: 370 s in all): profile 58 s, the tests 62 s side
# by side, graphs 45, 8b 62, hf 35, speculative 33, eager 22; the diagnostic was stopped at its 20 s share and took
# about 35 s alone. They add up to 665 s (m6@fused, m6@triton, m6@no-pieces: +45; overlap +70), so a full run ends in
# about 500 s and leaves a 15-minute loan room to rerun.
PROFILE_SECONDS, SDPA_SECONDS, TESTS_SECONDS = 100, 45, 75  # profile: +15 s each for m6@fused, m6@no-pieces (not yet
#                                                              run on a GPU)
MIN_STEP_SECONDS = 5  # a phase left less than this is not started
EIGHT_B_LAYERS = 32  # the whole of Llama-3.1-8B: 16 GB a step, 3.3 ms on an H200 and 4.9 on an H100, like the host's
BENCH_GROUPS = {  # in ``all``'s order
    # The graphs and overlap lessons, each against its own switch turned off (decode is batch 1). m6@sync first, so
    # that whatever the first engine of a process pays falls on a baseline. Three passes of the small workload (the
    # first on the row's loaded engine, the others each on a new one): in the H200 run its one pass ran 4-5x faster
    # in the last row than in the first three, and three say whether a first pass pays once.
    # m6@triton: the Triton decode kernel, and with it each decode step's layers fused (issue 70).
    "graphs": BenchGroup("m6@sync,m6,m6@triton,m5,m5@eager", "decode,batch,small",
                         ("--batch-sizes", "4,8", "--max-num-seqs", "64", "--mixed-runs", "3", *SHORTER), 95,
                         cpu_engines="m6@sync,m6,m6@fused+eager,m5,m5@eager"),
    # The engine's own work per step (issue 55's host-time row): a tiny checkpoint, so a step is almost all host time;
    # m1 at batch 1 only. Each row loads, captures three sizes and times 64 steps each: seconds on a GPU.
    "host": BenchGroup("m1,m5,m6@sync,m6", "host", ("--host-batch-sizes", "1,8,64,256", "--host-steps", "64"), 30,
                       cpu_engines="m1,m6@sync+eager"),
    # Overlap where it can pay (issue 70, item 4): m6 against m6@sync on the 135M shape from batch 1, where a fused
    # step may be as short as the host's work, to 256, where the host's work grows with the rows; decode and mixed
    # (steps with prefill replayed in pieces). Estimated, not yet run: two loads capturing 20 batch sizes and 7 token
    # counts each, then seconds of rows.
    "overlap": BenchGroup("m6@sync,m6", "batch,mixed",
                          ("--batch-sizes", "1,16,64,256", "--max-num-seqs", "256", "--decode-tokens", "32",
                           "--runs", "2", "--num-requests", "128", "--output-len-range", "32,128"), 70,
                          cpu_engines="m6@sync+eager,m6@async+eager"),
    # Overlap where the device's time per step is like the host's (~4 ms): Llama-3.1-8B's shape, made on the GPU, and
    # loaded once per row (the milestones stage it in float32 on the device: 48 GB at peak). Estimated, not yet run:
    # 10-30 s to make it, 10-20 s a load, seconds for the rows.
    "8b": BenchGroup("m6@sync,m6", "decode,batch,mixed",
                     ("--batch-sizes", "8,32", "--max-num-seqs", "32", "--decode-tokens", "32", "--runs", "2",
                      "--num-requests", "32", "--output-len-range", "32,128"), 110, checkpoint="llama3.1-8b",
                     cpu_engines="m6@sync+eager,m6@async+eager"),  # a new shape: a CPU's torch.compile is cold
    # m6 and transformers in one run: the ratio is taken inside it.
    "hf": BenchGroup("m6,hf-generate,hf-static", "decode,mixed", ("--mixed-runs", "1", *SHORTER), 60),
    # m7 against m6 at batch 1 (in the H200 run the random model repeated itself: most n-gram guesses were kept).
    "speculative": BenchGroup("m6,m7@ngram,m7@draft", "grounded,open",
                              ("--max-num-seqs", "1", "--chat-requests", "8", "--draft-layers", "8"), 50),
    # A reference only: one small batch, 32 tokens, one timed run (an eager step takes 28-56 ms on an H200).
    "eager": BenchGroup("m1,m2,m3,m4", "decode,batch",
                        ("--batch-sizes", "8", "--max-num-seqs", "8", "--decode-tokens", "32", "--runs", "1"), 30),
}
CPU_REHEARSAL_FLAGS = ("--runs", "1", "--threads", "1", "--decode-tokens", "4", "--decode-prompt-len", "8",
                       "--batch-sizes", "2", "--num-requests", "3", "--prompt-len-range", "4,12",
                       "--output-len-range", "2,6", "--hf-batch-size", "2", "--m1-requests", "3",
                       "--chat-requests", "2", "--draft-layers", "1", "--host-batch-sizes", "1,2", "--host-steps", "4")


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
    facts["free in /tmp"] = f"{shutil.disk_usage('/tmp').free / 1e9:.0f} GB (the 8b group writes 16 GB there)"
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
    from tests.checkpoints import is_complete, make_checkpoint

    if not is_complete(model):
        make_checkpoint("smollm2-135m" if device == "cuda" else "llama", model)
    return model


def profile_command(out: Path, device: str, model: Path) -> list[str]:
    """Where m5's and m6's steps spend their time (tests/gpu_profile.py), into OUT/profile/."""
    return [sys.executable, "-m", "tests.gpu_profile", str(out), "--model", str(ensure_model(model, device)),
            "--device", device, *(["--threads", "1"] if device == "cpu" else [])]


def sdpa_command(out: Path, device: str) -> list[str]:
    """Prefill attention's first calls, per thread and with cuDNN on and off (tests/gpu_sdpa.py), into OUT/sdpa.*."""
    return [sys.executable, "-m", "tests.gpu_sdpa", str(out), "--device", device]


def tests_command(out: Path, group: str) -> list[str]:
    """One group of the CUDA tests, with a JUnit XML and the whole log under OUT (on a CPU they skip)."""
    return [sys.executable, "-m", "pytest", "tests/cuda", "-m", "cuda", "-k", TEST_GROUPS[group], "-v", "-rA",
            "-s", "-p", "no:cacheprovider", f"--junitxml={out / f'tests-{group}.xml'}"]


def bench_command(out: Path, group: str, device: str, model: Path, layers: int, engines: str | None = None
                  ) -> list[str]:
    """One group of benchmark rows; the JSON is rewritten after every row, and a failed row fails the step. A group
    with a checkpoint of its own first makes it, unless it is there (its log says how long that took)."""
    from tests.checkpoints import is_complete

    spec, make = BENCH_GROUPS[group], []
    if spec.checkpoint is None:
        model = ensure_model(model, device)
    else:
        kind = spec.checkpoint if device == "cuda" else f"{spec.checkpoint}-tiny"
        # Beside the runbook's model (in /tmp on the GPU; the rehearsal's test keeps it in its own folder).
        model = model.parent / (f"milestones-{kind}-random" + (f"-{layers}-layers" if device == "cuda" else ""))
        if not is_complete(model):
            make = [[sys.executable, "-m", "tests.checkpoints", kind, str(model), "--device", device,
                     *(["--layers", str(layers)] if device == "cuda" else [])]]
    return chained([*make, [sys.executable, "examples/benchmark.py", "--model", str(model), "--device", device,
                            "--engines", engines or spec.rows(device), "--workloads", spec.workloads,
                            *(spec.flags if device == "cuda" else CPU_REHEARSAL_FLAGS),
                            "--out", str(out / f"bench-{group}.json")]])


@dataclass(frozen=True, slots=True)
class Phase:
    """Steps that run side by side, sharing ``seconds`` of weight in ``all``'s budget; each named in the summary."""

    name: str
    seconds: int
    steps: dict[str, tuple[list[str], Path]]  # summary name -> (command, log)
    echo: bool = True  # the test groups' logs are read later; the others are followed as they run


def phases(out: Path, device: str, model: Path, layers: int) -> list[Phase]:
    """``all``'s phases, in order."""
    return [Phase("profile", PROFILE_SECONDS, {"profile": (profile_command(out, device, model), out / "profile.log")}),
            Phase("sdpa", SDPA_SECONDS, {"sdpa": (sdpa_command(out, device), out / "sdpa.log")}),
            Phase("tests", TESTS_SECONDS, {f"tests {g}": (tests_command(out, g), out / f"tests-{g}.log")
                                           for g in TEST_GROUPS}, echo=False),
            *(Phase(g, spec.seconds, {f"bench {g}": (bench_command(out, g, device, model, layers),
                                                     out / f"bench-{g}.log")})
              for g, spec in BENCH_GROUPS.items())]


def run_all(out: Path, device: str, model: Path, budget: float | None, pack: Path | None, layers: int) -> int:
    """Every step in one command, for a loan of minutes: the preflight, then each phase in turn (the test groups side
    by side: they check correctness, and one GPU has room for five small processes; everything else alone, as timings
    want the GPU to themselves). With ``budget``, each phase gets a share of the seconds left, in proportion to its
    weight (Phase.seconds), so time a phase leaves goes to the next; a phase with nothing left is not started. With
    ``pack``, one archive of OUT at the end, whatever happened (SIGTERM included). Exits non-zero if any step failed,
    was stopped or did not run; ``summary.txt`` says which, and how long each took."""
    end = None if budget is None else time.monotonic() + budget
    results: dict[str, Outcome] = {}
    seconds: dict[str, float] = {}  # each step's, in the summary: what the next loan's weights are set from
    live: list[Step] = []
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        began = time.monotonic()
        results["preflight"] = outcome(preflight(out, device, model))
        seconds["preflight"] = time.monotonic() - began
        planned = phases(out, device, model, layers) if results["preflight"].ok else []
        for number, phase in enumerate(planned):
            began = time.monotonic()
            until = None if end is None else began + (end - began) * phase.seconds / sum(
                later.seconds for later in planned[number:])
            if until is not None and until - began < MIN_STEP_SECONDS:
                results.update(dict.fromkeys(phase.steps, NOT_RUN))
                continue
            started = {name: Step.start(command, log, phase.echo) for name, (command, log) in phase.steps.items()}
            live += started.values()
            for name, step in started.items():
                results[name] = outcome(step.finish(until), tests=phase.name == "tests")
                seconds[name] = step.seconds
    finally:
        signal.signal(signal.SIGTERM, previous)
        for step in live:
            step.stop()  # a step still running when something broke: no orphan holds the GPU
        lines = [f"{name}: {result.text}" + (f", {seconds[name]:.0f} s" if name in seconds else "")
                 for name, result in results.items()]
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        if pack is not None:
            pack.parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(pack, "w:gz") as archive:
                archive.add(out, arcname=out.name)
            print(f"packed {out} into {pack}")
    return int(not all(result.ok for result in results.values()))


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # so that ``run_all``'s cleanup, summary and archive still happen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["preflight", "profile", "sdpa", "tests", "bench", "all"])
    parser.add_argument("out", type=Path, help="the folder to write into (the one that comes back)")
    parser.add_argument("--group", help=f"tests: {', '.join(TEST_GROUPS)}; bench: {', '.join(BENCH_GROUPS)}")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: rehearse on a tiny model")
    parser.add_argument("--model", type=Path, default=None, help="the checkpoint (made if missing)")
    parser.add_argument("--engines", default=None, help="bench: these rows instead of the group's (re-running one)")
    parser.add_argument("--layers", type=int, default=EIGHT_B_LAYERS,
                        help="bench 8b and all: the 8B shape's layers (fewer if the whole does not fit the loan)")
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
        return run_all(args.out, args.device, model, args.budget, args.pack, args.layers)
    if args.step == "tests":
        status = Step.start(tests_command(args.out, args.group), args.out / f"tests-{args.group}.log").finish()
        print(f"tests {args.group}: {outcome(status, tests=True).text}")
        return int(not outcome(status, tests=True).ok)
    command = {"profile": lambda: profile_command(args.out, args.device, model),
               "sdpa": lambda: sdpa_command(args.out, args.device),
               "bench": lambda: bench_command(args.out, args.group, args.device, model, args.layers, args.engines)}
    log = args.out / (f"bench-{args.group}.log" if args.step == "bench" else f"{args.step}.log")
    return Step.start(command[args.step](), log).finish()


if __name__ == "__main__":
    sys.exit(main())
