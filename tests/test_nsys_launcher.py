"""The nsys launcher end to end, with a real Nsight Systems on the CPU (no mock, no skip).

One full ``case=tiny launcher=nsys`` run (module fixture) serves the report, table and nesting checks;
small runs cover the faults: no nsys, nsys refusing its arguments, the worker killed mid-run. Kernel
attribution needs a GPU report: a small hand-built SQLite checks that it reaches the rows.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from autotuner.config import NsysLauncherConfig
from autotuner.errors import UserError
from autotuner.launchers import nsys_command as nsys_lookup
from autotuner.launchers import nsys_process
from autotuner.launchers.nsys_command import nsys_command
from autotuner.launchers.nsys_process import NsysRun
from autotuner.launchers.nsys_protocol import marker_name
from autotuner.launchers.nsys_report import NvtxRange, OpenRange, read_nvtx_ranges
from autotuner.launchers.nsys_rows import Outcome, build_rows, measured_ranges, read_sqlite
from autotuner.main import run
from autotuner.op_mapping import LAYER_SUB_OPS
from autotuner.ops.naming import format_range, parse_range
from autotuner.ops_test.base import ShapePoint
from autotuner.results import COLUMNS, load_rows
from tests.conftest import PLAN_LINE, dense_model_ops

REPO = Path(__file__).resolve().parents[1]
POINT = "s16_b1"
ITERATIONS = 2
SMALL = [
    "shapes.seq_len=[16]",
    "shapes.micro_batch_size=[1]",
    "launcher.warmup=1",
    f"launcher.iterations={ITERATIONS}",
    "progress=false",
]
# The sub-ops of a TransformerLayer in model order (Megatron calls RoPE twice: on q, then on k).
LAYER_OPS = [op for op in LAYER_SUB_OPS if op in dense_model_ops()]  # case=tiny: no MLA, no MoE
# Their backward ranges open in reverse model order, each container (mlp, self_attention) as soon as
# its output gradient is ready, i.e. before the sub-ops inside it.
LAYER_OPS_BACKWARD = [
    "mlp_bda",
    "mlp",
    "linear_fc2",
    "activation",
    "linear_fc1",
    "pre_mlp_layernorm",
    "self_attn_bda",
    "self_attention",
    "linear_proj",
    "core_attention",
    "rope",
    "linear_qkv",
    "input_layernorm",
]
CONTAINERS = {
    "self_attention": {"linear_qkv", "rope", "core_attention", "linear_proj"},
    "mlp": {"linear_fc1", "activation", "linear_fc2"},
}


@dataclass
class Launch:
    code: int
    run_dir: Path
    stdout: str
    stderr: str


def _launch(nsys_bin: str | None, run_dir: Path, *overrides: str) -> Launch:
    """``python -m autotuner.main`` in this process (one Megatron import for every run); ``nsys_bin``
    None leaves the launcher to look for nsys."""
    out, err = io.StringIO(), io.StringIO()
    explicit = [] if nsys_bin is None else [f"launcher.nsys_bin={nsys_bin}"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(["launcher=nsys", *explicit, f"hydra.run.dir={run_dir}", "report=false", *overrides])
    return Launch(code, run_dir, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def tiny(nsys_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return _launch(nsys_bin, tmp_path_factory.mktemp("nsys_tiny"), "case=tiny", *SMALL)


@pytest.fixture(scope="module")
def tiny_ranges(tiny: Launch) -> list[NvtxRange]:
    return read_nvtx_ranges(tiny.run_dir / "report.sqlite")


def _window(ranges: list[NvtxRange], op: str, phase: str) -> NvtxRange:
    (window,) = [r for r in ranges if r.name == marker_name(op, phase, POINT)]
    return window


# --- the full run ------------------------------------------------------------------------------


@pytest.mark.nsys
def test_tiny_run_writes_report_sqlite_and_table(tiny: Launch) -> None:
    assert tiny.code == 0, tiny.stderr[-3000:]
    for name in ("report.nsys-rep", "report.sqlite", "results.csv", "results.jsonl", "nsys.log"):
        assert (tiny.run_dir / name).is_file(), name
    rows = load_rows(tiny.run_dir / "results.jsonl")
    with open(tiny.run_dir / "results.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert list(table[0]) == COLUMNS and len(table) == len(rows)
    assert [(r["op"], r["phase"]) for r in rows] == [
        (op, ph) for op in dense_model_ops() for ph in ("forward", "backward")
    ]
    for row in rows:
        assert row["status"] == "ok", row
        assert (row["launcher"], row["point"], row["stop_reason"]) == ("nsys", POINT, "nsys")
        assert row["samples"] == ITERATIONS
        assert 0 < row["min_us"] <= row["median_us"]
        assert row["kernel_time_us"] is None and row["top_kernels"] is None  # no GPU, no kernels
    assert rows[0]["weight_bytes"] > 0  # the embedding table
    # The table on stdout: every row, none failed.
    assert "linear_qkv" in tiny.stdout and f"{len(rows)} rows (0 failed)" in tiny.stdout


@pytest.mark.nsys
def test_report_holds_every_op_phase_and_iteration(tiny: Launch, tiny_ranges: list[NvtxRange]) -> None:
    names = {r.name for r in tiny_ranges}
    for op in dense_model_ops():
        for phase in ("forward", "backward"):
            for i in range(ITERATIONS):
                assert format_range(op, phase, POINT, i) in names
            assert format_range(op, phase, POINT, 0, warmup=True) in names
            assert marker_name(op, phase, POINT) in names


@pytest.mark.nsys
def test_rows_are_the_ops_own_ranges_in_their_window(tiny: Launch, tiny_ranges: list[NvtxRange]) -> None:
    """linear_qkv's forward name also appears nested in every op that contains it and in its backward
    phase (the forward before each backward); the row is made of the ranges in its own window only."""
    rows = {(r["op"], r["phase"]): r for r in load_rows(tiny.run_dir / "results.jsonl")}
    for op, phase in [
        ("linear_qkv", "forward"),
        ("linear_qkv", "backward"),
        ("transformer_layer", "backward"),
    ]:
        window = _window(tiny_ranges, op, phase)
        durations = sorted(
            r.duration_ns
            for r in tiny_ranges
            if r.parsed is not None
            and (r.parsed.op, r.parsed.phase, r.parsed.warmup) == (op, phase, False)
            and window.start_ns <= r.start_ns <= r.end_ns <= window.end_ns
        )
        assert len(durations) == ITERATIONS
        assert rows[(op, phase)]["min_us"] == pytest.approx(durations[0] / 1e3)
        assert rows[(op, phase)]["median_us"] == pytest.approx(sum(durations) / len(durations) / 1e3)
    everywhere = [r for r in tiny_ranges if r.name == format_range("linear_qkv", "forward", POINT, 0)]
    assert len(everywhere) > 2


def _inside(outer: NvtxRange, ranges: list[NvtxRange], phase: str, iteration: int) -> list[NvtxRange]:
    """Our ranges of ``phase`` and ``iteration`` on outer's thread that start inside it, by start."""
    return sorted(
        (
            r
            for r in ranges
            if r.parsed is not None
            and r is not outer
            and r.global_tid == outer.global_tid
            and (r.parsed.phase, r.parsed.point, r.parsed.iteration, r.parsed.warmup)
            == (phase, POINT, iteration, False)
            and outer.start_ns <= r.start_ns <= outer.end_ns
        ),
        key=lambda r: r.start_ns,
    )


