"""The page of one prediction (``prediction.html``): the pipeline schedule, the memory of each stage, and
the predicted against the measured steps, made from ``prediction.json`` alone (plain data: the results
side never imports the predictor, so a page can be remade wherever the file is).

**Timeline** (``schedule``): the boxes the predictor placed (``step.schedule`` in ``prediction.json``;
autotuner.predict.schedule simulates Megatron-Core's 1F1B order, interleaved with vpp, each stage its
own forward and backward, every exchange charged to both ends or, interleaved, to the receiving box), a
row per stage. The gaps are the
bubble: a stage waiting for its neighbour, and the exchanges. The caption gives the closed form the
simulation replaces (Narayanan et al. 2021, section 2.2: every stage paced at the slowest one).

**Memory** (``memory_stack``): per stage, the six terms the predictor adds (weights, gradients,
optimizer states, activations, logits, in flight) stacked to its total; beside each, Korthikanti et
al.'s closed-form activation estimate from the same base, and the GPU's memory as a line when given.

**Validation** (``validation_bars``): the ``validation`` record (``validate=true``) as predicted and
measured bars for step time (with the measured IQR) and peak memory, and between them each phase of
the step (``validation_phases``: forward-backward, gradient reduction, optimizer), where the error
comes from; its table adds each op inside the step (autotuner.predict.in_step) beside its prediction.
Below them the measured step op by op (``measured_timeline_figure``): each rank's op visits in the median
step, on the schedule's time axis, with what lies between them.
"""

from __future__ import annotations

import base64
import io
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import EngFormatter, FuncFormatter, MultipleLocator

from autotuner.errors import UserError
from autotuner.report.style import DPI, new_figure
from autotuner.report.tables import cell, table
from autotuner.results.atomic import atomic_write_text
from autotuner.results.units import BINARY_UNITS, human_bytes, human_time

PAGE_NAME = "prediction.html"
MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "logits", "in_flight")
TERM_COLOURS = {
    "weights": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer": "#2ca02c",
    "activations": "#9467bd",
    "logits": "#8c564b",
    "in_flight": "#e377c2",
}
PHASE_COLOURS = {"forward": "#4c9be8", "backward": "#f28e2b"}
KINDS = ("measured", "scaled", "modelled")


def load_prediction(path: Path) -> dict[str, Any]:
    """``prediction.json`` as a dict; UserError (one line) for a file that is not one."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot read {path} as JSON ({exc}): give a prediction.json of python -m autotuner.predict"
        ) from None
    if not isinstance(record, dict) or not {"layout", "stages", "step", "memory"} <= set(record):
        raise UserError(f"{path} is not a prediction (no layout/stages/step/memory): give a prediction.json")
    return record


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
    placed = step.get("schedule")
    if not placed:
        raise UserError(
            "this prediction.json has no schedule (an older autotuner wrote it): run python -m "
            "autotuner.predict again for the page"
        )
    boxes = [dict(zip(placed["columns"], row, strict=True)) for row in placed["boxes"]]
    return Schedule(boxes, float(step["pipeline_s"]), int(layout["vpp"]) > 1)


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
    layers = {int(st["stage"]): st["layers"] for st in record.get("stages", [])}  # an uneven split shows
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
        + f" m={record['layout']['microbatches']}: bubble and exchanges {bubble:.1%} of the slowest stage's"
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
    total: float  # the prediction's total_bytes
    korthikanti: float


def memory_stack(record: Mapping[str, Any]) -> list[StageStack]:
    return [
        StageStack(
            int(m["stage"]),
            [(t, float(m[t]["value"])) for t in MEMORY_TERMS],
            float(m["total_bytes"]),
            float(m["korthikanti_activations"]["value"]),
        )
        for m in record["memory"]
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
    """Stacked bars per stage; a narrow hatched bar beside the activations is Korthikanti's estimate."""
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
        ax.text(stack.stage - 0.075, base, human_bytes(stack.total), ha="center", va="bottom", fontsize=8)
    top = max([s.total for s in stacks] + [s.korthikanti + sum(v for _, v in s.terms[:3]) for s in stacks])
    handles = [Patch(facecolor=TERM_COLOURS[t], label=t) for t in MEMORY_TERMS]
    handles.append(
        Patch(facecolor="white", edgecolor=TERM_COLOURS["activations"], hatch="xx", label="Korthikanti")
    )
    if gpu_memory_gb:
        limit = gpu_memory_gb * 1e9
        line = ax.axhline(limit, color="#d62728", linewidth=1.2)
        line.set_gid("gpu_memory")
        handles.append(Line2D([], [], color="#d62728", label=f"GPU memory {gpu_memory_gb:g} GB"))
        top = max(top, limit)
    ax.set_xlim(-0.7, len(stacks) - 0.3)
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
    figure.suptitle("Predicted against measured steps (validate=true)")
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
    pipeline = float(record["step"]["pipeline_s"])
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


