"""The nsys launcher: ``nsys profile`` around our worker, then the per-op table read from the report.

The parent (this module, inside ``python -m autotuner.main``) does not build a model. It

1. builds the ``nsys profile`` argument list (autotuner.launchers.nsys_command; never a shell string)
   around ``python -m autotuner.launchers.nsys_worker <run_dir> <config>``, which runs the get_data plan
   under NVTX ranges (see autotuner.launchers.nsys_worker);
2. runs it (autotuner.launchers.nsys_process), streaming its output to stderr and keeping the tail
   (``nsys.log`` in the run directory holds all of it);
3. exports ``report.nsys-rep`` to ``report.sqlite`` and reads it (autotuner.launchers.nsys_rows);
4. writes ``results.csv``/``results.jsonl`` with one row per planned (op, phase, point)
   (:func:`autotuner.runner.plan.plan`, the plan the worker's Runner ran) and prints the table.

The options nsys gets, and where nsys is looked for: autotuner.launchers.nsys_command.

The columns it writes and how each fault ends: docs/launchers.md, "nsys: columns and faults".
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from autotuner.errors import UserError
from autotuner.launchers.nsys_command import find_nsys, nsys_command, worker_command
from autotuner.launchers.nsys_process import (
    TORCHRUN_STOP_GRACE_S,
    StopSignals,
    describe_exit,
    join_ranks,
    profile,
    wait_turn,
)
from autotuner.launchers.nsys_protocol import FIT_FILE
from autotuner.launchers.nsys_protocol import worker_dir as worker_dir_of
from autotuner.launchers.nsys_rows import Outcome, build_rows, read_report, read_worker
from autotuner.measure.limits import MemoryLimit, oom_kills
from autotuner.runner.fit import FitCheck
from autotuner.runner.plan import plan

if TYPE_CHECKING:
    from autotuner.launchers.common import RunDirectory

REPORT_NAME = "report"  # run_dir/report.nsys-rep, run_dir/report.sqlite
LOG_NAME = "nsys.log"


def check_settings(cfg: DictConfig, spec: Any) -> None:
    """``cfg.launcher`` checked, and nsys found, before anything runs (autotuner.launchers.check_settings:
    in a sweep, every job's before the first one measures). Raises UserError (one line, exit code 2)."""
    _check_settings(cfg)
    find_nsys(str(cfg.launcher.nsys_bin))


def _check_settings(cfg: DictConfig) -> None:
    from autotuner.launchers.common import check_profiled_calls

    launcher = cfg.launcher
    if launcher.warmup < 0 or launcher.iterations < 1:
        raise UserError("launcher.warmup must be >= 0 and launcher.iterations >= 1: fix launcher.*")
    check_profiled_calls({"launcher.warmup": launcher.warmup, "launcher.iterations": launcher.iterations})
    if not 0 < launcher.start_timeout_s <= 3600:  # NaN fails too
        raise UserError(
            f"launcher.start_timeout_s={launcher.start_timeout_s} must be above 0 and at most 3600 (seconds "
            "nsys may take to start the worker)"
        )
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


def launch(cfg: DictConfig, spec: Any, run: RunDirectory) -> int:
    """Profile the plan under nsys, read the report, write and print the table.

    Exit code: 0 when every row is ok or skipped; 1 when a row failed or nsys exited non-zero; 2
    (UserError) for bad launcher settings or a missing nsys; 128 + N after signal N (SIGTERM: 143,
    SIGINT: 130; see :class:`autotuner.launchers.nsys_process.StopSignals`), with what was measured before
    it written.
    """
    from autotuner.launchers.common import finish, start_writer

    _check_settings(cfg)
    launcher = cfg.launcher
    found = find_nsys(str(launcher.nsys_bin))
    nsys = found.path
    rank, world = spec.rank, spec.world
    if rank == 0:
        print(f"autotuner: nsys {found.short_version} at {nsys}", file=sys.stderr)
    run_dir = run.path.resolve()
    worker_port = join_ranks(world)  # under torchrun: where the workers' own process group meets
    worker_dir = worker_dir_of(run_dir, rank, world)
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

    writer = start_writer(cfg, spec, run, tools={"nsys": (nsys, found.version)})
    # From here a SIGTERM or SIGINT stops nsys and the worker, and the rows are still written.
    with StopSignals(worker_dir, TORCHRUN_STOP_GRACE_S if world > 1 else None) as stop:
        wait_turn(run_dir, rank, world, stop)
        report = report_base.with_suffix(".nsys-rep")
        kills = oom_kills()
        result = profile(cmd, log_path, worker_dir, report, stop, worker_port, launcher.start_timeout_s)
        if stop.never_started is not None:
            raise UserError(
                f"{nsys} did not start the worker within launcher.start_timeout_s={stop.never_started:g} s "
                f"(killed; its output: {log_path}): check that it runs a program ({nsys} profile "
                "python -c pass), or raise launcher.start_timeout_s"
            )
        oom = _out_of_memory(result.returncode, kills, worker_dir)
        if stop.killed:
            print(
                f"autotuner: {stop.killed}: killed nsys and the worker (its report may be lost)",
                file=sys.stderr,
            )
        outcome = Outcome(result, *read_worker(worker_dir), read_report(nsys, report_base, result), oom)

        # The plan the worker's Runner ran, so the rows come in the order and number it ran them.
        writer.extend(build_rows(spec, plan(spec), outcome))
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
    if oom is not None:
        how = f"the kernel's out-of-memory killer ending the profiled process ({how})"
    print(f"autotuner: nsys profile ended with {how}; its last lines:\n{result.tail}", file=sys.stderr)
    return code or 1


def _out_of_memory(returncode: int, kills_before: int, worker_dir: Path) -> FitCheck | None:
    """The worker's fit check (its estimates and limit) where the kernel's OOM killer ended it: a SIGKILL
    (nsys passes 128 + 9 on) while the kernel's count of OOM kills rose (autotuner.measure.limits); None
    otherwise. A check the worker did not leave reads as no estimate, the limit unknown (0)."""
    if returncode not in (-signal.SIGKILL, 128 + signal.SIGKILL) or oom_kills() <= kills_before:
        return None
    try:
        return FitCheck.from_json(json.loads((worker_dir / FIT_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return FitCheck(MemoryLimit(0, "unknown: the worker left no fit check"))
