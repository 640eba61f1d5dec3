"""Do launchers agree? ``autotuner-launcher-agreement GET_DATA_RUN TORCH_PROFILER_RUN [NSYS_RUN]``

The three launchers time the same plan in three ways: get_data with its own timers (CUDA events on a
GPU), torch_profiler from the op's profiler ranges (their GPU-side span on a GPU), nsys from the op's
NVTX ranges and, on a GPU, from the CUDA kernels launched inside them. This reads the runs' results,
pairs the rows of the same (op, phase, shape point) and says per row whether the times agree::

    reference = nsys's time if an nsys run is given, else torch_profiler's median
    nsys's time = median_us: on a GPU each iteration's kernels, memsets and copies, on a CPU the NVTX
                  range (rows written before host_median_us existed: kernel_time_us, the kernels alone)
    ratio[launcher] = launcher's median / reference          (for get_data and torch_profiler)
    verdict = "below floor"  when reference < floor_us
              "within"       when every |ratio - 1| <= tolerance
              "outside"      otherwise

Why this reference: the summed durations of the op's kernels, memsets and copies are the time the GPU
spent on it, with neither the host's launch time nor a timer's own cost in them; torch_profiler sums the
same from its trace, get_data's CUDA events bracket it with the launches queued ahead
(timing.hide_launch). Why a floor: below about 100 us each launcher's fixed costs (an event pair, a
profiler range, launch gaps between kernels) are a large part of the time and differ by design, so a
ratio there says more about the launcher than about the op.

Rows come from one process: the ``rank="max"`` rows of a torchrun run (the slowest rank), else rank 0. A
row that failed in some launcher cannot be compared and fails the check; one skipped anywhere (an op
that does not exist with this layer spec) is listed and not counted. Exit status: 0 when every row at
or above the floor is within the tolerance, 1 otherwise, 2 for bad input (one line on stderr).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autotuner.cli import Command, entry, parse, setting
from autotuner.errors import UserError, say_error
from autotuner.results import load_rows
from autotuner.results.atomic import atomic_write_text, check_writable
from autotuner.results.table import text_table
from autotuner.termination import ending_quietly_on_a_closed_pipe

LAUNCHERS = ("get_data", "torch_profiler", "nsys")
Key = tuple[str, str, str]  # (op, phase, point)


@dataclass
class Run:
    """One launcher's rows of one process, by (op, phase, point), in the order the run measured them."""

    launcher: str
    path: Path
    rows: dict[Key, dict[str, Any]]


@dataclass
class Comparison:
    """One (op, phase, point): each launcher's time (us), the ratios to the reference, the verdict."""

    op: str
    phase: str
    point: str
    times_us: dict[str, float | None]
    nsys_time: str | None  # "gpu" (kernels, memsets, copies), "kernel" (kernels: old rows) or "nvtx"
    reference_us: float | None
    ratios: dict[str, float | None]
    verdict: str
    warnings: dict[str, str] = field(default_factory=dict)


@dataclass
class Agreement:
    """The whole check: its settings, one Comparison per common row, and the rows left out."""

    reference: str
    tolerance: float
    floor_us: float
    runs: dict[str, str]
    rows: list[Comparison]
    left_out: dict[str, list[str]]  # launcher -> "op phase point" of rows only that run has

    @property
    def counted(self) -> list[Comparison]:
        """The rows that decide the exit status: at or above the floor, and not skipped."""
        return [r for r in self.rows if r.verdict not in ("below floor", "skipped")]

    @property
    def passed(self) -> bool:
        return all(r.verdict == "within" for r in self.counted)

    def summary(self) -> str:
        ref = _reference_name(self.reference, self.rows)
        bad = [r for r in self.counted if r.verdict != "within"]
        within = len(self.counted) - len(bad)
        line = (
            f"agreement: {within} of {len(self.counted)} rows of {self.floor_us:g} us or more within "
            f"{self.tolerance * 100:g}% of {ref}"
        )
        if bad:
            several_points = len({r.point for r in self.rows}) > 1
            names = [f"{r.op} {r.phase}" + (f" {r.point}" if several_points else "") for r in bad]
            line += (
                f"; not within ({len(bad)}): " + ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            )
        below = sum(r.verdict == "below floor" for r in self.rows)
        skipped = sum(r.verdict == "skipped" for r in self.rows)
        if below or skipped:
            line += f"; {below} below the floor, {skipped} skipped (not counted)"
        return line + ("; PASS" if self.passed else "; FAIL")

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "tolerance": self.tolerance,
            "floor_us": self.floor_us,
            "runs": self.runs,
            "passed": self.passed,
            "summary": self.summary(),
            "rows": [asdict(r) for r in self.rows],
            "left_out": self.left_out,
        }