# ----------------------------------------------------------------------------------------------- page


def _png(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=DPI, format="png", metadata={"Software": None})
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _kinds(sources: Sequence[Mapping[str, Any]]) -> str:
    """ "measured 10, scaled 2": how many figures of each kind of source."""
    counts = {k: sum(1 for s in sources if s.get("kind") == k) for k in KINDS}
    return ", ".join(f"{k} {n}" for k, n in counts.items() if n) or "none"


def _t(seconds: float) -> str:
    return human_time(seconds * 1e6)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def describe_layout(layout: Mapping[str, Any]) -> str:
    """The layout in one line, from its JSON (``Layout.to_json``), as the predictor prints it: its
    ``Layout.describe`` calls this (the results side imports no predictor, the predictor may import it)."""
    flag = lambda key: str(bool(layout.get(key))).lower()  # noqa: E731
    split = "".join(
        f" {end}={layout[f'{end}_stage_layers']}"
        for end in ("first", "last")
        if layout.get(f"{end}_stage_layers")
    )
    return (
        f"tp={layout['tp']} pp={layout['pp']} vpp={layout['vpp']} dp={layout['dp']} ep={layout['ep']} "
        f"mbs={layout['micro_batch_size']} gbs={layout['global_batch_size']} s={layout['seq_len']} "
        f"recompute={layout['recompute']} sp={flag('sequence_parallel')} "
        f"distopt={flag('distributed_optimizer')} {layout['dtype']}{split} "
        f"({_count(layout['gpus'], 'GPU', 'GPUs')}, "
        f"{_count(layout['microbatches'], 'micro-batch', 'micro-batches')})"
    )


def _step_table(record: Mapping[str, Any]) -> str:
    """The step's parts: compute of the slowest stage, bubble, DP reduction, optimizer, total."""
    step, layout = record["step"], record["layout"]
    slow = record["stages"][int(step["slowest_stage"])]
    compute = int(layout["microbatches"]) * (slow["forward_s"] + slow["backward_s"])
    total = float(step["total_s"])
    slow_kinds = _kinds([i["source"] for i in slow["items"]])
    parts = [
        ("pipeline compute", compute, slow_kinds, f"m x (t_f + t_b) of stage {step['slowest_stage']}"),
        (
            "pipeline bubble and exchanges",
            step["pipeline_s"] - compute,
            "modelled",
            f"{step['formula']}, less the compute",
        ),
        (
            "DP gradient reduction",
            step["dp_reduction"]["value"],
            step["dp_reduction"]["source"]["kind"],
            step["dp_reduction"]["source"]["detail"],
        ),
        (
            "optimizer step",
            step["optimizer"]["value"],
            step["optimizer"]["source"]["kind"],
            step["optimizer"]["source"]["detail"],
        ),
    ]
    body = [
        f"<tr>{cell(name)}{cell(_t(s), s, 'n')}{cell(f'{s / total:.1%}' if total else '-', s, 'n')}"
        f"{cell(kind)}{cell(detail)}</tr>"
        for name, s, kind, detail in parts
    ]
    body.append(
        f"<tr>{cell('step')}{cell(_t(total), total, 'n')}{cell('100%')}{cell('')}{cell(step['overlap'])}</tr>"
    )
    return table(["part", "time", "share", "source", "how"], body)


