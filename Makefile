# Set-up and the two commands README.md gives: `make demo` and `make test`.
# Each creates/updates .venv; on a machine without CUDA it installs torch first
# (installing megatron-core into an empty environment would pull a multi-GB CUDA torch):
# the CPU build where pip's configured sources offer it (this project's machines: a local
# wheel directory), else set TORCH_INDEX=https://download.pytorch.org/whl/cpu (PyPI's
# Linux torch is the CUDA build).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH_CPU ?= torch==2.13.0
TORCH_INDEX ?=
MUTANTS_ARGS ?=
DEMO_ARGS ?= --cuda-graph-impl local --cuda-graph-scope full_iteration --train-iters 20

.PHONY: venv demo test lint check bench-cpu mutants clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# The package depends on the hook contract, its own distribution (mcgraph-hookspecs, built
# from hookspecs/): both are installed from this checkout, in one pip call.
$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml hookspecs/setup.cfg hookspecs/pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  echo "no CUDA device: installing torch ($(TORCH_CPU)$(if $(TORCH_INDEX), from $(TORCH_INDEX))) first"; \
	  $(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_CPU)"; \
	fi
	$(BIN)/python -m pip install -q -e ./hookspecs -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/python examples/train_gpt.py $(DEMO_ARGS)

# The suite on two pytest-xdist workers, sized for a 2-core machine (XDIST="-n 4" on a bigger
# one, XDIST= for one process). --dist loadgroup keeps the tests that read one module-scoped
# job run on one worker (their xdist_group marks), so the job runs once. One torch thread per
# worker: the workers already fill the cores. The ten slowest tests are listed at the end, so
# a slow new test shows at once. PYTEST_ARGS adds arguments (--randomly-seed=N, -k ...).
XDIST ?= -n 2 --dist loadgroup
PYTEST_ARGS ?=
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest --durations=10 $(XDIST) $(PYTEST_ARGS)

# The configuration check of a command line, without a GPU: make check CHECK_ARGS="--cuda-graph-impl ..."
CHECK_ARGS ?= --cuda-graph-impl local --cuda-graph-scope full_iteration
check: $(VENV)/.installed
	$(BIN)/python -m cudagraph_plugin check $(CHECK_ARGS)

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Mutation testing (not part of CI: the tool run takes hours on 2 cores): the hand-made
# mutants of the lifecycle guarantees (each killed by named tests), then cosmic-ray over
# the lifecycle core, module by module with a time cap. Results: docs/mutation-testing.md.
$(VENV)/.mutation-installed: $(VENV)/.installed setup.cfg
	$(BIN)/python -m pip install -q -e '.[test,mutation]'
	touch $@

mutants: $(VENV)/.mutation-installed
	$(BIN)/python tools/mutation/handmade.py
	$(BIN)/python tools/mutation/tool_run.py $(MUTANTS_ARGS)

bench-cpu: $(VENV)/.installed
	$(BIN)/python benchmarks/hook_overhead.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mutation
