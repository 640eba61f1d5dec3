"""The nsys launcher's processes: running ``nsys profile`` (with its launch-race retry), passing stop signals
on to it and its worker, and, under torchrun, the ranks' turns and the workers' meeting port.

Faults handled here (autotuner.launchers.nsys says what the rows then hold):

* nsys exits non-zero: the tail of its output is kept for the launcher to print (``nsys.log`` in the run
  directory holds all of it).
* nsys 2022.4 loses its launch race before the worker starts (:func:`lost_launch_race`): run again, up
  to LAUNCH_ATTEMPTS times (:func:`profile`).
* SIGTERM or SIGINT: passed on to nsys and the worker, which run in sessions of their own
  (:class:`StopSignals`); no process of the run outlives it.
* nsys itself ends first (killed, crashed): the worker, which would go on measuring with nothing
  recording it, is ended at once, and so is anything else nsys left (:meth:`StopSignals.reap`, which also
  ends an agent nsys left running).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.errors import UserError
from autotuner.launchers.nsys_command import INSTALL_HINT
from autotuner.launchers.nsys_protocol import LAUNCHER_ENV, STARTED_FILE, process_identity, worker_dir

LAUNCH_ATTEMPTS = 3  # see lost_launch_race
AGENT_GRACE_S = 5.0  # how long nsys's agent may take to end by itself after nsys has (see end_agent)


@dataclass
class NsysRun:
    """How ``nsys profile`` ended: its exit code and the end of its output (progress bars unrolled)."""

    returncode: int
    tail: str


def worker_env(worker_port: str | None = None) -> dict[str, str]:
    """The parent's environment, with this checkout first on the path, unbuffered output (so the
    worker's lines and nsys's arrive in order) and this process named (the worker watches it: see
    autotuner.launchers.nsys_worker._watch_launcher); under torchrun, ``worker_port``: where the workers'
    own process group meets (:func:`join_ranks`)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    env[LAUNCHER_ENV] = process_identity(os.getpid()) or ""  # the worker ends if this process is gone
    if worker_port is not None:
        env["MASTER_PORT"] = worker_port
        # torchrun tells its children to use its agent's store as clients; the workers' group has no
        # agent on the new port, so rank 0's worker must host the store itself.
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    return env


def join_ranks(world: int) -> str | None:
    """Under torchrun each rank's parent runs its own ``nsys profile`` around its own worker, and the
    workers form the tensor-parallel group. The parents form a small gloo group of their own on
    torchrun's port (to agree on the workers' port, and so rank 0 can wait for every rank before merging
    the rows); the workers then meet on a fresh port that rank 0 picks and sends to all: returned, for
    :func:`run_nsys`. None for a single process."""
    import socket

    import torch.distributed as dist

    if world <= 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # torchrun's environment says where the parents meet
    port = [None]
    if dist.get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = [str(sock.getsockname()[1])]
    dist.broadcast_object_list(port, src=0)
    return port[0]


def wait_turn(run_dir: Path, rank: int, world: int, stop: StopSignals, timeout_s: float = 600) -> None:
    """Launch the ranks' ``nsys profile`` one after another: two nsys 2022.4 started at the same moment
    on one machine both lose the ``sem_open`` launch race (see lost_launch_race) far more often than one.
    Rank N waits until rank N-1's worker has started (its ``started`` file); the workers then wait for
    each other in their process group's rendezvous. A stop signal ends the wait."""
    if rank == 0:
        return
    previous = worker_dir(run_dir, rank - 1, world) / STARTED_FILE
    deadline = time.monotonic() + timeout_s
    while not previous.exists() and stop.signum is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank - 1}'s nsys worker did not start within {timeout_s:.0f} s")
        time.sleep(0.2)


