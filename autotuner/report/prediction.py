"""The page of one prediction (``prediction.html``): the pipeline schedule, the memory of each stage, and
the predicted against the measured steps, made from ``prediction.json`` alone (plain data: the results
side never imports the predictor, so a page can be remade wherever the file is).

Its figures (the schedule's timeline, each stage's memory, the predicted against the measured steps) are
drawn by autotuner.report.prediction_figures; here the tables beside them and the page.
"""

from __future__ import annotations

import base64
import io
import json
import statistics
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from autotuner.errors import UserError
from autotuner.report.prediction_figures import (
    MEMORY_TERMS,
    STEP_TERM,
    measured_timeline_figure,
    memory_figure,
    schedule,
    timeline_figure,
    validation_figure,
    validation_phases,
)
from autotuner.report.style import DPI
from autotuner.report.tables import cell, table
from autotuner.results.atomic import atomic_write_text
from autotuner.results.units import human_bytes, human_time

PAGE_NAME = "prediction.html"
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
    overlaps = [
        name
        for name, key in (
            ("grad", "overlap_grad_reduce"),
            ("param", "overlap_param_gather"),
            ("tp", "tp_comm_overlap"),
        )
        if layout.get(key)
    ]
    split += f" overlap={','.join(overlaps)}" if overlaps else ""
    context = f" cp={layout['cp']}" if int(layout.get("cp") or 1) > 1 else ""
    return (
        f"tp={layout['tp']}{context} pp={layout['pp']} vpp={layout['vpp']} dp={layout['dp']} "
        f"ep={layout['ep']} "
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
            if m.get(t)
            else cell("-")  # a prediction made before the Adam step was a term
            for t in (*MEMORY_TERMS, STEP_TERM, "korthikanti_activations")
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
            f'<td colspan="{len(MEMORY_TERMS) + 2}">{escape(said)}</td>'
            f"{cell(human_bytes(report['total_bytes']), report['total_bytes'], 'n')}</tr>"
        )
    return table(["stage", *MEMORY_TERMS, "Adam step", "Korthikanti", "total/GPU"], body)


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
            for t in (*MEMORY_TERMS, STEP_TERM)
            if m.get(t)
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
        # a prediction.json without exchange_overlapped (an older file): interleaved means overlapped
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
    memory_sources = [
        m[t]["source"] for m in record["memory"] for t in (*MEMORY_TERMS, STEP_TERM) if m.get(t)
    ]
    memory_caption = (
        "Each bar stacks one stage's GPU at its peak: weights, gradients (fp32 main grads), optimizer "
        "states, the activations of the micro-batches the stage holds under 1F1B, the logits on the "
        "last stage, and what the op running at the peak allocates beyond them (in flight). The narrow "
        "hatched bar beside it starts where the activations start and is Korthikanti "
        "et al.'s closed-form estimate of the same activations. The narrow bar on the left is what Adam's "
        "step allocates after those are freed: the peak is the taller of the two above the optimizer "
        "states."
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
