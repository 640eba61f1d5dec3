"""From an nsys report to the launcher's rows: which ranges each row is made of, and its columns.

Used by the nsys launcher (autotuner.launchers.nsys) after its run, and by ``python -m
autotuner.nsys_read`` on a report alone. Reads the worker's record and the report (exported to SQLite
with ``nsys export``, then read by autotuner.launchers.nsys_report); nothing here profiles or builds a
model. A row's statistics are a :class:`autotuner.measure.timer.Measurement` of one time per iteration,
as get_data's are, so its ``rel_ci`` and ``warnings`` mean what they mean there; its identity is
:func:`autotuner.runner.plan.row_identity` (:func:`autotuner.runner.plan.named_identity` for a report alone).
"""

from __future__ import annotations

import sqlite3
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotuner.launchers.nsys_process import NsysRun, describe_exit
from autotuner.launchers.nsys_protocol import MEASURING_FILE, parse_marker
from autotuner.launchers.nsys_report import (
    TOP_KERNELS,
    KernelStats,
    NvtxRange,
    OpenRange,
    attribute_kernels,
    export_sqlite,
    read_nvtx_ranges,
    read_open_ranges,
)
from autotuner.measure.metrics import Observed, fill, register_metric
from autotuner.measure.timer import Measurement
from autotuner.results import CALL_COLUMNS, load_rows
from autotuner.runner.plan import named_identity, row_identity

if TYPE_CHECKING:
    from autotuner.ops_test.base import OpTest, ShapePoint
    from autotuner.runner.fit import FitCheck

Key = tuple[str, str, str]  # (op, phase, point)


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
    """The five kernels with the most time over the iterations, as per-iteration averages.

    Kernels are told apart by their short name, the name shown: the instantiations of one template
    (``elementwise_kernel`` for an add, a copy, a multiply) add up to one entry, so each name appears
    once with all of its time. Every kernel of every iteration counts (see KernelStats.kernels).
    """
    totals: dict[str, list[float]] = {}
    for s in stats:
        for k in s.kernels:
            entry = totals.setdefault(k.name or k.demangled_name, [0.0, 0.0])
            entry[0] += k.total_ns
            entry[1] += k.count
    n = len(stats)
    top = sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))[:TOP_KERNELS]
    return "; ".join(f"{name} {total / n / 1e3:.1f}us x{count / n:g}" for name, (total, count) in top)


def range_columns(ranges: Sequence[NvtxRange], kernels: dict[NvtxRange, KernelStats]) -> dict[str, Any]:
    """The measured columns of one row from its ranges (one per iteration) and, on a GPU, their kernels.

    Which time leads: an NVTX range is host time. On a CPU that is the op's time, so ``median_us`` and
    the other statistics are of the range durations. On a GPU the range only brackets the launches
    (linear_qkv's forward of Llama-2-7B at s2048_b1 on an H200: a 110 us range, a 262 us GEMM), so the
    statistics are of each iteration's GPU time, the summed durations of the kernels, memsets and copies
    launched inside it, the time the device spent on the op, as the other launchers' GPU times are
    device times; ``host_median_us`` keeps the ranges' median there (and equals ``median_us`` on a CPU).
    ``kernel_time_us`` is the kernels' part alone: ``median_us`` minus it is the memsets and copies.
    """
    host = Measurement(times_ns=[r.duration_ns for r in ranges], stop_reason="nsys")
    stats = [kernels[r] for r in ranges if r in kernels]
    lead = Measurement(times_ns=[s.gpu_time_ns for s in stats], stop_reason="nsys") if stats else host
    row: dict[str, Any] = {**lead.columns(), "host_median_us": host.median_ns / 1e3}
    fill(row, Observed("nsys", kernels=stats or None))  # the kernel columns below, on a GPU
    if stats and row["kernel_count"] == 0:
        # A GPU time of 0: either the op launches nothing (the backward of a residual add passes its
        # gradient on) or its launches fell outside its ranges (another thread; shared/notes/nsys.md).
        row["warnings"] = ";".join(w for w in (row["warnings"], "no_kernels") if w)
    return row


# The kernel columns: metrics of nsys alone (autotuner.measure.metrics), from each iteration's KernelStats.


@register_metric("kernel_time_us", needs=("kernels",), launchers=("nsys",))
def _kernel_time_us(row: dict[str, Any], seen: Observed) -> float:
    return statistics.median(s.kernel_time_ns for s in seen.kernels or ()) / 1e3


