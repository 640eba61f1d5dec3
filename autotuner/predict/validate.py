"""``validate=true``: a prediction against the real training steps it predicts.

The predictor (autotuner.predict.prediction) turns op rows into a step time and a peak memory per GPU;
autotuner.predict.steps runs the real thing, the case's whole GPTModel (embedding, every layer, output
layer and loss) trained for a few steps in the layout, with Megatron-Core's own schedule (no-pipelining
at PP=1, 1F1B at PP>1) and torch's Adam, timed and metered. Both sides are of the same model: the steps
get the hf./tf. overrides the profiled run was made with (its ``.hydra/overrides.yaml``), so a run of a
llama-shaped case at reduced width validates that reduced model.

What is compared, and why those two: the step time (the predicted one holds the pipeline's forward and
backward, recompute, the data-parallel reduction and the optimizer step; the measured one the schedule's
forward-backward plus the optimizer step, the slowest rank's, median over the timed steps) and the peak
memory of the fullest GPU (predicted: weights, gradients, optimizer states, the activations of the
micro-batches a stage holds, the logits and what the op at the peak has in flight; measured: what is
resident when the step starts plus the allocator's peak above it during the step). The error is
predicted / measured - 1. The steps run tp * pp * dp processes (torchrun on this machine), with expert
parallelism inside them, and the interleaved schedule and the distributed optimizer where asked.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotuner.errors import UserError
from autotuner.predict.layout import Layout

if TYPE_CHECKING:
    from autotuner.predict.in_step import Visit

# Overrides the steps take from the layout, not from the profiled run (they set the parallel layout).
_LAYOUT_OWNED = (
    "tf.tensor_model_parallel_size",
    "tf.pipeline_model_parallel_size",
    "tf.sequence_parallel",
    "tf.expert_model_parallel_size",
    "tf.expert_tensor_parallel_size",
    "tf.virtual_pipeline_model_parallel_size",
)
_MODEL_KEYS = ("hf.", "tf.", "seed=", "device=")


def model_overrides(run_dir: Path, num_layers: int | None = None) -> list[str]:
    """The overrides of a profiled run that shape its model (hf./tf. fields, seed, device), from the
    ``.hydra/overrides.yaml`` Hydra keeps in the run directory; [] for a run without one. With
    ``num_layers``, the model is built at that depth instead of the run's (``num_layers=`` of predict)."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    found = yaml.safe_load(path.read_text()) or []
    out = []
    for item in found:
        text = str(item).lstrip("+")
        if text.startswith(_MODEL_KEYS) and not text.startswith(_LAYOUT_OWNED):
            out.append(text)
    if num_layers is not None:
        out = [o for o in out if not o.startswith("hf.num_hidden_layers=")]
        out.append(f"hf.num_hidden_layers={num_layers}")
    return out


