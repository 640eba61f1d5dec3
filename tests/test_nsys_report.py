"""Tests of autotuner.launchers.nsys_report: a hand-built GPU report, a row's statistics, and real nsys."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from autotuner.launchers.nsys_report import (
    KernelStats,
    KernelTotal,
    NvtxRange,
    attribute_kernels,
    export_sqlite,
    process_id,
    read_nvtx_ranges,
    read_open_ranges,
    thread_id,
)
from autotuner.launchers.nsys_rows import range_columns
from autotuner.measure.timer import Measurement
from autotuner.ops.naming import format_range, parse_range

REPO_ROOT = Path(__file__).resolve().parents[1]
POINT = "s256_b1"

# --- a hand-built report with the tables and columns of a real GPU report ----------------------

PID, OTHER_PID = 4000, 4100
MAIN = (1 << 48) | (PID << 24) | PID  # globalTid: hardware bits, pid, tid
AUTOGRAD = (1 << 48) | (PID << 24) | (PID + 7)
OTHER = (1 << 48) | (OTHER_PID << 24) | OTHER_PID
CAPTURE_END = 5000


def _name(op: str, phase: str, iteration: int, warmup: bool = False) -> str:
    return format_range(op, phase, POINT, iteration, warmup)


# Ranges: (key, name, start, end, thread, registered). Registered names have text NULL and go
# through StringIds via textId, as the nvtx package's names do.
RANGES = [
    ("warm", _name("transformer_layer", "forward", 0, warmup=True), 10, 90, MAIN, True),
    ("layer", _name("transformer_layer", "forward", 0), 100, 1000, MAIN, True),
    ("qkv", _name("linear_qkv", "forward", 0), 110, 300, MAIN, False),
    ("attn", _name("core_attention", "forward", 0), 310, 600, MAIN, True),
    ("megatron", "megatron_internal_range", 320, 400, MAIN, False),
    ("proj", _name("linear_proj", "forward", 0), 610, 900, MAIN, True),
    ("bwcall", "loss.backward()", 1050, 2100, MAIN, False),
    ("layer_bw", _name("transformer_layer", "backward", 0), 1100, 2000, AUTOGRAD, True),
    ("qkv_bw", _name("linear_qkv", "backward", 0), 1500, 1900, AUTOGRAD, True),
    ("other_qkv", _name("linear_qkv", "forward", 0), 100, 200, OTHER, False),
]
# Left open by the program: end NULL, or closed by nsys at the end of the capture.
OPEN = [
    ("proj_bw_open", _name("linear_proj", "backward", 1), 2500, None, AUTOGRAD, True),
    ("layer_open", _name("transformer_layer", "forward", 1), 2400, CAPTURE_END, MAIN, True),
]

# Kernels: (correlationId, launching thread, call start, call end, kernel ns, short name).
KERNELS = [
    (1, MAIN, 120, 130, 50, "gemm"),  # qkv
    (2, MAIN, 200, 210, 30, "gemm"),  # qkv
    (3, MAIN, 350, 360, 30, "softmax"),  # megatron, inside attn
    (4, MAIN, 305, 308, 10, "elementwise"),  # layer itself, between qkv and attn
    (5, AUTOGRAD, 1200, 1210, 40, "gemm"),  # layer_bw itself
    (6, AUTOGRAD, 1600, 1610, 70, "gemm_bw"),  # qkv_bw
    (7, MAIN, 1060, 1070, 5, "memset"),  # bwcall (main thread)
    (8, MAIN, 2200, 2210, 8, "gemm"),  # in no range
    (9, AUTOGRAD, 1700, 1710, 20, "graph_a"),  # one graph launch, two kernels: qkv_bw
    (9, AUTOGRAD, 1700, 1710, 25, "graph_b"),
    (10, MAIN, 20, 30, 15, "gemm"),  # warm
    (1, OTHER, 150, 160, 1000, "gemm"),  # another process reusing correlationId 1: other_qkv
]


def _demangled(short: str) -> str:
    return f"void {short}_kernel<float>(float const*, float*)"


def _create(conn: sqlite3.Connection) -> None:
    conn.executescript(
        """
        CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE NVTX_EVENTS (
            start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
            category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER,
            textId INTEGER, domainId INTEGER);
        CREATE TABLE ANALYSIS_DETAILS (
            globalVid INTEGER NOT NULL, duration INTEGER NOT NULL, startTime INTEGER NOT NULL,
            stopTime INTEGER NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (
            start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
            contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER,
            globalPid INTEGER, demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (
            start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
            globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL,
            returnValue INTEGER NOT NULL);
        """
    )


def _string_id(conn: sqlite3.Connection, value: str) -> int:
    row = conn.execute("SELECT id FROM StringIds WHERE value = ?", (value,)).fetchone()
    if row:
        return row[0]
    return conn.execute("INSERT INTO StringIds (value) VALUES (?)", (value,)).lastrowid or 0


def build_gpu_report(path: Path) -> Path:
    """Write the report described by RANGES, OPEN and KERNELS."""
    with sqlite3.connect(path) as conn:
        _create(conn)
        conn.execute(
            "INSERT INTO ANALYSIS_DETAILS VALUES (?, ?, ?, ?)",
            (1 << 48, CAPTURE_END, 10**12, 10**12 + CAPTURE_END),
        )
        conn.execute(
            "INSERT INTO NVTX_EVENTS (start, eventType, globalTid, domainId) VALUES (1, 75, ?, 0)",
            (MAIN,),
        )
        conn.execute(
            "INSERT INTO NVTX_EVENTS (start, eventType, text, globalTid, domainId)"
            " VALUES (5, 34, 'a mark', ?, 0)",
            (MAIN,),
        )
        for _, name, start, end, tid, registered in RANGES + OPEN:
            text, text_id = (None, _string_id(conn, name)) if registered else (name, None)
            conn.execute(
                "INSERT INTO NVTX_EVENTS (start, end, eventType, text, textId, globalTid, domainId)"
                " VALUES (?, ?, 59, ?, ?, ?, 0)",
                (start, end, text, text_id, tid),
            )
        launch_id = _string_id(conn, "cudaLaunchKernel_v7000")
        calls = set()
        gpu_clock = 3000
        for corr, tid, call_start, call_end, duration, short in KERNELS:
            pid_bits = tid & 0xFFFFFFFFFF000000
            if (corr, tid) not in calls:
                calls.add((corr, tid))
                conn.execute(
                    "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, ?, 0)",
                    (call_start, call_end, tid, corr, launch_id),
                )
            conn.execute(
                "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, ?, ?, ?, ?)",
                (
                    gpu_clock,
                    gpu_clock + duration,
                    corr,
                    pid_bits,
                    _string_id(conn, _demangled(short)),
                    _string_id(conn, short),
                ),
            )
            gpu_clock += duration + 1
        # A runtime call that launched nothing.
        conn.execute(
            "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (400, 450, 0, ?, 11, ?, 0)",
            (MAIN, _string_id(conn, "cudaStreamSynchronize_v3020")),
        )
    return path


@pytest.fixture
def gpu_report(tmp_path: Path) -> Path:
    return build_gpu_report(tmp_path / "gpu.sqlite")


def _by_key(ranges: list[NvtxRange]) -> dict[str, NvtxRange]:
    index = {(name, start, tid): key for key, name, start, _, tid, _ in RANGES}
    return {index[(r.name, r.start_ns, r.global_tid)]: r for r in ranges}


def _top(*entries: tuple[str, int, int]) -> tuple[KernelTotal, ...]:
    return tuple(KernelTotal(short, _demangled(short), total, count) for short, total, count in entries)


def test_read_nvtx_ranges_names_threads_and_open_ranges(gpu_report: Path) -> None:
    ranges = read_nvtx_ranges(gpu_report)
    assert [r.start_ns for r in ranges] == sorted(r.start_ns for r in ranges)
    assert {(r.name, r.start_ns, r.end_ns, r.global_tid) for r in ranges} == {
        (name, start, end, tid) for _, name, start, end, tid, _ in RANGES
    }
    by_key = _by_key(ranges)
    assert set(by_key) == {key for key, *_ in RANGES}
    # Registered (textId) and literal (text) names both come back, and parse.
    assert by_key["layer"].name == "transformer_layer.forward [s256_b1] #0"
    assert by_key["layer"].parsed == parse_range(by_key["layer"].name)
    assert by_key["qkv"].parsed is not None and by_key["qkv"].parsed.op == "linear_qkv"
    assert by_key["warm"].parsed is not None and by_key["warm"].parsed.warmup
    assert by_key["megatron"].parsed is None
    assert by_key["layer"].duration_ns == 900
    assert (by_key["qkv_bw"].pid, by_key["qkv_bw"].tid) == (PID, PID + 7)
    assert (process_id(OTHER), thread_id(OTHER)) == (OTHER_PID, OTHER_PID)

    still_open = read_open_ranges(gpu_report)
    assert [(r.name, r.start_ns, r.global_tid) for r in still_open] == [
        (_name("transformer_layer", "forward", 1), 2400, MAIN),
        (_name("linear_proj", "backward", 1), 2500, AUTOGRAD),
    ]
    assert still_open[1].parsed == parse_range(_name("linear_proj", "backward", 1))


def test_attribute_kernels_innermost_same_thread_and_roll_up(gpu_report: Path) -> None:
    ranges = read_nvtx_ranges(gpu_report)
    stats = attribute_kernels(gpu_report, ranges)
    assert set(stats) == set(ranges)
    got = {key: stats[rng] for key, rng in _by_key(ranges).items()}

    assert got["qkv"] == KernelStats(80, 2, _top(("gemm", 80, 2)), 80, 2)
    # The layer sums its sub-ops (roll-up); only the kernel between them is its own.
    assert got["layer"] == KernelStats(
        120, 4, _top(("gemm", 80, 2), ("softmax", 30, 1), ("elementwise", 10, 1)), 10, 1
    )
    # Megatron's nested range is innermost for the softmax; attention still includes it.
    assert got["megatron"] == KernelStats(30, 1, _top(("softmax", 30, 1)), 30, 1)
    assert got["attn"] == KernelStats(30, 1, _top(("softmax", 30, 1)), 0, 0)
    assert got["proj"] == KernelStats(0, 0, (), 0, 0)
    assert got["warm"] == KernelStats(15, 1, _top(("gemm", 15, 1)), 15, 1)
    # Backward kernels belong to the autograd thread's ranges, not to the main thread's range
    # around backward(), although they fall inside it in time.
    assert got["bwcall"] == KernelStats(5, 1, _top(("memset", 5, 1)), 5, 1)
    assert got["qkv_bw"] == KernelStats(
        115, 3, _top(("gemm_bw", 70, 1), ("graph_b", 25, 1), ("graph_a", 20, 1)), 115, 3
    )
    assert got["layer_bw"].kernel_time_ns == 155
    assert got["layer_bw"].kernel_count == 4
    assert (got["layer_bw"].self_kernel_time_ns, got["layer_bw"].self_kernel_count) == (40, 1)
    # The other process's kernel with correlationId 1 goes to its own range only.
    assert got["other_qkv"] == KernelStats(1000, 1, _top(("gemm", 1000, 1)), 1000, 1)


def test_attribute_kernels_only_ranges_passed_in(gpu_report: Path) -> None:
    ours = [r for r in read_nvtx_ranges(gpu_report) if r.parsed is not None]
    stats = attribute_kernels(gpu_report, ours)
    got = {key: stats[rng] for key, rng in _by_key(ours).items()}
    assert "megatron" not in got
    assert got["attn"] == KernelStats(30, 1, _top(("softmax", 30, 1)), 30, 1)


def test_top_kernels_keeps_five_by_time(tmp_path: Path) -> None:
    path = tmp_path / "many.sqlite"
    with sqlite3.connect(path) as conn:
        _create(conn)
        layer = _name("transformer_layer", "forward", 0)
        conn.execute(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (0, 1000, 59, ?, ?)",
            (layer, MAIN),
        )
        for i in range(7):
            conn.execute(
                "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 1, 0)",
                (10 + i, 11 + i, MAIN, i),
            )
            conn.execute(
                "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (0, ?, 0, 1, 7, ?, ?, ?, ?)",
                (
                    10 * (i + 1),
                    i,
                    MAIN & 0xFFFFFFFFFF000000,
                    _string_id(conn, f"k{i}"),
                    _string_id(conn, f"s{i}"),
                ),
            )
    (stats,) = attribute_kernels(path, read_nvtx_ranges(path)).values()
    assert stats.kernel_count == 7
    assert [k.name for k in stats.top_kernels] == ["s6", "s5", "s4", "s3", "s2"]


def test_kernel_table_without_global_pid(tmp_path: Path) -> None:
    """Older exports may lack globalPid: kernels then join on correlationId alone."""
    path = tmp_path / "nopid.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(
            """
            CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
            CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT,
                textId INTEGER, globalTid INTEGER, domainId INTEGER);
            CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER,
                streamId INTEGER, correlationId INTEGER, shortName INTEGER, demangledName INTEGER);
            CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, globalTid INTEGER,
                correlationId INTEGER, nameId INTEGER);
            INSERT INTO StringIds VALUES (1, 'gemm'), (2, 'void gemm()'), (3, 'cudaLaunchKernel');
            """
        )
        conn.execute("INSERT INTO NVTX_EVENTS VALUES (0, 100, 59, 'r', NULL, ?, 0)", (MAIN,))
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (10, 20, ?, 42, 3)", (MAIN,))
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (500, 512, 0, 7, 42, 1, 2)")
    (stats,) = attribute_kernels(path, read_nvtx_ranges(path)).values()
    assert stats == KernelStats(12, 1, (KernelTotal("gemm", "void gemm()", 12, 1),), 12, 1)


def test_reports_without_tables(tmp_path: Path) -> None:
    empty = tmp_path / "empty.sqlite"
    with sqlite3.connect(empty) as conn:
        conn.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    assert read_nvtx_ranges(empty) == []
    assert read_open_ranges(empty) == []
    assert attribute_kernels(empty, []) == {}

    cpu = tmp_path / "cpu.sqlite"
    with sqlite3.connect(cpu) as conn:  # NVTX without StringIds, no CUPTI tables
        conn.execute(
            "CREATE TABLE NVTX_EVENTS"
            " (start INTEGER, end INTEGER, eventType INTEGER, text TEXT, globalTid INTEGER)"
        )
        conn.execute("INSERT INTO NVTX_EVENTS VALUES (5, 9, 60, 'startend', ?)", (MAIN,))
    ranges = read_nvtx_ranges(cpu)
    assert [(r.name, r.duration_ns) for r in ranges] == [("startend", 4)]
    assert attribute_kernels(cpu, ranges) == {}

    with pytest.raises(FileNotFoundError):
        read_nvtx_ranges(tmp_path / "missing.sqlite")
    assert not (tmp_path / "missing.sqlite").exists()


# --- statistics --------------------------------------------------------------------------------


def _range(name: str, duration: int, start: int = 0) -> NvtxRange:
    return NvtxRange(name, start, start + duration, MAIN, parse_range(name))


def test_row_statistics_are_a_measurement_of_the_iterations() -> None:
    """A row's statistics (nsys_rows.range_columns) are those of autotuner.measure.timer.Measurement over
    one time per measured iteration, as get_data's are: the same numbers, rel_ci and warnings."""
    durations = [40, 10, 100, 30, 20]
    ranges = [_range(_name("linear_qkv", "forward", i), d) for i, d in enumerate(durations)]
    row = range_columns(ranges, {})  # a CPU report: the ranges' durations are the op's time
    # 10 20 30 40 100: median 30, inclusive quartiles at 20 and 40.
    assert (row["samples"], row["median_us"], row["min_us"], row["mean_us"], row["iqr_us"]) == pytest.approx(
        (5, 0.030, 0.010, 0.040, 0.020)
    )
    assert row["fenced_mean_us"] == pytest.approx(0.040)  # 100 is on the outer fence, 40 + 3 * 20: kept
    assert row["host_median_us"] == row["median_us"]
    assert row["warnings"] == "few_samples(5);noisy(iqr=67%)" and row["rel_ci"] is None  # a CI needs 6
    assert (row["stop_reason"], row["precision_rule"]) == ("nsys", None)  # a fixed count: no target
    same = Measurement(durations, stop_reason="nsys").columns()
    assert {k: row[k] for k in same} == same

    steady = [_range(_name("linear_qkv", "backward", i), 7_000 + i % 2) for i in range(12)]
    row = range_columns(steady, {})
    assert row["samples"] == 12 and row["median_us"] == pytest.approx(7.0005)
    assert row["rel_ci"] == pytest.approx(1 / 7_000.5) and row["warnings"] == ""


