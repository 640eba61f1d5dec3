"""What a run measures and what each row is called: the plan and the row identity, for every launcher.

The plan is the list of (shape point, op, phase) a run goes through, in order; the identity is the part of
a row that says which measurement it is (case, op, phase, point, rank, ...) as opposed to what was
measured. Every launcher names its rows through :func:`row_identity`: the get_data and torch_profiler
launchers through the Runner, the nsys launcher for the rows it reads from its report, so the rows of the
three launchers match on the same keys. A report read with no run at hand (``python -m
autotuner.nsys_read``) has only the names in it: :func:`named_identity` gives the same columns from those.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotuner.ops_test.base import OpTest, ShapePoint
    from autotuner.runner import RunSpec

PlanItem = tuple["ShapePoint", "OpTest", str]

# The identity columns, in the order the rows hold them (autotuner.results).
IDENTITY_COLUMNS = (
    "case",
    "op",
    "phase",
    "point",
    "seq_len",
    "micro_batch_size",
    "dtype",
    "device",
    "launcher",
    "rank",
    "tensor_parallel",
    "emulated_layout",
    "call_count",
)


def plan(spec: RunSpec) -> list[PlanItem]:
    """The (point, op, phase) triples of a run, in the order they run: a capture's own plan as it is, else
    every point, and within a point every op in model order with each phase it has."""
    if spec.plan is not None:
        return list(spec.plan)
    return [(p, op, ph) for p in spec.points for op in spec.ops for ph in spec.phases if ph in op.phases]


def row_identity(spec: RunSpec, op: OpTest, point: ShapePoint, phase: str, launcher: str) -> dict[str, Any]:
    """The columns that name one row of ``spec``'s plan (see :data:`IDENTITY_COLUMNS`)."""
    return {
        "case": spec.case,
        "op": op.name,
        "phase": phase,
        "point": point.label,
        "seq_len": point.seq_len,
        "micro_batch_size": point.micro_batch_size,
        "dtype": spec.dtype,
        "device": spec.device.type,
        "launcher": launcher,
        "rank": spec.row_rank,
        "tensor_parallel": spec.tf_config.tensor_model_parallel_size,
        "emulated_layout": spec.emulation.describe() if spec.emulation is not None else None,
        "call_count": spec.call_counts.get((op.name, point.label)),
    }


_POINT_RE = re.compile(r"^s(?P<seq_len>\d+)_b(?P<micro_batch_size>\d+)$")


def point_dims(label: str) -> tuple[int | None, int | None]:
    """(seq_len, micro_batch_size) of a shape point label ``s<seq>_b<mbs>`` (ShapePoint.label); Nones for
    another label (a captured call's signature)."""
    match = _POINT_RE.match(label)
    return (None, None) if match is None else (int(match["seq_len"]), int(match["micro_batch_size"]))


def named_identity(
    op: str, phase: str, point: str, launcher: str, known: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The identity of a row known only by its names (no spec): op, phase and point as named, the
    dimensions from the point's label, the other columns from ``known`` (what a run's record tells), else
    None. The same columns as :func:`row_identity`."""
    seq_len, micro_batch_size = point_dims(point)
    row: dict[str, Any] = {column: None for column in IDENTITY_COLUMNS}
    row.update({k: v for k, v in (known or {}).items() if k in row})
    row.update(
        op=op, phase=phase, point=point, seq_len=seq_len, micro_batch_size=micro_batch_size, launcher=launcher
    )
    return row
