"""The profiling plan (autotuner.predict.plan): what a set of layouts needs, less what run directories
hold, as commands the profiler's config accepts and as SLURM arrays over scripts/slurm/."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from autotuner.config import compose_config
from autotuner.errors import UserError
from autotuner.main import run
from autotuner.predict.layout import Layout
from autotuner.predict.plan import Need, measured, needs_of, plan

REPO = Path(__file__).resolve().parents[1]
FAST = ["timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3", "progress=false", "report=false"]


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory) -> Path:
    """A real get_data run of tiny at s16_b1, fp32 on the CPU, one op."""
    run_dir = tmp_path_factory.mktemp("tiny_s16_b1")
    args = ["case=tiny", "launcher=get_data", "device=cpu", "dtype=fp32", "ops=[linear_qkv]"]
    shapes = ["shapes.seq_len=[16]", "shapes.micro_batch_size=[1]"]
    assert run([*args, *shapes, f"hydra.run.dir={run_dir}", *FAST]) == 0
    return run_dir


def _overrides(argv: list[str]) -> list[str]:
    """The overrides part of a command: what follows ``-m autotuner.main``."""
    return argv[argv.index("autotuner.main") + 1 :]


@pytest.mark.slow
def test_a_run_directory_holds_its_point_with_its_settings(measured_run):
    assert measured([measured_run]) == {
        Need("tiny", 16, 1, tp=1, ep=1, sequence_parallel=False, dtype="fp32", processes=1)
    }


@pytest.mark.slow
def test_a_cpu_need_is_held_and_profiled_beside_its_layouts_processes(measured_run):
    """On a CPU a layout's ops run beside its other processes (autotuner.predict.prediction): a need
    names their count, only a run of that many processes holds it, and its run starts that many (a
    multiple of tp and ep); a GPU need (0) is held by any and runs on the fewest that fit."""
    pp2 = Layout(seq_len=16, micro_batch_size=1, global_batch_size=8, dtype="fp32", pp=2)
    (cpu_need,) = needs_of("tiny", [pp2], cpu=True)
    assert cpu_need.processes == 2 and "in 2 processes" in cpu_need.describe()
    (gpu_need,) = needs_of("tiny", [pp2])
    assert gpu_need.processes == 0
    on_cpu = plan([cpu_need], [measured_run], extra=["device=cpu"])  # measured in one process
    assert on_cpu.already == () and on_cpu.commands()[0][:3] == [
        "torchrun",
        "--standalone",
        "--nproc-per-node=2",
    ]
    assert "tf.tensor_model_parallel_size=2" not in on_cpu.commands()[0]
    assert plan([gpu_need], [measured_run]).already == (gpu_need,)
    assert plan([Need("tiny", 16, 1, tp=2, ep=1)]).runs[0].nproc == 2
    assert plan([Need("tiny_moe", 16, 1, tp=2, ep=4, processes=8)]).runs[0].nproc == 8
    assert plan([Need("tiny", 16, 1, processes=4), Need("tiny", 16, 1, processes=2)]).runs[0].nproc == 2
    # the run that plan writes holds the need once it has run: its environment records 2 processes
    env = json.loads((measured_run / "environment.json").read_text())
    two = measured_run.parent / "two_processes"
    two.mkdir()
    (two / "results.jsonl").write_text((measured_run / "results.jsonl").read_text())
    (two / "environment.json").write_text(json.dumps({**env, "world_size": 2}))
    assert plan([cpu_need], [two]).already == (cpu_need,)


@pytest.mark.slow
def test_the_plan_omits_what_is_measured_and_its_commands_compose(measured_run):
    def layout(**fields) -> Layout:
        return Layout(
            **{"seq_len": 16, "micro_batch_size": 1, "global_batch_size": 8, "dtype": "fp32", **fields}
        )

    layouts = [
        layout(),  # measured
        layout(micro_batch_size=2),
        layout(
            micro_batch_size=2, pp=2, recompute="full"
        ),  # pipeline and recompute need no rows of their own
        layout(seq_len=32, micro_batch_size=2),
        layout(tp=2, sequence_parallel=True),
        layout(dtype="bf16"),  # measured, but in fp32
    ]
    needs = needs_of("tiny", layouts)
    assert len(needs) == 5
    result = plan(needs, [measured_run], extra=["device=cpu"])
    assert result.already == (Need("tiny", 16, 1, dtype="fp32"),)
    assert Need("tiny", 16, 1, dtype="fp32") not in result.missing
    assert set(result.missing) == set(needs) - set(result.already)
    commands = result.commands()
    assert [c[0] for c in commands] == ["python", "python", "torchrun"]
    assert commands[1][:4] == ["python", "-m", "autotuner.main", "case=tiny"]
    # fp32: s16 and s32 need micro-batch 2, one run crossing them; the tp=2 run on two processes
    assert "shapes.seq_len=[16,32]" in commands[1] and "shapes.micro_batch_size=[2]" in commands[1]
    assert commands[2][:3] == ["torchrun", "--standalone", "--nproc-per-node=2"]
    assert {"tf.tensor_model_parallel_size=2", "tf.sequence_parallel=true"} <= set(commands[2])
    for argv in commands:
        cfg = compose_config(_overrides(argv))
        assert cfg.case == "tiny" and cfg.launcher.name == "get_data" and cfg.device == "cpu"
        assert list(cfg.shapes.seq_len) and list(cfg.shapes.micro_batch_size)


def test_crossed_shape_lists_measure_no_point_nobody_needs():
    needs = [Need("tiny", 16, 1), Need("tiny", 16, 2), Need("tiny", 32, 4)]
    runs = plan(needs).runs
    assert sorted((n for r in runs for n in r.needs), key=Need.sort_key) == needs
    assert [(r.overrides[-2], r.overrides[-1]) for r in runs] == [
        ("shapes.seq_len=[16]", "shapes.micro_batch_size=[1,2]"),
        ("shapes.seq_len=[32]", "shapes.micro_batch_size=[4]"),
    ]


def test_expert_parallel_runs_on_the_least_common_multiple_of_tp_and_ep():
    needs = [Need("tiny_moe", 32, 2, tp=2, ep=4, sequence_parallel=True), Need("tiny_moe", 32, 2, ep=2)]
    by_nproc = {r.nproc: r for r in plan(needs).runs}
    assert set(by_nproc) == {2, 4}
    assert "tf.expert_model_parallel_size=4" in by_nproc[4].overrides
    for r in by_nproc.values():
        compose_config(list(r.overrides))


def test_the_slurm_arrays_list_one_task_per_run(tmp_path):
    needs = [
        Need("tiny", 16, 1),
        Need("tiny", 64, 1),
        Need("tiny", 16, 1, tp=2, sequence_parallel=True),
        Need("tiny", 16, 1, tp=2),
        Need("llama7b", 128, 1, tp=2),
    ]
    result = plan(needs, extra=["device=cpu"])
    arrays = result.slurm(tmp_path / "plan", gpus=False)
    assert [a.env["NPROC"] for a in arrays] == ["1", "2"]
    assert sum(len(a.runs) for a in arrays) == len(result.runs) == 4
    for array in arrays:
        lines = array.task_file.read_text().splitlines()
        assert array.argv == [
            "sbatch",
            f"--array=0-{len(lines) - 1}",
            "--gpus-per-node=0",
            "scripts/slurm/sweep_array.sbatch",
        ]
        assert array.env["SWEEP_FILE"] == str(array.task_file) and array.task_file.is_absolute()
        for line, one in zip(lines, array.runs, strict=True):
            assert line.split(" ") == list(one.overrides)  # what sweep_array.sbatch splits it into
            compose_config(line.split(" "))
        assert array.shell().startswith(f"SWEEP_FILE={array.task_file} NPROC=")


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(UserError, match="holds no results.jsonl"):
        plan([Need("tiny", 16, 1)], [tmp_path])
    with pytest.raises(UserError, match="holds a space"):
        plan([Need("tiny", 16, 1)], extra=["hf.name=a b"])
    (tmp_path / "results.jsonl").write_text(json.dumps({"case": "tiny", "op": 3}) + "\n")
    with pytest.raises(UserError) as info:
        plan([Need("tiny", 16, 1)], [tmp_path])
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_an_array_task_runs_its_line_of_the_task_file(tmp_path):
    """scripts/slurm/sweep_array.sbatch as SLURM would start array task 1 (without SLURM: its environment
    set by hand): task 1 runs the second line's overrides through profile_case.sbatch and torchrun, with
    the brackets of the shape lists reaching the profiler as written (here as a dry run: its plan)."""
    needs = [Need("tiny", 16, 1), Need("tiny", 16, 2, tp=2, sequence_parallel=True), Need("tiny", 24, 2)]
    result = plan(needs, extra=["device=cpu", "dry_run=true"])
    (array,) = [a for a in result.slurm(tmp_path, gpus=False) if a.env["NPROC"] == "1"]
    assert len(array.task_file.read_text().splitlines()) == 2
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID")
    }
    env.update(array.env, SLURM_ARRAY_TASK_ID="1", AUTOTUNER_DIR=str(REPO), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        ["bash", str(REPO / array.argv[-1])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shapes.seq_len=[24] shapes.micro_batch_size=[2]" in proc.stderr  # the task's line, announced
    assert "s24_b2" in proc.stdout and "s16_b1" not in proc.stdout
