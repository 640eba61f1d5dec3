"""What every figure shares: fixed pixel sizes, one colour per op, one marker and line style per run,
and the one way figures are written to PNG (matplotlib's Agg canvas, no pyplot, written atomically).
Numbers are formatted by autotuner.results.units, as in every other table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from autotuner.results.atomic import atomic_path

DPI = 100
# Pixel sizes of the figures. Fixed, so the page lays out the same for every run (and the tests can check
# them): savefig is called without bbox_inches="tight", which would crop each figure to a different size.
SIZES = {
    "layer_breakdown": (1200, 600),
    "sublayer_breakdown": (1200, 700),
    "scaling_time": (1200, 800),
    "scaling_memory": (1200, 900),
    "roofline": (1200, 700),
    "experts": (1200, 550),
    "prediction_timeline": (1200, 500),
    "prediction_memory": (1000, 550),
    "prediction_validation": (900, 450),
    "prediction_measured_timeline": (1200, 450),
}
MARKERS = ("o", "s", "D", "v", "^", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")
REMAINDER_COLOUR = "#bbbbbb"
EXCESS_COLOUR = "#d62728"


def new_figure(name: str) -> Figure:
    """A figure of the registered size, on the Agg canvas: works headless and never touches pyplot's
    global state, so making a report inside a run (or a notebook) leaves the caller's backend alone."""
    width, height = SIZES[name]
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def save(figure: Figure, path: Path) -> None:
    """Write ``figure`` to ``path`` whole or not at all: a report page open in a browser, or a run killed
    half-way, never shows a truncated PNG. ``format`` is given because the temporary name ends in .tmp."""
    with atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=DPI, format="png", metadata={"Software": None})


def op_colours(ops: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """The same colour for an op in every figure of a report, in model order: tab10's strong colours, then
    their light variants, then Dark2. Red and grey are left out: in the breakdowns grey means "not covered
    by sub-ops" and red "sub-ops exceed the whole"."""
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"].colors
    reserved = {6, 7, 14, 15}  # tab20's reds and greys
    strong = [c for i, c in enumerate(tab20) if i % 2 == 0 and i not in reserved]
    light = [c for i, c in enumerate(tab20) if i % 2 == 1 and i not in reserved]
    palette = strong + light + list(matplotlib.colormaps["Dark2"].colors)
    return {op: palette[i % len(palette)] for i, op in enumerate(ops)}
