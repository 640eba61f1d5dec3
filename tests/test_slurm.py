"""The SLURM scripts and the submitit sweep, against a real one-node cluster started on this machine.

``scripts/slurm/local_cluster.sh start`` installs Debian's slurmctld, slurmd and munge where they are
missing and starts them; the fixture stops them again at the end, also
when a test fails, unless the cluster was already running before the session. Each job imports
Megatron, so every job here is case=tiny on the CPU with one shape point and a few samples.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotuner.results import load_rows

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
# submitit asks sacct about jobs that end without a result; the test cluster has no accounting, so
# a stand-in answers from squeue (see the file for why a hang would follow otherwise).
STAND_INS = REPO / "tests" / "slurm_bin"
SMALL = [
    "device=cpu",
    "shapes.micro_batch_size=[1]",
    "timing.warmup=1",
    "timing.max_samples=5",
    "report=false",
    "progress=false",
]
# The test cluster has no GPUs: the scripts ask for one unless told otherwise.
CPU_JOB = ["--gpus-per-node=0"]
JOB_TIMEOUT_S = 240

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # each job imports Megatron: 10-15 s a test


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """The environment for SLURM clients of the local cluster (SLURM_CONF set), cluster running."""
    assert os.access(STAND_INS / "sacct", os.X_OK), "tests/slurm_bin/sacct must be executable (git: 100755)"
    already_up = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True).returncode == 0
    started = time.monotonic()
    proc = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=900)
    try:
        if proc.returncode != 0:
            pytest.fail(f"the local SLURM cluster did not start:\n{proc.stderr[-4000:]}", pytrace=False)
        print(f"\nlocal SLURM cluster up in {time.monotonic() - started:.1f} s", file=sys.stderr)
        # Inherited job variables (pytest itself may run in a SLURM job, or under torchrun) would
        # leak into the jobs and into the run-directory naming; only SLURM_CONF is ours.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        }
        env["SLURM_CONF"] = proc.stdout.strip().splitlines()[-1]
        env["PATH"] = f"{STAND_INS}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        yield env
    finally:
        if not already_up:
            subprocess.run(["bash", str(CLUSTER), "stop"], check=False, timeout=120)


def _sbatch(env: dict[str, str], log_dir: Path, options: list[str], script: str, overrides: list[str]):
    """``sbatch --wait`` from the checkout: (job id, exit code, the job logs' text)."""
    command = ["sbatch", "--wait", "--parsable", f"--output={log_dir}/slurm-%x-%j.out", *options]
    proc = subprocess.run(
        [*command, str(REPO / "scripts" / "slurm" / script), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    job_id = proc.stdout.strip().split(";")[0]
    logs = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(log_dir.glob("slurm-*.out")))
    return job_id, proc.returncode, f"{proc.stderr}\n{logs}"[-6000:]


def _own_run_dir(path: Path, since: float, request) -> Path:
    """A run directory the job wrote in the checkout's runs/; removed after the test."""
    request.addfinalizer(lambda: shutil.rmtree(path, ignore_errors=True))
    assert path.is_dir(), f"no run directory {path}"
    assert (path / "results.jsonl").stat().st_mtime >= since, f"{path} holds an earlier run's results"
    return path


@pytest.mark.torchrun
def test_profile_case_runs_tensor_parallel_under_torchrun(slurm_env, tmp_path, request):
    since = time.time() - 1
    ops = ("linear_qkv", "linear_proj", "transformer_layer")
    job, code, logs = _sbatch(
        {**slurm_env, "NPROC": "2"},
        tmp_path,
        CPU_JOB,
        "profile_case.sbatch",
        [
            "case=tiny",
            "tf.tensor_model_parallel_size=2",
            f"ops=[{','.join(ops)}]",
            "shapes.seq_len=[16]",
            *SMALL,
        ],
    )
    assert code == 0, logs
    assert "2 process(es)" in logs
    run_dir = _own_run_dir(REPO / "runs" / "tiny" / "get_data" / f"job-{job}", since, request)
    rows = load_rows(run_dir / "results.jsonl")
    assert {(r["op"], r["phase"], r["rank"]) for r in rows} == {
        (op, phase, rank) for op in ops for phase in ("forward", "backward") for rank in (0, 1, "max")
    }
    assert len(rows) == len(ops) * 2 * 3
    assert all(r["status"] == "ok" and r["tensor_parallel"] == 2 and r["point"] == "s16_b1" for r in rows)


def test_sweep_array_runs_one_value_per_task(slurm_env, tmp_path, request):
    since = time.time() - 1
    job, code, logs = _sbatch(
        {**slurm_env, "SWEEP_KEY": "shapes.seq_len", "SWEEP_VALUES": "[16] [32]"},
        tmp_path,
        [*CPU_JOB, "--array=0-1", "--cpus-per-task=1"],
        "sweep_array.sbatch",
        ["case=tiny", "ops=[linear_qkv]", *SMALL],
    )
    assert code == 0, logs
    for task, point in enumerate(("s16_b1", "s32_b1")):
        run_dir = _own_run_dir(REPO / "runs" / "tiny" / "get_data" / f"job-{job}_{task}", since, request)
        rows = load_rows(run_dir / "results.jsonl")
        assert [(r["op"], r["phase"], r["point"], r["status"]) for r in rows] == [
            ("linear_qkv", "forward", point, "ok"),
            ("linear_qkv", "backward", point, "ok"),
        ]


def test_submitit_multirun_sends_each_case_to_slurm(slurm_env, tmp_path):
    cases = tmp_path / "cases"
    cases.mkdir()
    tiny = (REPO / "cases" / "tiny.yaml").read_text()
    assert "hidden_size: 64\n" in tiny
    (cases / "tiny2.yaml").write_text(tiny.replace("hidden_size: 64\n", "hidden_size: 128\n"))
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotuner.main",
            "-m",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.partition=debug",
            "hydra.launcher.timeout_min=10",
            "hydra.launcher.cpus_per_task=1",
            f"hydra.sweep.dir={sweep}",
            f"case_dir={cases}",
            "case=tiny,tiny2",
            "ops=[linear_qkv]",
            "shapes.seq_len=[16]",
            *SMALL,
        ],
        cwd=REPO,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # while the jobs ran, submitit asked sacct for their state: the stand-in answered every time
    assert "sacct error" not in proc.stderr
    # submitit's own folder: one per array task, so the jobs did go through sbatch
    assert len(list((sweep / ".submitit").glob("*_[01]"))) == 2
    weights = {}
    for number, case in enumerate(("tiny", "tiny2")):
        rows = load_rows(sweep / f"{number}_{case}_get_data" / "results.jsonl")
        assert {(r["case"], r["op"], r["phase"], r["status"]) for r in rows} == {
            (case, "linear_qkv", phase, "ok") for phase in ("forward", "backward")
        }
        weights[case] = rows[0]["weight_bytes"]
    assert weights["tiny2"] == 2 * weights["tiny"]  # hidden 128 against 64: the second case did run