# --- end to end with real nsys ---------------------------------------------------------------

PROFILED = textwrap.dedent(
    """
    import os
    import sys
    import threading
    import time

    import nvtx

    from autotuner.ops.naming import format_range

    POINT = "s256_b1"
    out = sys.argv[1]


    def rng(op, phase, iteration, warmup=False):
        return format_range(op, phase, POINT, iteration, warmup)


    def forward(iteration, warmup=False):
        nvtx.push_range(rng("transformer_layer", "forward", iteration, warmup))
        for op in ("linear_qkv", "core_attention"):
            nvtx.push_range(rng(op, "forward", iteration, warmup))
            time.sleep(0.002)
            nvtx.pop_range()
        nvtx.pop_range()


    tids = {}


    def backward():
        tids["backward"] = threading.get_native_id()
        nvtx.push_range(rng("transformer_layer", "backward", 0))
        nvtx.push_range(rng("linear_qkv", "backward", 0))
        time.sleep(0.002)
        nvtx.pop_range()
        nvtx.pop_range()


    forward(0, warmup=True)
    forward(0)
    forward(1)
    worker = threading.Thread(target=backward)
    worker.start()
    worker.join()
    handle = nvtx.start_range("not ours")
    time.sleep(0.001)
    nvtx.end_range(handle)
    with open(out, "w") as f:
        f.write(f"{os.getpid()} {tids['backward']}")
    nvtx.push_range(rng("linear_proj", "forward", 2))  # never popped: the process ends inside it
    """
)


