"""Every figure of a report, drawn and written as PNG beside the page, each with a caption that says how
to read it. A figure that has nothing to show (the layer was not measured, one shape point only) is left
out, and the page says why instead; a figure of one kind of op (the MoE ``experts``) is listed only when
the run has rows of that op."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from autotuner.ops.naming import PHASES
from autotuner.report import breakdown, experts, roofline, scaling
from autotuner.report.data import LAYER, LAYER_PARTS, SUBLAYER_PARTS, Run
from autotuner.report.style import op_colours, save


@dataclass
class FigureFile:
    name: str
    title: str
    caption: str
    path: Path | None  # None: not drawn, and the caption says why


def _missing(runs: Sequence[Run], whole: str, parts: Sequence[str]) -> list[str]:
    """Parts not measured at some point where ``whole`` was (their time then sits in "not covered")."""
    missing = []
    for run in runs:
        for phase in PHASES:
            for point in run.points:
                if run.value(whole, phase, point) is not None:
                    missing += [p for p in parts if run.value(p, phase, point) is None]
    return list(dict.fromkeys(missing))


def _captions(runs: Sequence[Run]) -> dict[str, tuple[str, str, str]]:
    """name -> (title, caption when drawn, caption when not drawn)."""
    layer_missing = _missing(runs, LAYER, LAYER_PARTS)
    sub_missing = [p for w, parts in SUBLAYER_PARTS.items() for p in _missing(runs, w, parts)]
    dims = scaling.swept(runs)
    fixed = [scaling.DIMS[d] for d in scaling.DIMS if d not in dims]
    exact = all(roofline.points(run)[1] for run in runs)
    calibrated = any(any(roofline.run_ceilings(run)) for run in runs)
    no_flops = sorted({r["op"] for run in runs for r in run.ok if not r.get("flops")})

    def unmeasured(names: list[str]) -> str:
        return f" Not measured, so inside the grey block: {', '.join(names)}." if names else ""

    return {
        "layer_breakdown": (
            "Layer breakdown",
            "Each bar is one transformer_layer phase at one shape point, stacked from its six direct sub-ops "
            "in execution order. The black tick is the layer's own median. The hatched grey block is the "
            "time no sub-op covers (glue between them, Python and dispatch overhead); a hatched red block "
            "means the sub-ops' medians add up to more than the layer's (each is measured separately, so "
            "this is noise). The label over each bar is that remainder as a share of the layer."
            + unmeasured(layer_missing),
            "transformer_layer has no ok row in this run (not selected with ops=[...], failed or skipped).",
        ),
        "sublayer_breakdown": (
            "Inside attention and MLP",
            "The same reading for self_attention (linear_qkv, rope, core_attention, linear_proj) and mlp "
            "(linear_fc1, activation, linear_fc2): grey is what their parts do not cover."
            + unmeasured(sub_missing),
            "Neither self_attention nor mlp has an ok row in this run.",
        ),
        "scaling_time": (
            "Scaling: time",
            "Median time of each op against each swept dimension, the other held at the value in the axis "
            "label. Log axes: a straight line of slope 1 is linear scaling, slope 2 quadratic."
            + (f" Not swept (one value): {', '.join(fixed)}." if fixed else ""),
            "Only one shape point: nothing to scale against. Sweep shapes.seq_len or "
            "shapes.micro_batch_size.",
        ),
        "scaling_memory": (
            "Scaling: memory",
            "Bytes saved for backward (forward rows) and peak bytes above the phase's starting point, "
            "against each swept dimension. Ops with zero bytes cannot sit on the log axis and are not drawn.",
            "Only one shape point, or no memory columns (the launcher did not measure memory): nothing "
            "to draw.",
        ),
        "roofline": (
            "Roofline",
            "Achieved FLOP/s (FLOPs / median time) against arithmetic intensity; colour is the op, filled "
            "is forward, hollow backward"
            + (", marker shape the run" if len(runs) > 1 else "")
            + ". "
            + (
                "The intensity uses the bytes_moved column."
                if exact
                else "No bytes_moved column: the intensity is approximated as FLOPs / (weight bytes + peak "
                "bytes), which ignores the inputs read, so read positions roughly and compare ops, not "
                "absolute distances to the roof."
            )
            + (
                " The dashed roof is the device's calibrated ceiling for the run's dtype."
                if calibrated
                else " No calibration.json in the run directory (python -m autotuner.calibrate writes "
                "one; or pass calibration=FILE), so no ceilings are drawn."
            )
            + (f" Ops without FLOPs, not drawn: {', '.join(no_flops)}." if no_flops else ""),
            "No op with FLOPs and a time was measured: nothing to place on a roofline.",
        ),
        "experts": (
            "Experts: time per expert against tokens per expert",
            "One segment per experts row (left forward, right backward), at the height of the row's median "
            "time divided by its number of local experts: the dot is the mean tokens per local expert "
            "(the work per expert if the load were even), the bar the most tokens any local expert got "
            "(the straggler a grouped GEMM waits for). A balanced routing is a dot alone; a long segment "
            "is imbalance, and at the same mean a higher point is the time it costs. Colour is the routing "
            "(moe.routing), labels the shape point; log axes, so time in proportion to tokens is a line "
            "of slope 1. The rows' tokens_per_expert histogram and expert_imbalance (max/mean) are in "
            "results.jsonl.",
            "No ok experts row with a tokens_per_expert histogram (failed, skipped, or written before the "
            "column existed): nothing to draw.",
        ),
    }


def make_figures(runs: Sequence[Run], out_dir: Path) -> list[FigureFile]:
    """Draw every figure for ``runs`` and write ``<name>.png`` into ``out_dir``."""
    known = [op for run in runs for op in run.ops]
    known += list(LAYER_PARTS) + [p for parts in SUBLAYER_PARTS.values() for p in parts]
    colours = op_colours(list(dict.fromkeys(known)))
    makers: dict[str, Callable[[Sequence[Run], dict[str, Any]], Figure | None]] = {
        "layer_breakdown": breakdown.layer_figure,
        "sublayer_breakdown": breakdown.sublayer_figure,
        "scaling_time": scaling.time_figure,
        "scaling_memory": scaling.memory_figure,
        "roofline": roofline.roofline_figure,
        "experts": experts.experts_figure,
    }
    # Figures of one kind of op, left off the page (not even "nothing to draw") when no row has that op.
    listed = {"experts": experts.has_expert_rows(runs)}
    captions = _captions(runs)
    files = []
    for name, make in makers.items():
        title, drawn, absent = captions[name]
        path = out_dir / f"{name}.png"
        figure = make(runs, colours) if listed.get(name, True) else None
        if figure is None:
            path.unlink(missing_ok=True)  # a stale figure from an earlier report would mislead
            if listed.get(name, True):
                files.append(FigureFile(name, title, absent, None))
            continue
        save(figure, path)
        files.append(FigureFile(name, title, drawn, path))
    return files