def _stage_table(record: Mapping[str, Any]) -> str:
    body = [
        f"<tr>{cell(st['stage'])}{cell(st['layers'], cls='n')}"
        f"{cell(_t(st['forward_s']), st['forward_s'], 'n')}"
        f"{cell(_t(st['backward_s']), st['backward_s'], 'n')}{cell(st['dominant_op'])}"
        f"{cell(_kinds([i['source'] for i in st['items']]))}</tr>"
        for st in record["stages"]
    ]
    return table(["stage", "layers", "forward/mb", "backward/mb", "dominant op", "sources"], body)


def _memory_table(record: Mapping[str, Any]) -> str:
    body = []
    for m in record["memory"]:
        terms = "".join(
            cell(f"{human_bytes(m[t]['value'])} [{m[t]['source']['kind']}]", m[t]["value"], "n")
            for t in (*MEMORY_TERMS, "korthikanti_activations")
        )
        body.append(
            f"<tr>{cell(m['stage'])}{terms}{cell(human_bytes(m['total_bytes']), m['total_bytes'], 'n')}</tr>"
        )
    report = record.get("megatron_report")
    if report:  # one line for what Megatron-LM's own report says of the first stage
        said = " ".join(
            f"{name.replace('_', ' ')} {human_bytes(report[name]['value'])}"
            for name in ("activations", "weights_and_optimizer")
        )
        body.append(
            f"<tr>{cell('0: Megatron-LM report')}"
            f'<td colspan="{len(MEMORY_TERMS) + 1}">{escape(said)}</td>'
            f"{cell(human_bytes(report['total_bytes']), report['total_bytes'], 'n')}</tr>"
        )
    return table(["stage", *MEMORY_TERMS, "Korthikanti", "total/GPU"], body)


def _validation_table(v: Mapping[str, Any]) -> str:
    rows = [
        (
            "step time",
            _t(v["predicted_step_s"]),
            f"{_t(v['measured_step_s'])} (IQR {_t(v['measured_step_iqr_s'])})",
            v["step_error"],
        ),
        *(
            (f"phase: {name}", _t(p["predicted"]), _t(p["measured"]), p["predicted"] / p["measured"] - 1)
            for name, p in validation_phases({"validation": v}).items()
            if p["measured"] > 0
        ),
        # where inside the forward-backward (autotuner.predict.in_step): each hooked op per visit
        *(
            (
                f"in the step, stage {i['stage']}: {i['what']} ({i['how']})",
                _t(i["predicted_s"]),
                _t(i["measured_s"]),
                i["predicted_s"] / i["measured_s"] - 1,
            )
            for i in v.get("in_step") or ()
            if i["measured_s"] > 0
        ),
        (
            "peak memory",
            human_bytes(v["predicted_peak_bytes"]),
            human_bytes(v["measured_peak_bytes"]),
            v["memory_error"],
        ),
    ]
    body = [
        f"<tr>{cell(a)}{cell(b, cls='n')}{cell(c, cls='n')}{cell(f'{100 * e:+.1f}%', e, 'n')}</tr>"
        for a, b, c, e in rows
    ]
    return table(["", "predicted", "measured", "error"], body) + (
        f"<p>Measured by: <code>{escape(' '.join(map(str, v.get('command', []))))}</code></p>"
    )