def _profile(
    nsys_bin: str, folder: Path, name: str, program: list[str]
) -> tuple[Path, subprocess.CompletedProcess]:
    """``nsys profile`` (CPU trace) of ``python PROGRAM`` in ``folder``, writing ``<name>.nsys-rep``; run
    again when nsys 2022.4 lost its launch race on a loaded machine (see lost_launch_race)."""
    from autotuner.launchers.nsys_process import NsysRun, lost_launch_race

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    cmd = [nsys_bin, "profile", "-t", "nvtx,osrt", "-s", "none", "--cpuctxsw=none", "-o", name, "-f", "true"]
    report = folder / f"{name}.nsys-rep"
    for _ in range(3):
        proc = subprocess.run(
            [*cmd, sys.executable, *program], capture_output=True, text=True, timeout=300, env=env, cwd=folder
        )
        if not lost_launch_race(NsysRun(proc.returncode, proc.stdout + proc.stderr), report):
            break
    return report, proc


@pytest.mark.nsys
def test_real_nsys_report(nsys_bin: str, tmp_path: Path) -> None:
    script = tmp_path / "profiled.py"
    script.write_text(PROFILED)
    ids_file = tmp_path / "ids.txt"
    report, proc = _profile(nsys_bin, tmp_path, "run", [str(script), str(ids_file)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report.is_file(), f"no .nsys-rep (only .qdstrm?): {sorted(p.name for p in tmp_path.iterdir())}"

    sqlite_path = export_sqlite(nsys_bin, report, tmp_path / "run.sqlite")
    assert sqlite_path.is_file()
    pid, backward_tid = map(int, ids_file.read_text().split())

    ranges = read_nvtx_ranges(sqlite_path)
    names = sorted(r.name for r in ranges)
    expected = sorted(
        [_name(op, "forward", 0, warmup=True) for op in ("transformer_layer", "linear_qkv", "core_attention")]
        + [
            _name(op, "forward", i)
            for op in ("transformer_layer", "linear_qkv", "core_attention")
            for i in (0, 1)
        ]
        + [_name(op, "backward", 0) for op in ("transformer_layer", "linear_qkv")]
        + ["not ours"]
    )
    assert names == expected
    for r in ranges:
        assert r.parsed == parse_range(r.name)
        assert r.pid == pid
        assert r.duration_ns > 0

    def find(name: str) -> NvtxRange:
        (match,) = [r for r in ranges if r.name == name]
        return match

    for i in (0, 1):
        layer = find(_name("transformer_layer", "forward", i))
        assert layer.tid == pid  # the main thread
        for op in ("linear_qkv", "core_attention"):
            inner = find(_name(op, "forward", i))
            assert inner.global_tid == layer.global_tid
            assert layer.start_ns <= inner.start_ns < inner.end_ns <= layer.end_ns
            assert inner.duration_ns >= 1_000_000  # slept 2 ms
    layer_bw = find(_name("transformer_layer", "backward", 0))
    qkv_bw = find(_name("linear_qkv", "backward", 0))
    assert layer_bw.tid == qkv_bw.tid == backward_tid != pid
    assert layer_bw.start_ns <= qkv_bw.start_ns < qkv_bw.end_ns <= layer_bw.end_ns

    (still_open,) = read_open_ranges(sqlite_path)
    assert still_open.name == _name("linear_proj", "forward", 2)
    assert still_open.parsed is not None and still_open.parsed.op == "linear_proj"

    assert attribute_kernels(sqlite_path, ranges) == {}  # a CPU report has no CUPTI tables
    ours = [r.parsed for r in ranges if r.parsed is not None and not r.parsed.warmup]
    assert {(p.op, p.phase, p.point) for p in ours} == {(p.op, p.phase, POINT) for p in ours}
    assert Counter((p.op, p.phase) for p in ours) == {
        ("core_attention", "forward"): 2,
        ("linear_qkv", "backward"): 1,
        ("linear_qkv", "forward"): 2,
        ("transformer_layer", "backward"): 1,
        ("transformer_layer", "forward"): 2,
    }


@pytest.mark.nsys
def test_export_sqlite_failure_names_the_cause(nsys_bin: str, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="File not found"):
        export_sqlite(nsys_bin, tmp_path / "missing.nsys-rep", tmp_path / "missing.sqlite")


# --- python -m autotuner.nsys_read on a .nsys-rep, made by real nsys ----------------------------

WINDOWED = textwrap.dedent(
    """
    import time

    import nvtx

    from autotuner.launchers.nsys_worker import marker_name
    from autotuner.ops.naming import format_range

    POINT = "s32_b2"


    def measure(op, iterations, close=True):
        nvtx.push_range(format_range(op, "forward", POINT, 0, warmup=True))  # outside the window
        nvtx.pop_range()
        nvtx.push_range(marker_name(op, "forward", POINT))
        for i in range(iterations):
            nvtx.push_range(format_range(op, "forward", POINT, i))
            time.sleep(0.002)
            nvtx.pop_range()
        if close:
            nvtx.pop_range()


    measure("linear_qkv", 3)
    # another program's ranges in our names' form: an op this tool does not have, a label that is no point
    measure("not_an_op", 3)
    POINT = "batch of 2"
    measure("mlp", 3)
    POINT = "s32_b2"
    measure("core_attention", 2)  # as if its third iteration raised
    measure("linear_proj", 1, close=False)  # the process ends inside the window
    """
)


@pytest.mark.nsys
def test_nsys_read_exports_a_real_report(
    nsys_bin: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from autotuner import nsys_read
    from autotuner.results import load_rows

    script = tmp_path / "windowed.py"
    script.write_text(WINDOWED)
    report, proc = _profile(nsys_bin, tmp_path, "cpu-rank1", [str(script)])
    assert proc.returncode == 0 and report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]

    out = tmp_path / "read"
    assert nsys_read.main([str(report), f"out={out}", f"nsys_bin={nsys_bin}"]) == 1  # two rows failed
    printed, said = capsys.readouterr()
    # the foreign windows were ok rows of nothing, which the report could not draw: counted, named once
    assert said.splitlines() == [
        "note: 2 range(s) not of this tool's ops and points, left out: measure not_an_op.forward [s32_b2] "
        "(no such op); measure mlp.forward [batch of 2] (not a shape point s<seq>_b<mbs>)"
    ]
    assert printed.splitlines()[0].split()[3:5] == ["median", "IQR"]  # a CPU report: one time, no host column
    assert "3 rows (2 failed)" in printed

    rows = {r["op"]: r for r in load_rows(out / "results.jsonl")}
    assert list(rows) == ["linear_qkv", "core_attention", "linear_proj"]  # the order measured
    qkv = rows["linear_qkv"]
    assert (qkv["status"], qkv["samples"], qkv["rank"]) == ("ok", 3, 1)  # rank from the report's name
    assert (qkv["seq_len"], qkv["micro_batch_size"], qkv["launcher"]) == (32, 2, "nsys")
    assert qkv["median_us"] == qkv["host_median_us"] >= 1500  # slept 2 ms; on a CPU the range is the time
    assert qkv["kernel_time_us"] is None and qkv["device"] is None  # no kernels, no environment.json
    assert rows["core_attention"]["status"] == "failed"
    assert rows["core_attention"]["error"].startswith("2 of 3 measured iterations in the report")
    assert rows["linear_proj"]["status"] == "failed" and "left open" in rows["linear_proj"]["error"]
    # The export is kept beside the rows: it reads again without nsys, to the same rows.
    assert (out / "cpu-rank1.sqlite").is_file()
    rows_again, _ = nsys_read.read_report(out / "cpu-rank1.sqlite", tmp_path / "again")
    assert [r.get("median_us") for r in rows_again] == [r["median_us"] for r in rows.values()]
    from autotuner.report import build_report

    assert build_report([out]).is_file()