def _dedupe(ops: list[str]) -> list[str]:
    return [op for i, op in enumerate(ops) if i == 0 or ops[i - 1] != op]


@pytest.mark.nsys
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_layer_sub_op_ranges_nest_in_model_order(tiny_ranges: list[NvtxRange], phase: str) -> None:
    window = _window(tiny_ranges, "transformer_layer", phase)
    for i in range(ITERATIONS):
        (layer,) = [
            r
            for r in tiny_ranges
            if r.name == format_range("transformer_layer", phase, POINT, i)
            and window.start_ns <= r.start_ns <= window.end_ns
        ]
        inner = _inside(layer, tiny_ranges, phase, i)
        for r in inner:
            assert r.end_ns <= layer.end_ns, f"{r.name} ends after {layer.name}"
        expected = LAYER_OPS if phase == "forward" else LAYER_OPS_BACKWARD
        assert _dedupe([r.parsed.op for r in inner]) == expected
        # Each container holds its sub-ops' ranges.
        for container, members in CONTAINERS.items():
            (outer,) = [r for r in inner if r.parsed.op == container]
            held = {r.parsed.op for r in _inside(outer, tiny_ranges, phase, i) if r.end_ns <= outer.end_ns}
            assert held == members, (container, held)
        # Nothing of this phase and iteration runs inside the window outside the layer's range.
        stray = [
            r
            for r in tiny_ranges
            if r.parsed is not None
            and r.parsed.op in LAYER_OPS
            and (r.parsed.phase, r.parsed.iteration, r.parsed.warmup) == (phase, i, False)
            and window.start_ns <= r.start_ns <= window.end_ns
            and not layer.start_ns <= r.start_ns <= layer.end_ns
        ]
        assert stray == []


@pytest.mark.nsys
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_block_holds_its_layers(tiny_ranges: list[NvtxRange], phase: str) -> None:
    window = _window(tiny_ranges, "transformer_block", phase)
    (block,) = [
        r
        for r in tiny_ranges
        if r.name == format_range("transformer_block", phase, POINT, 0)
        and window.start_ns <= r.start_ns <= window.end_ns
    ]
    layers = [r for r in _inside(block, tiny_ranges, phase, 0) if r.parsed.op == "transformer_layer"]
    assert len(layers) == 2  # transformer_block_layers
    assert all(r.end_ns <= block.end_ns for r in layers)
    assert layers[0].end_ns <= layers[1].start_ns  # one after the other, not nested in each other


# --- faults ------------------------------------------------------------------------------------


def test_missing_nsys_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = _launch(str(tmp_path / "no-such-nsys"), tmp_path / "run", "case=tiny", *SMALL)
    assert result.code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "nsys not found" in lines[0]
    assert "scripts/install_nsys.sh" in lines[0] and "launcher.nsys_bin" in lines[0]


