"""``autotuner-nsys-read REPORT [out=DIR] [nsys_bin=NSYS]``: the per-op table from a report.

For a report of launcher=nsys read somewhere else than where it was made (a cluster node's report on a
laptop), or one the launcher could not read (the node's nsys had no working exporter). Everything a row
needs is in the range names: op, phase and point (``measure linear_qkv.forward [s2048_b1]`` around the
measured iterations ``linear_qkv.forward [s2048_b1] #<i>``), seq_len and micro_batch_size from the point
label, so no model and no Hydra config is built. The rows are those of the launcher
(autotuner.launchers.nsys_rows): on a GPU the times are the op's kernel time, ``host_median_us`` its
NVTX range. What the report cannot tell (case, dtype, tensor_parallel) comes from an
``environment.json`` beside the report when it sits in its run directory, else stays empty; the worker's
columns (weight_bytes, num_threads, call_count) stay empty.

* ``REPORT.sqlite`` (nsys's SQLite export) is read as it is; ``REPORT.nsys-rep`` is first exported with
  nsys (``nsys_bin``, looked up as the launcher looks up ``launcher.nsys_bin``), and the export is kept
  in DIR as ``<REPORT stem>.sqlite``.
* DIR (``out``, default the report's folder) gets ``results.csv`` and ``results.jsonl``. Left to its
  default, it must not hold results already (the launcher's, with the worker's columns, are kept); named,
  it may hold results only when it is the report's own folder (replaced), never another run's.
* Exit code 0 when every row is ok, 1 when one failed (a window left open or short of iterations), 2
  with one line on stderr and nothing written for a file that is not a report, one with no ranges of
  ours, or a missing nsys.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.cli import Command, entry, parse, setting
from autotuner.errors import UserError, say_error
from autotuner.notices import say_notes
from autotuner.results.reading import read_run_text
from autotuner.termination import ending_quietly_on_a_closed_pipe

REPORT_SUFFIXES = (".nsys-rep", ".sqlite")
_RANK_RE = re.compile(r"-rank(\d+)$")  # report-rank<N>: one report per rank under torchrun


@dataclass(frozen=True)
class NsysReadSettings:
    out: str | None = setting(
        None,
        "where to write results.csv/.jsonl (default: the report's folder, if it holds no results)",
        "DIR",
    )
    nsys_bin: str | None = setting(
        None, "the nsys that exports a .nsys-rep (default: launcher.nsys_bin's default search)", "NSYS"
    )


COMMAND = Command(
    "autotuner-nsys-read",
    "autotuner.nsys_read",
    "Build the per-op table (results.csv/.jsonl) from an nsys report of launcher=nsys.",
    "REPORT",
    NsysReadSettings,
    most=1,
)


def context_of(report: Path) -> dict[str, Any]:
    """The identity columns (autotuner.runner.plan.IDENTITY_COLUMNS) a report cannot tell: case, dtype,
    device and tensor_parallel from the run directory it sits in (``environment.json``), the rank from its
    name. With no spec, this is what :func:`autotuner.runner.plan.named_identity` gets for the launcher's
    spec."""
    match = _RANK_RE.search(report.stem)
    context: dict[str, Any] = {"rank": int(match[1]) if match else 0}
    record = _record_of(report)
    if not record:
        return context  # a report copied on its own: those columns stay empty
    tf_config = record.get("transformer_config") or {}
    context.update(
        case=record.get("case"),
        dtype=record.get("dtype"),
        device=(record.get("environment") or {}).get("device_type"),
        tensor_parallel=tf_config.get("tensor_model_parallel_size") if isinstance(tf_config, dict) else None,
    )
    return {k: v for k, v in context.items() if v is not None}


def foreign(op: str, point: str, record: dict[str, Any]) -> str | None:
    """Why a ``measure`` window of ``op`` at ``point`` is not one of this tool's, or None when it is: an op
    this tool has (or the run's record lists: a captured call's) at a shape point ``s<seq>_b<mbs>`` (a
    captured call's at its signature). Another program's ranges can share our names' form; as rows they
    were ``ok`` rows of nothing, which the report could not draw."""
    from autotuner.ops_test.places import op_tree
    from autotuner.runner.plan import point_dims

    listed = record.get("ops") if isinstance(record.get("ops"), list) else []
    ours = set(op_tree().order)
    if op not in ours and op not in listed:
        return "no such op"
    if op in ours and not all(d is not None and d > 0 for d in point_dims(point)):
        return "not a shape point s<seq>_b<mbs>"
    return None


def _record_of(report: Path) -> dict[str, Any]:
    """The environment.json of the run directory the report sits in, or {} for a report copied on its
    own or a record that is not a JSON object (its columns then stay empty). Only a regular file is read:
    a FIFO is one line (autotuner.results.reading), not an open that waits."""
    path = report.parent / "environment.json"
    if not os.path.lexists(path):
        return {}
    try:
        record = json.loads(read_run_text(path))
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def read_rows(sqlite_path: Path, shown: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of an SQLite export, and the ``measure`` windows left out as not this tool's
    (:func:`foreign`: each named once, with why); UserError (naming ``shown``) when it is not a report or
    has no window of ours."""
    from autotuner.launchers.nsys_rows import read_sqlite, report_rows
    from autotuner.launchers.nsys_worker import marker_name

    try:
        data = read_sqlite(sqlite_path)
    except sqlite3.DatabaseError as exc:
        raise UserError(
            f"{shown} is not an nsys report ({exc}): give a .nsys-rep or the .sqlite that nsys export wrote"
        ) from exc
    context, record = context_of(shown), _record_of(shown)
    left_out = {key: why for key in data.measured if (why := foreign(key[0], key[2], record))}
    data.measured = {key: found for key, found in data.measured.items() if key not in left_out}
    if not data.measured:
        raise UserError(
            f"{shown} holds no ranges of ours (no 'measure <op>.<phase> [<point>]' NVTX range of this "
            "tool's ops and points): give a report made by python -m autotuner.main launcher=nsys"
        )
    return report_rows(data, context), [f"{marker_name(*key)} ({why})" for key, why in left_out.items()]


def _export(report: Path, nsys_bin: str | None, tmp: Path) -> Path:
    """``report`` (.nsys-rep) exported to SQLite under ``tmp``."""
    from autotuner.config import NsysLauncherConfig
    from autotuner.launchers.nsys_command import find_nsys
    from autotuner.launchers.nsys_report import export_sqlite

    nsys = find_nsys(nsys_bin or NsysLauncherConfig.nsys_bin).path
    try:
        return export_sqlite(nsys, report, tmp / f"{report.stem}.sqlite")
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines()[1:] if line.strip()]
        why = lines[-1].strip() if lines else str(exc).splitlines()[0]
        raise UserError(f"nsys could not export {report} ({why}): is it an Nsight Systems report?") from exc


