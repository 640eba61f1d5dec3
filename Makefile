# Set-up, demo and tests. Everything installs into ./.venv (and Nsight Systems into ./.tools), both git-ignored.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned for development and CI: a CPU wheel of this version lies where pip finds it, while an
# unpinned or newer torch pulls a CUDA build of several GB. The package itself asks only torch>=2.4.
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo test test-fast lint format tools clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

tools:
	bash scripts/install_nsys.sh >/dev/null

demo: setup
	$(BIN)/python -m autotuner.main case=tiny launcher=get_data

test: setup tools
	$(BIN)/python -m pytest

# The development loop: no nsys, no SLURM, no torchrun, no GPU, nothing over ~10 s (README: Testing).
test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not nsys and not slurm and not torchrun and not gpu"

lint: setup
	$(BIN)/ruff check autotuner tests benchmarks
	$(BIN)/ruff format --check autotuner tests benchmarks

format: setup
	$(BIN)/ruff format autotuner tests benchmarks
	$(BIN)/ruff check --fix autotuner tests benchmarks

clean:
	rm -rf $(VENV) .tools runs