@pytest.mark.nsys
def test_nsys_failure_prints_its_tail_and_no_shell_runs(
    nsys_bin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A switch nsys refuses: its message, a non-zero exit, every row failed naming nsys. The switch
    holds shell syntax, which must reach nsys as text: no shell runs it."""
    monkeypatch.chdir(tmp_path)
    result = _launch(
        nsys_bin,
        tmp_path / "run",
        "case=tiny",
        "ops=[linear_qkv]",
        *SMALL,
        "launcher.extra_args=['--bogus=$(touch pwned);touch pwned2']",
    )
    assert result.code == 1
    assert "nsys profile ended with exit code 1" in result.stderr
    assert "unrecognised option" in result.stderr  # nsys's own words, from the tail
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    rows = load_rows(tmp_path / "run" / "results.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["status"] == "failed" and row["error"].startswith("nsys profile failed (exit code 1)")


# An nsys that answers --version (the real one's) but never starts the program it is to profile.
_NSYS_THAT_NEVER_STARTS = """#!{python}
import os, sys, time
if sys.argv[1:2] != ["profile"]:
    os.execv({real!r}, [{real!r}, *sys.argv[1:]])
open({pid_file!r}, "w").write(str(os.getpid()))
time.sleep(3600)
"""


@pytest.mark.nsys
def test_an_nsys_that_never_starts_the_worker_is_killed_after_the_start_timeout(
    nsys_bin: str, tmp_path: Path
) -> None:
    """It had waited for ever. After launcher.start_timeout_s it is killed, and the run refused in one
    line naming the nsys and the setting; nothing of it is left running."""
    wrapper, pid_file = tmp_path / "nsys", tmp_path / "nsys.pid"
    wrapper.write_text(
        _NSYS_THAT_NEVER_STARTS.format(python=sys.executable, real=nsys_bin, pid_file=str(pid_file))
    )
    wrapper.chmod(0o755)
    started = time.monotonic()
    result = _launch(
        str(wrapper), tmp_path / "run", "case=tiny", "ops=[linear_qkv]", *SMALL, "launcher.start_timeout_s=2"
    )
    assert result.code == 2 and time.monotonic() - started < 120, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("autotuner: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{wrapper} did not start the worker within launcher.start_timeout_s=2 s" in errors[0]
    assert "raise launcher.start_timeout_s" in errors[0]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    assert not (tmp_path / "run" / "results.jsonl").exists()


# Inside a mount namespace with a small tmpfs at DISK: a run whose report's SQLite export does not fit;
# what it said, and the run folder (the tmpfs ends with the namespace), copied to OUT.
_ON_A_SMALL_DISK = """
import json, os, shutil, subprocess, sys
disk, out, args = sys.argv[1], sys.argv[2], sys.argv[3:]
proc = subprocess.run([sys.executable, "-m", "autotuner.main", *args, f"hydra.run.dir={disk}/run"],
                      capture_output=True, text=True, timeout=600)
shutil.copytree(os.path.join(disk, "run"), os.path.join(out, "run"))
open(os.path.join(out, "said.json"), "w").write(json.dumps({"code": proc.returncode, "err": proc.stderr}))
"""


@pytest.mark.nsys
@pytest.mark.slow
def test_a_disk_too_small_for_the_reports_export_leaves_no_export_and_says_so(nsys_bin: str, tmp_path: Path):
    """On a disk too small for report.sqlite nsys export exits 0 leaving an empty file, which was read as a
    report without ranges (every row "no measured range ... nvtx package") and kept beside the run as if
    valid. The export is checked whole before it is kept: none is left, the rows and one line name the
    cause and the way on (free space, then nsys_read the report, which is whole)."""
    from tests.namespaces import namespaced

    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    script = tmp_path / "small_disk.py"
    script.write_text(_ON_A_SMALL_DISK)
    args = ["case=tiny", "launcher=nsys", f"launcher.nsys_bin={nsys_bin}", "ops=[linear_qkv]", *SMALL]
    # 3 MiB: the run's files and report.nsys-rep (under 1 MiB) fit, its SQLite export (over 3) does not
    command = namespaced([sys.executable, script, disk, out, *args, "report=false"], tmpfs=[(disk, "3m")])
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads((out / "said.json").read_text())
    run_dir = out / "run"
    assert said["code"] == 1 and "Traceback" not in said["err"], said["err"][-3000:]
    assert (run_dir / "report.nsys-rep").is_file()
    assert not [p.name for p in run_dir.iterdir() if p.suffix == ".sqlite"]  # no export left to misread
    ours = [
        line
        for line in said["err"].splitlines()
        if line.startswith("autotuner: ") and "nsys 20" not in line and not PLAN_LINE.match(line)
    ]
    assert len(ours) == 1, said["err"][-3000:]
    assert (
        f"nsys export of {disk}/run/report.nsys-rep" in ours[0] and "so no report.sqlite is kept" in ours[0]
    )
    assert "a full disk? free space, then read the report again with python -m autotuner.nsys_read" in ours[0]
    rows = load_rows(run_dir / "results.jsonl")
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all(r["error"].startswith("no report to read: nsys export of") for r in rows)


def _worker_pid(run_dir: Path) -> int | None:
    """The worker that nsys started for ``run_dir`` (not nsys itself, whose arguments name it too)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"autotuner.launchers.nsys_worker" in args
            and str(run_dir).encode() in args
            and b"nsys" not in args[0]
        ):
            return int(proc.name)
    return None


def _kill_worker_after(run_dir: Path, rows: int, done: threading.Event, killed: list[int]) -> None:
    results = run_dir / "worker" / "results.jsonl"
    while not done.is_set():
        if results.is_file() and len(results.read_text().splitlines()) >= rows:
            pid = _worker_pid(run_dir)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.002)


