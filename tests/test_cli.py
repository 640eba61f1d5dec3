"""The command line end to end: the get_data run, bad input, --help, multirun, failures, interruption."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from autotuner.main import run
from autotuner.results import COLUMNS, load_rows
from tests.conftest import FAST, PLAN_LINE, dense_model_ops

REPO = Path(__file__).resolve().parents[1]


def _check_files(run_dir: Path) -> list[dict]:
    rows = load_rows(run_dir / "results.jsonl")
    with open(run_dir / "results.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["op"] for r in table] == [r["op"] for r in rows]
    assert list(table[0]) == COLUMNS if table else True
    return rows


@pytest.fixture(scope="module")
def tiny_run(tiny_every_op_run: Path) -> Path:
    return tiny_every_op_run


@pytest.mark.slow
def test_tiny_run_has_every_op_phase_and_point(tiny_run: Path):
    rows = _check_files(tiny_run)
    keys = {(r["op"], r["phase"], r["point"]) for r in rows}
    expected = {
        (op, phase, point)
        for op in dense_model_ops()
        for phase in ("forward", "backward")
        for point in ("s32_b2", "s64_b2")
    }
    assert keys == expected and len(rows) == len(expected)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["samples"] >= 2 and 0 < row["min_us"] <= row["median_us"]
        assert row["peak_bytes"] >= 0 and row["device"] == "cpu" and row["dtype"] == "fp32"
    gemm = [r for r in rows if r["op"] == "linear_qkv"]
    assert all(r["flops"] > 0 and r["tflops"] > 0 for r in gemm)


@pytest.mark.slow
def test_a_finished_run_leaves_no_empty_log_and_no_lock(tiny_run: Path):
    # the lock is the kernel's and ends with the run; its file and a log nothing was written to are clutter
    left = sorted(p.name for p in tiny_run.iterdir() if p.name.endswith(".lock"))
    log = tiny_run / "main.log"
    assert left == [] and (not log.exists() or log.stat().st_size > 0), (left, log.exists())


@pytest.mark.slow
def test_run_directory_records_how_to_reproduce(tiny_run: Path):
    record = json.loads((tiny_run / "environment.json").read_text())
    env = record["environment"]
    assert env["torch"] and env["megatron_core"] and env["transformers"] and env["device_name"]
    assert env["host_heap"].startswith("glibc, freed memory kept")  # a CPU run (autotuner.model.host_heap)
    # which autotuner measured it: its version, and in a git checkout the commit (what a meter's rule was)
    assert env["autotuner"] == metadata.version("autotuner")
    if (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:  # git usable here: it was for the run too
            assert head.stdout.startswith(env["autotuner_revision"].removesuffix("-dirty"))
    assert record["transformer_config"]["num_query_groups"] == 2
    assert (tiny_run / ".hydra" / "config.yaml").exists() and (
        tiny_run / ".hydra" / "overrides.yaml"
    ).exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["case=nope"], "unknown case 'nope'"),
        (["ops=[linear_qkv,fc3]"], "unknown op 'fc3'"),
        (["launcher=perf"], "unknown launcher"),
        (["foo=1"], "Could not override 'foo'"),
        (["timing.warmups=1"], "timing.warmups"),
        (["hf.hiden_size=1"], "hiden_size"),
        (["tf.num_layer=1"], "num_layer"),
        (["hf.num_attention_heads=3", "hf.head_dim=null"], "not a multiple of the number of attention heads"),
        (["hf.num_key_value_heads=3"], "does not divide num_attention_heads"),
        (["shapes.seq_len=[0]"], "positive integers"),
        (["shapes.micro_batch_size=[-2]"], "positive integers"),
        (["shapes.seq_len=[100000]"], "max_position_embeddings"),
        (["device=tpu"], "unknown device"),
        (["dtype=int8"], "unknown dtype"),
        (["tf.tensor_model_parallel_size=3"], "does not divide"),
        (["device=cpu", "timing.cuda_graph=true"], "timing.cuda_graph replays CUDA graphs"),
        (["timing.precision_rule=mad"], "use one of ci, iqr"),
        (["timing.target_rel_ci=nan"], "timing.target_rel_ci=nan is not a number"),
        (["timing.held_activations_mib=inf"], "timing.held_activations_mib=inf is not a number"),
        (["timing.idle_before_ms=1e12"], "give at most 60000"),
        (["timing.min_time_s=1e9"], "give at most 3600"),
        # TransformerConfig takes these without a word; each op's build (or none) would fail later
        (["tf.params_dtype=abc"], "set dtype=fp32, bf16 or fp16 instead"),
        (["tf.activation_func=foo"], "set hf.hidden_act instead"),
        (["tf.attention_backend=foo"], "one of flash, fused, unfused, local, auto"),
        (["tf.normalization=Foo"], "use one of LayerNorm, RMSNorm, L2Norm"),
        (["tf.context_parallel_size=2"], "context parallelism is not profiled"),
        (["tf.num_query_groups=3"], "does not divide num_attention_heads=4"),
        (["tf.kv_channels=7"], "odd rotary width"),
        # a profiler keeps every range to the end: a mistyped count would run for hours, then out of memory
        (["launcher=torch_profiler", "launcher.active=100000"], "launcher.active=100000 = 100002 profiled"),
        (["launcher=nsys", "launcher.iterations=5000"], "launcher.iterations=5000 = 5002 profiled calls"),
        # the traces' folder would take the name of the run's own results file
        (["launcher=torch_profiler", "launcher.output_dir=results.csv"], "writes its own results.csv"),
        (["seed=99999999999999999999"], "seed=99999999999999999999 is out of range: give a seed from 0"),
        (["seed=-1"], "seed=-1 is out of range"),
        # Hydra's flags, checked before the run folder is claimed (its lock file was left behind)
        (["--dry-run"], "unknown option --dry-run"),
        (["--cfg", "nope"], "argument --cfg/-c: invalid choice: 'nope'"),
        # another primary config than the one the checks compose: Hydra's multi-line error, after the lock
        (["--config-name", "nosuch"], "--config-name nosuch: the one primary config is 'config'"),
        (["--config-path", "/nonexistent"], "--config-path /nonexistent: the shipped configs cannot be"),
        (["--experimental-rerun", "/nonexistent"], "--experimental-rerun is not supported"),  # a pickle
        # a + adds a key nothing reads (the run went on with the default); Hydra's merge error says why
        (
            ["+timing.budget=0.1"],
            "timing.budget is not a setting (the + adds a key nothing reads): did you mean",
        ),
        (["ops=linear_qkv"], "not a ListConfig, list or tuple: give a list, e.g. ops=[linear_qkv]"),
        (["resume=maybe"], "Value 'maybe' is not a valid bool"),
        (["--hydra-help"], "--hydra-help takes no settings"),
        (["--shell-completion"], "--shell-completion needs what to do"),
        (["--cfg", "job", "dry_run=true"], "dry_run=true: the key=value settings go together"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(overrides, message, capsys, tmp_path):
    assert run(["case=tiny", f"hydra.run.dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autotuner: error:") and message in err[0], err
    assert not (tmp_path / "results.jsonl").exists() and not (tmp_path / ".results.lock").exists()


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("name: get_data\nfoo: [unclosed\n", "a config file is not valid YAML: expected ',' or ']'"),
        ("name: mine\n", "launcher.name=mine is no launcher: use get_data, nsys, torch_profiler"),
        ("warmup: 3\n", "launcher.name=None is no launcher"),  # no name at all: a KeyError before
        (b"name: \xff\xfe\n", "a config file is not valid YAML"),  # not UTF-8: a traceback before
    ],
)
def test_a_launcher_yaml_of_ones_own_that_cannot_run_is_one_line(yaml_text, message, tmp_path, capsys):
    (tmp_path / "mine" / "launcher").mkdir(parents=True)
    config = tmp_path / "mine" / "launcher" / "mine.yaml"
    config.write_bytes(yaml_text) if isinstance(yaml_text, bytes) else config.write_text(yaml_text)
    argv = [
        "--config-dir",
        str(tmp_path / "mine"),
        "launcher=mine",
        "case=tiny",
        f"hydra.run.dir={tmp_path}/r",
    ]
    assert run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r").exists()


def test_a_config_group_of_ones_own_is_appended_with_a_plus(tmp_path, capsys):
    """+extra=fast appends a group from --config-dir: not a key nothing reads (autotuner.main
    ._check_added_keys), as +timing.budget=0.1 is."""
    (tmp_path / "mine" / "extra").mkdir(parents=True)
    (tmp_path / "mine" / "extra" / "fast.yaml").write_text(
        "# @package _global_\ntiming: {flush_cache: true}\n"
    )
    argv = ["--config-dir", str(tmp_path / "mine"), "+extra=fast", "case=tiny", "dry_run=true"]
    assert run(argv) == 0, capsys.readouterr().err


def test_version_is_hydras_and_exits_0(capsys):
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.startswith("Hydra ")


def test_a_bad_launcher_setting_is_refused_before_any_job_of_a_sweep_or_any_run_folder(tmp_path, capsys):
    """Checked in the preflight with every other setting (autotuner.launchers.check_settings): job 0 of the
    sweep had measured, and a single run had left a run folder of Hydra's files, before the refusal."""
    sweep, single = tmp_path / "sweep", tmp_path / "single"
    profiler = ["case=tiny", "ops=[linear_qkv]", "launcher=torch_profiler", *FAST]
    for argv in (
        ["-m", *profiler, "launcher.active=1,0", f"hydra.sweep.dir={sweep}"],
        [*profiler, "launcher.active=0", f"hydra.run.dir={single}"],
    ):
        assert run(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "launcher.active=0: the profiler records only active steps" in err[0], err
    assert not sweep.exists() and not single.exists()


def test_bad_input_from_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "autotuner.main", "case=llama8"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown case 'llama8'" in proc.stderr


def test_help_lists_cases_and_ops(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("llama7b", "llama70b", "mistral7b", "tiny", "core_attention", "mlp_bda", "launcher="):
        assert name in out


@pytest.mark.slow
def test_failing_op_is_recorded_and_the_plan_goes_on(tmp_path, capsys):
    from autotuner.ops_test.base import REGISTRY, register_op

    @register_op("always_fails")
    def always_fails(ctx, point):
        """An op whose build raises."""
        raise RuntimeError("out of memory (simulated)\nsecond line")

    try:
        code = run(
            [
                "case=tiny",
                "ops=[always_fails,linear_qkv]",
                "shapes.seq_len=[8]",
                f"hydra.run.dir={tmp_path}",
                *FAST,
            ]
        )
    finally:
        del REGISTRY["always_fails"]
    assert code == 1  # some op failed
    rows = {(r["op"], r["phase"]): r for r in _check_files(tmp_path)}
    assert rows[("always_fails", "forward")]["status"] == "failed"
    assert rows[("always_fails", "backward")]["error"] == "RuntimeError: out of memory (simulated)"
    assert rows[("linear_qkv", "backward")]["status"] == "ok"


@pytest.mark.slow
def test_multirun_over_cases_at_real_llama7b_size(tmp_path):
    overrides = ["ops=[transformer_layer]", "shapes.seq_len=[16]", "shapes.micro_batch_size=[1]"]
    assert run(["-m", "case=tiny,llama7b", f"hydra.sweep.dir={tmp_path}", *overrides, *FAST]) == 0
    jobs = {p.name.split("_", 1)[1]: p for p in tmp_path.iterdir() if p.is_dir()}
    assert set(jobs) == {"tiny_get_data", "llama7b_get_data"}
    llama = load_rows(jobs["llama7b_get_data"] / "results.jsonl")
    assert {r["status"] for r in llama} == {"ok"}
    assert llama[0]["weight_bytes"] == 202_383_360 * 4  # one Llama-2-7B layer in fp32


def _after_the_plan_line(err: str) -> list[str]:
    """The lines of an interrupted run's stderr after its first, which says the plan's estimate."""
    plan_line, *rest = err.strip().splitlines()
    assert PLAN_LINE.match(plan_line), plan_line
    return rest


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop, status, said",
    [
        (
            signal.SIGTERM,
            -signal.SIGTERM,
            "terminated",
        ),  # what SLURM sends on preemption or at the time limit
        (signal.SIGINT, 130, "interrupted"),  # Ctrl-C
    ],
)
def test_interrupted_run_leaves_valid_files_and_resumes(tmp_path, stop, status, said):
    ops = ["input_layernorm", "linear_qkv", "core_attention", "linear_proj", "linear_fc1", "linear_fc2"]
    args = [
        "case=tiny",
        f"ops=[{','.join(ops)}]",  # six of the plan's ops: enough rows to cut the run among them
        f"hydra.run.dir={tmp_path}",
        "timing.budget_s=0.3",
        "timing.max_samples=1000",
        "progress=false",
    ]
    stderr = tmp_path.parent / f"{tmp_path.name}.stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "autotuner.main", *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err
        )
    results = tmp_path / "results.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if results.exists() and len(results.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    os.kill(proc.pid, stop)
    assert proc.wait() == status
    before = _check_files(tmp_path)
    assert 4 <= len(before) < len(ops) * 2 * 2
    # the plan's estimate, then one line, no traceback, with the command that finishes the run
    said_lines = _after_the_plan_line(stderr.read_text())
    assert len(said_lines) == 1 and said_lines[0].startswith(f"autotuner: {said}; finish the run with: "), (
        said_lines
    )
    command = shlex.split(said_lines[0].split("finish the run with: ", 1)[1])
    assert command[:3] == ["python", "-m", "autotuner.main"] and "resume=true" in command

    # that command, the same settings (a resume that changes the sampler is refused: test_faults_data.py)
    assert run(command[3:]) == 0
    after = _check_files(tmp_path)
    assert len(after) == len(ops) * 2 * 2 and len({(r["op"], r["phase"], r["point"]) for r in after}) == len(
        after
    )
    kept = {(r["op"], r["phase"], r["point"]): r["median_us"] for r in after}
    for row in before:  # measured rows were kept, not measured again
        if row["status"] == "ok":
            assert kept[(row["op"], row["phase"], row["point"])] == row["median_us"]


