"""The ``nsys profile`` command of the nsys launcher: which nsys, and the argument list around the worker.

Nothing here runs a profile (autotuner.launchers.nsys_process does) or reads one
(autotuner.launchers.nsys_rows).

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
  ``none`` nsys acts only on the first.)
* CPU: ``-t nvtx,osrt``, whole process (the CUDA profiler API does not exist there).

Which nsys: ``launcher.nsys_bin`` left at its default ``nsys`` is looked for on the PATH, then in the
project's own install (``make tools``: ``.tools/nsys``), then in ``/usr/local/cuda/bin``,
``/opt/nvidia/nsight-systems/*/bin`` and ``/usr/local/cuda*/bin`` (newest version first); the first that
answers ``nsys --version`` runs. Any other value is used alone. None found:
:class:`autotuner.errors.UserError` (one line, exit 2) naming where it looked and how to install it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autotuner.errors import UserError

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
