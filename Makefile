# Set-up, demo and tests. Everything installs into ./.venv (and Nsight Systems into ./.tools), both git-ignored.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned for development and CI: a CPU wheel of this version lies where pip finds it, while an
# unpinned or newer torch pulls a CUDA build of several GB. The package itself asks only torch>=2.4.
TORCH_VERSION ?= 2.13.0
# Every other package at the version the suite last passed with, on the Python CI runs (constraints.txt,
# written by `make lock`): a dependency's release between two CI runs must not change what the tests run
# on. Other Pythons, and `make setup CONSTRAINTS=`, get the newest versions pyproject.toml allows.
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: setup demo test test-fast lint format tools clean lock

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(PIN) torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet $(PIN) -e '.[dev]'
	touch $@

tools:
	bash scripts/install_nsys.sh >/dev/null

demo: setup
	$(BIN)/python -m autotuner.main case=tiny launcher=get_data

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file to a worker so that a module's
# fixture (a profiled run, a built wheel, a SLURM cluster) is made once. In one process it kept a 2-core
# VM's cores about half busy, waiting on its subprocesses (torchrun, nsys, SLURM, pip); TEST_WORKERS=1
# runs it in one (README: Testing).
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

test: setup tools
	$(BIN)/python -m pytest $(XDIST)

# The development loop: no nsys, no SLURM, no torchrun, no GPU, nothing over ~3 s (README: Testing).
test-fast: setup
	$(BIN)/python -m pytest $(XDIST) -m "not slow and not nsys and not slurm and not torchrun and not gpu"

lint: setup
	$(BIN)/ruff check autotuner tests benchmarks
	$(BIN)/ruff format --check autotuner tests benchmarks

format: setup
	$(BIN)/ruff format autotuner tests benchmarks
	$(BIN)/ruff check --fix autotuner tests benchmarks

# The newest versions pyproject.toml allows, installed into a scratch environment and written to
# constraints.txt for this Python only; run `make test` on them before committing the file.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	.lock-venv/bin/python -m pip install --quiet -e '.[dev]'
	.lock-venv/bin/python scripts/write_constraints.py > constraints.txt
	rm -rf .lock-venv

clean:
	rm -rf $(VENV) .tools runs
