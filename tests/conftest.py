"""Shared pytest fixtures, and the markers' rules (the markers are registered in pyproject.toml)."""

import functools
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

_REPO_ROOT = Path(__file__).resolve().parents[1]

# --- markers: `make test-fast` deselects them, so each must be on every test that needs it ------

# A fixture that installs or starts something, and the marker a test using it must carry: an unmarked
# test would make `make test-fast` install nsys or start SLURM.
_FIXTURE_MARKERS = {"nsys_bin": "nsys", "slurm_env": "slurm"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        f"{item.nodeid} uses the {fixture} fixture: mark it @pytest.mark.{marker}"
        for item in items
        for fixture, marker in _FIXTURE_MARKERS.items()
        if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None
    ]
    if unmarked:
        raise pytest.UsageError("\n".join(unmarked))
    # gpu tests stay in a run without CUDA (CI's), reported as skipped rather than silently deselected
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu and not torch.cuda.is_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


# --- nsys: a real Nsight Systems for the tests (see scripts/install_nsys.sh) ------------------


def _nsys_answers(nsys: str) -> bool:
    try:
        proc = subprocess.run([nsys, "--version"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


@pytest.fixture(scope="session")
def nsys_bin() -> str:
    """Path of a working nsys: $NSYS_BIN, else the project's own in .tools/nsys, installed if missing.

    scripts/install_nsys.sh returns at once when the install is complete; it checks the report
    importer as well as ``nsys --version``, which answers even when only a .qdstrm can be written.
    """
    from_env = os.environ.get("NSYS_BIN")
    if from_env:
        if not _nsys_answers(from_env):
            pytest.fail(f"NSYS_BIN={from_env} does not answer --version")
        return from_env
    proc = subprocess.run(
        ["bash", str(_REPO_ROOT / "scripts/install_nsys.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "NSYS_PREFIX"},  # the default prefix
    )
    if proc.returncode != 0:
        pytest.fail(f"scripts/install_nsys.sh failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    installed = proc.stdout.strip().splitlines()[-1]
    if not _nsys_answers(installed):
        pytest.fail(f"install_nsys.sh printed {installed!r}, which does not answer --version")
    return installed


# --- Megatron: one tiny model per test session (Megatron imports once per pytest process) ------


# The line a run states before its first row: how many rows it will run and the plan's estimate.
PLAN_LINE = re.compile(r"autotuner: \d+ rows to run, estimated ")
# The fewest samples the sampler takes: for tests of files, rows and reports, not of times.
FAST = ["timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3", "progress=false"]


@pytest.fixture(scope="session")
def tiny_every_op_run(tmp_path_factory) -> Path:
    """One get_data run of case=tiny, every op at both of its points, with its report: what the file,
    CLI and report tests read (each test leaves it as it found it)."""
    from autotuner.main import run

    run_dir = tmp_path_factory.mktemp("tiny_get_data")
    assert run(["case=tiny", "launcher=get_data", f"hydra.run.dir={run_dir}", *FAST]) == 0
    return run_dir


@pytest.fixture(scope="session")
def tiny_spec():
    """The validated RunSpec of case=tiny with every op (CPU, fp32)."""
    from autotuner.config import compose_config
    from autotuner.runner.spec import resolve_spec

    return resolve_spec(compose_config(["case=tiny", "device=cpu"]))


@pytest.fixture(scope="session")
def tiny_session(tiny_spec):
    """(model, OpContext) for case=tiny with every part built (embedding, 2 layers, head)."""
    from autotuner.runner.spec import open_session

    return open_session(tiny_spec)


@functools.cache
def dense_model_ops() -> tuple[str, ...]:
    """The ops of the dense tiny model in model order: OP_ORDER less the MLA and MoE ops it has not
    (what ``ops=[all]`` runs on case=tiny)."""
    from autotuner.config import compose_config
    from autotuner.op_mapping import ops_in_model
    from autotuner.runner.spec import resolve_spec

    return ops_in_model(resolve_spec(compose_config(["case=tiny", "device=cpu"])).tf_config)