def run_nsys(
    cmd: list[str],
    log_path: Path,
    stop: StopSignals,
    tail_bytes: int = 16_384,
    *,
    worker_port: str | None = None,
    start_timeout_s: float | None = None,
) -> NsysRun:
    """Run ``cmd`` (no shell), copying its output to stderr and ``log_path``; keep the tail.

    The log is appended to, each run starting with its argument list as JSON: the exact command, for
    a rerun by hand. nsys leads a session of its own, and ``stop`` passes it a SIGTERM or SIGINT of
    ours (see :class:`StopSignals`), and kills it if the worker has not started ``start_timeout_s``
    after it (:meth:`StopSignals.expect_start`). ``worker_port``: under torchrun, where the workers'
    process group meets (:func:`join_ranks`).
    """
    tail = b""
    # nsys's own temporary files (its raw .qdstrm, a status file, nvidia/) go where TMPDIR says: a folder
    # removed however nsys ends (a killed nsys left them in /tmp for good; a launcher killed outright
    # still leaves this folder)
    with tempfile.TemporaryDirectory(prefix="autotuner-nsys-", ignore_cleanup_errors=True) as scratch:
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**worker_env(worker_port), "TMPDIR": scratch},
                start_new_session=True,
            )
        except OSError as exc:
            raise UserError(f"cannot run {cmd[0]!r}: {exc.strerror or exc}: {INSTALL_HINT}") from exc
        stop.attach(proc)
        if start_timeout_s is not None:
            stop.expect_start(start_timeout_s)
        # Its output pipe stays open while anything nsys started lives: the reaper ends that once nsys ended.
        reaper = threading.Thread(target=stop.reap, args=(proc,), name="nsys-reaper", daemon=True)
        reaper.start()
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
            reaper.join()
            stop.detach()
    return NsysRun(proc.returncode, _last_lines(tail.decode(errors="replace")))


