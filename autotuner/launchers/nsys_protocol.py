"""What the nsys launcher and its worker process agree on: the files the worker writes, the range that
marks a phase's measured iterations, and how the worker recognises its launcher.

Both sides import this module; neither imports the other's entry point. Under ``<run_dir>/worker/``
(``worker.rank<N>`` for each rank of a job of several processes) the worker writes:

* ``results.jsonl``/``results.csv``: one row per (op, phase, point) as the runner finishes it, with the
  status (ok, failed with the error, skipped). After a crash these rows say which ops completed.
* :data:`MEASURING_FILE`: the (op, phase, point) whose iterations are running, rewritten before each one;
  after a crash it names the op the process died in.
* :data:`STARTED_FILE`: the worker's pid, written first thing (the parent passes stop signals to it).
* :data:`FIT_FILE`: its fit check (autotuner.runner.fit), before the model is built: each row's
  estimated peak and the limit, which the parent names should the kernel kill the worker for memory.
"""

from __future__ import annotations

import re
from pathlib import Path

WORKER_DIR = "worker"
MEASURING_FILE = "measuring.txt"
STARTED_FILE = "started"
FIT_FILE = "fit.json"
LAUNCHER_ENV = "AUTOTUNER_NSYS_LAUNCHER"  # "<pid> <start time>" of the launcher (nsys_process.worker_env)

_MARKER_RE = re.compile(r"^measure (?P<op>[a-z0-9_]+)\.(?P<phase>forward|backward) \[(?P<point>[^\]]+)\]$")


def process_identity(pid: int) -> str | None:
    """``"<pid> <start time>"`` of a live process (the start in clock ticks since boot, field 22 of
    /proc/<pid>/stat: a pid reused by another process has another), None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return f"{pid} {fields[19]}" if len(fields) > 19 and fields[0] != "Z" else None


def worker_dir(run_dir: Path, rank: int, world: int) -> Path:
    """Where rank ``rank``'s worker records its rows: ``worker``, or ``worker.rank<N>`` for each rank of a
    job of several processes (``world``)."""
    return Path(run_dir) / (f"{WORKER_DIR}.rank{rank}" if world > 1 else WORKER_DIR)


def marker_name(op: str, phase: str, point: str) -> str:
    """The name of the range around a phase's measured iterations. It does not parse as one of the op
    ranges (:func:`autotuner.ops.naming.parse_range` gives None), so no statistic ever counts it."""
    return f"measure {op}.{phase} [{point}]"


def parse_marker(name: str) -> tuple[str, str, str] | None:
    """(op, phase, point) of a :func:`marker_name`; None for any other range."""
    match = _MARKER_RE.match(name)
    return None if match is None else (match["op"], match["phase"], match["point"])