def load_run(path: str | Path, launcher: str) -> Run:
    """The rows of one process of a run directory that ``launcher`` wrote. Raises UserError."""
    path = Path(path)
    results = path / "results.jsonl"
    if not results.is_file():
        raise UserError(f"{path} has no results.jsonl: pass the directory of a {launcher} run")
    try:
        rows = load_rows(results)
    except (OSError, ValueError) as exc:  # ValueError: undecodable text, a line that is not JSON
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        problem = reason if str(results) in reason else f"{results} cannot be read ({reason})"
        raise UserError(f"{problem}: pass the directory of a {launcher} run") from exc
    if not all(isinstance(r, dict) for r in rows):
        raise UserError(f"{results} is not a results file (a line is not a row): pass a run directory")
    others = sorted({str(r.get("launcher")) for r in rows} - {launcher})
    if others:
        raise UserError(
            f"{path} holds {', '.join(others)} rows where {launcher} rows were expected: "
            "pass GET_DATA_RUN TORCH_PROFILER_RUN [NSYS_RUN] in that order"
        )
    # Under torchrun each rank wrote its rows and rank 0 added the "max" rows (the slowest rank's
    # figures, as Megatron's timers report): those describe the op; else the single process's rank 0.
    chosen = [r for r in rows if r.get("rank") == "max"] or [
        r for r in rows if r.get("rank") in (0, "0", None)
    ]
    return Run(launcher, path, {(r.get("op"), r.get("phase"), r.get("point")): r for r in chosen})


def _time_us(row: dict[str, Any], launcher: str) -> tuple[float | None, str | None]:
    """The row's time for the comparison and, for nsys, which time it is."""
    if launcher == "nsys":
        # On a GPU the op's device time is its kernels', memsets' and copies' summed durations (median_us
        # beside host_median_us); the NVTX range only brackets the launches (linear_qkv forward: 110 us
        # of host range for 262 us of GEMM on an H200). Rows written before host_median_us existed had
        # the range as median_us and the kernels alone as kernel_time_us.
        kernel = row.get("kernel_time_us")
        if kernel not in (None, "") and row.get("host_median_us") not in (None, ""):
            return float(row["median_us"]), "gpu"
        if kernel not in (None, ""):
            return float(kernel), "kernel"
        median = row.get("median_us")
        return (None, None) if median in (None, "") else (float(median), "nvtx")
    median = row.get("median_us")
    return (None, None) if median in (None, "") else (float(median), None)


def _check_same_setting(runs: Sequence[Run]) -> None:
    """Runs of different cases, dtypes or devices share op names but not meaning: refuse them."""
    seen = {}
    for run in runs:
        settings = {(r.get("case"), r.get("dtype"), r.get("device")) for r in run.rows.values()}
        seen[run.launcher] = settings
    first = runs[0]
    for run in runs[1:]:
        if seen[run.launcher] != seen[first.launcher]:
            describe = {k: sorted("/".join(map(str, s)) for s in v) for k, v in seen.items()}
            raise UserError(
                f"the runs differ in case/dtype/device ({describe}): compare runs of the same case, dtype "
                "and device"
            )


def compare(runs: Sequence[Run], tolerance: float = 0.1, floor_us: float = 100.0) -> Agreement:
    """Pair the runs' rows and judge each (see the module's docstring). Raises UserError when the runs
    have no (op, phase, point) in common."""
    _check_same_setting(runs)
    by_name = {run.launcher: run for run in runs}
    reference = "nsys" if "nsys" in by_name else "torch_profiler"
    common = [k for k in runs[0].rows if all(k in run.rows for run in runs[1:])]
    if not common:
        raise UserError(
            f"the runs have no (op, phase, shape point) in common ({', '.join(str(r.path) for r in runs)}): "
            "run the launchers with the same ops and shapes"
        )
    compared = [name for name in ("get_data", "torch_profiler") if name in by_name]
    rows = []
    for key in common:
        op, phase, point = key
        statuses = {run.launcher: run.rows[key].get("status") for run in runs}
        times: dict[str, float | None] = {}
        nsys_time = None
        for run in runs:
            times[run.launcher], which = _time_us(run.rows[key], run.launcher)
            if run.launcher == "nsys":
                nsys_time = which
        warnings = {run.launcher: run.rows[key]["warnings"] for run in runs if run.rows[key].get("warnings")}
        ref = times.get(reference)
        ratios = {
            name: (times[name] / ref if times.get(name) is not None and ref else None) for name in compared
        }
        not_ok = {name: status for name, status in statuses.items() if status != "ok"}
        if any(status == "skipped" for status in not_ok.values()):
            verdict = "skipped"
        elif not_ok or ref is None or any(v is None for v in ratios.values()):
            missing = not_ok or {name: "no time" for name, t in times.items() if t is None}
            verdict = "not measured (" + ", ".join(f"{n}: {s}" for n, s in missing.items()) + ")"
        elif ref < floor_us:
            verdict = "below floor"
        elif all(abs(r - 1) <= tolerance for r in ratios.values() if r is not None):
            verdict = "within"
        else:
            verdict = "outside"
        rows.append(Comparison(op, phase, point, times, nsys_time, ref, ratios, verdict, warnings))
    left_out = {
        run.launcher: [" ".join(k) for k in run.rows if k not in set(common)]
        for run in runs
        if any(k not in set(common) for k in run.rows)
    }
    return Agreement(reference, tolerance, floor_us, {r.launcher: str(r.path) for r in runs}, rows, left_out)