def lost_launch_race(run: NsysRun, report: Path) -> bool:
    """Whether nsys failed before starting the program because of its launch race (nsys 2022.4).

    nsys's launcher creates a named semaphore ``/dev/shm/sem.nsys_sem_<pid>`` for the program it starts,
    and another nsys process opens it; on a loaded machine the open can come first, and nsys exits 1
    with a ``sem_open`` "No such file or directory" error from its ProcessWaiter, before the program
    ran (seen here in about 1 of 8 runs under load; the program had not started in any of them). Such
    a run is safe to repeat. So is its other start-up failure on a loaded machine (seen with the test suite
    running beside it): "Connection to the Agent lost." and no report, at exit code 0 or 1. The caller repeats
    only a run whose program had not started.
    """
    if report.exists():
        return False
    raced = run.returncode != 0 and "sem_open" in run.tail and "ProcessWaiter" in run.tail
    return raced or "Connection to the Agent lost" in run.tail


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
# Under torchrun, less: its agent SIGKILLs this process 30 s after its SIGTERM, and the rows are written
# only if nsys and the worker have ended (killed, if need be) and the report was read before then.
TORCHRUN_STOP_GRACE_S = 15.0
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
    :attr:`killed` says why. After nsys ended, :meth:`reap` kills whatever is left of either group,
    so no process of the run outlives it. The launcher then reads what was saved, as for a worker that
    died, and exits with :attr:`exit_code` (128 + the signal's number: 143 for SIGTERM, 130 for SIGINT).
    Without a signal too, :meth:`reap` ends what nsys leaves when it ends.

    A signal that comes while nsys is not running is only recorded: the launcher starts no nsys after
    it, and finishes writing what it has. What this cannot help: a SIGKILL of this process (torchrun's
    agent sends one 30 s after its SIGTERM, hence the shorter grace under it) writes no rows; the worker
    sees this process gone and stops (autotuner.launchers.nsys_worker._watch_launcher), and nsys then
    ends as after any end of its program. Outside the main thread nothing is installed (Python runs
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
        self._start_timer: threading.Timer | None = None
        # Set when nsys did not start the worker in time (:meth:`expect_start`) and was killed for it.
        self.never_started: float | None = None

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
        """nsys has ended (and :meth:`reap` ended what it left): no signal is passed on any more."""
        self._proc = None
        self._cancel_timer()
        if self._start_timer is not None:
            self._start_timer.cancel()
            self._start_timer = None

    def expect_start(self, timeout_s: float) -> None:
        """Kill nsys (its group and the worker's) if the worker has not written its ``started`` file
        ``timeout_s`` after nsys started: an nsys that never starts its program (a wrapper that hangs, an
        agent that never answers) would hold the run for ever. :attr:`never_started` then says so."""

        def check() -> None:
            if self._proc is not None and not (self.worker_dir / STARTED_FILE).exists():
                self.never_started = timeout_s
                self._kill(f"nsys did not start the worker within {timeout_s:g} s")

        self._start_timer = threading.Timer(timeout_s, check)
        self._start_timer.daemon = True
        self._start_timer.start()

    def reap(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait for nsys to end, then kill what is left of its process group and the worker's, and end
        an agent it left (:func:`end_agent`). Normally nothing is left: nsys ends after its program. But
        after a stop signal, or when nsys itself is killed or crashes, the worker may still run: it
        would measure on with nothing recording it, and hold nsys's output pipe open, so the launcher
        would wait for the whole plan (45 s of a 72-row tiny run with 990 iterations, nsys SIGKILLed).
        """
        proc.wait()
        self._worker_pid()
        # Groups only: their leaders may be gone, and a lone pid may have been reused since.
        for pgid in (proc.pid, self._worker):
            if pgid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        end_agent(proc.pid)

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


def _agents_of(nsys_pid: int) -> list[int]:
    """The pids of the live agents nsys ``nsys_pid`` started: ``nsys --start-agent
    --session-name=profile-<program>-<nsys pid> ...`` (nsys 2022.4)."""
    session_end = f"-{nsys_pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--start-agent" in args and any(
            a.startswith(b"--session-name=profile-") and a.endswith(session_end) for a in args
        ):
            found.append(int(entry.name))
    return found


def end_agent(nsys_pid: int, grace_s: float = AGENT_GRACE_S) -> None:
    """End the agent nsys ``nsys_pid`` left running, if it has not ended ``grace_s`` after nsys.

    nsys runs its agent in a session of its own, so no signal to nsys's group reaches it. It ends with
    nsys's program (seen here within 0.25 s of nsys, nsys killed or not), except after nsys's start-up
    failure "Connection to the Agent lost.", after which it stayed for good (two found hours
    later). Said in one line; SIGTERM first, SIGKILL 3 s later."""
    deadline = time.monotonic() + grace_s
    while (agents := _agents_of(nsys_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        if not agents:
            return
        if signum == signal.SIGTERM:
            print(
                f"autotuner: nsys's agent (pid {', '.join(map(str, agents))}) still ran {grace_s:g} s "
                "after nsys ended: ending it",
                file=sys.stderr,
            )
        for pid in agents:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        deadline = time.monotonic() + 3.0
        while (agents := _agents_of(nsys_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)


def _signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group that ``pid`` leads, or to ``pid`` alone if it leads none."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
    except PermissionError:
        pass


def profile(
    cmd: list[str],
    log_path: Path,
    worker_dir: Path,
    report: Path,
    stop: StopSignals,
    worker_port: str | None = None,
    start_timeout_s: float | None = None,
) -> NsysRun:
    """Run nsys; again (up to LAUNCH_ATTEMPTS) only when it lost its launch race before the worker ran.
    After a stop signal no nsys is started, nor after one that did not start the worker in time."""
    log_path.unlink(missing_ok=True)
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        if stop.signum is not None:
            return NsysRun(stop.exit_code, f"nsys not started: this process got {stop.name}")
        result = run_nsys(cmd, log_path, stop, worker_port=worker_port, start_timeout_s=start_timeout_s)
        if stop.never_started is not None:
            break
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
            f"autotuner: nsys failed to start the worker (see {__name__}.lost_launch_race); retrying",
            file=sys.stderr,
        )
    return result
