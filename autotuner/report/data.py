"""What a report is made from: one run directory read back, and the views the figures and tables need.

Nothing is drawn here (figures.py) and nothing is rendered (page.py). A run directory holds
``results.jsonl`` (the rows, see autotuner.results), ``environment.json`` (versions, device, command line),
Hydra's ``.hydra/`` (the composed config and the overrides) and, optionally, ``calibration.json`` (the
device's measured ceilings, written by ``python -m autotuner.calibrate``). Only ``results.jsonl`` is
required, so a report can be made from whatever launcher wrote the directory, or from a copied results file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from autotuner.ops_test.places import op_tree
from autotuner.results import load_run_rows
from autotuner.results.calibration import load as load_calibration  # the launcher's reader, its checks
from autotuner.results.environment import load_environment
from autotuner.results.reading import read_run_text

# The transformer layer's direct sub-ops: they do not overlap and run one after the other, so their
# medians sum to the layer's median minus the glue between them (residual bookkeeping, Python calls).
# Derived from the places the ops declare (autotuner.ops_test.places, which imports no torch).
LAYER = "transformer_layer"
_OPS = op_tree()
LAYER_PARTS = _OPS.children(LAYER)
# The parts of the two sub-layers that have parts of their own.
SUBLAYER_PARTS = {part: _OPS.children(part) for part in LAYER_PARTS if _OPS.children(part)}


@dataclass
class Run:
    """One run directory read back. ``label`` names it in legends and tables (unique within a report)."""

    path: Path
    label: str
    rows: list[dict[str, Any]]
    record: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    config_yaml: str = ""
    calibration: dict[str, Any] | None = None

    @cached_property
    def ok(self) -> list[dict[str, Any]]:
        """The rows the figures and comparisons use: ``ok`` with a time, one per (op, phase, point).

        Under tensor parallelism each rank has its rows plus one merged row per key with rank ``max``
        (the slowest rank, as Megatron's own timers report): then only the merged rows count.
        """
        rows = self.rows
        if any(r.get("rank") == "max" for r in rows):
            rows = [r for r in rows if r.get("rank") == "max"]
        return [r for r in rows if r.get("status") == "ok" and r.get("median_us") is not None]

    @cached_property
    def _by_key(self) -> dict[tuple[str, str, str], dict[str, Any]]:
        return {(r["op"], r["phase"], r["point"]): r for r in reversed(self.ok)}  # first row wins

    @property
    def ops(self) -> list[str]:
        """Ops in the order they were measured (the runner's plan is model order)."""
        return list(dict.fromkeys(r["op"] for r in self.rows))

    @property
    def points(self) -> list[str]:
        """Shape point labels, by micro-batch size then sequence length."""
        dims = {r["point"]: (r.get("micro_batch_size") or 0, r.get("seq_len") or 0) for r in self.rows}
        return sorted(dims, key=lambda p: dims[p])

    @property
    def dtype(self) -> str:
        return next((str(r["dtype"]) for r in self.rows if r.get("dtype")), "")

    def value(self, op: str, phase: str, point: str, column: str = "median_us") -> float | None:
        """One number of an ``ok`` row, or None when the row is missing, not ok, or the value is empty."""
        row = self._by_key.get((op, phase, point))
        value = None if row is None else row.get(column)
        return None if value is None or value == "" else float(value)


def _read_overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not os.path.lexists(path):
        return []
    # Hydra writes a YAML list of strings ("- key=value"); reading it by line keeps yaml out of the report.
    return [line[2:].strip() for line in read_run_text(path).splitlines() if line.startswith("- ")]


def load_run(run_dir: Path, label: str | None = None, calibration: dict[str, Any] | None = None) -> Run:
    """Read a run directory. ``calibration`` (from ``calibration=``) wins over the run's own file."""
    run_dir = Path(run_dir)
    # checked: a bad line or value is one UserError here, not a traceback later
    rows = load_run_rows(run_dir, "give a run directory of python -m autotuner.main")
    if calibration is None and (run_dir / "calibration.json").is_file():
        calibration = load_calibration(run_dir / "calibration.json")
    config = run_dir / ".hydra" / "config.yaml"
    return Run(
        path=run_dir,
        label=label or run_dir.name,
        rows=rows,
        record=load_environment(run_dir),
        overrides=_read_overrides(run_dir),
        config_yaml=read_run_text(config) if os.path.lexists(config) else "",
        calibration=calibration,
    )


def unique_labels(paths: list[Path]) -> list[str]:
    """Short names for run directories: the folder name, with parents added until all names differ."""
    paths = [Path(p).resolve() for p in paths]
    for depth in range(1, 6):
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{i}:{p.name}" for i, p in enumerate(paths, 1)]


@dataclass
class Breakdown:
    """A whole op's median split into its parts' medians; ``remainder`` is what the parts do not cover.

    The remainder can be negative: each median is measured separately, so noise can make the parts sum
    to more than the whole. It is shown as it is, not clipped. ``missing`` parts were not measured (not
    selected, failed or skipped); their time is inside the remainder.
    """

    total: float
    parts: list[tuple[str, float]]
    missing: list[str]

    @property
    def remainder(self) -> float:
        return self.total - sum(v for _, v in self.parts)


def breakdown(run: Run, whole: str, parts: tuple[str, ...], phase: str, point: str) -> Breakdown | None:
    """The breakdown of ``whole`` at one phase and point, or None when ``whole`` was not measured there."""
    total = run.value(whole, phase, point)
    if total is None:
        return None
    measured, missing = [], []
    for part in parts:
        value = run.value(part, phase, point)
        if value is None:
            missing.append(part)
        else:
            measured.append((part, value))
    return Breakdown(total, measured, missing)


def geometric(values: list[float]) -> bool:
    """Whether a sweep's values grow by a constant factor (then a log axis spaces them evenly).

    Two values count when their ratio is at least 1.5 (doubling sweeps are the common case).
    """
    values = sorted(set(v for v in values if v and v > 0))
    if len(values) < 2:
        return False
    ratios = [b / a for a, b in zip(values, values[1:], strict=False)]
    return min(ratios) >= 1.5 and max(ratios) / min(ratios) < 1.01


@dataclass
class Speedup:
    op: str
    phase: str
    point: str
    base_us: float
    other_us: float

    @property
    def factor(self) -> float:
        """Above 1: the other run is faster."""
        return self.base_us / self.other_us


def multi_rank(rows: list[dict[str, Any]]) -> bool:
    """Whether the rows come from several ranks (tables then show the rank column)."""
    return len({r.get("rank") for r in rows}) > 1


def speedups(base: Run, other: Run) -> list[Speedup]:
    """Per (op, phase, point) measured ``ok`` in both runs, in the base run's order."""
    theirs = {(r["op"], r["phase"], r["point"]): float(r["median_us"]) for r in other.ok}
    out = []
    for row in base.ok:
        key = (row["op"], row["phase"], row["point"])
        if key in theirs and theirs[key] > 0 and float(row["median_us"]) > 0:
            out.append(Speedup(*key, float(row["median_us"]), theirs[key]))
    return out


def intensity(row: dict[str, Any]) -> tuple[float | None, bool]:
    """(FLOPs per byte, exact) of a row for the roofline.

    ``bytes_moved`` (the bytes the op reads and writes, when the launcher measures it) gives the real
    arithmetic intensity. Without it the report uses FLOPs / (weight bytes + peak bytes): the weights the
    op must read plus the memory it allocates (outputs, saved tensors, workspaces). It ignores the inputs
    and counts an allocation once however often it is touched, so it is an approximation, labelled as one.
    """
    flops = row.get("flops") or 0
    if flops <= 0:
        return None, False
    if row.get("arithmetic_intensity"):  # the launcher's own figure (autotuner.measure.metrics)
        return float(row["arithmetic_intensity"]), True
    moved = row.get("bytes_moved")
    if moved:  # rows written before that column existed
        return flops / float(moved), True
    approx = (row.get("weight_bytes") or 0) + (row.get("peak_bytes") or 0)
    return (flops / approx, False) if approx > 0 else (None, False)