@pytest.mark.slow
def test_an_interrupted_sweep_says_how_to_finish_every_job(tmp_path):
    """A ``-m`` sweep stopped by Ctrl-C in its first job: the command it prints resumes the sweep's folder,
    each job its own (it had printed no command: a sweep was thought not resumable)."""
    sweep = tmp_path / "sweep"
    ops = "ops=[linear_qkv,linear_proj,linear_fc1]"
    args = [
        "-m",
        "case=tiny",
        ops,
        "shapes.seq_len=[16],[32]",
        "shapes.micro_batch_size=[1]",
        "progress=false",
    ]
    args += ["report=false", "timing.budget_s=0.3", "timing.max_samples=1000", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotuner.main", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = sweep / "0_tiny_get_data" / "results.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not (first.exists() and first.read_text()):
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    said = _after_the_plan_line(err)
    assert len(said) == 1 and said[0].startswith("autotuner: interrupted; finish the run with: "), said
    command = shlex.split(said[0].split("finish the run with: ", 1)[1])
    assert command[:4] == ["python", "-m", "autotuner.main", "-m"] and f"hydra.sweep.dir={sweep}" in command
    assert run(command[3:]) == 0
    for job in ("0_tiny_get_data", "1_tiny_get_data"):
        assert len(_check_files(sweep / job)) == 3 * 2


@pytest.mark.slow
def test_generator_flush_and_calibration_from_the_command_line(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"peak_flops": {"fp32": 1e11}, "memory_bandwidth": 1e10}))
    run_dir = tmp_path / "run"
    overrides = [
        "ops=[linear_fc1,activation]",
        "shapes.generator=pow2",
        "shapes.pow2.seq_len.min_power=3",
        "shapes.pow2.seq_len.max_power=4",
        "shapes.micro_batch_size=[1]",
        "timing.flush_cache=true",
        f"calibration={calibration}",
    ]
    assert run(["case=tiny", f"hydra.run.dir={run_dir}", *overrides, *FAST]) == 0
    rows = _check_files(run_dir)
    assert {r["point"] for r in rows} == {"s8_b1", "s16_b1"}
    assert all(r["cache_flush"] is True and r["input_sets"] == 1 and r["calls_per_sample"] == 1 for r in rows)
    by_op = {(r["op"], r["phase"], r["point"]): r for r in rows}
    # ridge point = 1e11 / 1e10 = 10 FLOP/byte: a GEMM of hidden 64 sits below it at this size
    fc1 = by_op[("linear_fc1", "forward", "s16_b1")]
    intensity = fc1["flops"] / fc1["bytes_moved"]
    assert fc1["bound"] == ("compute" if intensity > 10 else "memory")
    assert by_op[("activation", "forward", "s16_b1")]["bound"] == "memory"  # no FLOPs counted at all
    for row in rows:
        achieved = (
            row["flops"] / (row["median_us"] * 1e-6) if row["bound"] == "compute" else row["gbps"] * 1e9
        )
        ceiling = 1e11 if row["bound"] == "compute" else 1e10
        assert row["ceiling_fraction"] == pytest.approx(achieved / ceiling)
    assert json.loads((run_dir / "calibration.json").read_text())["memory_bandwidth"] == 1e10


