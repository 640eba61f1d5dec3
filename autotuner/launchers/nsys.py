"""The nsys launcher: ``nsys profile`` around our worker, then the per-op table read from the report.

The parent (this module, inside ``python -m autotuner.main``) does not build a model. It

1. builds the ``nsys profile`` argument list (:func:`nsys_command`; never a shell string) around
   ``python -m autotuner.launchers.nsys_worker <run_dir> <config>``, which runs the get_data plan under
   NVTX ranges (see autotuner.launchers.nsys_worker);
2. runs it, streaming its output to stderr and keeping the tail (``nsys.log`` in the run directory holds
   all of it);
3. exports ``report.nsys-rep`` to ``report.sqlite`` and reads it (autotuner.launchers.nsys_report);
4. writes ``results.csv``/``results.jsonl`` with one row per planned (op, phase, point) and prints the
   table.

nsys options, by device (each overridable, see :func:`nsys_command`):

* both: ``--sample=none --cpuctxsw=none``. CPU sampling and context-switch tracing add overhead to the
  process being timed, need perf permissions that containers often lack, and the table needs neither.
* CUDA: ``-t cuda,nvtx,osrt,cublas,cudnn`` and ``--capture-range=cudaProfilerApi
  --capture-range-end=none``. The worker calls cudaProfilerStart/Stop around the measured iterations of
  every phase, so there are many start/stop pairs. nsys handles them by ``--capture-range-end``: the
  default ``stop-shutdown`` ends the whole session at the first stop (one op in the report), ``stop``
  ignores every later range (the same), ``repeat`` writes one report per pair (hundreds of files), and
  ``none`` ignores the stops: capture begins at the first start (after the imports, the model build
  and the first op's warm-up, which stay out of the report) and lasts to the end of the process, in
  one report. Later starts are no-ops while capture is on. Warm-up iterations of later ops are inside
  the capture, but their ranges are named ``#w<i>`` and never enter a statistic. (nsys 2022.4's guide
  also warns that many short start/stop pairs under the *interactive* ``nsys launch`` can fault; with
  ``none`` nsys acts only on the first.) This choice follows nsys's documentation; it has not been run
  on a GPU here.
* CPU: ``-t nvtx,osrt``, whole process (the CUDA profiler API does not exist there).

Columns: the times (``median_us``, ``iqr_us``, ``min_us``, ``mean_us``) are statistics of the durations
of the op's own ranges in its measured iterations, in microseconds, and ``samples`` is how many ranges
were found (``launcher.iterations`` when nothing was lost). An NVTX range is *host* time: on a CPU that
is the op's time; on a GPU it is the time to issue the op's kernels (plus any synchronisation inside
the op), and the GPU's own time is ``kernel_time_us``: the median over iterations of the summed
durations of the kernels launched inside the range (nested ranges included; kernels overlapping on
several streams each count in full), with ``kernel_count`` and ``top_kernels`` (per iteration, the
five longest by total time: ``name time_us xcount``). These three are empty where the report has no
CUDA kernels (a CPU run). ``weight_bytes`` comes from the worker. ``activation_bytes``, ``peak_bytes``,
``flops`` and ``tflops`` are left empty: measuring them takes extra runs of each op, which would
appear on the timeline among the measured ones; use launcher=get_data for them.

Faults:

* nsys not found: :class:`autotuner.errors.UserError` (one line, exit 2) saying how to install it.
* nsys exits non-zero: the tail of its output on stderr and a non-zero exit code; whatever report it
  saved is still read.
* the worker dies (a crash, the OOM killer, a kill): nsys still saves the report, and passes the exit
  status through (128 + signal after a kill). Rows the worker completed are read from the report; the
  op it was running is ``failed`` with "the profiled process died while measuring it", every op after it
  ``failed`` with "... died before measuring it".
* an op fails in the worker (an exception, OOM): its row is ``failed`` with the error, and the plan goes on.
* a completed op with no range in the report: ``failed``, naming the likely cause (the nvtx package's
  version; see autotuner.ops.annotate).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from autotuner.errors import UserError
from autotuner.launchers.nsys_report import (
    KernelStats,
    NvtxRange,
    OpenRange,
    attribute_kernels,
    export_sqlite,
    read_nvtx_ranges,
    read_open_ranges,
    summarize,
)
from autotuner.launchers.nsys_worker import MEASURING_FILE, STARTED_FILE, NsysObserver, parse_marker
from autotuner.launchers.nsys_worker import worker_dir as worker_dir_of
from autotuner.ops_test.base import OpTest, ShapePoint
from autotuner.results import load_rows
from autotuner.runner import Runner

REPORT_NAME = "report"  # run_dir/report.nsys-rep, run_dir/report.sqlite
LOG_NAME = "nsys.log"
LAUNCH_ATTEMPTS = 3  # see lost_launch_race
INSTALL_HINT = "install it with scripts/install_nsys.sh or point launcher.nsys_bin at an nsys binary"

CUDA_TRACE = ("cuda", "nvtx", "osrt", "cublas", "cudnn")
CPU_TRACE = ("nvtx", "osrt")

# Switches the launcher sets itself and a user may not pass: (long name, short letter).
_RESERVED = {"output": "o", "force-overwrite": "f", "trace": "t"}
# Short letters of the switches the launcher sets by default and a user may replace.
_SHORT = {"sample": "s", "capture-range": "c"}
_TRACE_RE = re.compile(r"^[a-z0-9_-]+$")

Key = tuple[str, str, str]  # (op, phase, point)


# --- the nsys command --------------------------------------------------------------------------


def find_nsys(nsys_bin: str) -> str:
    """The absolute path of ``nsys_bin`` (a name on the PATH or a path); UserError when absent."""
    found = shutil.which(nsys_bin)
    if found is None:
        raise UserError(f"nsys not found (launcher.nsys_bin={nsys_bin!r}): {INSTALL_HINT}")
    return os.path.abspath(found)


def default_trace(device: torch.device) -> list[str]:
    return list(CUDA_TRACE if device.type == "cuda" else CPU_TRACE)


def _switch_names(args: Sequence[str]) -> set[str]:
    """Names of the switches in an argument list: ``--name[=v]`` gives name, ``-x`` gives x."""
    names = set()
    for arg in args:
        if arg.startswith("--"):
            names.add(arg[2:].split("=", 1)[0])
        elif arg.startswith("-") and len(arg) >= 2:
            names.add(arg[1])
    return names


def nsys_command(
    nsys: str,
    launcher: Any,
    device: torch.device,
    report_base: Path,
    program: Sequence[str],
) -> list[str]:
    """The full ``nsys profile`` argument list around ``program`` (see the module docstring).

    nsys refuses a switch given twice, so a switch of ``launcher.extra_args`` that names one of the
    defaults (``--sample``, ``--cpuctxsw``, ``--capture-range``, ``--capture-range-end``) replaces it.
    The report path and ``--trace`` belong to the launcher and ``launcher.trace``: passing them in
    ``extra_args`` is a UserError, as is a trace list without nvtx (the table is made of NVTX ranges).
    """
    extra = [str(a) for a in launcher.extra_args]
    given = _switch_names(extra)
    for name, short in _RESERVED.items():
        if name in given or short in given:
            what = (
                "launcher.trace=[...]" if name == "trace" else f"the run directory ({report_base}.nsys-rep)"
            )
            raise UserError(f"launcher.extra_args may not set --{name}/-{short}: it is set from {what}")
    trace = [str(t) for t in launcher.trace] if launcher.trace is not None else default_trace(device)
    bad = [t for t in trace if not _TRACE_RE.match(t)]
    if bad or "nvtx" not in trace:
        raise UserError(
            f"launcher.trace={trace} must be a list of nsys API names holding nvtx (the table is read from "
            "NVTX ranges), e.g. launcher.trace=[cuda,nvtx,osrt]"
        )
    defaults = {"sample": "none", "cpuctxsw": "none"}
    if device.type == "cuda" and "cuda" in trace:
        # cudaProfilerApi needs CUDA tracing; without it the whole process is captured.
        defaults.update({"capture-range": "cudaProfilerApi", "capture-range-end": "none"})
    options = [
        f"--{name}={value}"
        for name, value in defaults.items()
        if name not in given and _SHORT.get(name) not in given
    ]
    return [
        nsys,
        "profile",
        f"--trace={','.join(trace)}",
        *options,
        f"--output={report_base}",
        "--force-overwrite=true",
        *extra,
        *program,
    ]


def worker_command(run_dir: Path, config_path: Path) -> list[str]:
    return [sys.executable, "-m", "autotuner.launchers.nsys_worker", str(run_dir), str(config_path)]


# --- running nsys ------------------------------------------------------------------------------


@dataclass
class NsysRun:
    """How ``nsys profile`` ended: its exit code and the end of its output (progress bars unrolled)."""

    returncode: int
    tail: str


_WORKER_MASTER_PORT: str | None = None  # under torchrun: the port the workers' process group meets on


def _worker_env() -> dict[str, str]:
    """The parent's environment, with this checkout first on the path and unbuffered output (so the
    worker's lines and nsys's arrive in order); under torchrun, the workers' own rendezvous port."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    if _WORKER_MASTER_PORT is not None:
        env["MASTER_PORT"] = _WORKER_MASTER_PORT
        # torchrun tells its children to use its agent's store as clients; the workers' group has no
        # agent on the new port, so rank 0's worker must host the store itself.
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    return env