def _sources(record: Mapping[str, Any]) -> str:
    lines = [
        f"stage {st['stage']} {i['name']}.{i['phase']} x{i['count']}: {_t(i['seconds'])} "
        f"[{i['source']['kind']}] {i['source']['detail']}"
        for st in record["stages"]
        for i in st["items"]
    ]
    exchange = record["step"].get("exchange")
    if exchange:
        lines.append(
            f"pipeline exchange (each end, per box that sends or receives): {_t(exchange['seconds'])} "
            f"[{exchange['source']['kind']}] {exchange['source']['detail']}"
        )
    for m in record["memory"]:
        lines += [
            f"stage {m['stage']} {t}: [{m[t]['source']['kind']}] {m[t]['source']['detail']}"
            for t in MEMORY_TERMS
        ]
    return (
        f"<details><summary>Every figure's source</summary><pre>{escape(chr(10).join(lines))}</pre></details>"
    )


def _figure(name: str, title: str, figure: Figure | None, caption: str, source: str) -> str:
    out = [f'<h2 id="{name}">{escape(title)}</h2>']
    if figure is not None:
        out.append(f'<img src="data:image/png;base64,{_png(figure)}" alt="{escape(title)}">')
    out.append(f'<p class="caption">{escape(caption)}</p>')
    out.append(f'<p class="caption"><b>Source:</b> {escape(source)}</p>')
    return "".join(out)


def render_prediction_page(record: Mapping[str, Any], gpu_memory_gb: float | None = None) -> str:
    from autotuner.report.page import CSS  # the run report's look

    layout, step = record["layout"], record["step"]
    case = record.get("model", {}).get("case") or "model"
    title = f"prediction: {case}, tp={layout['tp']} pp={layout['pp']} vpp={layout['vpp']} dp={layout['dp']}"
    sched = schedule(record)
    timeline_caption = (
        "One row per pipeline stage; each box is one micro-batch's forward (blue) or backward (orange)"
        + (", labelled micro-batch.chunk" if sched.interleaved else ", labelled by micro-batch")
        + ", in the order the rank runs it under 1F1B"
        + (" interleaved over virtual chunks" if sched.interleaved else "")
        + ": warm-up forwards, then one forward and one backward in turn, then the cool-down backwards. "
        + (
            "Each box takes its own model chunk's time"
            if sched.interleaved
            else "Each box takes its own stage's time"
        )
        + " and starts when its rank is free and its input has arrived; an exchange with a neighbour stage "
        "costs "
        # prediction.json before session 27 had no exchange_overlapped: then interleaved meant overlapped
        + (
            "the receiving box (overlapped with compute)"
            if step.get("exchange_overlapped", sched.interleaved)
            else "both ends"
        )
        + (f" {_t(step['exchange']['seconds'])} (pp_p2p)" if step.get("exchange") else "")
        + ". White gaps are the bubble: a stage waiting for its neighbour, and the exchanges. The pipeline "
        f"ends at {_t(sched.end)} ({step['formula']})."
    )
    stage_sources = [i["source"] for st in record["stages"] for i in st["items"]]
    memory_sources = [m[t]["source"] for m in record["memory"] for t in MEMORY_TERMS]
    memory_caption = (
        "Each bar stacks one stage's GPU at its peak: weights, gradients (fp32 main grads), optimizer "
        "states, the activations of the micro-batches the stage holds under 1F1B, the logits on the "
        "last stage, and what the op running at the peak allocates beyond them (in flight). The narrow "
        "hatched bar beside it starts where the activations start and is Korthikanti "
        "et al.'s closed-form estimate of the same activations."
        + (
            f" The red line is the GPU's {gpu_memory_gb:g} GB."
            if gpu_memory_gb
            else " No GPU memory given (gpu_memory_gb=): no line."
        )
    )
    validation = record.get("validation")
    mfu = record.get("mfu")
    summary = (
        f"<p>{escape(describe_layout(layout))}</p>"
        f"<p>Step {escape(_t(step['total_s']))} (upper bound: nothing overlaps), "
        f"{record['tokens_per_s_per_gpu']['value']:.4g} tokens/s per GPU, "
        + (f"MFU {mfu['value']:.1%}" if mfu else escape(record.get("mfu_note", "no MFU")))
        + "</p>"
    )
    parts = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>',
        f"<style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        summary,
        "<h2>Step</h2>",
        _step_table(record),
        "<h2>Stages (per micro-batch)</h2>",
        _stage_table(record),
        _figure(
            "timeline",
            "Pipeline schedule",
            timeline_figure(record),
            timeline_caption,
            f"stage times {_kinds(stage_sources)}; the schedule modelled (Megatron-Core's order, simulated)",
        ),
        _figure(
            "memory",
            "Memory per stage",
            memory_figure(record, gpu_memory_gb),
            memory_caption,
            f"terms {_kinds(memory_sources)}; Korthikanti modelled",
        ),
        _memory_table(record),
        _figure(
            "validation",
            "Predicted against measured steps",
            validation_figure(record),
            "Predicted step time and peak memory of the fullest GPU beside the real steps' (median, IQR bar)."
            if validation
            else "No validation record: python -m autotuner.predict ... validate=true runs the "
            "real steps of this layout and adds one.",
            "predicted: this prediction; measured: the real training steps" if validation else "none",
        ),
        _validation_table(validation) if validation else "",
        _measured_timeline_section(record),
    ]
    if record.get("missing"):
        commands = dict.fromkeys(item["command"] for item in record["missing"])
        parts.append(
            "<h2>Not measured at this point: to measure</h2><pre>" + escape("\n".join(commands)) + "</pre>"
        )
    if record.get("warnings"):
        parts.append(
            "<ul>" + "".join(f'<li class="warn">{escape(w)}</li>' for w in record["warnings"]) + "</ul>"
        )
    parts += [_sources(record), "</body></html>"]
    return "\n".join(parts) + "\n"