def _reference_name(reference: str, rows: Sequence[Comparison]) -> str:
    if reference != "nsys":
        return "torch_profiler's median"
    kinds = {r.nsys_time for r in rows if r.nsys_time}
    names = {
        frozenset({"gpu"}): "nsys GPU time (kernels, memsets, copies)",
        frozenset({"kernel"}): "nsys kernel time",
        frozenset({"nvtx"}): "nsys NVTX range time",
    }
    return names.get(frozenset(kinds), "nsys time (GPU where the report had GPU work, else NVTX)")


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(agreement: Agreement) -> str:
    """The table as fixed-width text, a legend and the summary line."""
    names = [n for n in LAUNCHERS if n in agreement.runs]
    header = ["op", "phase", "point", *(f"{n} us" for n in names)]
    # The reference's own ratio (1 when torch_profiler is the reference) stays in the JSON only.
    ratio_names = [
        n for n in ("get_data", "torch_profiler") if n in agreement.runs and n != agreement.reference
    ]
    header += [f"{n}/{agreement.reference}" for n in ratio_names] + ["verdict"]
    lines = []
    for row in agreement.rows:
        cells = [row.op, row.phase, row.point]
        for name in names:
            text = _us(row.times_us.get(name))
            if name == "nsys" and row.nsys_time == "nvtx" and row.times_us.get(name) is not None:
                text += " (nvtx)"
            cells.append(text + (" !" if name in row.warnings else ""))
        cells += ["-" if row.ratios[n] is None else f"{row.ratios[n]:.3f}" for n in ratio_names]
        cells.append(row.verdict)
        lines.append(cells)
    left = {0, 1, 2, len(header) - 1}  # names left-aligned, numbers right-aligned
    text = text_table(header, lines, [i not in left for i in range(len(header))], rule=False)
    legend = [
        f"reference: {_reference_name(agreement.reference, agreement.rows)}"
        + ("" if "nsys" in agreement.runs else " (no nsys run given)"),
        f"within: every ratio within 1 +- {agreement.tolerance:g}; below floor: reference under "
        f"{agreement.floor_us:g} us (not counted); ! = that launcher warned about the row (its results.csv)",
    ]
    for launcher, keys in agreement.left_out.items():
        shown = ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
        legend.append(f"only in the {launcher} run, not compared: {len(keys)} rows ({shown})")
    return "\n".join([text, "", *legend, agreement.summary()])


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all (autotuner.results.atomic): a reader never sees half a file."""
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


@dataclass(frozen=True)
class AgreementSettings:
    tolerance: float = setting(
        0.1, "the largest accepted |ratio - 1| of a row's time to the reference's", "X"
    )
    floor_us: float = setting(
        100.0, "rows whose reference time is under this many microseconds are not judged", "US"
    )
    json: str | None = setting(None, "also write the table as JSON here", "OUT")


COMMAND = Command(
    "autotuner-launcher-agreement",
    "autotuner.launcher_agreement",
    "Compare the times of a get_data, a torch_profiler and (optionally) an nsys run of the same ops and "
    "shape points, row by row, against nsys's GPU time (else torch_profiler's).",
    "GET_DATA_RUN TORCH_PROFILER_RUN [NSYS_RUN]",
    AgreementSettings,
    least=2,
    most=3,
)


@ending_quietly_on_a_closed_pipe
@entry(COMMAND)
def main(argv: Sequence[str] | None = None) -> int:
    paths, args, _ = parse(COMMAND, argv)
    get_data, torch_profiler, nsys = (*paths, None)[:3]
    for name, value in (("tolerance", args.tolerance), ("floor_us", args.floor_us)):
        if not math.isfinite(value) or value < 0:
            say_error(COMMAND.name, f"{name}={value}: give a finite number >= 0")
            return 2
    try:
        runs = [load_run(get_data, "get_data"), load_run(torch_profiler, "torch_profiler")]
        if nsys:
            runs.append(load_run(nsys, "nsys"))
        agreement = compare(runs, args.tolerance, args.floor_us)
        if args.json is not None:
            check_writable(args.json, f"json={args.json}", reads=paths)
    except UserError as exc:
        say_error(COMMAND.name, exc)
        return exc.exit_code
    if args.json is not None:  # before the table is printed: kept if the reader stops reading (| head)
        _write_json(Path(args.json), agreement.to_json())
    print(render(agreement))
    return 0 if agreement.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
