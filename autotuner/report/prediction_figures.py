"""The figures of a prediction's page (autotuner.report.prediction), drawn from ``prediction.json``
alone (plain data: the results side never imports the predictor).

**Timeline** (``schedule``): the boxes the predictor placed (``step.schedule`` in ``prediction.json``;
autotuner.predict.schedule simulates Megatron-Core's 1F1B order, interleaved with vpp, each stage its
own forward and backward, every exchange charged to both ends or, interleaved, to the receiving box), a
row per stage. The gaps are the
bubble: a stage waiting for its neighbour, and the exchanges. The caption gives the closed form the
simulation replaces (Narayanan et al. 2021, section 2.2: every stage paced at the slowest one).

**Memory** (``memory_stack``): per stage, the six terms the predictor adds (weights, gradients,
optimizer states, activations, logits, in flight) stacked to its total; beside each, Korthikanti et
al.'s closed-form activation estimate from the same base, and the GPU's memory as a line when given.

**Validation** (``validation_bars``): the ``validation`` record (``autotuner-validate``) as predicted and
measured bars for step time (with the measured IQR) and peak memory, and between them each phase of
the step (``validation_phases``: forward-backward, gradient reduction, optimizer), where the error
comes from; its table adds each op inside the step (autotuner.validate.in_step) beside its prediction.
Below them the measured step op by op (``measured_timeline_figure``): each rank's op visits in the median
step, on the schedule's time axis, with what lies between them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import EngFormatter, FuncFormatter, MultipleLocator

from autotuner.report.style import new_figure
from autotuner.results.units import BINARY_UNITS, human_bytes

MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "logits", "in_flight")
# Adam's step allocates its own after the forward-backward's terms are freed (autotuner.predict.memory):
# a bar beside those, on the resident states (the first three terms).
STEP_TERM = "optimizer_step"
BOX_KEY = ("stage", "phase", "microbatch", "chunk")  # a schedule box's key (autotuner.predict.schedule)
TERM_COLOURS = {
    "weights": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer": "#2ca02c",
    "activations": "#9467bd",
    "logits": "#8c564b",
    "in_flight": "#e377c2",
    STEP_TERM: "#17becf",
}
PHASE_COLOURS = {"forward": "#4c9be8", "backward": "#f28e2b"}


# ------------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Schedule:
    boxes: list[
        dict[str, Any]
    ]  # one per forward or backward: stage, phase, microbatch, chunk, start_s, end_s
    pipeline_s: float  # the prediction's
    interleaved: bool

    @property
    def end(self) -> float:
        return max(b["end_s"] for b in self.boxes)


def schedule(record: Mapping[str, Any]) -> Schedule:
    """The boxes of the prediction's pipeline schedule (module docstring)."""
    layout, step = record["layout"], record["step"]
    placed = step["schedule"]  # its placement order: (key, input, ...) per box, and each box's start and end
    boxes = [
        dict(zip(BOX_KEY, key, strict=True), start_s=start, end_s=end)
        for (key, *_), start, end in zip(placed["placed"], placed["starts"], placed["ends"], strict=True)
    ]
    return Schedule(boxes, float(step["pipeline"]), int(layout["vpp"]) > 1)