def _join_ranks() -> None:
    """Under torchrun each rank's parent runs its own ``nsys profile`` around its own worker, and the
    workers form the tensor-parallel group. The parents form a small gloo group of their own on
    torchrun's port (to agree on the workers' port, and so rank 0 can wait for every rank before merging
    the rows); the workers then meet on a fresh port that rank 0 picks and sends to all."""
    global _WORKER_MASTER_PORT
    import socket

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    port = [None]
    if dist.get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = [str(sock.getsockname()[1])]
    dist.broadcast_object_list(port, src=0)
    _WORKER_MASTER_PORT = port[0]


def _wait_turn(run_dir: Path, timeout_s: float = 600) -> None:
    """Launch the ranks' ``nsys profile`` one after another: two nsys 2022.4 started at the same moment
    on one machine both lose the ``sem_open`` launch race (see lost_launch_race) far more often than one.
    Rank N waits until rank N-1's worker has started (its ``started`` file); the workers then wait for
    each other in their process group's rendezvous."""
    import time

    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        return
    previous = run_dir / f"worker.rank{rank - 1}" / STARTED_FILE
    deadline = time.monotonic() + timeout_s
    while not previous.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank - 1}'s nsys worker did not start within {timeout_s:.0f} s")
        time.sleep(0.2)