def launch_killed_after(nsys_bin: str, run_dir: Path, rows: int, *overrides: str) -> Launch:
    """``_launch`` of case=tiny's embedding and layer at s16 and s32, the worker SIGKILLed once ``rows``
    rows are done (asserted: it was)."""
    done, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_worker_after, args=(run_dir, rows, done, killed), daemon=True)
    watcher.start()
    try:
        result = _launch(
            nsys_bin,
            run_dir,
            "case=tiny",
            "ops=[embedding,transformer_layer]",
            "shapes.seq_len=[16,32]",
            "shapes.micro_batch_size=[1]",
            *overrides,
            "progress=false",
        )
    finally:
        done.set()
        watcher.join()
    assert killed, "the worker finished before it could be killed"
    return result


@pytest.mark.nsys
def test_worker_killed_mid_run(nsys_bin: str, tmp_path: Path) -> None:
    """SIGKILL the worker once two rows are done: what nsys saved is read, the rest is named."""
    run_dir = tmp_path / "run"
    result = launch_killed_after(nsys_bin, run_dir, 2, "launcher.warmup=1", "launcher.iterations=3")
    assert result.code == 1
    assert "killed by SIGKILL" in result.stderr
    assert (run_dir / "report.sqlite").is_file()

    rows = load_rows(run_dir / "results.jsonl")
    assert len(rows) == 8
    statuses = [r["status"] for r in rows]
    first_failed = statuses.index("failed")
    # The rows done well before the kill are read from the report. The last one done may not be: the
    # NVTX events wait in the process's buffer before nsys collects them, and a SIGKILL drops what was
    # not sent (seen once in a clean-clone run under load): it is then failed with that reason below.
    assert first_failed >= 1 and statuses[:first_failed] == ["ok"] * first_failed
    assert set(statuses[first_failed:]) == {"failed"}
    for row in rows[:first_failed]:  # read from the report nsys saved after the kill
        assert 1 <= row["samples"] <= 3 and row["median_us"] > 0
    assert rows[0]["samples"] == 3  # done well before the kill: every iteration was saved
    errors = [r["error"] for r in rows[first_failed:]]
    while_measuring = [e for e in errors if "died while measuring it" in e]
    assert len(while_measuring) <= 1 and (not while_measuring or errors[0] == while_measuring[0])
    for error in errors:
        assert "the profiled process died" in error and "killed by SIGKILL" in error, error


# --- finding nsys ------------------------------------------------------------------------------


def _path_without_nsys() -> str:
    """$PATH less every folder that holds an nsys, so only the launcher's own search can find one."""
    return os.pathsep.join(
        d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nsys").exists()
    )


def _fake_nsys(path: Path, version: str, answers: bool = True) -> Path:
    """A program that answers ``nsys --version`` as nsys does (or fails): the search runs nothing else."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"#!/bin/sh\necho 'NVIDIA Nsight Systems version {version}'\nexit {0 if answers else 1}\n"
    )
    path.chmod(0o755)
    return path


@pytest.mark.nsys
def test_default_nsys_bin_finds_the_project_install(
    nsys_bin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The design card's command, as written: no launcher.nsys_bin and no nsys on the PATH; the nsys of
    ``make tools`` (.tools/nsys) is found, named first on stderr and in environment.json."""
    monkeypatch.setenv("PATH", _path_without_nsys())
    project = nsys_lookup.PROJECT_ROOT / nsys_lookup.PROJECT_NSYS
    assert project.is_file(), "make tools / scripts/install_nsys.sh installs nsys here"
    result = _launch(None, tmp_path / "run", "case=tiny", "ops=[linear_qkv]", *SMALL)
    assert result.code == 0, result.stderr[-3000:]
    rows = load_rows(result.run_dir / "results.jsonl")
    assert [(r["op"], r["phase"], r["status"]) for r in rows] == [
        ("linear_qkv", "forward", "ok"),
        ("linear_qkv", "backward", "ok"),
    ]
    environment = json.loads((result.run_dir / "environment.json").read_text())["environment"]
    assert environment["nsys_path"] == str(project)
    assert environment["nsys_version"].startswith("NVIDIA Nsight Systems version 20")
    version = environment["nsys_version"].split()[-1]
    assert result.stderr.splitlines()[0] == f"autotuner: nsys {version} at {project}"


