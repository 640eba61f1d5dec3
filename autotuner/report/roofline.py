"""The roofline: each op's achieved FLOP/s against its arithmetic intensity (FLOPs per byte), log-log.

Under a calibration (``calibration.json`` in the run directory, or ``calibration=FILE``) the device's
ceilings are drawn: the compute peak of the run's dtype (flat) and the memory bandwidth (slope 1), the roof
being the lower of the two. A point far below the roof has headroom; a point near the sloped part is
memory-bound. Without a ``bytes_moved`` column the intensity is an approximation (see
autotuner.report.data.intensity) and the axis says so. Ops without FLOPs (norms, RoPE, bias-dropout-add,
the activation) have no intensity and are not drawn; the caption counts them.

Markers: the colour is the op, the shape is the run, filled is forward and hollow is backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, FuncFormatter, NullFormatter

from autotuner.report.data import Run, intensity
from autotuner.report.style import MARKERS, new_figure
from autotuner.results.calibration import ceilings
from autotuner.results.units import human_si


def points(run: Run) -> tuple[list[tuple[dict[str, Any], float]], bool]:
    """([(row, intensity)], all exact) for the run's ok rows with FLOPs and a time."""
    found, exact = [], True
    for row in run.ok:
        value, is_exact = intensity(row)
        if value is not None and row["median_us"] > 0:
            found.append((row, value))
            exact = exact and is_exact
    return found, exact


def run_ceilings(run: Run) -> tuple[float | None, float | None]:
    """(peak FLOP/s for the run's dtype, memory bandwidth in bytes/s) from its calibration, if any: the
    ceilings the rows' ``bound`` and ``ceiling_fraction`` were judged against."""
    return ceilings(run.calibration, run.dtype)


def roofline_figure(runs: Sequence[Run], colours: dict[str, Any]) -> Figure | None:
    drawn = [points(run) for run in runs]
    if not any(found for found, _ in drawn):
        return None
    figure = new_figure("roofline")
    ax = figure.subplots()
    xs, exact, ops = [], True, []
    for index, (found, run_exact) in enumerate(drawn):
        exact = exact and run_exact
        marker = MARKERS[index % len(MARKERS)]
        for row, x in found:
            y = row["flops"] / (row["median_us"] * 1e-6)
            forward = row["phase"] == "forward"
            colour = colours[row["op"]]
            ax.scatter(
                x,
                y,
                s=40,
                marker=marker,
                linewidths=1.5,
                edgecolors=colour,
                facecolors=colour if forward else "none",
            )
            xs.append(x)
            ops.append(row["op"])
    # Show the ridge points too (peak / bandwidth), so the sloped, memory-bound part of each roof is seen.
    ridges = [p / b for p, b in map(run_ceilings, runs) if p and b]
    lo, hi = min(xs + ridges) / 4, max(xs + ridges) * 4
    roofs = _draw_ceilings(ax, runs, lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(EngFormatter(unit="FLOP/s"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(
        "arithmetic intensity (FLOP / byte moved)"
        if exact
        else "approximate arithmetic intensity: FLOPs / (weight bytes + peak bytes)"
    )
    ax.set_ylabel("achieved FLOP/s (FLOPs / median time)")
    ax.grid(alpha=0.3, which="both")
    handles = [
        Line2D([], [], linestyle="", marker="o", color=colours[op], label=op) for op in dict.fromkeys(ops)
    ]
    handles += [
        Line2D([], [], linestyle="", marker="o", color="black", label="forward"),
        Line2D([], [], linestyle="", marker="o", markerfacecolor="none", color="black", label="backward"),
    ]
    if len(runs) > 1:
        handles += [
            Line2D([], [], linestyle="", marker=MARKERS[i % len(MARKERS)], color="grey", label=f"run {i + 1}")
            for i in range(len(runs))
        ]
    handles += roofs
    figure.legend(handles=handles, loc="center right", fontsize=9, frameon=False)
    title = "Roofline" + ("" if roofs else " (no calibration: ceilings not drawn)")
    ax.set_title(title)
    figure.subplots_adjust(left=0.12, right=0.76, bottom=0.1, top=0.92)
    return figure


def _draw_ceilings(ax: Any, runs: Sequence[Run], lo: float, hi: float) -> list[Line2D]:
    """Draw each distinct calibration's roof over [lo, hi]; returns legend handles."""
    handles, seen = [], set()
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    for run in runs:
        peak, bandwidth = run_ceilings(run)
        if (peak, bandwidth) in seen or (peak is None and bandwidth is None):
            continue
        seen.add((peak, bandwidth))
        roof = np.minimum(
            np.full_like(x, peak if peak else np.inf), bandwidth * x if bandwidth else np.full_like(x, np.inf)
        )
        parts = []
        if peak:
            parts.append(f"{run.dtype} peak {human_si(peak, 'FLOP/s')}")
        if bandwidth:
            parts.append(f"memory {human_si(bandwidth, 'B/s')}")
        label = "calibrated roof:\n" + ",\n".join(parts)
        (line,) = ax.plot(x, roof, "--", color="black", linewidth=1.2, label=label)
        handles.append(line)
    return handles