def run_nsys(cmd: list[str], log_path: Path, tail_bytes: int = 16_384) -> NsysRun:
    """Run ``cmd`` (no shell), copying its output to stderr and ``log_path``; keep the tail.

    The log is appended to, each run starting with its argument list as JSON: the exact command, for
    a rerun by hand.
    """
    tail = b""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_worker_env())
    except OSError as exc:
        raise UserError(f"cannot run {cmd[0]!r}: {exc.strerror or exc}: {INSTALL_HINT}") from exc
    # As a context manager, Popen waits for nsys even when we are interrupted: a Ctrl-C reaches nsys too,
    # and it needs the time to write what it recorded.
    with proc, open(log_path, "ab") as log:
        assert proc.stdout is not None
        log.write(json.dumps(cmd).encode() + b"\n")
        # Chunks, not lines: tqdm and nsys redraw progress bars with carriage returns.
        while chunk := proc.stdout.read1(65_536):
            log.write(chunk)
            _echo(chunk)
            tail = (tail + chunk)[-tail_bytes:]
    return NsysRun(proc.returncode, _last_lines(tail.decode(errors="replace")))


def lost_launch_race(run: NsysRun, report: Path) -> bool:
    """Whether nsys failed before starting the program because of its launch race (nsys 2022.4).

    nsys's launcher creates a named semaphore ``/dev/shm/sem.nsys_sem_<pid>`` for the program it starts,
    and another nsys process opens it; on a loaded machine the open can come first, and nsys exits 1
    with a ``sem_open`` "No such file or directory" error from its ProcessWaiter, before the program
    ran (seen here in about 1 of 8 runs under load; the program had not started in any of them). Such
    a run is safe to repeat.
    """
    return (
        run.returncode != 0 and not report.exists() and "sem_open" in run.tail and "ProcessWaiter" in run.tail
    )


def _echo(chunk: bytes) -> None:
    """Pass the child's output on to our stderr (a test's capture may have no byte buffer)."""
    buffer = getattr(sys.stderr, "buffer", None)
    if buffer is not None:
        sys.stderr.flush()  # text written before must come first
        buffer.write(chunk)
    else:
        sys.stderr.write(chunk.decode(errors="replace"))
    sys.stderr.flush()