def test_search_order_path_project_then_newest_cuda_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, project = tmp_path / "root", tmp_path / "checkout"
    opt = root / "opt/nvidia/nsight-systems"
    _fake_nsys(opt / "2023.1/bin/nsys", "2023.1.1")
    _fake_nsys(opt / "2023.4.1/bin/nsys", "2023.4.1")
    newest = _fake_nsys(opt / "2024.2/bin/nsys", "2024.2.3")
    _fake_nsys(opt / "2025.1/bin/nsys", "2025.1.1", answers=False)  # broken: passed over
    cuda_12_10 = _fake_nsys(root / "usr/local/cuda-12.10/bin/nsys", "2024.1.1")
    cuda_12_4 = _fake_nsys(root / "usr/local/cuda-12.4/bin/nsys", "2023.4.4")
    (root / "usr/local/cuda").symlink_to("cuda-12.4")  # the usual link: tried first, and only once
    monkeypatch.setenv("PATH", _path_without_nsys())

    candidates = nsys_lookup.nsys_candidates(project, root)
    assert candidates == [
        root / "usr/local/cuda/bin/nsys",
        opt / "2025.1/bin/nsys",
        newest,
        opt / "2023.4.1/bin/nsys",
        opt / "2023.1/bin/nsys",
        cuda_12_10,  # 12.10 is newer than 12.4, which the cuda link already named
    ]
    assert cuda_12_4.resolve() == candidates[0].resolve()
    found = nsys_lookup.find_nsys("nsys", project, root)
    assert found.path == str(root / "usr/local/cuda/bin/nsys") and found.short_version == "2023.4.4"
    (root / "usr/local/cuda").unlink()
    found = nsys_lookup.find_nsys("nsys", project, root)
    assert (found.path, found.version) == (str(newest), "NVIDIA Nsight Systems version 2024.2.3")

    # The project's own install comes before the system's, and the PATH before both.
    own = _fake_nsys(project / nsys_lookup.PROJECT_NSYS, "2022.4.2")
    assert nsys_lookup.find_nsys("nsys", project, root).path == str(own)
    on_path = _fake_nsys(tmp_path / "bin/nsys", "2023.2.1")
    monkeypatch.setenv("PATH", os.pathsep.join([str(on_path.parent), _path_without_nsys()]))
    assert nsys_lookup.find_nsys("nsys", project, root).path == str(on_path)

    # An explicit launcher.nsys_bin is used alone: found, or an error (never another nsys instead).
    assert nsys_lookup.find_nsys(str(cuda_12_4), project, root).path == str(cuda_12_4)
    with pytest.raises(UserError, match="launcher.nsys_bin=.*does not answer --version"):
        nsys_lookup.find_nsys(str(opt / "2025.1/bin/nsys"), project, root)
    with pytest.raises(UserError, match="nsys not found"):
        nsys_lookup.find_nsys(str(tmp_path / "elsewhere/nsys"), project, root)


def test_no_nsys_anywhere_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", _path_without_nsys())
    monkeypatch.setattr(nsys_lookup, "PROJECT_ROOT", tmp_path / "checkout")
    monkeypatch.setattr(nsys_lookup, "SYSTEM_ROOT", tmp_path / "root")
    result = _launch(None, tmp_path / "run", "case=tiny", *SMALL)
    assert result.code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("autotuner: error: nsys not found (launcher.nsys_bin='nsys'")
    assert "make tools" in lines[0] and "/opt/nvidia/nsight-systems/*/bin" in lines[0]
    assert not (tmp_path / "run" / "results.jsonl").exists()


# --- stopping a run: SIGTERM, SIGINT -----------------------------------------------------------