def _out_dir(report: Path, out: Path | None) -> Path:
    """Where the rows go. Results already there are replaced only when asked for by name: ``out`` the
    report's own folder (its launcher's rows); another run's folder is refused, its measurements kept."""
    taken = [name for name in ("results.jsonl", "results.csv") if ((out or report.parent) / name).exists()]
    if out is not None:
        if taken and out.resolve() != report.parent.resolve():
            raise UserError(
                f"out={out} holds another run's {taken[0]}: give out= an empty or new folder (or the "
                f"report's own, {report.parent}, to replace its rows)"
            )
        return out
    if taken:
        raise UserError(
            f"{report.parent} already holds {taken[0]}: pass out=DIR for the rows read from the report "
            f"(out={report.parent} replaces them)"
        )
    return report.parent


def read_report(
    report: Path, out: Path | None = None, nsys_bin: str | None = None
) -> tuple[list[dict], Path]:
    """Read ``report`` and write its rows to ``out`` (see the module's docstring); (rows, the folder).

    Everything is checked and read before anything is written, so bad input leaves no file behind.
    """
    from autotuner.results import ResultsWriter

    report = Path(report)
    if not report.is_file():
        raise UserError(f"no report at {report}: give the path of a .nsys-rep or .sqlite file")
    if report.suffix == ".qdstrm":
        raise UserError(
            f"{report} is nsys's raw capture, not a report: turn it into a .nsys-rep with an nsys whose "
            "importer works (scripts/install_nsys.sh) and read that"
        )
    if report.suffix not in REPORT_SUFFIXES:
        raise UserError(f"{report} is not an nsys report: give a .nsys-rep or its .sqlite export")
    out_dir = _out_dir(report, out)
    with tempfile.TemporaryDirectory(prefix="nsys_read-") as tmp:
        exported = _export(report, nsys_bin, Path(tmp)) if report.suffix == ".nsys-rep" else None
        rows, left_out = read_rows(exported or report, report)
        if left_out:  # counted and named once, never rows
            shown = "; ".join(left_out[:5]) + (f"; and {len(left_out) - 5} more" if len(left_out) > 5 else "")
            say_notes(
                f"{len(left_out)} range(s) not of this tool's ops and points, left out: {shown}",
                stream=sys.stderr,
            )
        try:
            ResultsWriter(out_dir).extend(rows)
            if exported is not None:
                shutil.move(exported, out_dir / exported.name)  # read it again without nsys
        except OSError as exc:
            raise UserError(
                f"cannot write to {out_dir}: {exc.strerror or exc}: give out= a writable folder"
            ) from exc
    return rows, out_dir


@ending_quietly_on_a_closed_pipe
@entry(COMMAND)
def main(argv: list[str] | None = None) -> int:
    paths, args, _ = parse(COMMAND, argv)
    try:
        out = Path(args.out) if args.out else None
        rows, out_dir = read_report(Path(paths[0]), out, args.nsys_bin)
    except UserError as exc:
        say_error(COMMAND.name, exc)
        return exc.exit_code
    from autotuner.results.table import render

    print(render(rows))
    failed = [r for r in rows if r.get("status") == "failed"]
    print(f"\n{len(rows)} rows ({len(failed)} failed) in {out_dir}/results.csv and results.jsonl")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