def _measured_timeline_section(record: Mapping[str, Any]) -> str:
    figure = measured_timeline_figure(record)
    if figure is None:
        return ""
    ranks = record["validation"]["timeline"]
    between = "; ".join(
        f"rank {r['rank']} {_t(r['between_ops_s'])} of {_t(r['forward_backward_s'])}" for r in ranks
    )
    handed = [h["seconds"] for h in record["validation"].get("handovers") or []]
    transfer = record["validation"].get("predicted_transfer_s")
    handovers = (
        f" Hand-overs a stage waited for (the sender's last op of a micro-batch to the receiver's first): "
        f"median {_t(statistics.median(handed))} "
        f"over {len(handed)}, against a predicted transfer of {_t(transfer or 0.0)}."
        if handed
        else ""
    )
    v = record["validation"]
    replayed = (
        f" The schedule model, given these forwards and backwards and the median hand-over per exchange, "
        f"ends {_t(v['replayed_s'])} after the first op, against {_t(v['measured_span_s'])} measured."
        if v.get("replayed_s") is not None and v.get("measured_span_s")
        else ""
    )
    caption = (
        "The real step beside the schedule above: each box one op's visit as module hooks timed it inside "
        "the step (autotuner.predict.in_step), in the step whose forward-backward was the median. White "
        "between the boxes is outside every op: on a pipeline the waits for the neighbour stage and the "
        "transfers, under tensor parallelism the collectives outside the layers, and everywhere the "
        f"schedule's own work. Between the ops: {between}.{handovers}{replayed}"
    )
    return _figure(
        "measured-timeline",
        "The measured step, op by op",
        figure,
        caption,
        "measured: module hooks inside the validated steps",
    )


def write_prediction_page(record: Mapping[str, Any], path: Path, gpu_memory_gb: float | None = None) -> Path:
    """Write the page to ``path`` whole or not at all; returns it."""
    return atomic_write_text(Path(path), render_prediction_page(record, gpu_memory_gb))
