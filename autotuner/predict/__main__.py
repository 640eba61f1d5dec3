"""Predict a layout's step time and memory from profiled runs.

    python -m autotuner.predict RUN_DIR [RUN_DIR ...] seq_len=2048 tp=2 pp=4 dp=8 micro_batch_size=1 \\
        global_batch_size=512 [vpp=1] [cp=1] [first_stage_layers=N] [last_stage_layers=N] \\
        [recompute=none|selective|full] [sequence_parallel=false] [distributed_optimizer=false] \\
        [overlap_grad_reduce=false] [overlap_param_gather=false] [tp_comm_overlap=false] \\
        [dtype=bf16] [calibration=h100|h200|FILE] [cluster=dgx_h100|FILE] [validate=false] \\
        [repeats=5] [report=true] [gpu_memory_gb=80] [num_layers=N|fit] [--json OUT]

Prints the table (stages, step, memory, MFU, each figure's source, the commands that would measure what
is missing; ``--slurm DIR``: also as SLURM arrays) and writes ``prediction.json`` (``--json``; default: in
the first run directory). dtype defaults to the runs' dtype; the calibration to the one the first run
kept (calibration.json); ``calibration=h100`` or ``h200`` names a preset measured on that GPU
(docs/predict_presets.md). A GPU's prediction without a calibration is refused, naming what measures it.
With ``gpu_memory_gb`` the prediction says whether its fullest GPU fits it less a 10% margin, as
``autotuner.tune`` keeps layouts. With ``cluster`` the collectives are priced by where their groups lie
on that cluster (autotuner.predict.collectives); the overlaps and ``cp`` are Megatron's
(autotuner.predict.overlap). ``validate=true`` also runs the layout's real training steps on this machine
and prints predicted against measured step time and peak memory (autotuner.predict.validate).
Beside prediction.json it writes ``prediction.html`` (autotuner.report.prediction: the 1F1B timeline,
the memory per stage against ``gpu_memory_gb`` when given, predicted against measured bars), as a run
writes its report.html; ``report=false`` turns it off. ``num_layers=N`` predicts (and validates) the
runs' model at another depth, their rows being per layer; ``num_layers=fit`` at the largest depth, up to
the case's own, whose fullest GPU the prediction fits in ``gpu_memory_gb`` less a 10% margin (a one-GPU
validation of a model at its real width: as many layers as fit).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotuner.errors import OneLineParser, UserError
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
from autotuner.predict.settings import parse_settings as parse_key_values
from autotuner.results.atomic import atomic_write_text, check_writable
from autotuner.termination import (
    ending_in_one_line_on_ctrl_c,
    ending_quietly_on_a_closed_pipe,
    unwinding_on_sigterm,
)

INT_KEYS = (
    *("seq_len", "tp", "cp", "pp", "vpp", "dp", "ep", "micro_batch_size", "global_batch_size", "repeats"),
    *("first_stage_layers", "last_stage_layers"),
)
BOOL_KEYS = (
    *("sequence_parallel", "distributed_optimizer", "validate", "report"),
    *("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"),
)
STR_KEYS = ("recompute", "dtype", "calibration", "num_layers", "cluster")
FLOAT_KEYS = ("gpu_memory_gb",)
KEYS = (*INT_KEYS, *BOOL_KEYS, *STR_KEYS, *FLOAT_KEYS)


def parse_settings(items: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split the arguments into run directories and ``key=value`` settings, typed; UserError (one line)
    for an unknown key, a value of the wrong type, or what is missing."""
    kinds = {
        **dict.fromkeys(INT_KEYS, int),
        **dict.fromkeys(BOOL_KEYS, bool),
        **dict.fromkeys(STR_KEYS, str),
        **dict.fromkeys(FLOAT_KEYS, float),
    }
    dirs, settings = parse_key_values(items, kinds)
    if not dirs:
        raise UserError("no run directory given: pass the directory of a run of python -m autotuner.main")
    if "seq_len" not in settings:
        raise UserError("seq_len= is required: give the training sequence length, e.g. seq_len=2048")
    return dirs, settings


@ending_quietly_on_a_closed_pipe
@ending_in_one_line_on_ctrl_c("autotuner.predict")
@unwinding_on_sigterm()  # a SIGTERM removes the temporary folders of steps and profiles, then ends
def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m autotuner.predict",
        description=__doc__.split("\n\n")[0],
        epilog=f"settings (key=value): {', '.join(KEYS)}",
    )
    parser.add_argument("args", nargs="+", help="run directories, then key=value settings")
    parser.add_argument("--json", help="write the prediction here (default: <first run>/prediction.json)")
    parser.add_argument(
        "--slurm",
        metavar="DIR",
        help="write the profiling runs that would measure what is missing as SLURM array task files here",
    )
    args = parser.parse_intermixed_args(argv)  # key=value settings after an option too
    try:
        dirs, settings = parse_settings(args.args)
        runs = load_runs(dirs)
        given = settings.pop("calibration", None)
        calibration = load_calibration_for(runs, given)
        cluster_given = settings.pop("cluster", None)
        cluster = load_cluster(cluster_given) if cluster_given else None
        validating, repeats = settings.pop("validate", False), settings.pop("repeats", 5)
        if repeats < 1:  # refused here, before the prediction, not by the steps' process after it
            raise UserError(f"repeats={repeats} must be at least 1: give e.g. repeats=5")
        page, gpu_memory_gb = settings.pop("report", True), settings.pop("gpu_memory_gb", None)
        if gpu_memory_gb is not None and gpu_memory_gb <= 0:
            raise UserError(f"gpu_memory_gb={gpu_memory_gb:g} must be positive: give e.g. gpu_memory_gb=80")
        settings_depth = settings.pop("num_layers", None)
        settings["dtype"] = runs.dtype_to_predict(settings.get("dtype"))
        layout = Layout(**settings)
        out = Path(args.json) if args.json else Path(dirs[0]) / "prediction.json"
        if out.suffix.lower() == ".html":  # the page is written beside the JSON, as out.with_suffix(".html")
            raise UserError(f"--json {out}: the page goes beside the JSON, with .html: give a .json name")
        check_writable(out, f"--json {out}", reads=dirs)
        if page:
            check_writable(out.with_suffix(".html"), f"--json {out} (its page)", reads=dirs)
        if args.slurm:
            check_writable(args.slurm, f"--slurm {args.slurm}", folder=True)
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
                print(f"autotuner.predict: error: {message}", file=sys.stderr)
                return 1
            print("\n" + render_validation(checked))
            record["validation"] = checked.to_json()
            atomic_write_text(out, json.dumps(record, indent=1) + "\n")
        if planned:
            print("\n" + pred.plan.text(arrays))
    except UserError as exc:
        print(f"autotuner.predict: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # the reader stopped reading: ending_quietly_on_a_closed_pipe
        raise
    except OSError as exc:
        print(
            f"autotuner.predict: error: cannot write the prediction: {exc.strerror or exc}: "
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
            f"autotuner.predict: page not written: {type(exc).__name__}: {exc}".splitlines()[0],
            file=sys.stderr,
        )
        return
    print(f"page: {page}")  # a closed pipe here ends the command (ending_quietly_on_a_closed_pipe)


if __name__ == "__main__":
    raise SystemExit(main())