@dataclass(frozen=True)
class RankTimeline:
    """One rank's op visits in one measured step (autotuner.predict.in_step.Visit, from the earliest
    rank's start) and that step's forward-backward on the rank, which began ``start_s`` after the
    earliest rank's: what is not inside an op is between them (waits for other ranks, transfers, the
    schedule's own work)."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    forward_backward_s: float
    visits: tuple[Visit, ...]
    start_s: float = 0.0

    @property
    def between_ops_s(self) -> float:
        from autotuner.predict.in_step import inside_ops_s

        return self.forward_backward_s - inside_ops_s(self.visits)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
            "dp_rank": self.dp_rank,
            "start_s": self.start_s,
            "forward_backward_s": self.forward_backward_s,
            "between_ops_s": self.between_ops_s,
            "visits": [list(v) for v in self.visits],
        }


@dataclass(frozen=True)
class Validation:
    """A prediction and the measured steps of the same layout."""

    layout: Layout
    predicted_step_s: float
    measured_step_s: float
    measured_step_iqr_s: float
    predicted_peak_bytes: float
    measured_peak_bytes: float
    command: tuple[str, ...]
    # (phase, predicted s, measured s): where a step-time error comes from; the measured phases are
    # medians of their own, so they need not add up to the step's median
    phases: tuple[tuple[str, float, float], ...] = ()
    # (stage, what, predicted s, measured s, how): the ops per visit against their times inside the
    # measured step (autotuner.predict.in_step), where the error sits inside the forward-backward
    in_step: tuple[tuple[int, str, float, float, str], ...] = ()
    # each rank's op visits in the measured step whose forward-backward was the median
    timeline: tuple[RankTimeline, ...] = ()
    # a pipeline's hand-overs that a stage waited for, in that step (autotuner.predict.in_step.
    # handovers: "forward" | "backward", seconds), and the predicted transfer per hand-over (pp_p2p)
    handovers: tuple[tuple[str, float], ...] = ()
    predicted_transfer_s: float | None = None
    # that step replayed by the predictor's schedule (autotuner.predict.in_step.replay: the measured
    # forwards and backwards, the median hand-over per exchange) and the span it replays, first op to last
    replayed_s: float | None = None
    measured_span_s: float | None = None
    # what Megatron-LM's theoretical-memory report says of the first stage (autotuner.predict.memory.
    # megatron_report), beside the fullest first-stage GPU of the steps
    megatron_report_bytes: float | None = None
    measured_first_stage_peak_bytes: float | None = None

    @property
    def step_error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1

    @property
    def memory_error(self) -> float:
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_json(),
            "predicted_step_s": self.predicted_step_s,
            "measured_step_s": self.measured_step_s,
            "measured_step_iqr_s": self.measured_step_iqr_s,
            "step_error": self.step_error,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "memory_error": self.memory_error,
            "phases": {
                name: {"predicted_s": predicted, "measured_s": measured}
                for name, predicted, measured in self.phases
            },
            "in_step": [
                {"stage": stage, "what": what, "predicted_s": predicted, "measured_s": measured, "how": how}
                for stage, what, predicted, measured, how in self.in_step
            ],
            "timeline": [r.to_json() for r in self.timeline],
            "handovers": [{"phase": phase, "seconds": seconds} for phase, seconds in self.handovers],
            "predicted_transfer_s": self.predicted_transfer_s,
            "replayed_s": self.replayed_s,
            "measured_span_s": self.measured_span_s,
            "megatron_report_bytes": self.megatron_report_bytes,
            "measured_first_stage_peak_bytes": self.measured_first_stage_peak_bytes,
            "command": list(self.command),
        }


def validate(
    prediction: Any, case: str, overrides: list[str], repeats: int = 5, steps_out: Path | None = None
) -> Validation:
    """Run the steps of ``prediction``'s layout (autotuner.predict.steps.run_steps, fresh processes) and
    compare. ``overrides``: the profiled run's model overrides (:func:`model_overrides`). ``steps_out``:
    where the measured steps are kept (and, when they fail, the workers' output beside it); None keeps
    them nowhere."""
    from autotuner.predict.steps import run_steps

    layout = prediction.layout
    overlaps = [
        f for f in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap") if getattr(layout, f)
    ]
    if layout.cp > 1 or overlaps:
        raise UserError(
            f"validate=true runs the layout's steps without context parallelism or Megatron's overlaps "
            f"(cp={layout.cp}{''.join(f', {f}' for f in overlaps)}): predict without validate=true, or with "
            "cp=1 and the overlaps off"
        )
    if steps_out is not None:
        measured = run_steps(case, overrides, layout, steps_out, repeats=repeats)
    else:
        with tempfile.TemporaryDirectory(prefix="autotuner-validate-") as folder:
            measured = run_steps(case, overrides, layout, Path(folder) / "steps.json", repeats=repeats)
    timeline = tuple(
        RankTimeline(
            r.rank,
            r.pp_rank,
            r.tp_rank,
            r.dp_rank,
            r.forward_backward_s[measured.timeline_step],
            r.timeline,
            r.timeline_start_s,
        )
        for r in measured.ranks
        if r.timeline
    )
    exchange = prediction.step.exchange
    handed = pipeline_handovers(timeline, layout, prediction.model.num_layers)
    device_type = measured.device.split(":")[0]
    replayed = pipeline_replay(timeline, layout, prediction.model.num_layers, handed, device_type)
    return Validation(
        layout=layout,
        predicted_step_s=prediction.step_seconds,
        measured_step_s=measured.step_s,
        measured_step_iqr_s=measured.step_iqr_s,
        predicted_peak_bytes=max(stage.total for stage in prediction.memory),
        measured_peak_bytes=float(measured.peak_bytes),
        megatron_report_bytes=prediction.megatron_report.total if prediction.megatron_report else None,
        measured_first_stage_peak_bytes=float(max(r.peak_bytes for r in measured.ranks if r.pp_rank == 0)),
        command=tuple(measured.command),
        phases=(
            # the pipeline: the schedule's forwards and backwards (TP collectives inside them)
            ("forward-backward", prediction.step.pipeline, measured.forward_backward_s),
            ("gradient reduction", prediction.step.dp_reduction, measured.reduce_s),
            ("optimizer", prediction.step.optimizer, measured.optimizer_s),
        ),
        in_step=tuple(in_step_pairs(prediction, measured)),
        timeline=timeline,
        handovers=tuple(handed),
        predicted_transfer_s=exchange.seconds if exchange else None,
        replayed_s=replayed[0] if replayed else None,
        measured_span_s=replayed[1] if replayed else None,
    )


def pipeline_handovers(
    timeline: Sequence[RankTimeline], layout: Layout, layers: int
) -> list[tuple[str, float]]:
    """The hand-overs a stage waited for (autotuner.predict.in_step.handovers) along each pipeline of
    ranks with the same tp and dp rank (``layers`` in the model); none off a pipeline."""
    from autotuner.predict.in_step import handovers

    if layout.pp == 1:
        return []
    lines: dict[tuple[int, int], list[RankTimeline]] = {}
    for r in timeline:
        lines.setdefault((r.tp_rank, r.dp_rank), []).append(r)
    found = []
    for ranks in lines.values():
        if len(ranks) == layout.pp:
            stages = [r.visits for r in sorted(ranks, key=lambda r: r.pp_rank)]
            found += handovers(stages, layout.layer_places(layers))
    return found


def pipeline_replay(
    timeline: Sequence[RankTimeline],
    layout: Layout,
    layers: int,
    handed: Sequence[tuple[str, float]],
    device_type: str,
) -> tuple[float, float] | None:
    """The pipeline of tp and dp rank 0 replayed (autotuner.predict.in_step.replay; ``layers`` in the
    model) with the median of the hand-overs measured, its exchanges charged as the predictor charges
    them on ``device_type``, and its span measured from the first op's start to the last op's end; None
    off a pipeline or without hand-overs."""
    from autotuner.predict.in_step import replay
    from autotuner.predict.schedule import overlaps_exchanges

    ranks = sorted((r for r in timeline if r.tp_rank == r.dp_rank == 0), key=lambda r: r.pp_rank)
    if layout.pp == 1 or not handed or len(ranks) != layout.pp:
        return None
    visits = [[v for v in r.visits if not v[0].startswith("stage.")] for r in ranks]
    if not all(visits):
        return None
    exchange = statistics.median(seconds for _, seconds in handed)
    overlapped = overlaps_exchanges(layout.vpp, device_type)
    replayed = replay(
        [r.visits for r in ranks], layout.layer_places(layers), layout.microbatches, exchange, overlapped
    )
    if replayed is None:
        return None
    span = max(v[3] for vs in visits for v in vs) - min(v[2] for vs in visits for v in vs)
    return replayed, span


def in_step_pairs(prediction: Any, measured: Any) -> list[tuple[int, str, float, float, str]]:
    """Per stage, each hooked op's predicted time per visit beside its fenced mean inside the measured steps,
    and the stage's forward per micro-batch (without the pipeline's exchange, which is outside the
    model's forward); at pp = vpp = 1 also the rest of a micro-batch (its backward and the schedule's
    own work: the step's forward-backward / m - that forward). An op's
    backward in the step holds its gradients' accumulation into the kept fp32 ones (Megatron's DDP
    hook): its predicted share of the stage's ``grad_accumulation`` (by parameters) is added to it, as
    are the TP collectives modelled beside a TP=1 row."""
    lay, model = prediction.layout, prediction.model
    pairs = []
    for stage in prediction.stages:
        inside = measured.in_step(stage.index)
        if not inside:
            continue
        items = {(name, phase): (time.seconds, count) for name, phase, time, count in stage.items}
        accumulation = items.get(("grad_accumulation", "backward"), (0.0, 1))[0]
        stage_params = prediction.memory[stage.index].params.value
        params = {  # whose gradients a hooked backward accumulates (a tied output weight's: the embedding's)
            "embedding": model.vocab * model.hidden / lay.tp,
            "transformer_layer": model.layer_params_on_rank(lay.tp, lay.ep),
            "final_layernorm": model.final_norm_params,
            "output_layer": 0 if model.tie_embeddings else model.vocab * model.hidden / lay.tp,
        }
        for key, seconds in inside.items():
            op, phase = key.split(".")
            if (op, phase) not in items:
                continue
            predicted, how = items[(op, phase)][0], ["its row"]
            collectives = items.get((f"tp_collectives:{op}", phase))
            if collectives is not None:  # modelled beside a TP=1 row; inside the op in the step
                predicted += collectives[0]
                how.append("its modelled TP collectives")
            if phase == "backward" and params.get(op) and accumulation and stage_params:
                predicted += accumulation * params[op] / stage_params
                how.append("its gradients' accumulation")
            pairs.append((stage.index, f"{op} {phase}", predicted, seconds, " + ".join(how)))
        if "stage.forward" in inside and lay.vpp == 1:
            pairs.append(
                (stage.index, "forward per micro-batch", stage.forward, inside["stage.forward"], "the stage")
            )
            if lay.pp == 1:
                rest = measured.forward_backward_s / lay.microbatches - inside["stage.forward"]
                pairs.append(
                    (stage.index, "backward per micro-batch", stage.backward, rest, "fb / m - forward")
                )
    return pairs


def render(result: Validation) -> str:
    from autotuner.results.units import human_bytes, human_time

    step, iqr = human_time(result.measured_step_s * 1e6), human_time(result.measured_step_iqr_s * 1e6)
    return "\n".join(
        [
            f"validation of {result.layout.describe()}: predicted vs measured steps",
            f"  step time    predicted {human_time(result.predicted_step_s * 1e6):>10}  measured "
            f"{step:>10} (IQR {iqr})  error {100 * result.step_error:+.1f}%",
            *(
                f"    {name:<18} predicted {human_time(predicted * 1e6):>10}  measured "
                f"{human_time(measured * 1e6):>10}"
                for name, predicted, measured in result.phases
            ),
            *_in_step_header(result),
            *(
                f"      stage {stage} {what:<26} predicted {human_time(predicted * 1e6):>10}  measured "
                f"{human_time(measured * 1e6):>10}  {100 * (predicted / measured - 1):+6.1f}%  ({how})"
                for stage, what, predicted, measured, how in result.in_step
            ),
            *_timeline_lines(result),
            f"  peak memory  predicted {human_bytes(result.predicted_peak_bytes):>10}  measured "
            f"{human_bytes(result.measured_peak_bytes):>10}  error {100 * result.memory_error:+.1f}%",
            *_megatron_report_line(result),
            "  measured by: " + " ".join(result.command),
        ]
    )


def _megatron_report_line(result: Validation) -> list[str]:
    from autotuner.results.units import human_bytes

    report, first = result.megatron_report_bytes, result.measured_first_stage_peak_bytes
    if not report or not first:
        return []
    return [
        f"    Megatron-LM's report of stage 0 {human_bytes(report):>10}  stage 0 measured "
        f"{human_bytes(first):>10}  error {100 * (report / first - 1):+.1f}% (its formula: 2-byte "
        "activations, no attention scores, 18 B a parameter)"
    ]


def _timeline_lines(result: Validation) -> list[str]:
    from autotuner.results.units import human_time

    if not result.timeline:
        return []
    lines = [
        "    the median step's forward-backward per rank: inside its ops, and between them (waits for other "
        "ranks, transfers, the schedule's own work)"
    ]
    for r in result.timeline:
        inside = r.forward_backward_s - r.between_ops_s
        lines.append(
            f"      rank {r.rank} (stage {r.pp_rank}, tp {r.tp_rank}, dp {r.dp_rank})  "
            f"{human_time(r.forward_backward_s * 1e6):>10} = ops {human_time(inside * 1e6):>10} + between "
            f"{human_time(r.between_ops_s * 1e6):>10}"
        )
    if result.handovers:
        median = statistics.median(seconds for _, seconds in result.handovers)
        predicted = result.predicted_transfer_s
        lines.append(
            f"      hand-overs a stage waited for: median {human_time(median * 1e6)} over "
            f"{len(result.handovers)} (the sender's last op to the receiver's first); predicted exchange "
            + (f"{human_time(predicted * 1e6)} (pp_p2p)" if predicted is not None else "none")
        )
    if result.replayed_s is not None and result.measured_span_s:
        lines.append(
            f"      the schedule model with the measured forwards, backwards and median hand-over: "
            f"{human_time(result.replayed_s * 1e6)} against {human_time(result.measured_span_s * 1e6)} "
            f"measured, first op to last ({100 * (result.replayed_s / result.measured_span_s - 1):+.1f}%)"
        )
    return lines


def _in_step_header(result: Validation) -> list[str]:
    if result.in_step:
        return [
            "    inside the steps, per visit: the fenced mean of the visits beside the rows' "
            "(module hooks: autotuner.predict.in_step)"
        ]
    if result.layout.recompute != "none":
        return ["    inside the steps: not timed (a recomputed forward would fire the module hooks twice)"]
    return []