def timeline_figure(record: Mapping[str, Any]) -> Figure:
    """One row per stage (stage 0 on top), each box a forward or backward as the predictor placed it."""
    sched = schedule(record)
    p = int(record["layout"]["pp"])
    figure = new_figure("prediction_timeline")
    ax = figure.subplots()
    for box in sched.boxes:
        y = p - 1 - box["stage"]
        start, end = box["start_s"], box["end_s"]
        drawn = Rectangle(
            (start, y - 0.4),
            end - start,
            0.8,
            facecolor=PHASE_COLOURS[box["phase"]],
            edgecolor="white",
            linewidth=0.4,
        )
        drawn.set_gid(f"{box['phase']}:{box['stage']}:{box['microbatch']}:{box['chunk']}")
        ax.add_patch(drawn)
        if len(sched.boxes) <= 100 * p:  # numbers stay legible up to about a hundred boxes a row
            label = str(box["microbatch"] + 1) + (f".{box['chunk']}" if sched.interleaved else "")
            ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=6)
    ax.axvline(sched.pipeline_s, color="black", linestyle="--", linewidth=1)
    ax.set_xlim(0, max(sched.end, sched.pipeline_s) * 1.01 or 1.0)
    ax.set_ylim(-0.6, p - 0.4)
    layers = {int(st["index"]): st["layers"] for st in record["stages"]}  # an uneven split shows
    ax.set_yticks(
        range(p),
        [
            f"stage {s}" + (f"\n{layers[s]} layer{'s' if layers[s] != 1 else ''}" if s in layers else "")
            for s in reversed(range(p))
        ],
    )
    ax.xaxis.set_major_formatter(EngFormatter(unit="s"))
    ax.set_xlabel("time in the step (dashed: the predicted pipeline time)")
    bubble = float(record["step"]["bubble_fraction"])
    ax.set_title(
        f"{'interleaved ' if sched.interleaved else ''}1F1B, p={p}"
        + (f" v={record['layout']['vpp']}" if sched.interleaved else "")
        + f" m={record['derived']['microbatches']}: bubble and exchanges {bubble:.1%} of the slowest stage's"
        + " compute",
        fontsize=10,
    )
    _phase_legend(
        ax, Patch(facecolor="white", edgecolor="grey", label="gaps: waits for a neighbour, exchanges")
    )
    figure.subplots_adjust(left=0.08, right=0.98, bottom=0.22, top=0.9)
    return figure


def _phase_legend(ax: Any, third: Patch) -> None:
    """The timelines' legend under the axis: forward, backward, and what else the boxes show."""
    ax.legend(
        handles=[
            Patch(facecolor=PHASE_COLOURS["forward"], label="forward"),
            Patch(facecolor=PHASE_COLOURS["backward"], label="backward"),
            third,
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.15),
        ncol=3,
        fontsize=8,
        frameon=False,
    )


# --------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class StageStack:
    stage: int
    terms: list[tuple[str, float]]  # MEMORY_TERMS, bottom to top
    total: float  # the prediction's total (derived.memory_total_bytes)
    korthikanti: float
    optimizer_step: float


def memory_stack(record: Mapping[str, Any]) -> list[StageStack]:
    return [
        StageStack(
            int(m["stage"]),
            [(t, float(m[t]["value"])) for t in MEMORY_TERMS],
            float(total),
            float(m["korthikanti_activations"]["value"]),
            float(m[STEP_TERM]["value"]),
        )
        for m, total in zip(record["memory"], record["derived"]["memory_total_bytes"], strict=True)
    ]


def _bytes_axis(ax: Any, top: float) -> None:
    """Ticks at round numbers of the binary unit the top falls in (1, 2, 2.5 or 5 x 10^k of it), so the
    axis reads as the tables do (human_bytes) instead of 488.3 KiB steps."""
    unit, scale = "B", 1.0
    for name in BINARY_UNITS[1:]:
        if top < scale * 1024:
            break
        unit, scale = name, scale * 1024
    raw = top / scale / 6
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(f * power for f in (1, 2, 2.5, 5, 10) if f * power >= raw)
    ax.yaxis.set_major_locator(MultipleLocator(step * scale))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / scale:g} {unit}"))