def _last_lines(text: str, count: int = 20) -> str:
    lines = [line.rstrip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(lines[-count:])


def describe_exit(returncode: int) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` for a signal (nsys reports a killed app as 128 + N)."""
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 192 else 0
    if number:
        try:
            return f"killed by {signal.Signals(number).name} (exit code {returncode})"
        except ValueError:
            pass
    return f"exit code {returncode}"


# --- from the report to rows -------------------------------------------------------------------


def measured_ranges(
    ranges: Iterable[NvtxRange], still_open: Iterable[OpenRange] = ()
) -> dict[Key, list[NvtxRange]]:
    """The ranges each row is made of: per ``measure`` window, the op's own ranges of that phase.

    An op's name appears in many places (its two phases, nested in every op that contains it), all
    with the same point and iteration; only the window tells them apart. A range belongs to the row
    of the window it lies in (by time; a backward range may be on autograd's thread, while the window
    is on the main thread, which waits for the backward) when its op, phase and point are the
    window's. Warm-up ranges are left out. Windows never overlap: phases run one after the other.

    A window left open (``still_open``) ends where the next window begins, or at the end: after a
    SIGKILL the last NVTX event the process recorded can be lost, and when that is a window's pop the
    iterations inside it were still recorded in full.
    """
    ranges = list(ranges)
    windows = [(key, r.start_ns, r.end_ns) for r in ranges if (key := parse_marker(r.name)) is not None]
    starts = sorted(start for _, start, _ in windows)
    for r in still_open:
        key = parse_marker(r.name)
        if key is not None:
            later = [s for s in starts if s > r.start_ns]
            windows.append((key, r.start_ns, later[0] if later else float("inf")))
    by_key: dict[Key, list[NvtxRange]] = defaultdict(list)
    for r in ranges:
        if r.parsed is not None and not r.parsed.warmup:
            by_key[(r.parsed.op, r.parsed.phase, r.parsed.point)].append(r)
    out: dict[Key, list[NvtxRange]] = {}
    for key, start, end in windows:
        inside = [r for r in by_key.get(key, []) if start <= r.start_ns <= r.end_ns <= end]
        out.setdefault(key, []).extend(inside)
    return out


def _top_kernels(stats: Sequence[KernelStats]) -> str:
    """The five kernels with the most time over the iterations, as per-iteration averages."""
    totals: dict[str, list[float]] = {}
    for s in stats:
        for k in s.top_kernels:
            entry = totals.setdefault(k.name or k.demangled_name, [0.0, 0.0])
            entry[0] += k.total_ns
            entry[1] += k.count
    n = len(stats)
    top = sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))[:5]
    return "; ".join(f"{name} {total / n / 1e3:.1f}us x{count / n:g}" for name, (total, count) in top)


def range_columns(ranges: Sequence[NvtxRange], kernels: dict[NvtxRange, KernelStats]) -> dict[str, Any]:
    """The measured columns of one row from its ranges (and their kernels, when the report has any)."""
    (summary,) = summarize(ranges)
    row: dict[str, Any] = {
        "samples": summary["count"],
        "median_us": summary["median_ns"] / 1e3,
        "iqr_us": summary["iqr_ns"] / 1e3,
        "min_us": summary["min_ns"] / 1e3,
        "mean_us": summary["mean_ns"] / 1e3,
    }
    stats = [kernels[r] for r in ranges if r in kernels]
    if stats:
        row["kernel_time_us"] = statistics.median(s.kernel_time_ns for s in stats) / 1e3
        count = statistics.median(s.kernel_count for s in stats)
        row["kernel_count"] = int(count) if float(count).is_integer() else count
        row["top_kernels"] = _top_kernels(stats)
    return row


@dataclass
class ReportData:
    """What the report holds for the table: each row's ranges, their kernels (empty without CUDA data),
    the names of ranges left open, or why it could not be read."""

    measured: dict[Key, list[NvtxRange]] = field(default_factory=dict)
    kernels: dict[NvtxRange, KernelStats] = field(default_factory=dict)
    still_open: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Outcome:
    """What the parent knows after nsys returned: how it ended, what the worker got to, the report."""

    nsys: NsysRun
    worker_rows: dict[Key, dict[str, Any]]
    in_flight: Key | None  # the phase the worker was running when it stopped
    report: ReportData


def read_sqlite(sqlite_path: Path) -> ReportData:
    """Read an exported report (see :class:`ReportData`)."""
    ranges = read_nvtx_ranges(sqlite_path)
    still_open = read_open_ranges(sqlite_path)
    measured = measured_ranges(ranges, still_open)
    ours = [r for found in measured.values() for r in found]
    kernels = attribute_kernels(sqlite_path, ours) if ours else {}
    return ReportData(measured, kernels, [r.name for r in still_open])


def build_rows(
    spec: Any, plan: Iterable[tuple[ShapePoint, OpTest, str]], outcome: Outcome
) -> list[dict[str, Any]]:
    """One row per planned (point, op, phase), in plan order: the worker's status, the report's times."""
    rows = []
    for point, op, phase in plan:
        key = (op.name, phase, point.label)
        worker = outcome.worker_rows.get(key)
        row = {
            "case": spec.case,
            "op": op.name,
            "phase": phase,
            "point": point.label,
            "seq_len": point.seq_len,
            "micro_batch_size": point.micro_batch_size,
            "dtype": spec.dtype,
            "device": spec.device.type,
            "launcher": "nsys",
            "rank": int(os.environ.get("RANK", 0)),
            "tensor_parallel": spec.tf_config.tensor_model_parallel_size,
            "call_count": spec.call_counts.get((op.name, point.label)),
        }
        if worker is None:
            row.update(status="failed", error=_missing_reason(key, outcome))
        elif worker.get("status") != "ok":
            row.update({k: worker.get(k) for k in ("status", "error", "num_threads")})
        else:
            row.update({k: worker.get(k) for k in ("weight_bytes", "stop_reason", "num_threads")})
            found = outcome.report.measured.get(key, [])
            if found:
                row.update(status="ok", **range_columns(found, outcome.report.kernels))
            else:
                row.update(status="failed", error=_no_range_reason(key, outcome))
        rows.append(row)
    return rows


def _missing_reason(key: Key, outcome: Outcome) -> str:
    if outcome.nsys.returncode == 0:
        return "the worker finished without measuring it"
    how = describe_exit(outcome.nsys.returncode)
    if outcome.in_flight is None and not outcome.worker_rows and outcome.report.error:
        last = outcome.nsys.tail.splitlines()[-1] if outcome.nsys.tail else ""
        return f"nsys profile failed ({how}) before the profiled process measured it: {last}"
    if key == outcome.in_flight:
        return f"the profiled process died while measuring it: {how}"
    return f"the profiled process died before measuring it: {how}"


def _no_range_reason(key: Key, outcome: Outcome) -> str:
    op, phase, point = key
    if outcome.report.error:
        return f"no report to read: {outcome.report.error}"
    if outcome.nsys.returncode != 0:
        how = describe_exit(outcome.nsys.returncode)
        return f"measured, but the profiled process died ({how}) before nsys saved its NVTX ranges"
    return (
        f"no measured NVTX range {op}.{phase} [{point}] in the report "
        "(the nvtx package records under nsys 2022.4/2023.4 only at 0.2.10-0.2.11)"
    )


# --- the launcher ------------------------------------------------------------------------------


def _check_settings(cfg: DictConfig) -> None:
    launcher = cfg.launcher
    if launcher.warmup < 0 or launcher.iterations < 1:
        raise UserError("launcher.warmup must be >= 0 and launcher.iterations >= 1: fix launcher.*")
    if cfg.resume:
        raise UserError("launcher=nsys cannot resume (one report holds every op of a run): drop resume=true")


def _worker_config(cfg: DictConfig, run_dir: Path, worker_dir: Path) -> Path:
    """The config the worker loads: the one Hydra saved before the task ran, or (with
    ``hydra.output_subdir=null``) the same config saved here."""
    hydra_saved = run_dir / ".hydra" / "config.yaml"
    if hydra_saved.is_file():
        return hydra_saved
    path = worker_dir / "config.yaml"
    OmegaConf.save(cfg, path)
    return path


def _profile(cmd: list[str], log_path: Path, worker_dir: Path, report: Path) -> NsysRun:
    """Run nsys; again (up to LAUNCH_ATTEMPTS) only when it lost its launch race before the worker ran."""
    log_path.unlink(missing_ok=True)
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        result = run_nsys(cmd, log_path)
        started = any(p.name != "config.yaml" for p in worker_dir.iterdir())
        if attempt == LAUNCH_ATTEMPTS or started or not lost_launch_race(result, report):
            break
        print(
            f"autotuner: nsys lost its launch race (see {__name__}.lost_launch_race); retrying",
            file=sys.stderr,
        )
    return result


def _read_worker(worker_dir: Path) -> tuple[dict[Key, dict[str, Any]], Key | None]:
    """The worker's rows by (op, phase, point), and the phase it was in when it stopped."""
    rows_path = worker_dir / "results.jsonl"
    rows = load_rows(rows_path) if rows_path.is_file() else []
    by_key = {(r["op"], r["phase"], r["point"]): r for r in rows}
    in_flight = None
    measuring = worker_dir / MEASURING_FILE
    if measuring.is_file():
        fields = measuring.read_text().strip().split("\t")
        if len(fields) == 3:
            in_flight = (fields[0], fields[1], fields[2])
    return by_key, in_flight


def _read_report(nsys: str, report_base: Path, result: NsysRun) -> ReportData:
    """Export and read whatever report nsys saved (after a crash too)."""
    report = report_base.with_suffix(".nsys-rep")
    if not report.is_file():
        if report_base.with_suffix(".qdstrm").is_file():
            return ReportData(
                error=f"nsys wrote only {report_base.name}.qdstrm, no .nsys-rep: its report importer is "
                "missing (see scripts/install_nsys.sh)"
            )
        last = result.tail.splitlines()[-1] if result.tail else ""
        return ReportData(error=f"nsys wrote no report ({describe_exit(result.returncode)}: {last})")
    try:
        return read_sqlite(export_sqlite(nsys, report, report_base.with_suffix(".sqlite")))
    except (RuntimeError, OSError) as exc:
        return ReportData(error=(str(exc).splitlines() or [type(exc).__name__])[0])


def launch(cfg: DictConfig, spec: Any, run_dir: Path) -> int:
    """Profile the plan under nsys, read the report, write and print the table.

    Exit code: 0 when every row is ok or skipped; 1 when a row failed or nsys exited non-zero; 2
    (UserError) for bad launcher settings or a missing nsys.
    """
    from autotuner.launchers.common import finish, start_writer

    _check_settings(cfg)
    launcher = cfg.launcher
    nsys = find_nsys(str(launcher.nsys_bin))
    run_dir = Path(run_dir).resolve()
    _join_ranks()
    worker_dir = worker_dir_of(run_dir)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # One report per rank: report-rank<N>.nsys-rep (a dot would read as the file's suffix).
    suffix = f"-rank{rank}" if world > 1 else ""
    report_base = run_dir / f"{REPORT_NAME}{suffix}"
    log_path = run_dir / f"{Path(LOG_NAME).stem}{suffix}.log"
    # A fresh worker record and report: what is there after the run is this run's, even after a crash.
    shutil.rmtree(worker_dir, ignore_errors=True)
    worker_dir.mkdir(parents=True)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank has cleared its old worker record before any waits on another's
    for suffix in (".nsys-rep", ".qdstrm", ".sqlite"):
        report_base.with_suffix(suffix).unlink(missing_ok=True)
    program = worker_command(run_dir, _worker_config(cfg, run_dir, worker_dir))
    cmd = nsys_command(nsys, launcher, spec.device, report_base, program)

    writer = start_writer(cfg, spec, run_dir)
    _wait_turn(run_dir)
    result = _profile(cmd, log_path, worker_dir, report_base.with_suffix(".nsys-rep"))
    outcome = Outcome(result, *_read_worker(worker_dir), _read_report(nsys, report_base, result))

    # The runner's own plan, so the rows come in the order and number the worker ran them.
    plan = Runner(spec, NsysObserver(spec.device, launcher.warmup, launcher.iterations), writer).plan()
    writer.extend(build_rows(spec, plan, outcome))
    code = finish(writer, spec)
    if outcome.report.error:
        print(f"autotuner: {outcome.report.error}", file=sys.stderr)
    if result.returncode == 0:
        return code
    if outcome.report.still_open:
        print(f"autotuner: ranges left open: {'; '.join(outcome.report.still_open[-3:])}", file=sys.stderr)
    how = describe_exit(result.returncode)
    print(f"autotuner: nsys profile ended with {how}; its last lines:\n{result.tail}", file=sys.stderr)
    return code or 1
