"""Lines: how each op's time and memory grow with sequence length and micro-batch size.

One column per swept dimension (a dimension with one value is left out and named in the caption). Along
sequence length the micro-batch size is held at the value with the most sequence lengths measured (the
largest on a tie), and the other way round. The y axes are logarithmic, because one layer's ops span
several decades (a bias-dropout-add against a whole block); the x axis too when the sweep is geometric
(each value a constant factor from the last), so a power law reads as a straight line. Zero values (ops
that save nothing for backward) cannot sit on a log axis and are left out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, FuncFormatter, NullFormatter

from autotuner.report.data import Run, geometric
from autotuner.report.style import LINESTYLES, new_figure
from autotuner.results.units import human_bytes

DIMS = {"seq_len": "sequence length", "micro_batch_size": "micro-batch size"}


def swept(runs: Sequence[Run]) -> list[str]:
    """The dimensions with more than one value in some run."""
    return [d for d in DIMS if any(len({r.get(d) for r in run.ok} - {None}) > 1 for run in runs)]


def _held(run: Run, dim: str) -> Any:
    """The value of the other dimension to hold while ``dim`` varies."""
    other = next(d for d in DIMS if d != dim)
    counts = Counter(r.get(other) for r in {r["point"]: r for r in run.ok}.values())
    return max(counts, key=lambda v: (counts[v], v or 0)) if counts else None


def _lines(run: Run, dim: str, phase: str, column: str) -> dict[str, list[tuple[float, float]]]:
    """op -> [(x, y)] of positive values, the other dimension held fixed."""
    other = next(d for d in DIMS if d != dim)
    held = _held(run, dim)
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in run.ok:
        value = row.get(column)
        # a row at no shape point (a captured call's; a null seq_len is the schema's) has no place on x
        at = row.get(dim)
        if row["phase"] == phase and row.get(other) == held and at is not None and value and value > 0:
            lines.setdefault(row["op"], []).append((float(row[dim]), float(value)))
    return {op: sorted(xy) for op, xy in lines.items()}


def _panel(ax: Axes, runs: Sequence[Run], dim: str, phase: str, column: str, colours: dict[str, Any]) -> None:
    xs: set[float] = set()
    for index, run in enumerate(runs):
        for op, xy in _lines(run, dim, phase, column).items():
            xs.update(x for x, _ in xy)
            style = LINESTYLES[index % len(LINESTYLES)]
            ax.plot(
                [x for x, _ in xy],
                [y for _, y in xy],
                style,
                color=colours[op],
                marker="o",
                markersize=3,
                linewidth=1.2,
            )
    ax.set_yscale("log")
    if geometric(sorted(xs)):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_formatter(NullFormatter())
    if xs:
        ax.set_xticks(sorted(xs), [f"{x:g}" for x in sorted(xs)])
    held = ", ".join(dict.fromkeys(str(_held(run, dim)) for run in runs))  # once when runs agree
    other = DIMS[next(d for d in DIMS if d != dim)]
    ax.set_xlabel(f"{DIMS[dim]} ({other} {held})", fontsize=9)
    ax.grid(alpha=0.3, which="both")


def _legend(figure: Figure, runs: Sequence[Run], colours: dict[str, Any]) -> None:
    ops = list(dict.fromkeys(op for run in runs for op in run.ops if any(r["op"] == op for r in run.ok)))
    handles = [Line2D([], [], color=colours[op], marker="o", markersize=4, label=op) for op in ops]
    if len(runs) > 1:
        handles += [
            Line2D([], [], color="black", linestyle=LINESTYLES[i % len(LINESTYLES)], label=f"run {i + 1}")
            for i in range(len(runs))
        ]
    figure.legend(handles=handles, loc="center right", fontsize=8, frameon=False)


def _grid(
    name: str, runs: Sequence[Run], rows: list[tuple[str, str, str]], colours: dict[str, Any]
) -> Figure:
    """rows: (phase, column, y label) per row of panels; one column of panels per swept dimension."""
    dims = swept(runs)
    figure = new_figure(name)
    axes = figure.subplots(len(rows), len(dims), squeeze=False)
    for r, (phase, column, label) in enumerate(rows):
        for c, dim in enumerate(dims):
            ax = axes[r][c]
            _panel(ax, runs, dim, phase, column, colours)
            ax.set_title(f"{label}, {phase}", fontsize=10)
            if column == "median_s":
                ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
            else:
                # Powers of two read as round KiB / MiB; powers of ten would not.
                ax.set_yscale("log", base=2)
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
            ax.yaxis.set_minor_formatter(NullFormatter())
    figure.subplots_adjust(left=0.09, right=0.8, bottom=0.07, top=0.92, wspace=0.3, hspace=0.5)
    _legend(figure, runs, colours)
    return figure


def _seconds(runs: Sequence[Run]) -> list[Run]:
    """The runs with a ``median_s`` column added: the time axis is labelled in seconds with SI prefixes."""
    converted = []
    for run in runs:
        rows = [{**r, "median_s": r["median_us"] * 1e-6} for r in run.ok]
        converted.append(Run(run.path, run.label, rows))
    return converted


def time_figure(runs: Sequence[Run], colours: dict[str, Any]) -> Figure | None:
    if not swept(runs):
        return None
    rows = [("forward", "median_s", "median time"), ("backward", "median_s", "median time")]
    figure = _grid("scaling_time", _seconds(runs), rows, colours)
    figure.suptitle("Time against shape (log axes)")
    return figure


def memory_figure(runs: Sequence[Run], colours: dict[str, Any]) -> Figure | None:
    measured = any(r.get(c) for run in runs for r in run.ok for c in ("activation_bytes", "peak_bytes"))
    if not swept(runs) or not measured:  # nsys and torch_profiler rows may carry no memory numbers
        return None
    rows = [
        ("forward", "activation_bytes", "activation bytes (saved for backward)"),
        ("forward", "peak_bytes", "peak bytes"),
        ("backward", "peak_bytes", "peak bytes"),
    ]
    figure = _grid("scaling_memory", runs, rows, colours)
    figure.suptitle("Memory against shape (log axes)")
    return figure
