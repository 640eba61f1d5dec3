"""Time per expert against tokens per expert: how the ``experts`` op's time follows the routing.

One panel per phase. Each ok ``experts`` row with a tokens-per-expert histogram is one horizontal segment
at the height of the row's median time divided by its number of local experts (the histogram's length):
a filled dot at the mean tokens per local expert, a bar at the most any local expert got. The mean is
the work per expert if the load were even; the maximum is the straggler a grouped GEMM waits for. So
a balanced routing is a dot with no segment, and for the same mean, a longer segment that sits higher is
time lost to imbalance. Colour is the routing (``moe.routing``), marker shape the run; axes are log-log,
so time growing in proportion to tokens is a line of slope 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, FuncFormatter, NullFormatter

from autotuner.ops.naming import PHASES
from autotuner.report.data import Run
from autotuner.report.style import MARKERS, new_figure

EXPERTS = "experts"
# A fixed colour per routing mode (autotuner.model.routing.ROUTINGS; the results side does not import it).
ROUTING_COLOURS = {
    "learned": "#1f77b4",
    "uniform": "#2ca02c",
    "balanced": "#9467bd",
    "zipf": "#ff7f0e",
}
OTHER_COLOUR = "#555555"  # a row without a routing (or one this version does not know)
LABELLED_UP_TO = 12  # per panel: more shape points than this and their labels would overlap


@dataclass(frozen=True)
class ExpertPoint:
    """One ``experts`` row as the figure draws it."""

    phase: str
    point: str
    routing: str | None
    local_experts: int
    mean_tokens: float
    max_tokens: int
    time_per_expert_us: float


def has_expert_rows(runs: Sequence[Run]) -> bool:
    """Whether any run has a row of the ``experts`` op (whatever its status): then the figure is listed."""
    return any(r.get("op") == EXPERTS for run in runs for r in run.rows)


def expert_points(run: Run) -> list[ExpertPoint]:
    """The run's ok ``experts`` rows with a non-empty tokens-per-expert histogram and some tokens."""
    found = []
    for row in run.ok:
        counts = row.get("tokens_per_expert")
        if row["op"] != EXPERTS or not isinstance(counts, list) or not counts or not sum(counts):
            continue
        found.append(
            ExpertPoint(
                phase=row["phase"],
                point=row["point"],
                routing=row.get("routing"),
                local_experts=len(counts),
                mean_tokens=sum(counts) / len(counts),
                max_tokens=max(counts),
                time_per_expert_us=row["median_us"] / len(counts),
            )
        )
    return found


def _panel(ax: Axes, runs: Sequence[Run], phase: str) -> None:
    drawn = [(index, p) for index, run in enumerate(runs) for p in expert_points(run) if p.phase == phase]
    for index, p in drawn:
        colour = ROUTING_COLOURS.get(p.routing or "", OTHER_COLOUR)
        y = p.time_per_expert_us * 1e-6
        ax.plot([p.mean_tokens, p.max_tokens], [y, y], color=colour, linewidth=1.5, alpha=0.8)
        ax.plot([p.max_tokens], [y], marker="|", markersize=12, markeredgewidth=2, color=colour)
        ax.plot(
            [p.mean_tokens], [y], marker=MARKERS[index % len(MARKERS)], markersize=6, color=colour, alpha=0.8
        )
    # Each shape point named once, at the right end of its rightmost segment: the routings of one point
    # share their mean, so labels at every segment would pile up.
    ends: dict[str, tuple[float, float]] = {}
    for _, p in drawn:
        if p.point not in ends or p.max_tokens > ends[p.point][0]:
            ends[p.point] = (p.max_tokens, p.time_per_expert_us * 1e-6)
    if len(ends) <= LABELLED_UP_TO:
        for point, xy in ends.items():
            ax.annotate(point, xy, xytext=(8, -3), textcoords="offset points", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # token counts, as integers
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.15)  # room for the labels right of the longest segment
    ax.set_xlabel("tokens per local expert (dot: mean; bar: max)", fontsize=9)
    ax.set_ylabel("median time / local experts", fontsize=9)
    ax.set_title(f"experts, {phase}" + ("" if drawn else " (no rows)"), fontsize=10)
    ax.grid(alpha=0.3, which="both")


def experts_figure(runs: Sequence[Run], colours: dict[str, Any]) -> Figure | None:
    """The figure, or None when no run has an ok ``experts`` row with a histogram."""
    if not any(expert_points(run) for run in runs):
        return None
    figure = new_figure(EXPERTS)
    axes = figure.subplots(1, len(PHASES), squeeze=False)[0]
    for ax, phase in zip(axes, PHASES, strict=True):
        _panel(ax, runs, phase)
    routings = list(dict.fromkeys(p.routing for run in runs for p in expert_points(run)))
    handles = [
        Line2D(
            [], [], color=ROUTING_COLOURS.get(r or "", OTHER_COLOUR), marker="o", label=r or "not recorded"
        )
        for r in routings
    ]
    if len(runs) > 1:
        handles += [
            Line2D(
                [], [], color="black", marker=MARKERS[i % len(MARKERS)], linestyle="", label=f"run {i + 1}"
            )
            for i in range(len(runs))
        ]
    figure.legend(handles=handles, title="routing", loc="center right", fontsize=8, frameon=False)
    figure.subplots_adjust(left=0.08, right=0.86, bottom=0.12, top=0.88, wspace=0.3)
    figure.suptitle("Time per expert against tokens per expert (log axes)")
    return figure