@pytest.mark.slow
def test_a_pause_before_every_sample_is_taken_and_recorded(tmp_path, capsys):
    """timing.idle_before_ms: every sample is one call after the pause (the op as a pipeline stage runs it
    after a wait), the rows say so, and the run lasts at least its pauses; a negative pause is refused."""
    run_dir = tmp_path / "run"
    overrides = ["ops=[activation]", "shapes.seq_len=[16]", "shapes.micro_batch_size=[1]"]
    started = time.perf_counter()
    assert run(["case=tiny", f"hydra.run.dir={run_dir}", *overrides, "timing.idle_before_ms=50", *FAST]) == 0
    elapsed = time.perf_counter() - started
    rows = [r for r in _check_files(run_dir) if r["status"] == "ok"]
    assert {(r["phase"], r["idle_before_ms"], r["calls_per_sample"], r["cache_flush"]) for r in rows} == {
        ("forward", 50.0, 1, False),
        ("backward", 50.0, 1, False),
    }
    pauses = sum(r["samples"] + 1 for r in rows)  # and one warm-up call each (FAST)
    assert elapsed >= pauses * 0.050
    capsys.readouterr()  # the measured run's own lines (the plan's estimate)
    assert run(["case=tiny", f"hydra.run.dir={tmp_path / 'bad'}", "timing.idle_before_ms=-1", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "idle_before_ms" in err[0] and "fix timing." in err[0]
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_forwards_timed_after_their_backward_say_so_in_their_rows(tmp_path):
    """timing.forward_after_backward: every forward sample is one call after the op's backward (untimed),
    its row says so, the backward's row does not, and the memory figures are the back-to-back run's (the
    kept graph is gone before the memory passes)."""
    overrides = ["ops=[activation]", "shapes.seq_len=[16]", "shapes.micro_batch_size=[1]", *FAST]
    rows = {}
    for after in (True, False):
        run_dir = tmp_path / str(after)
        assert (
            run(
                [
                    "case=tiny",
                    f"hydra.run.dir={run_dir}",
                    *overrides,
                    f"timing.forward_after_backward={after}",
                ]
            )
            == 0
        )
        rows[after] = {r["phase"]: r for r in _check_files(run_dir) if r["status"] == "ok"}
    assert {p: r["forward_after_backward"] for p, r in rows[True].items()} == {
        "forward": True,
        "backward": False,
    }
    assert {r["forward_after_backward"] for r in rows[False].values()} == {False}
    assert rows[True]["forward"]["calls_per_sample"] == 1  # each sample after a backward: one call
    for column in ("activation_bytes", "peak_bytes"):
        assert rows[True]["forward"][column] == rows[False]["forward"][column]


@pytest.mark.slow
def test_rows_timed_beside_held_activations_say_how_much_was_held(tmp_path, capsys):
    """timing.held_activations_mib: both phases' samples ran beside earlier calls' graphs, enough whole graphs
    of what the forward saves to hold at least that much (at most MAX_HELD_GRAPHS), and the rows say how many
    bytes; each forward sample followed a held graph's backward; by default nothing is held; a negative
    amount is refused."""
    from autotuner.measure.memory import MAX_HELD_GRAPHS

    overrides = ["ops=[activation]", "shapes.seq_len=[16]", "shapes.micro_batch_size=[1]", *FAST]
    rows = {}
    for mib in (1, 0):
        run_dir = tmp_path / str(mib)
        assert (
            run(["case=tiny", f"hydra.run.dir={run_dir}", *overrides, f"timing.held_activations_mib={mib}"])
            == 0
        )
        rows[mib] = {r["phase"]: r for r in _check_files(run_dir) if r["status"] == "ok"}
    saved = rows[1]["forward"]["activation_bytes"]
    assert 0 < saved < 2**20
    for phase in ("forward", "backward"):
        graphs, rest = divmod(rows[1][phase]["held_activation_bytes"], saved)
        assert rest == 0 and graphs == min(-(-(2**20) // saved), MAX_HELD_GRAPHS), (phase, graphs, saved)
        assert rows[0][phase]["held_activation_bytes"] is None
    assert rows[1]["forward"]["forward_after_backward"] is True
    assert rows[0]["forward"]["forward_after_backward"] is False
    bad = tmp_path / "bad"
    capsys.readouterr()  # the measured runs' own lines (the plan's estimate)
    assert run(["case=tiny", f"hydra.run.dir={bad}", "timing.held_activations_mib=-1", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "held_activations_mib" in err[0] and "fix timing." in err[0]
    assert not bad.exists()


@pytest.mark.slow
def test_functional_group_measures_the_device_without_a_model(tmp_path, monkeypatch):
    import torch

    from autotuner.model import build as model

    def no_model(*args, **kwargs):
        raise AssertionError("the functional ops need no Megatron model")

    monkeypatch.setattr(model, "build_model", no_model)
    calibration = tmp_path / "calibration.json"
    ceilings = {"peak_flops": {"fp32": 1e11}, "memory_bandwidth": 1e10, "h2d_pinned": 2e10}
    calibration.write_text(json.dumps(ceilings))
    run_dir = tmp_path / "run"
    overrides = ["ops=[functional]", "shapes.seq_len=[16]", "shapes.micro_batch_size=[2]"]
    assert (
        run(["case=tiny", f"hydra.run.dir={run_dir}", f"calibration={calibration}", *overrides, *FAST]) == 0
    )
    rows = {r["op"]: r for r in _check_files(run_dir)}
    assert {r["phase"] for r in rows.values()} == {"forward"}  # no backward rows
    hidden, fp32 = 64, 4  # cases/tiny.yaml
    cuda = torch.cuda.is_available()
    assert rows["matmul"]["flops"] == 2 * (16 * 2) * hidden * hidden
    copy = rows["copy"]
    assert copy["bytes_moved"] == 2 * 16 * 2 * hidden * fp32  # read once, written once
    assert copy["bound"] == "memory"
    assert copy["ceiling_fraction"] == pytest.approx(copy["gbps"] * 1e9 / 1e10)
    for name in ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned"):
        assert rows[name]["status"] == ("ok" if cuda else "skipped"), rows[name]
        if cuda:
            assert rows[name]["bytes_moved"] == 16 * 2 * hidden * fp32 and rows[name]["gbps"] > 0
    if cuda:
        assert rows["h2d_pinned"]["bound"] == "h2d_pinned" and rows["h2d_pinned"]["ceiling_fraction"] > 0


@pytest.mark.parametrize(
    "module",
    [
        "compare",
        "nsys_read",
        "tune",
        "calibrate",
        "report.__main__",
        "predict.__main__",
        "capture.__main__",
        "launcher_agreement",
    ],
)
def test_every_tools_bad_arguments_are_one_line_and_exit_2(module, capsys, monkeypatch):
    """A flag where the grammar wants key=value is one line naming the setting, exit code 2
    (autotuner.cli)."""
    import importlib

    main = importlib.import_module(f"autotuner.{module}").main
    monkeypatch.setattr(sys, "argv", [module, "--bogus-option"])  # capture's main reads sys.argv
    if module == "capture.__main__":
        with pytest.raises(SystemExit) as ended:
            main()
        code = ended.value.code
    else:
        code = main(["--bogus-option"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "error:" in err[0] and "(see --help)" in err[0], err
    assert "bogus_option=" in err[0], err


TOOLS = (
    "compare",
    "report.__main__",
    "nsys_read",
    "launcher_agreement",
    "capture.__main__",
    "calibrate",
    "predict.__main__",
    "tune",
)


@pytest.mark.parametrize("module", TOOLS)
def test_every_tools_help_lists_each_setting_with_its_meaning(module, capsys):
    """One grammar: every command but autotuner takes paths then key=value settings, and --help names
    each setting of its settings class with its meaning (and default where it has one)."""
    import dataclasses
    import importlib

    command = importlib.import_module(f"autotuner.{module}").COMMAND
    with pytest.raises(SystemExit) as ended:
        from autotuner.cli import parse

        parse(command, ["--help"])
    out = capsys.readouterr().out
    assert ended.value.code == 0 and out.startswith(f"usage: {command.name} ")
    words = " ".join(out.split())  # a long meaning is wrapped
    for field in dataclasses.fields(command.settings):
        assert f"  {field.name}=" in out and " ".join(field.metadata["meaning"].split()) in words, field.name


def _console_scripts() -> dict[str, str]:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.slow
def test_each_console_commands_help_names_it_and_says_every_setting_with_its_meaning_and_default():
    """Each console script's --help, run as the user runs it: the usage names the command as typed (not
    ``python -m``), every setting is listed with a meaning and a default (or says it is required), the
    ops' descriptions are whole sentences, and only launchers are listed as launchers."""
    import importlib
    import sysconfig

    from autotuner.config import LAUNCHER_SCHEMAS, AutotunerConfig

    scripts = Path(sysconfig.get_path("scripts"))
    started = {
        name: subprocess.Popen(
            [str(scripts / name), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for name in _console_scripts()
    }
    helps = {}
    for name, proc in started.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and not err.strip(), (name, err.decode()[-2000:])
        helps[name] = out.decode()
    for name, target in _console_scripts().items():
        text = helps[name]
        assert "python -m" not in text, (name, [line for line in text.splitlines() if "python -m" in line])
        assert re.search(rf"^usage: {re.escape(name)} ", text, re.IGNORECASE | re.MULTILINE), (
            name,
            text[:300],
        )
        settings = (
            importlib.import_module(target.partition(":")[0]).COMMAND.settings
            if name != "autotuner"
            else None
        )
        launchers = [("launcher.", schema) for schema in LAUNCHER_SCHEMAS.values()]
        classes = [("", settings)] if settings else [("", AutotunerConfig), *launchers]
        entries = re.split(r"\n  (?=\S+=)", text)  # "  key=VALUE" then its wrapped meaning
        listed = {entry.split("=", 1)[0]: " ".join(entry.split()) for entry in entries[1:]}
        for prefix, cls in classes:
            for key in _leaf_keys(cls, prefix):
                said = listed.get(key, "")
                assert "(default" in said or "required" in said, (name, key, said)
                assert len(said.split()) > 3, (name, key, said)  # a meaning, not only a default
    ops = helps["autotuner"].split("Ops (")[1].split("\n\n")[0].split("\n")[1:]
    descriptions = " ".join(" ".join(ops).split())
    for entry in re.split(r" (?=[a-z0-9_]+ {2,}[A-Z])", descriptions):
        assert entry.rstrip().endswith((".", ")")), entry  # not cut mid-sentence
    launchers = helps["autotuner"].split("Launchers (")[1].split("\n")[0]
    assert "schema" not in launchers and all(name in launchers for name in LAUNCHER_SCHEMAS), launchers


def _leaf_keys(cls: type, prefix: str) -> list[str]:
    """The ``key`` of each setting of ``cls`` as --help writes it (``timing.warmup``, ``hf.FIELD``)."""
    import dataclasses

    keys = []
    for field in dataclasses.fields(cls):
        default = (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        )
        if dataclasses.is_dataclass(default):
            keys += _leaf_keys(type(default), f"{prefix}{field.name}.")
        elif isinstance(default, dict):
            keys.append(f"{prefix}{field.name}.{field.metadata['metavar']}")
        elif default != "???" and field.name != "name":  # the launcher group's choice, and its name
            keys.append(f"{prefix}{field.name}")
    return keys


@pytest.mark.slow
def test_on_the_default_timing_a_row_warns_only_where_its_median_is_uncertain(tmp_path, capsys):
    """get_data at its default timing settings: a warning marks a median whose confidence interval is over
    10% of it (or cannot be given), or a drift over 25%, never a mere spread of the samples; the summary
    names each kind once with what to do."""
    ops = "ops=[rope,self_attn_bda,linear_fc2,final_layernorm]"
    assert run(["case=tiny", ops, "progress=false", "report=false", f"hydra.run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    rows = load_rows(tmp_path / "results.jsonl")
    for row in rows:
        for warning in filter(None, row["warnings"].split(";")):
            kind = warning.split("(")[0]
            assert kind in ("imprecise", "few_samples", "drift"), row
            if kind == "imprecise":
                assert row["rel_ci"] > 0.10, row
            if kind == "few_samples":
                assert row["rel_ci"] is None and row["samples"] < 6, row
        if row["rel_ci"] is not None and row["rel_ci"] <= 0.10:
            assert "imprecise" not in row["warnings"] and "few_samples" not in row["warnings"], row
    kinds = {w.split("(")[0] for row in rows for w in filter(None, row["warnings"].split(";"))}
    for kind in kinds:
        assert sum(line.startswith(f"  {kind}: ") for line in out.splitlines()) == 1, out