@register_metric("kernel_count", needs=("kernels",), launchers=("nsys",))
def _kernel_count(row: dict[str, Any], seen: Observed) -> float:
    count = statistics.median(s.kernel_count for s in seen.kernels or ())
    return int(count) if float(count).is_integer() else count


@register_metric("top_kernels", needs=("kernels",), launchers=("nsys",))
def _top_kernels_column(row: dict[str, Any], seen: Observed) -> str:
    return _top_kernels(seen.kernels or ())


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
    """What the parent knows after nsys returned: how it ended, what the worker got to, the report;
    ``out_of_memory``: the worker's fit check (autotuner.runner.fit) where the kernel's OOM killer ended
    it (autotuner.launchers.nsys), else None."""

    nsys: NsysRun
    worker_rows: dict[Key, dict[str, Any]]
    in_flight: Key | None  # the phase the worker was running when it stopped
    report: ReportData
    out_of_memory: FitCheck | None = None


def read_sqlite(sqlite_path: Path) -> ReportData:
    """Read an exported report (see :class:`ReportData`)."""
    ranges = read_nvtx_ranges(sqlite_path)
    still_open = read_open_ranges(sqlite_path)
    measured = measured_ranges(ranges, still_open)
    ours = [r for found in measured.values() for r in found]
    kernels = attribute_kernels(sqlite_path, ours) if ours else {}
    return ReportData(measured, kernels, [r.name for r in still_open])


def read_worker(worker_dir: Path) -> tuple[dict[Key, dict[str, Any]], Key | None]:
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


def read_report(nsys: str, report_base: Path, result: NsysRun) -> ReportData:
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
    except (RuntimeError, OSError, sqlite3.DatabaseError) as exc:
        return ReportData(error=(str(exc).splitlines() or [type(exc).__name__])[0])


def build_rows(
    spec: Any, plan: Iterable[tuple[ShapePoint, OpTest, str]], outcome: Outcome
) -> list[dict[str, Any]]:
    """One row per planned (point, op, phase), in plan order: the worker's status, the report's times.
    After the OOM killer ended the worker, the op it was measuring at a point of as many tokens or more
    is ``skipped`` with that reason (it would be killed again: :meth:`_KilledForMemory.covers`)."""
    plan, rows = list(plan), []
    killed = _killed_for_memory(plan, outcome)
    for point, op, phase in plan:
        key = (op.name, phase, point.label)
        worker = outcome.worker_rows.get(key)
        row = row_identity(spec, op, point, phase, "nsys")
        if (
            worker is not None
        ):  # what the op stated about its call (OpCall.row_fields), as the worker wrote it
            row.update({k: worker[k] for k in CALL_COLUMNS if worker.get(k) is not None})
        if worker is None and outcome.out_of_memory is not None:
            row.update(outcome.out_of_memory.columns((point.label, op.name, phase)))
        if worker is None and killed is not None and key == killed.key:
            row.update(status="failed", error=killed.out_of_memory)
        elif worker is None and killed is not None and killed.covers(op, point, phase):
            row.update(status="skipped", error=killed.reason)
        elif worker is None and killed is not None:
            op_, phase_, point_ = killed.key
            row.update(
                status="failed",
                error=f"the profiled process died before measuring it: {killed.out_of_memory} in "
                f"{op_}.{phase_} {point_}",
            )
        elif worker is None:
            row.update(status="failed", error=_missing_reason(key, outcome))
        elif worker.get("status") != "ok":
            row.update({k: worker.get(k) for k in ("status", "error", "num_threads", *_FIT_COLUMNS)})
        else:
            row.update({k: worker.get(k) for k in _WORKER_COLUMNS})
            found = outcome.report.measured.get(key, [])
            if found:
                row.update(status="ok", **range_columns(found, outcome.report.kernels))
                ran = worker.get("samples")
                if ran and len(found) < ran:
                    # the worker ran every iteration, the report kept fewer (nsys stopped by a signal
                    # before it saved the last ones): the statistics are of those found
                    lost = f"ranges_lost({len(found)}/{ran})"
                    row["warnings"] = ";".join(w for w in (row["warnings"], lost) if w)
                fill(row, Observed("nsys"))  # what follows from the sensors and the times (TFLOP/s)
            else:
                row.update(status="failed", error=_no_range_reason(key, outcome))
        rows.append(row)
    return rows


