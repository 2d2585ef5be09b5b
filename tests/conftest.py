"""Shared fixtures: seeded random checkpoints (fast, no download; see checkpoints.py) and the bundled real model."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from milestones import MILESTONES
from milestones.exercise.install import IMPL_VARIABLE, install
from milestones.model_store import resolve_model

from .checkpoints import make_checkpoint

# Where triton is installed but no GPU is there, its interpreter runs the Triton kernels on CPU tensors
# (tests/kernels/test_triton_decode.py). It must be on before anything imports triton (torch._dynamo does, so
# test modules would be too late), and stay on: kernels made before and after must agree on it. CI has no triton.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make check M=m3 IMPL=workspace/m3` runs the suite with a learner's package in place of milestones.m3
# (before any test module imports it).
if os.environ.get(IMPL_VARIABLE):
    install(*os.environ[IMPL_VARIABLE].split("=", 1))

# The compiled decode kernel needs a C++ compiler (torch's cpp_extension uses $CXX, else c++) and
# ninja (pip's, next to this interpreter, will do). With both present, a failing build fails the tests.
HAS_KERNEL_TOOLCHAIN = shutil.which(os.environ.get("CXX", "c++")) is not None and (
    shutil.which("ninja") is not None or (Path(sys.executable).parent / "ninja").exists()
)
needs_compiler = pytest.mark.skipif(
    not HAS_KERNEL_TOOLCHAIN, reason="no C++ compiler or ninja to build the decode-attention kernel"
)


def selected_milestones() -> list[str]:
    """All milestones, or those in $MILESTONES (comma-separated), e.g. MILESTONES=m2 for `make test-m2`."""
    wanted = os.environ.get("MILESTONES")
    return [m for m in MILESTONES if not wanted or m in wanted.split(",")]


def pytest_generate_tests(metafunc):
    if "milestone" in metafunc.fixturenames:
        metafunc.parametrize("milestone", selected_milestones(), scope="module")


@pytest.fixture(scope="session")
def bundled_model_path() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(kind: str = "llama") -> Path:
        if kind not in made:
            made[kind] = make_checkpoint(kind, tmp_path_factory.mktemp(f"random-{kind}"))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def mod(milestone):
    """The milestone package under test, e.g. ``milestones.m2``."""
    return importlib.import_module(f"milestones.{milestone}")


@pytest.fixture(scope="module")
def lesson_options(mod) -> dict:
    """Options that turn a milestone's lesson on where its default leaves it off (on a CPU).

    m6 overlaps only on CUDA by default (``async_scheduling="auto"``); its contract tests run the overlapped loop.
    m7 guesses only when asked to (``speculative_config``); its contract tests guess with the shortest n-grams.
    """
    fields = mod.EngineConfig.__dataclass_fields__
    if "speculative_config" in fields:
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}}
    return {"async_scheduling": True} if "async_scheduling" in fields else {}


@pytest.fixture(scope="module")
def tiny_llm(mod, tiny_model_path, lesson_options):
    return mod.LLM(tiny_model_path, device="cpu", max_model_len=512, **lesson_options)


REPORT = pytest.StashKey[list[str]]()


@pytest.fixture
def report(request):
    """Add a line to the summary printed at the end of the run (e.g. how many cases a property test tried)."""
    return request.config.stash.setdefault(REPORT, []).append


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(REPORT, [])
    if lines:
        terminalreporter.write_sep("=", "reported by the tests")
        for line in lines:
            terminalreporter.write_line(line)