def memory_figure(record: Mapping[str, Any], gpu_memory_gb: float | None = None) -> Figure:
    """Stacked bars per stage; a narrow hatched bar beside the activations is Korthikanti's estimate, a
    narrow bar on the other side Adam's step (on the resident states, as the activations are: the two
    phases' own terms do not add up)."""
    figure = new_figure("prediction_memory")
    ax = figure.subplots()
    stacks = memory_stack(record)
    for stack in stacks:
        base = 0.0
        for term, value in stack.terms:
            bar = Rectangle((stack.stage - 0.3, base), 0.45, value, facecolor=TERM_COLOURS[term])
            bar.set_gid(f"memory:{stack.stage}:{term}")
            ax.add_patch(bar)
            if term == "activations":
                estimate = Rectangle(
                    (stack.stage + 0.17, base),
                    0.15,
                    stack.korthikanti,
                    facecolor="white",
                    edgecolor=TERM_COLOURS[term],
                    hatch="xx",
                )
                estimate.set_gid(f"korthikanti:{stack.stage}")
                ax.add_patch(estimate)
            base += value
            if term == "optimizer":  # the resident states' top: where the step's own begins
                resident = base
                step = Rectangle((stack.stage - 0.47, base), 0.15, stack.optimizer_step)
                step.set(facecolor="white", edgecolor=TERM_COLOURS[STEP_TERM], hatch="//")
                step.set_gid(f"{STEP_TERM}:{stack.stage}")
                ax.add_patch(step)
        top_of_stage = max(base, resident + stack.optimizer_step)
        ax.text(
            stack.stage - 0.075, top_of_stage, human_bytes(stack.total), ha="center", va="bottom", fontsize=8
        )
    top = max([s.total for s in stacks] + [s.korthikanti + sum(v for _, v in s.terms[:3]) for s in stacks])
    handles = [Patch(facecolor=TERM_COLOURS[t], label=t) for t in MEMORY_TERMS]
    handles.append(
        Patch(facecolor="white", edgecolor=TERM_COLOURS["activations"], hatch="xx", label="Korthikanti")
    )
    handles.append(Patch(facecolor="white", edgecolor=TERM_COLOURS[STEP_TERM], hatch="//", label="Adam step"))
    if gpu_memory_gb:
        limit = gpu_memory_gb * 1e9
        line = ax.axhline(limit, color="#d62728", linewidth=1.2)
        line.set_gid("gpu_memory")
        handles.append(Line2D([], [], color="#d62728", label=f"GPU memory {gpu_memory_gb:g} GB"))
        top = max(top, limit)
    ax.set_xlim(-0.75, len(stacks) - 0.3)
    ax.set_ylim(0, top * 1.12 or 1)
    ax.set_xticks(range(len(stacks)), [f"stage {s.stage}" for s in stacks])
    _bytes_axis(ax, top)
    ax.set_ylabel("bytes per GPU")
    ax.set_title("Memory per GPU of each pipeline stage, at its peak", fontsize=10)
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    figure.subplots_adjust(left=0.12, right=0.8, bottom=0.1, top=0.92)
    return figure


# ----------------------------------------------------------------------------------------- validation


def validation_bars(record: Mapping[str, Any]) -> dict[str, dict[str, float]] | None:
    """{"step time": {predicted, measured}, "peak memory": {...}} from the validation record, or None."""
    v = record.get("validation")
    if not v:
        return None
    return {
        "step time": {"predicted": float(v["predicted_step_s"]), "measured": float(v["measured_step_s"])},
        "peak memory": {
            "predicted": float(v["predicted_peak_bytes"]),
            "measured": float(v["measured_peak_bytes"]),
        },
    }