@dataclass(frozen=True)
class _KilledForMemory:
    """The op and point the OOM killer ended the worker in, and what its rows say."""

    key: Key  # the (op, phase, point) it died in
    tokens: int  # seq_len x micro_batch_size of its point
    reason: str  # what the same op at as large a point says
    out_of_memory: str  # what its own row says

    def covers(self, op: OpTest, point: ShapePoint, phase: str) -> bool:
        """The same op at a point of as many tokens or more, in the same phase (or any, where a forward
        died: a backward holds what its forward does and more): it would be killed again."""
        larger = point.seq_len * point.micro_batch_size >= self.tokens
        return op.name == self.key[0] and larger and self.key[1] in (phase, "forward")


def _killed_for_memory(
    plan: list[tuple[ShapePoint, OpTest, str]], outcome: Outcome
) -> _KilledForMemory | None:
    """Where the OOM killer ended the worker: the phase it was measuring, or, where that one's row was
    written (the kill came before the next phase named itself), the first planned phase after it with no
    row."""
    fit = outcome.out_of_memory
    if fit is None or outcome.in_flight is None:
        return None
    keys = [(op.name, phase, point.label) for point, op, phase in plan]
    if outcome.in_flight not in keys:
        return None
    start = keys.index(outcome.in_flight)
    for (point, op, phase), key in list(zip(plan, keys, strict=True))[start:]:
        if key not in outcome.worker_rows:
            oom = fit.out_of_memory((point.label, op.name, phase))
            reason = f"{oom} at {point.label}: a point as large would be killed too"
            return _KilledForMemory(key, point.seq_len * point.micro_batch_size, reason, oom)
    return None


# The worker's columns of a measured row: the sensors' (autotuner.measure.metrics, run in the worker) and
# its settings; the times come from the report.
_FIT_COLUMNS = ("estimated_peak_bytes", "memory_limit_bytes")  # the worker's fit check (autotuner.runner.fit)
_WORKER_COLUMNS = (
    "weight_bytes",
    "activation_bytes",
    "peak_bytes",
    "flops",
    "stop_reason",
    "num_threads",
    "collectives",  # an emulated rank's (autotuner.model.emulation), recorded in the worker
    *_FIT_COLUMNS,
)

_NO_RANGE = (
    "no measured NVTX range {op}.{phase} [{point}] in the report "
    "(the nvtx package records under nsys 2022.4/2023.4 only at 0.2.10-0.2.11)"
)


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
    return _NO_RANGE.format(op=op, phase=phase, point=point)


# --- rows from a report alone (python -m autotuner.nsys_read) ----------------------------------


def report_rows(report: ReportData, context: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per ``measure`` window in the report, in the order measured, from the report alone.

    Without the launcher's plan and worker record, what a row is made of comes from the range names:
    op, phase and point from the window, seq_len and micro_batch_size from the point's label
    (:func:`autotuner.runner.plan.named_identity`). The
    number of measured iterations is taken as the most any window holds; a window with fewer (the op
    raised, or the process ended inside it), or one left open, makes a ``failed`` row, as the launcher
    would. ``context`` fills the columns a report cannot tell (case, dtype, device, ...); a column it
    leaves out stays empty, except ``device``, which is ``cuda`` when the report holds kernels.
    """
    iterations = {
        key: {r.parsed.iteration for r in found if r.parsed} for key, found in report.measured.items()
    }
    expected = max((len(found) for found in iterations.values()), default=0)
    left_open = {key for name in report.still_open if (key := parse_marker(name)) is not None}
    rows = []
    for key, found in report.measured.items():
        op, phase, point = key
        known = {"device": "cuda" if report.kernels else None, **(context or {})}
        row = {**named_identity(op, phase, point, "nsys", known), "stop_reason": "nsys"}
        done = len(iterations[key])
        if key in left_open:
            row.update(status="failed", error="the profiled process ended inside its measurement (left open)")
        elif not found:
            row.update(status="failed", error=_NO_RANGE.format(op=op, phase=phase, point=point))
        elif done < expected:
            row.update(
                status="failed",
                error=f"{done} of {expected} measured iterations in the report: the op raised or the "
                "profiled process ended inside it (the run's worker/results.jsonl has the error)",
            )
        else:
            row.update(status="ok", **range_columns(found, report.kernels))
        rows.append(row)
    return rows
