"""Stacked bars: where a transformer layer's time goes, per shape point, forward and backward.

Each bar stacks the medians of an op's parts. What the parts do not cover is drawn, not hidden: a hatched
grey block up to the whole op's median when the parts sum to less, a hatched red block above it when they
sum to more (each median is measured on its own, so noise can do that). A black tick marks the whole op's
median, and the uncovered share is written above the bar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from autotuner.ops.naming import PHASES
from autotuner.report.data import LAYER, LAYER_PARTS, SUBLAYER_PARTS, Breakdown, Run, breakdown
from autotuner.report.style import EXCESS_COLOUR, REMAINDER_COLOUR, new_figure
from autotuner.results.units import time_unit


def _bars(runs: Sequence[Run], whole: str, parts: tuple[str, ...], phase: str) -> list[tuple[str, Breakdown]]:
    """(x label, breakdown) per shape point, runs side by side within a point."""
    points = list(dict.fromkeys(p for run in runs for p in run.points))
    bars = []
    for point in points:
        for index, run in enumerate(runs, 1):
            found = breakdown(run, whole, parts, phase, point)
            if found is not None:
                bars.append((point if len(runs) == 1 else f"{point}\nrun {index}", found))
    return bars


def _draw(
    ax: Axes, bars: list[tuple[str, Breakdown]], colours: dict[str, Any], whole: str, phase: str
) -> None:
    if not bars:
        ax.text(0.5, 0.5, f"{whole} {phase}: not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    tops = [max(b.total, sum(v for _, v in b.parts)) for _, b in bars]
    unit, divisor = time_unit(max(tops))
    width = 0.7
    for x, (_, item) in enumerate(bars):
        bottom = 0.0
        for part, value in item.parts:
            ax.bar(
                x,
                value / divisor,
                width,
                bottom=bottom,
                color=colours[part],
                edgecolor="white",
                linewidth=0.5,
            )
            bottom += value / divisor
        gap = item.remainder / divisor
        if gap >= 0:
            ax.bar(x, gap, width, bottom=bottom, color=REMAINDER_COLOUR, hatch="//", edgecolor="#666666")
        else:
            # The parts overshoot: show the overshoot above the whole's median, in red, not clipped away.
            ax.bar(x, -gap, width, bottom=bottom + gap, color="none", hatch="xx", edgecolor=EXCESS_COLOUR)
        ax.hlines(
            item.total / divisor, x - width / 2 - 0.06, x + width / 2 + 0.06, colors="black", linewidth=2
        )
        share = 100 * item.remainder / item.total if item.total else 0.0
        ax.annotate(
            f"{share:+.0f}%",
            (x, max(item.total, item.total - item.remainder) / divisor),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=9)
    ax.set_ylabel(f"median time ({unit})")
    ax.set_title(f"{whole} {phase}")
    ax.set_ylim(0, max(tops) / divisor * 1.12)  # room for the share labels
    ax.grid(axis="y", alpha=0.3)


def _legend(figure: Figure, parts: Sequence[str], colours: dict[str, Any], whole: str) -> None:
    handles = [Patch(facecolor=colours[p], label=p) for p in parts]
    handles += [
        Patch(facecolor=REMAINDER_COLOUR, hatch="//", edgecolor="#666666", label="not covered by sub-ops"),
        Patch(
            facecolor="none", hatch="xx", edgecolor=EXCESS_COLOUR, label="sub-ops exceed the whole\n(noise)"
        ),
        Line2D([], [], color="black", linewidth=2, label="median of the whole op"),
    ]
    figure.legend(handles=handles, loc="center right", fontsize=9, frameon=False)


def layer_figure(runs: Sequence[Run], colours: dict[str, Any]) -> Figure | None:
    """transformer_layer = its six direct sub-ops + what they do not cover; forward | backward."""
    if not any(
        run.value(LAYER, phase, p) is not None for run in runs for phase in PHASES for p in run.points
    ):
        return None
    figure = new_figure("layer_breakdown")
    axes = figure.subplots(1, 2)
    for ax, phase in zip(axes, PHASES, strict=True):
        _draw(ax, _bars(runs, LAYER, LAYER_PARTS, phase), colours, LAYER, phase)
    figure.suptitle("Where the transformer layer's time goes (median per op; labels: share not covered)")
    figure.subplots_adjust(left=0.06, right=0.8, bottom=0.12, top=0.88, wspace=0.25)
    _legend(figure, LAYER_PARTS, colours, LAYER)
    return figure


def sublayer_figure(runs: Sequence[Run], colours: dict[str, Any]) -> Figure | None:
    """self_attention and mlp split into their parts; rows forward / backward."""
    wholes = [
        w
        for w in SUBLAYER_PARTS
        if any(run.value(w, ph, p) for run in runs for ph in PHASES for p in run.points)
    ]
    if not wholes:
        return None
    figure = new_figure("sublayer_breakdown")
    axes = figure.subplots(2, len(SUBLAYER_PARTS), squeeze=False)
    for col, whole in enumerate(SUBLAYER_PARTS):
        for row, phase in enumerate(PHASES):
            _draw(axes[row][col], _bars(runs, whole, SUBLAYER_PARTS[whole], phase), colours, whole, phase)
    figure.suptitle("Inside self_attention and mlp (median per op; labels: share not covered)")
    figure.subplots_adjust(left=0.06, right=0.8, bottom=0.1, top=0.9, wspace=0.25, hspace=0.45)
    parts = [p for whole in SUBLAYER_PARTS for p in SUBLAYER_PARTS[whole]]
    _legend(figure, parts, colours, "sub-layer")
    return figure