def _processes_naming(text: str) -> list[str]:
    """Live processes whose command line holds ``text`` (zombies have none)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                args = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in args:
                words = args.replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name}: {words}")
    return found


def _start_a_long_nsys_run(run_dir: Path, iterations: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``python -m autotuner.main ... launcher=nsys``, returned once its worker has finished a row. A
    session of its own: a signal goes to the main process alone, as from `kill <pid>`."""
    cmd = [
        sys.executable,
        "-m",
        "autotuner.main",
        "case=tiny",
        "launcher=nsys",
        f"launcher.iterations={iterations}",
        "shapes.seq_len=[16,32]",
        "shapes.micro_batch_size=[1]",
        "progress=false",
        "report=false",
        f"hydra.run.dir={run_dir}",
    ]
    worker_rows = run_dir / "worker" / "results.jsonl"
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (worker_rows.is_file() and worker_rows.read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the worker wrote no row in 240 s"
            time.sleep(0.05)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # it may have ended already (the failure said why)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc


@pytest.mark.nsys
@pytest.mark.slow
def test_a_launcher_killed_outright_leaves_no_nsys_or_worker_behind(nsys_bin: str, tmp_path: Path) -> None:
    """SIGKILL of the launcher (torchrun's agent 30 s after its SIGTERM, SLURM after KillWait) passes no
    stop on: the worker sees its launcher gone and stops, and nsys ends with it."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # 990 iterations a row: the plan would take the worker minutes more (the most a launcher takes)
    proc = _start_a_long_nsys_run(run_dir, 990, env)
    running = _processes_naming(str(run_dir))
    assert any("autotuner.launchers.nsys_worker" in line for line in running), running
    nsys_pids = [line.split(":")[0] for line in running if "nsys profile" in line]
    assert len(nsys_pids) == 1, running

    def left() -> list[str]:  # the run's processes, and the agent nsys started (named by nsys's pid)
        agent = f"--session-name=profile-python-{nsys_pids[0]}\0"  # the NUL: not another nsys's 12345
        return _processes_naming(str(run_dir)) + _processes_naming(agent)

    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed = time.monotonic()
    try:
        while left() and time.monotonic() < killed + 30:
            time.sleep(0.2)
        assert left() == []
    except AssertionError:
        for line in left():  # what the failure left, ended here rather than at the suite's end
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        raise
    print(f"gone {time.monotonic() - killed:.1f} s after the launcher's SIGKILL")


@pytest.mark.nsys
@pytest.mark.slow
def test_nsys_killed_mid_run_ends_the_worker_at_once(nsys_bin: str, tmp_path: Path) -> None:
    """nsys itself SIGKILLed (the OOM killer's choice, a crash): the worker, left measuring with nothing
    recording it, held nsys's output pipe open, so the launcher waited for the whole plan (45 s here at
    990 iterations a row); now it is ended with whatever nsys left (its agent: up to AGENT_GRACE_S)."""
    run_dir, temporary = tmp_path / "run", tmp_path / "tmp"
    temporary.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = _start_a_long_nsys_run(run_dir, 990, {**env, "TMPDIR": str(temporary)})
    running = _processes_naming(str(run_dir))
    nsys_pids = [line.split(":")[0] for line in running if "nsys profile" in line]
    assert len(nsys_pids) == 1, running

    def left() -> list[str]:
        return _processes_naming(str(run_dir)) + _processes_naming(
            f"--session-name=profile-python-{nsys_pids[0]}\0"
        )

    os.kill(int(nsys_pids[0]), signal.SIGKILL)
    killed = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=120)
        ended = time.monotonic() - killed
        assert ended < nsys_process.AGENT_GRACE_S + 25, f"the launcher ended {ended:.1f} s after nsys"
        assert left() == []
    finally:
        for line in left():  # what a failure left, ended here rather than at the suite's end
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    err = stderr.decode(errors="replace")
    assert proc.returncode == 1 and "nsys profile ended with killed by SIGKILL" in err, err[-3000:]
    rows = load_rows(run_dir / "results.jsonl")
    assert len(rows) == len(dense_model_ops()) * 2 * 2
    assert all(r["status"] == "failed" and "SIGKILL" in r["error"] for r in rows), rows[0]
    assert list(temporary.iterdir()) == []  # nsys's .qdstrm went with its folder
    print(f"launcher ended {ended:.1f} s after nsys's SIGKILL")


def test_an_agent_left_running_after_nsys_is_ended() -> None:
    """After nsys's "Connection to the Agent lost." its agent stayed for good. A process with an agent's
    command line (nsys's pid in its session name) stands in for it: ended after the grace, said in one
    line; another nsys's agent is left alone."""
    nsys_pid = 4_000_000  # above any pid_max: no real nsys has it
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "--start-agent"]
    ours = subprocess.Popen([*sleeper, f"--session-name=profile-python-{nsys_pid}"])
    other = subprocess.Popen([*sleeper, f"--session-name=profile-python-{nsys_pid}1"])
    try:
        deadline = time.monotonic() + 10  # until the interpreter shows its command line
        while nsys_process._agents_of(nsys_pid) != [ours.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            nsys_process.end_agent(nsys_pid, grace_s=0.5)
        assert ours.wait(timeout=5) == -signal.SIGTERM
        assert other.poll() is None
        assert err.getvalue() == (
            f"autotuner: nsys's agent (pid {ours.pid}) still ran 0.5 s after nsys ended: ending it\n"
        )
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


@pytest.mark.nsys
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_reaches_nsys_and_worker_and_keeps_what_was_measured(
    nsys_bin: str, tmp_path: Path, signum: signal.Signals
) -> None:
    """A real ``python -m autotuner.main`` process, signalled once its worker has finished a row: it
    exits 128 + N with nsys's report read, the measured rows ok, the rest failed, and nothing left."""
    run_dir = tmp_path / "run"
    # At 500 iterations a row the rest of the plan takes the worker half a minute or more after the first
    # row (6.7 s at 50, on the 2-core VM with a second suite beside it): the stop always comes first. (A
    # plan once measured to its end after the signal: the worker's stop was lost in a finalizer, see
    # test_faults.test_a_stop_signal_that_lands_in_a_finalizer_still_stops_the_measuring.)
    iterations = 500
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = _start_a_long_nsys_run(run_dir, iterations, env)
    try:
        os.kill(proc.pid, signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = stderr.decode(errors="replace")
    assert proc.returncode == 128 + signum, err[-3000:]
    assert _processes_naming(str(run_dir)) == []
    assert f"autotuner: interrupted by {signum.name}" in err.splitlines()[-1]
    assert (run_dir / "report.nsys-rep").is_file()

    rows = load_rows(run_dir / "results.jsonl")
    with open(run_dir / "results.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == len(rows) == len(dense_model_ops()) * 2 * 2
    statuses = [r["status"] for r in rows]
    assert "failed" in statuses, "the plan finished before the signal"
    first_failed = statuses.index("failed")
    assert first_failed >= 1 and statuses[:first_failed] == ["ok"] * first_failed
    assert set(statuses[first_failed:]) == {"failed"}
    for row in rows[:first_failed]:
        # every iteration's range, or those nsys saved before the signal ended its collection, said so
        lost = f"ranges_lost({row['samples']}/{iterations})" in (row["warnings"] or "")
        assert (row["samples"] == iterations or lost) and row["median_us"] > 0, row
    for row in rows[first_failed:]:
        assert "the profiled process died" in row["error"] and signum.name in row["error"], row
    assert "before measuring it" in rows[-1]["error"]
    report = subprocess.run(
        [sys.executable, "-m", "autotuner.report", str(run_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-3000:]


def test_a_program_that_ignores_the_stop_signal_is_killed_after_the_grace(tmp_path: Path) -> None:
    """StopSignals around a real process group (in place of nsys) that ignores SIGTERM, child included:
    the signal is passed on, and once the grace is over the whole group is killed and run_nsys returns."""
    hold = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    child = f"{hold}time.sleep(120)"
    program = [
        sys.executable,
        "-c",
        f"{hold}subprocess.Popen([sys.executable, '-c', {child!r}, sys.argv[1]]); time.sleep(120)",
        str(tmp_path),  # names the run's processes, for the check below
    ]
    before = signal.getsignal(signal.SIGTERM)
    stop = nsys_process.StopSignals(tmp_path, grace_s=1.0)
    sender = threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    with stop:
        sender.start()
        result = nsys_process.run_nsys(program, tmp_path / "nsys.log", stop)
    elapsed = time.monotonic() - started
    sender.join()
    assert stop.signum == signal.SIGTERM and stop.exit_code == 143
    assert stop.killed == "nsys did not end within 1 s of SIGTERM"
    assert result.returncode == -signal.SIGKILL
    assert 2.0 <= elapsed < 60
    assert _processes_naming(str(tmp_path)) == []
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is gone with the run


# --- under torchrun ----------------------------------------------------------------------------


@pytest.mark.nsys
@pytest.mark.torchrun
@pytest.mark.slow
def test_torchrun_tensor_parallel_with_default_settings(nsys_bin: str, tmp_path: Path) -> None:
    """TP=2 under torchrun with nothing pinned (default iterations, default nsys lookup): it ends, well
    inside the watchdog, with both ranks' rows and the cross-rank max."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "autotuner.main",
        "case=tiny",
        "launcher=nsys",
        "tf.tensor_model_parallel_size=2",
        "ops=[linear_qkv,linear_proj]",
        "shapes.seq_len=[16]",
        "shapes.micro_batch_size=[1]",
        "progress=false",
        "report=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = load_rows(run_dir / "results.jsonl")
    assert {(r["op"], r["phase"], r["rank"]) for r in rows} == {
        (op, phase, rank)
        for op in ("linear_qkv", "linear_proj")
        for phase in ("forward", "backward")
        for rank in (0, 1, "max")
    }
    assert all(r["status"] == "ok" and r["launcher"] == "nsys" for r in rows), rows
    assert all(r["samples"] == NsysLauncherConfig().iterations for r in rows if r["rank"] != "max")
    assert (run_dir / "report-rank0.nsys-rep").is_file() and (run_dir / "report-rank1.nsys-rep").is_file()


# --- the nsys command --------------------------------------------------------------------------


def _launcher(**fields: object) -> object:
    return OmegaConf.structured(NsysLauncherConfig(**fields))


def test_command_defaults_per_device(tmp_path: Path) -> None:
    program = ["python", "-m", "worker"]
    cpu = nsys_command("nsys", _launcher(), torch.device("cpu"), tmp_path / "report", program)
    assert cpu == [
        "nsys",
        "profile",
        "--trace=nvtx,osrt",
        "--sample=none",
        "--cpuctxsw=none",
        f"--output={tmp_path / 'report'}",
        "--force-overwrite=true",
        *program,
    ]
    cuda = nsys_command("nsys", _launcher(), torch.device("cuda"), tmp_path / "report", program)
    assert "--trace=cuda,nvtx,osrt,cublas,cudnn" in cuda
    assert "--capture-range=cudaProfilerApi" in cuda and "--capture-range-end=none" in cuda
    # An extra switch that names a default replaces it (nsys refuses a switch given twice).
    custom = nsys_command(
        "nsys",
        _launcher(extra_args=["-s", "process-tree", "--capture-range-end=repeat"]),
        torch.device("cuda"),
        tmp_path / "report",
        program,
    )
    assert "--sample=none" not in custom and "--capture-range-end=none" not in custom
    assert custom[-6:] == ["-s", "process-tree", "--capture-range-end=repeat", *program]


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"extra_args": ["-o", "elsewhere"]}, "--output/-o"),
        ({"extra_args": ["--trace=cuda"]}, "launcher.trace"),
        ({"trace": ["osrt"]}, "nvtx"),
        ({"trace": ["nvtx", "osrt;rm"]}, "nvtx"),
    ],
)
def test_command_rejects_bad_settings(tmp_path: Path, fields: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        nsys_command("nsys", _launcher(**fields), torch.device("cpu"), tmp_path / "report", ["python"])


# --- kernel attribution reaches the rows (a hand-built GPU report) ------------------------------

MAIN, AUTOGRAD = (7 << 24) | 7, (7 << 24) | 9  # globalTid: pid 7, two threads


def _gpu_report(path: Path) -> Path:
    """linear_qkv's two phases: windows, measured ranges, decoys, and kernels under the forward."""
    fwd = lambda i, warmup=False: format_range("linear_qkv", "forward", POINT, i, warmup)  # noqa: E731
    ranges = [
        (fwd(0, warmup=True), 0, 50, MAIN),  # warm-up: outside the window, never counted
        (marker_name("linear_qkv", "forward", POINT), 90, 1000, MAIN),
        (fwd(0), 100, 300, MAIN),
        (fwd(1), 400, 700, MAIN),
        (marker_name("self_attention", "forward", POINT), 1100, 1900, MAIN),
        (fwd(0), 1200, 1300, MAIN),  # nested in self_attention's measurement: not linear_qkv's row
        (marker_name("linear_qkv", "backward", POINT), 2000, 3000, MAIN),
        (fwd(0), 2100, 2200, MAIN),  # the forward before the backward: not the forward row
        (format_range("linear_qkv", "backward", POINT, 0), 2300, 2500, AUTOGRAD),
    ]
    # (correlation id, launching thread, call start, kernel ns, name)
    kernels = [(1, MAIN, 110, 5000, "gemm"), (2, MAIN, 120, 1000, "bias"), (3, MAIN, 410, 7000, "gemm")]
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.executescript(
            """
            CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
            CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT,
                textId INTEGER, globalTid INTEGER);
            CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, globalTid INTEGER,
                correlationId INTEGER);
            CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, correlationId INTEGER,
                globalPid INTEGER, shortName INTEGER, demangledName INTEGER);
            """
        )
        conn.executemany(
            "INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, ?, NULL, ?)", [(s, e, n, t) for n, s, e, t in ranges]
        )
        names = {"gemm": 1, "bias": 2}
        conn.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, n) for n, i in names.items()])
        for corr, tid, call, duration, name in kernels:
            conn.execute(
                "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?)", (call, call + 5, tid, corr)
            )
            conn.execute(
                "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, ?, ?)",
                (10_000 * corr, 10_000 * corr + duration, corr, tid & ~0xFFFFFF, names[name], names[name]),
            )
    return path


def test_kernel_columns_from_a_gpu_report(tmp_path: Path) -> None:
    report = read_sqlite(_gpu_report(tmp_path / "gpu.sqlite"))
    point, op = ShapePoint(16, 1), SimpleNamespace(name="linear_qkv")
    spec = SimpleNamespace(
        case="tiny",
        dtype="bf16",
        device=torch.device("cuda"),
        tf_config=SimpleNamespace(tensor_model_parallel_size=1),
        call_counts={},
        rank=0,
        row_rank=0,
        emulation=None,
    )
    worker = {
        ("linear_qkv", ph, POINT): {"status": "ok", "weight_bytes": 64, "stop_reason": "nsys"}
        for ph in ("forward", "backward")
    }
    worker[("linear_qkv", "forward", POINT)]["samples"] = 3  # it ran 3 iterations, the report kept 2
    outcome = Outcome(NsysRun(0, ""), worker, None, report)
    forward, backward = build_rows(spec, [(point, op, "forward"), (point, op, "backward")], outcome)

    assert forward["status"] == "ok" and forward["samples"] == 2
    # On a GPU the time is the kernels' (6000 ns: gemm + bias, then 7000 ns), the ranges' is the host's.
    assert (forward["median_us"], forward["min_us"]) == (6.5, 6.0)
    assert forward["host_median_us"] == 0.25  # ranges of 200 and 300 ns
    assert forward["kernel_time_us"] == 6.5
    assert forward["kernel_count"] == 1.5
    assert forward["top_kernels"] == "gemm 6.0us x1; bias 0.5us x0.5"  # per iteration
    assert forward["weight_bytes"] == 64 and forward["launcher"] == "nsys"

    assert backward["status"] == "ok" and backward["samples"] == 1 and backward["host_median_us"] == 0.2
    assert (backward["kernel_time_us"], backward["kernel_count"]) == (0, 0)  # a GPU report, no kernels here
    # The statistics are a Measurement's, as get_data's (a fixed count is not a row's warning), then
    # nsys's own warnings.
    assert backward["median_us"] == 0 and backward["warnings"] == "no_kernels"
    assert forward["rel_ci"] is None  # a CI needs 6 samples
    assert forward["warnings"] == "ranges_lost(2/3)"  # the report lost one range
    assert forward["stop_reason"] == "nsys" and forward["precision_rule"] is None


def test_window_left_open_by_a_kill_still_counts() -> None:
    """After a SIGKILL the window's pop can be the one event nsys lost: the iterations inside it count,
    up to the next window."""

    def closed(name: str, start: int, end: int) -> NvtxRange:
        return NvtxRange(name, start, end, MAIN, parse_range(name))

    qkv = lambda i: format_range("linear_qkv", "backward", POINT, i)  # noqa: E731
    ranges = [
        closed(qkv(0), 110, 200),
        closed(qkv(1), 210, 300),
        closed(marker_name("linear_proj", "forward", POINT), 400, 500),
        closed(qkv(2), 410, 420),  # a later window's range (not possible in a run, but not counted)
    ]
    window = marker_name("linear_qkv", "backward", POINT)
    got = measured_ranges(ranges, [OpenRange(window, 100, MAIN, None)])
    assert [r.name for r in got[("linear_qkv", "backward", POINT)]] == [qkv(0), qkv(1)]
    assert measured_ranges(ranges) == {("linear_proj", "forward", POINT): []}


def test_nsys_start_up_failures_worth_a_second_run(tmp_path: Path) -> None:
    """What nsys 2022.4 printed when it failed to start its program on a loaded machine (no report): run
    again (the launcher does, while its worker has not started); any other failure, or a report, is kept."""
    from autotuner.launchers.nsys_process import NsysRun, lost_launch_race

    report = tmp_path / "report.nsys-rep"
    race = "ProcessWaiter.cpp:95: sem_open failed: No such file or directory"
    assert lost_launch_race(NsysRun(1, race), report)
    assert not lost_launch_race(NsysRun(0, race), report)  # the race ends nsys with 1
    assert lost_launch_race(
        NsysRun(0, "Connection to the Agent lost.\nConnection to the Agent lost."), report
    )
    assert not lost_launch_race(NsysRun(1, "Error: the program crashed"), report)
    report.write_bytes(b"")
    assert not lost_launch_race(NsysRun(1, race), report)
