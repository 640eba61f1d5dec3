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

Columns: :func:`autotuner.launchers.nsys_rows.range_columns` says which time leads. In short: on a CPU
the statistics are of the op's own NVTX ranges in its measured iterations; on a GPU they are of each
iteration's summed kernel durations (the device's time, as ``kernel_time_us``), and the ranges' median
(the host's time to issue the op) is ``host_median_us``. ``samples`` is how many ranges were found
(``launcher.iterations`` when nothing was lost). ``weight_bytes`` comes from the worker.
``activation_bytes``, ``peak_bytes``, ``flops`` and ``tflops`` are left empty: measuring them takes
extra runs of each op, which would appear on the timeline among the measured ones; use
launcher=get_data for them.

Faults:

* which nsys: ``launcher.nsys_bin`` left at its default ``nsys`` is looked for on the PATH, then in the
  project's own install (``make tools``: ``.tools/nsys``), then in ``/usr/local/cuda/bin``,
  ``/opt/nvidia/nsight-systems/*/bin`` and ``/usr/local/cuda*/bin`` (newest version first); the first
  that answers ``nsys --version`` runs. Any other value is used alone. The path and version go into
  ``environment.json`` (``nsys_path``, ``nsys_version``) and the first line on stderr. None found:
  :class:`autotuner.errors.UserError` (one line, exit 2) naming where it looked and how to install it.
* nsys exits non-zero: the tail of its output on stderr and a non-zero exit code; whatever report it
  saved is still read.
* the worker dies (a crash, the OOM killer, a kill): nsys still saves the report, and passes the exit
  status through (128 + signal after a kill). Rows the worker completed are read from the report; the
  op it was running is ``failed`` with "the profiled process died while measuring it", every op after it
  ``failed`` with "... died before measuring it".
* SIGTERM or SIGINT (``kill``, Ctrl-C, a batch system ending the job): passed on to nsys and the worker,
  which run in sessions of their own (:class:`StopSignals`). The worker unwinds and exits, nsys saves its
  report (given STOP_GRACE_S; then it and the worker are killed, said in one line), the rows are read
  and written as for a worker that died, and the exit code is 128 + the signal's number (143, 130)
  after one line saying so and where the results are. No process of the run outlives it.
* an op fails in the worker (an exception, OOM): its row is ``failed`` with the error, and the plan goes on.
* a completed op with no range in the report: ``failed``, naming the likely cause (the nvtx package's
  version; see autotuner.ops.annotate).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from autotuner.errors import UserError
from autotuner.launchers.nsys_report import export_sqlite
from autotuner.launchers.nsys_rows import (  # noqa: F401 (measured_ranges, range_columns: re-exported)
    Key,
    Outcome,
    ReportData,
    build_rows,
    measured_ranges,
    range_columns,
    read_sqlite,
)
from autotuner.launchers.nsys_worker import MEASURING_FILE, STARTED_FILE, NsysObserver
from autotuner.launchers.nsys_worker import worker_dir as worker_dir_of
from autotuner.results import load_rows
from autotuner.runner import Runner

REPORT_NAME = "report"  # run_dir/report.nsys-rep, run_dir/report.sqlite
LOG_NAME = "nsys.log"
LAUNCH_ATTEMPTS = 3  # see lost_launch_race
INSTALL_HINT = (
    "install it with make tools (scripts/install_nsys.sh) or point launcher.nsys_bin at an nsys binary"
)
# launcher.nsys_bin's default, which means: look for nsys (see find_nsys). Tests point the roots elsewhere.
DEFAULT_NSYS = "nsys"
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout
PROJECT_NSYS = Path(".tools/nsys/usr/lib/nsight-systems/bin/nsys")  # where scripts/install_nsys.sh puts it
SYSTEM_ROOT = Path("/")
# CUDA's usual locations (relative to SYSTEM_ROOT), in the order they are tried.
SYSTEM_NSYS = ("usr/local/cuda/bin/nsys", "opt/nvidia/nsight-systems/*/bin/nsys", "usr/local/cuda*/bin/nsys")

CUDA_TRACE = ("cuda", "nvtx", "osrt", "cublas", "cudnn")
CPU_TRACE = ("nvtx", "osrt")

# Switches the launcher sets itself and a user may not pass: (long name, short letter).
_RESERVED = {"output": "o", "force-overwrite": "f", "trace": "t"}
# Short letters of the switches the launcher sets by default and a user may replace.
_SHORT = {"sample": "s", "capture-range": "c"}
_TRACE_RE = re.compile(r"^[a-z0-9_-]+$")

# --- the nsys command --------------------------------------------------------------------------


@dataclass(frozen=True)
class NsysBinary:
    """The nsys a run uses: its absolute path and the line ``nsys --version`` printed."""

    path: str
    version: str

    @property
    def short_version(self) -> str:
        """``2022.4.2.1-df9881f`` from ``NVIDIA Nsight Systems version 2022.4.2.1-df9881f``."""
        match = re.search(r"version\s+(\S+)", self.version)
        return match[1] if match else self.version


def nsys_candidates(project_root: Path | None = None, system_root: Path | None = None) -> list[Path]:
    """Where the default ``nsys_bin`` is looked for after the PATH, in order: the project's own install
    (PROJECT_NSYS under ``project_root``), then SYSTEM_NSYS under ``system_root``, the matches of a
    pattern newest version first. Only executable files; one path per file (``/usr/local/cuda`` is
    usually a link to one of the ``/usr/local/cuda-*`` folders)."""
    project_root = PROJECT_ROOT if project_root is None else project_root
    system_root = SYSTEM_ROOT if system_root is None else system_root
    found = [project_root / PROJECT_NSYS]
    for pattern in SYSTEM_NSYS:
        found += sorted(system_root.glob(pattern), key=_version_key, reverse=True)
    unique: dict[str, Path] = {}
    for path in found:
        if path.is_file() and os.access(path, os.X_OK):
            unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


def _version_key(nsys: Path) -> tuple[int, ...]:
    """The numbers of the folder above ``bin/nsys`` (``2024.2``, ``cuda-12.4``), compared as numbers."""
    return tuple(int(n) for n in re.findall(r"\d+", nsys.parent.parent.name))


def nsys_version(nsys: str) -> str | None:
    """The last line ``nsys --version`` prints; None when it does not answer."""
    try:
        proc = subprocess.run([nsys, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return lines[-1] if proc.returncode == 0 and lines else None


def find_nsys(nsys_bin: str, project_root: Path | None = None, system_root: Path | None = None) -> NsysBinary:
    """The nsys to run and its version; UserError (one line) when none answers ``nsys --version``.

    A ``nsys_bin`` other than the default ``nsys`` (a path, or another name on the PATH) is used
    alone. The default is looked for on the PATH, then in :func:`nsys_candidates` (the project's own
    install, then the usual CUDA locations); the first that answers is used.
    """
    if nsys_bin != DEFAULT_NSYS:
        found = shutil.which(nsys_bin)
        if found is None:
            raise UserError(f"nsys not found (launcher.nsys_bin={nsys_bin!r}): {INSTALL_HINT}")
        version = nsys_version(found)
        if version is None:
            raise UserError(
                f"launcher.nsys_bin={nsys_bin!r} ({os.path.abspath(found)}) does not answer --version: "
                f"{INSTALL_HINT}"
            )
        return NsysBinary(os.path.abspath(found), version)
    on_path = shutil.which(DEFAULT_NSYS)
    silent = []
    for path in ([Path(on_path)] if on_path else []) + nsys_candidates(project_root, system_root):
        version = nsys_version(str(path))
        if version is not None:
            return NsysBinary(os.path.abspath(path), version)
        silent.append(str(path))
    project = (PROJECT_ROOT if project_root is None else project_root) / PROJECT_NSYS
    system = ", ".join(str(Path("/", p).parent) for p in SYSTEM_NSYS)
    mute = f"; {', '.join(silent)} did not answer --version" if silent else ""
    raise UserError(
        f"nsys not found (launcher.nsys_bin={nsys_bin!r}: looked on the PATH, at {project} and in {system}"
        f"{mute}): {INSTALL_HINT}"
    )


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


def _wait_turn(run_dir: Path, stop: StopSignals, timeout_s: float = 600) -> None:
    """Launch the ranks' ``nsys profile`` one after another: two nsys 2022.4 started at the same moment
    on one machine both lose the ``sem_open`` launch race (see lost_launch_race) far more often than one.
    Rank N waits until rank N-1's worker has started (its ``started`` file); the workers then wait for
    each other in their process group's rendezvous. A stop signal ends the wait."""
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        return
    previous = run_dir / f"worker.rank{rank - 1}" / STARTED_FILE
    deadline = time.monotonic() + timeout_s
    while not previous.exists() and stop.signum is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank - 1}'s nsys worker did not start within {timeout_s:.0f} s")
        time.sleep(0.2)


def run_nsys(cmd: list[str], log_path: Path, stop: StopSignals, tail_bytes: int = 16_384) -> NsysRun:
    """Run ``cmd`` (no shell), copying its output to stderr and ``log_path``; keep the tail.

    The log is appended to, each run starting with its argument list as JSON: the exact command, for
    a rerun by hand. nsys leads a session of its own, and ``stop`` passes it a SIGTERM or SIGINT of
    ours (see :class:`StopSignals`).
    """
    tail = b""
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_worker_env(), start_new_session=True
        )
    except OSError as exc:
        raise UserError(f"cannot run {cmd[0]!r}: {exc.strerror or exc}: {INSTALL_HINT}") from exc
    stop.attach(proc)
    try:
        # As a context manager, Popen waits for nsys even after an exception here.
        with proc, open(log_path, "ab") as log:
            assert proc.stdout is not None
            log.write(json.dumps(cmd).encode() + b"\n")
            # Chunks, not lines: tqdm and nsys redraw progress bars with carriage returns.
            while chunk := proc.stdout.read1(65_536):
                log.write(chunk)
                _echo(chunk)
                tail = (tail + chunk)[-tail_bytes:]
    finally:
        stop.detach()
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


# --- stopping: SIGTERM and SIGINT -----------------------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_GRACE_S = 300.0  # how long nsys may take, after a stop signal, to end and save its report
REPEAT_S = 2.0  # a second stop signal sooner than this is the first one again (see StopSignals)


class StopSignals:
    """What the parent does with SIGTERM and SIGINT while it runs nsys (a context manager).

    nsys runs in a session of its own, and starts the worker in another, so a signal for this process
    (``kill``, a Ctrl-C in the terminal, a batch system's SIGTERM) reaches neither unless passed on.
    The handler passes it to nsys's process group and to the worker's (its pid is in the worker's
    ``started`` file): the worker stops at once (see autotuner.launchers.nsys_worker), and nsys sees
    it end and saves its report as after any death of the program. If nsys has not ended STOP_GRACE_S
    later, or a second stop signal comes (at least REPEAT_S after the first, so that one stop sent twice,
    to the process and to its group, is not taken for a second), both groups are killed (SIGKILL) and
    :attr:`killed` says why. After nsys ended, :meth:`detach` kills whatever is left of either group,
    so no process of the run outlives it. The launcher then reads what was saved, as for a worker that
    died, and exits with :attr:`exit_code` (128 + the signal's number: 143 for SIGTERM, 130 for SIGINT).

    A signal that comes while nsys is not running is only recorded: the launcher starts no nsys after
    it, and finishes writing what it has. What this cannot help: a SIGKILL of this process (torchrun's
    agent sends one 30 s after its SIGTERM) leaves nsys, in its own session, to finish its report
    alone, with no rows written. Outside the main thread nothing is installed (Python runs
    signal handlers only there). The handler prints nothing: output written from a handler can
    interrupt a write to the same stream (a RuntimeError); the launcher says what happened afterwards.
    """

    def __init__(self, worker_dir: Path, grace_s: float | None = None) -> None:
        self.worker_dir = worker_dir
        self.grace_s = STOP_GRACE_S if grace_s is None else grace_s
        self.signum: int | None = None
        self.killed: str | None = None
        self._first_at = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._timer: threading.Timer | None = None
        self._saved: dict[int, Any] = {}
        self._worker: int | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._saved[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved.clear()
        self._cancel_timer()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def attach(self, proc: subprocess.Popen[bytes]) -> None:
        """nsys runs as ``proc``, leader of its own process group (a signal that came before it
        started is passed on now)."""
        self._proc = proc
        if self.signum is not None:
            self._pass_on(self.signum)

    def detach(self) -> None:
        """nsys has ended: after a stop signal, kill what is left of its group and the worker's."""
        proc, self._proc = self._proc, None
        self._cancel_timer()
        if proc is not None and self.signum is not None:
            self._worker_pid()
            # Groups only: their leaders may be gone, and a lone pid may have been reused since.
            for pgid in (proc.pid, self._worker):
                if pgid is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pgid, signal.SIGKILL)

    def _on_signal(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            self._pass_on(signum)
        elif now - self._first_at >= REPEAT_S:
            self._kill(f"a second {signal.Signals(signum).name} came")

    def _pass_on(self, signum: int) -> None:
        if self._proc is None:
            return
        for pid in (self._proc.pid, self._worker_pid()):
            if pid is not None:
                _signal_group(pid, signum)
        if self._timer is None:
            self._timer = threading.Timer(
                self.grace_s,
                self._kill,
                args=(f"nsys did not end within {self.grace_s:.0f} s of {self.name}",),
            )
            self._timer.daemon = True
            self._timer.start()

    def _kill(self, why: str) -> None:
        proc = self._proc
        if proc is None or self.killed is not None:
            return
        self.killed = why
        for pid in (proc.pid, self._worker_pid()):
            if pid is not None:
                _signal_group(pid, signal.SIGKILL)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _worker_pid(self) -> int | None:
        """The worker's pid from its ``started`` file while it runs (checked: a pid can be reused); the
        pid is kept, as its process group's id, for :meth:`detach`."""
        try:
            pid = int((self.worker_dir / STARTED_FILE).read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return None
        if b"autotuner.launchers.nsys_worker" not in cmdline:
            return None
        self._worker = pid
        return pid


def _signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group that ``pid`` leads, or to ``pid`` alone if it leads none."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
    except PermissionError:
        pass


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


def _profile(cmd: list[str], log_path: Path, worker_dir: Path, report: Path, stop: StopSignals) -> NsysRun:
    """Run nsys; again (up to LAUNCH_ATTEMPTS) only when it lost its launch race before the worker ran.
    After a stop signal no nsys is started."""
    log_path.unlink(missing_ok=True)
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        if stop.signum is not None:
            return NsysRun(stop.exit_code, f"nsys not started: this process got {stop.name}")
        result = run_nsys(cmd, log_path, stop)
        if stop.signum is not None:
            if result.returncode == 0:
                # nsys 2022.4 signalled too can end with 0 although its program ended with 128 + N:
                # the rows the program did not finish are to name the signal all the same.
                result = NsysRun(stop.exit_code, result.tail)
            break
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
    (UserError) for bad launcher settings or a missing nsys; 128 + N after signal N (SIGTERM: 143,
    SIGINT: 130; see :class:`StopSignals`), with what was measured before it written.
    """
    from autotuner.launchers.common import finish, start_writer

    _check_settings(cfg)
    launcher = cfg.launcher
    found = find_nsys(str(launcher.nsys_bin))
    nsys = found.path
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0:
        print(f"autotuner: nsys {found.short_version} at {nsys}", file=sys.stderr)
    run_dir = Path(run_dir).resolve()
    _join_ranks()
    worker_dir = worker_dir_of(run_dir)
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

    writer = start_writer(cfg, spec, run_dir, tools={"nsys": (nsys, found.version)})
    # From here a SIGTERM or SIGINT stops nsys and the worker, and the rows are still written.
    with StopSignals(worker_dir) as stop:
        _wait_turn(run_dir, stop)
        result = _profile(cmd, log_path, worker_dir, report_base.with_suffix(".nsys-rep"), stop)
        if stop.killed:
            print(
                f"autotuner: {stop.killed}: killed nsys and the worker (its report may be lost)",
                file=sys.stderr,
            )
        outcome = Outcome(result, *_read_worker(worker_dir), _read_report(nsys, report_base, result))

        # The runner's own plan, so the rows come in the order and number the worker ran them.
        plan = Runner(spec, NsysObserver(spec.device, launcher.warmup, launcher.iterations), writer).plan()
        writer.extend(build_rows(spec, plan, outcome))
        code = finish(writer, spec)
    if outcome.report.error:
        print(f"autotuner: {outcome.report.error}", file=sys.stderr)
    if stop.signum is not None:
        ok = sum(r.get("status") == "ok" for r in writer.rows)
        results = run_dir / "results.jsonl" if rank == 0 else writer.jsonl  # rank 0 merged every rank's
        print(
            f"autotuner: interrupted by {stop.name}; {ok} of {len(writer.rows)} rows were measured "
            f"before it: {results} (and .csv)",
            file=sys.stderr,
        )
        return stop.exit_code
    if result.returncode == 0:
        return code
    if outcome.report.still_open:
        print(f"autotuner: ranges left open: {'; '.join(outcome.report.still_open[-3:])}", file=sys.stderr)
    how = describe_exit(result.returncode)
    print(f"autotuner: nsys profile ended with {how}; its last lines:\n{result.tail}", file=sys.stderr)
    return code or 1