def validation_phases(record: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """{phase: {predicted, measured}} of the validated step (empty for a record from before phases)."""
    phases = (record.get("validation") or {}).get("phases") or {}
    return {
        name: {"predicted": float(p["predicted_s"]), "measured": float(p["measured_s"])}
        for name, p in phases.items()
    }


def _phase_bars(ax: Any, phases: Mapping[str, Mapping[str, float]]) -> None:
    """Predicted and measured side by side for each phase of the step."""
    width = 0.38
    for offset, (side, color) in (
        (-width / 2, ("predicted", "#4c9be8")),
        (width / 2, ("measured", "#7f7f7f")),
    ):
        drawn = ax.bar(
            [i + offset for i in range(len(phases))],
            [p[side] for p in phases.values()],
            width=width,
            color=color,
            label=side,
        )
        for name, patch in zip(phases, drawn.patches, strict=True):
            patch.set_gid(f"phase {name}:{side}")
    ax.set_xticks(
        range(len(phases)), [name.replace(" ", "\n").replace("-", "-\n") for name in phases], fontsize=8
    )
    ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
    ax.set_title("the step's phases", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def validation_figure(record: Mapping[str, Any]) -> Figure | None:
    bars = validation_bars(record)
    if bars is None:
        return None
    v = record["validation"]
    phases = validation_phases(record)
    figure = new_figure("prediction_validation")
    axes = list(figure.subplots(1, 3 if phases else 2))
    if phases:
        _phase_bars(axes.pop(1), phases)
    for ax, (what, values) in zip(axes, bars.items(), strict=True):
        drawn = ax.bar(list(values), list(values.values()), color=["#4c9be8", "#7f7f7f"], width=0.6)
        for name, patch in zip(values, drawn.patches, strict=True):
            patch.set_gid(f"{what}:{name}")
        if what == "step time":  # the measured steps' spread: half the IQR either side of the median
            iqr = float(v.get("measured_step_iqr_s") or 0.0)
            ax.errorbar([1], [values["measured"]], yerr=[[iqr / 2], [iqr / 2]], color="black", capsize=6)
            ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
            error = v["predicted_step_s"] / v["measured_step_s"] - 1
        else:
            _bytes_axis(ax, max(values.values()))
            error = v["predicted_peak_bytes"] / v["measured_peak_bytes"] - 1
        ax.set_title(f"{what}: error {100 * error:+.1f}%", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    figure.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.88, wspace=0.35)
    figure.suptitle("Predicted against measured steps (autotuner-validate)")
    return figure


def measured_timeline_figure(record: Mapping[str, Any]) -> Figure | None:
    """The validated step's op visits, one row per rank (rank 0 on top), on the same time axis as the
    pipeline schedule: forwards blue, backwards orange, layers solid and the other ops (embedding, final
    norm, output layer with the loss) lighter; the white between them is time outside every op. None
    without a timeline (a record from before it, or a step with recompute)."""
    ranks = (record.get("validation") or {}).get("timeline") or []
    if not ranks:
        return None
    figure = new_figure("prediction_measured_timeline")
    ax = figure.subplots()
    n = len(ranks)
    for row, r in enumerate(ranks):
        y = n - 1 - row
        for key, layer, begin, end in r["visits"]:
            op, phase = key.split(".")
            if op == "stage":
                continue
            box = Rectangle(
                (begin, y - 0.4),
                end - begin,
                0.8,
                facecolor=PHASE_COLOURS[phase],
                alpha=1.0 if op == "transformer_layer" else 0.45,
                edgecolor="none",
            )
            box.set_gid(f"visit:{r['rank']}:{key}:{layer}:{begin:.6g}")
            ax.add_patch(box)
        start = r.get("start_s", 0.0)  # the rank's own start: ranks leave the barrier apart
        for x in (start, start + r["forward_backward_s"]):  # its forward-backward
            ax.plot([x, x], [y - 0.45, y + 0.45], color="black", linewidth=1)
    pipeline = float(record["step"]["pipeline"])
    ax.axvline(pipeline, color="black", linestyle="--", linewidth=1)
    ax.set_xlim(0, max(pipeline, *(r.get("start_s", 0.0) + r["forward_backward_s"] for r in ranks)) * 1.01)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_yticks(range(n), [f"rank {r['rank']} (stage {r['pp_rank']})" for r in reversed(ranks)], fontsize=8)
    ax.xaxis.set_major_formatter(EngFormatter(unit="s"))
    ax.set_xlabel("time in the measured step (bars: each rank's forward-backward; dashed: predicted)")
    ax.set_title("Measured: the op visits of the median step, per rank", fontsize=10)
    _phase_legend(ax, Patch(facecolor="grey", alpha=0.45, label="embedding, final norm, output layer + loss"))
    figure.subplots_adjust(left=0.14, right=0.98, bottom=0.24, top=0.9)
    return figure
