"""``autotuner-predict RUN_DIR ... seq_len=S [tp=.. pp=.. dp=.. ...]``: a layout's step time and memory per
GPU predicted from profiled runs (``--help`` lists every setting; docs/predict.md every term).

Prints the table (stages, step, memory, MFU, each figure's source, the commands that would measure what is
missing) and writes ``prediction.json`` and, beside it, ``prediction.html``. A GPU's prediction without a
calibration is refused, naming what measures it. ``validate=true`` also runs the layout's real training
steps here and prints predicted against measured (autotuner.predict.validate).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.cli import Command, entry, parse, setting
from autotuner.errors import UserError, say_error
from autotuner.predict.cluster import load as load_cluster
from autotuner.predict.inputs import ModelShape
from autotuner.predict.layout import Layout
from autotuner.predict.prediction import (
    case_depth,
    check_calibration,
    deepest_that_fits,
    load_calibration_for,
    load_runs,
    predict,
    render,
)
from autotuner.results.atomic import atomic_write_text, check_writable
from autotuner.termination import (
    ending_in_one_line_on_ctrl_c,
    ending_quietly_on_a_closed_pipe,
    unwinding_on_sigterm,
)


@dataclass(frozen=True)
class PredictSettings:
    """The layout (autotuner.predict.layout.Layout: its defaults), then what the command does with it."""

    seq_len: int | None = setting(None, "the training sequence length; required", "S")
    tp: int = setting(1, "tensor-parallel size", "N")
    cp: int = setting(1, "context-parallel size (modelled: docs/cluster_model.md)", "N")
    pp: int = setting(1, "pipeline-parallel size", "N")
    vpp: int = setting(1, "virtual pipeline stages per rank (interleaved 1F1B above 1)", "N")
    dp: int = setting(1, "data-parallel size", "N")
    ep: int = setting(1, "expert-parallel size", "N")
    micro_batch_size: int = setting(1, "sequences per micro-batch", "B")
    global_batch_size: int = setting(1, "sequences per step, all data-parallel ranks together", "G")
    first_stage_layers: int | None = setting(None, "layers of the first pipeline stage (default even)", "N")
    last_stage_layers: int | None = setting(None, "layers of the last pipeline stage (default even)", "N")
    recompute: str = setting("none", "activation recompute: none, selective or full", "MODE")
    sequence_parallel: bool = setting(False, "Megatron's sequence parallelism (with tp > 1)", "BOOL")
    distributed_optimizer: bool = setting(False, "the distributed optimizer (ZeRO-1 over dp)", "BOOL")
    overlap_grad_reduce: bool = setting(False, "the gradient reduce overlapped with the backward", "BOOL")
    overlap_param_gather: bool = setting(
        False, "the distributed optimizer's parameter all-gather overlapped", "BOOL"
    )
    tp_comm_overlap: bool = setting(
        False, "TP communication overlapped with its GEMMs (as TE does; modelled)", "BOOL"
    )
    dtype: str | None = setting(None, "the compute dtype (default: the runs' dtype)", "DTYPE")
    calibration: str | None = setting(
        None, "a calibration file or preset, h100 or h200 (default: the first run's)", "NAME|FILE"
    )
    cluster: str | None = setting(
        None,
        "a cluster file or preset (dgx_h100, ...): prices every collective by where it lies",
        "NAME|FILE",
    )
    gpu_memory_gb: float | None = setting(
        None, "the GPU's memory: the prediction says whether its fullest GPU fits (less 10%)", "GB"
    )
    num_layers: str | None = setting(
        None, "predict the runs' model at N layers, or fit: the deepest that fits gpu_memory_gb", "N|fit"
    )
    validate: bool = setting(False, "also run the layout's real training steps here and compare", "BOOL")
    repeats: int = setting(5, "measured steps of a validation", "N")
    report: bool = setting(True, "write prediction.html beside prediction.json", "BOOL")
    json: str | None = setting(None, "write the prediction here (default <first run>/prediction.json)", "OUT")
    slurm: str | None = setting(
        None,
        "write the profiling runs that would measure what is missing as SLURM array task files here",
        "DIR",
    )


COMMAND = Command(
    "autotuner-predict",
    "autotuner.predict",
    "Predict a layout's step time and memory per GPU from profiled runs (docs/predict.md).",
    "RUN_DIR",
    PredictSettings,
)
LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(Layout))


@ending_quietly_on_a_closed_pipe
@ending_in_one_line_on_ctrl_c("autotuner.predict")
@unwinding_on_sigterm()  # a SIGTERM removes the temporary folders of steps and profiles, then ends
@entry(COMMAND)
def main(argv: Sequence[str] | None = None) -> int:
    dirs, args, _ = parse(COMMAND, argv)
    try:
        if args.seq_len is None:
            raise UserError("seq_len= is required: give the training sequence length, e.g. seq_len=2048")
        runs = load_runs(dirs)
        given = args.calibration
        calibration = load_calibration_for(runs, given)
        cluster = load_cluster(args.cluster) if args.cluster else None
        validating, repeats = args.validate, args.repeats
        if repeats < 1:  # refused here, before the prediction, not by the steps' process after it
            raise UserError(f"repeats={repeats} must be at least 1: give e.g. repeats=5")
        page, gpu_memory_gb = args.report, args.gpu_memory_gb
        if gpu_memory_gb is not None and gpu_memory_gb <= 0:
            raise UserError(f"gpu_memory_gb={gpu_memory_gb:g} must be positive: give e.g. gpu_memory_gb=80")
        settings_depth = args.num_layers
        settings = {k: getattr(args, k) for k in LAYOUT_KEYS}
        settings["dtype"] = runs.dtype_to_predict(args.dtype)
        layout = Layout(**settings)
        out = Path(args.json) if args.json else Path(dirs[0]) / "prediction.json"
        if out.suffix.lower() == ".html":  # the page is written beside the JSON, as out.with_suffix(".html")
            raise UserError(f"json={out}: the page goes beside the JSON, with .html: give a .json name")
        check_writable(out, f"json={out}", reads=dirs)
        if page:
            check_writable(out.with_suffix(".html"), f"json={out} (its page)", reads=dirs)
        if args.slurm:
            check_writable(args.slurm, f"slurm={args.slurm}", folder=True)
        profiled = ModelShape.from_environment(runs.env)
        check_calibration(runs, calibration, layout.dtype, given, profiled.case)  # before num_layers=fit
        model = _model_at_depth(runs, layout, profiled, settings_depth, gpu_memory_gb)
        pred = predict(runs, layout, calibration, model, calibration_from=given, cluster=cluster)
        if gpu_memory_gb is not None:
            pred = pred.against_gpu_memory(gpu_memory_gb)
        record = pred.to_json()
        # written before it is printed: kept if the validation fails, or the reader stops reading (| head)
        atomic_write_text(out, json.dumps(record, indent=1) + "\n")
        planned = args.slurm and pred.plan is not None and pred.plan.runs
        arrays = pred.plan.slurm(args.slurm) if planned else ()  # the task files, likewise
        print(render(pred))
        if validating:  # the real steps of this layout (autotuner.predict.validate)
            from autotuner.predict.steps import StepsFailed
            from autotuner.predict.validate import model_overrides, validate
            from autotuner.predict.validate import render as render_validation

            case = str(runs.env.get("case") or pred.model.case)
            depth = pred.model.num_layers if pred.model.num_layers != profiled.num_layers else None
            try:
                overrides = model_overrides(Path(dirs[0]), depth)
                steps_out = out.with_suffix(".steps.json")  # the measured steps, kept beside the prediction
                checked = validate(pred, case, overrides, repeats=repeats, steps_out=steps_out)
            except StepsFailed as exc:
                message = f"validate=true: {exc}; the prediction, unvalidated, is in {out}"
                say_error(COMMAND.name, f"{message}")
                return 1
            print("\n" + render_validation(checked))
            record["validation"] = checked.to_json()
            atomic_write_text(out, json.dumps(record, indent=1) + "\n")
        if planned:
            print("\n" + pred.plan.text(arrays))
    except UserError as exc:
        say_error(COMMAND.name, exc)
        return exc.exit_code
    except BrokenPipeError:  # the reader stopped reading: ending_quietly_on_a_closed_pipe
        raise
    except OSError as exc:
        print(
            f"{COMMAND.name}: error: cannot write the prediction: {exc.strerror or exc}: "
            "give a path you can write",
            file=sys.stderr,
        )
        return 2
    print(f"\nprediction written to {out}")
    if page:
        _page(record, out.with_suffix(".html"), gpu_memory_gb)
    return 0


def _model_at_depth(
    runs: Any, layout: Layout, model: ModelShape, depth: str | None, gpu_memory_gb: float | None
) -> ModelShape:
    """The runs' ``model``, at ``num_layers`` when given (a count, or ``fit``)."""
    if depth is None:
        return model
    if depth == "fit":
        if gpu_memory_gb is None:
            raise UserError(
                "num_layers=fit needs the GPU's memory: give gpu_memory_gb=<GB>, e.g. gpu_memory_gb=80"
            )
        deepest = deepest_that_fits(runs, layout, model, gpu_memory_gb)
        fits = f"{deepest.num_layers} layers fit {gpu_memory_gb:g} GB"
        if deepest.num_layers == case_depth(model):  # deepest_that_fits tries no deeper model
            fits += ", all the case's (no deeper model is tried)"
        print(f"num_layers=fit: {fits} (the runs' model has {model.num_layers})")
        return deepest
    if not depth.isdigit() or int(depth) < 1:
        raise UserError(
            f"num_layers={depth!r} is not a layer count: give e.g. num_layers=32, or num_layers=fit"
        )
    return model.at_depth(int(depth))


def _page(record: dict[str, Any], path: Path, gpu_memory_gb: float | None) -> None:
    """The prediction's HTML page. Like a run's report, a page that cannot be made is one line on stderr
    and never fails the prediction, which is already written."""
    try:
        from autotuner.report.prediction import write_prediction_page

        page = write_prediction_page(record, path, gpu_memory_gb)
    except Exception as exc:  # noqa: BLE001 - prediction.json is on disk whatever happens here
        print(
            f"{COMMAND.name}: page not written: {type(exc).__name__}: {exc}".splitlines()[0],
            file=sys.stderr,
        )
        return
    print(f"page: {page}")  # a closed pipe here ends the command (ending_quietly_on_a_closed_pipe)


if __name__ == "__main__":
    raise SystemExit(main())
