"""Rank the training layouts of a model on a number of GPUs by predicted step time.

    python -m autotuner.tune [RUN_DIR ...] case=llama7b gpus=16 gpu_memory_gb=80 global_batch_size=512 \\
        seq_len=4096 [dtype=bf16] [top=5] [margin=0.1] [gpus_per_node=8] [calibration=h100|h200|FILE] \\
        [cluster=dgx_h100|FILE] [overlap=false] [max_cp=1] [num_layers=N] [--explain N] [--slurm DIR]

Every layout Megatron-Core accepts (autotuner.predict.layouts: the divisibility of heads, experts and
batch, the layers' split over the pipeline ranks, uneven ones near the even split included; with
``gpus_per_node``, tensor parallelism kept inside a node) is predicted
from the runs' measured ops (autotuner.predict.prediction); a layout whose largest stage would need more
than ``gpu_memory_gb`` less the safety ``margin`` (a fraction, shown) is dropped; the rest are ranked by
predicted step time, ties by memory. The top ``top`` are printed with time, MFU, tokens/s per GPU,
memory, the op that decides the slowest stage and how much of the prediction is measured; ``--explain
N`` prints the whole prediction of the N-th. Where the ranking rests on figures that were not measured,
the profiling runs that would measure them (for the layouts shown) are printed as commands, and with
``--slurm DIR`` written as SLURM array task files.

With ``cluster`` (autotuner.predict.cluster: a preset such as ``dgx_h100``, or the file
``autotuner-calibrate --links`` writes) every collective is priced by where its group's ranks lie
(autotuner.predict.collectives), and tp is kept inside its nodes; ``overlap=true`` ranks the layouts with
Megatron's overlaps on where they apply, ``max_cp`` tries context parallelism up to that size
(autotuner.predict.layouts); ``num_layers`` ranks the runs' model at that depth (their rows are per
layer: a one-layer profile ranks the whole model).

Without run directories every figure is modelled from the case's sizes and the calibration (and says
so): the profiling plan then lists everything to measure. A calibration is needed then, and for runs
profiled on a GPU: ``calibration=h100`` or ``h200`` names a preset measured on that GPU
(docs/predict_presets.md), else the command refuses in one line naming what measures one. Layouts with
expert parallelism are ranked as the others (autotuner.predict.op_time: the expert ops at that ep,
measured or derived from ep=1 rows).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autotuner.errors import OneLineParser, UserError
from autotuner.predict.links import describe_gaps
from autotuner.predict.memory import MEMORY_MARGIN
from autotuner.results.atomic import check_writable
from autotuner.termination import ending_quietly_on_a_closed_pipe

INT_KEYS = ("gpus", "global_batch_size", "seq_len", "top", "gpus_per_node", "max_cp", "num_layers")
FLOAT_KEYS = ("gpu_memory_gb", "margin")
STR_KEYS = ("case", "case_dir", "dtype", "calibration", "cluster")
BOOL_KEYS = ("overlap",)
KEYS = (*INT_KEYS, *FLOAT_KEYS, *STR_KEYS, *BOOL_KEYS)
REQUIRED = ("gpus", "gpu_memory_gb", "global_batch_size", "seq_len")


@dataclass(frozen=True)
class Ranked:
    """One predicted layout: its prediction, its largest stage's memory, whether that fits."""

    prediction: Any  # autotuner.predict.prediction.Prediction
    memory_bytes: float
    fits: bool


def parse_settings(items: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Run directories and typed ``key=value`` settings; UserError (one line) for what is wrong."""
    from autotuner.predict.settings import parse_settings as parse_key_values

    kinds = {
        **dict.fromkeys(INT_KEYS, int),
        **dict.fromkeys(FLOAT_KEYS, float),
        **dict.fromkeys(STR_KEYS, str),
        **dict.fromkeys(BOOL_KEYS, bool),
    }
    dirs, settings = parse_key_values(items, kinds)
    missing = [key for key in REQUIRED if key not in settings]
    if missing:
        raise UserError(f"{', '.join(missing)} required: e.g. gpus=16 gpu_memory_gb=80 global_batch_size=512")
    if not dirs and "case" not in settings:
        raise UserError("give run directories of the model, or case=<name> to rank from its sizes alone")
    if settings["gpu_memory_gb"] <= 0 or not 0 <= settings.get("margin", MEMORY_MARGIN) < 1:
        raise UserError(
            "gpu_memory_gb must be positive and margin in [0, 1): e.g. gpu_memory_gb=80 margin=0.1"
        )
    if settings.get("top", 5) < 1:
        raise UserError("top must be at least 1: e.g. top=5")
    return dirs, settings


def rank(
    dirs: Sequence[str], settings: dict[str, Any], keep: Callable[[Any], bool] | None = None
) -> tuple[list[Ranked], Any]:
    """Predict every layout (those ``keep`` keeps, where given: a benchmark's stated layout); (the ranked
    ones, fitting first by step time; the runs)."""
    from autotuner.predict.cluster import load as load_cluster
    from autotuner.predict.inputs import ModelShape
    from autotuner.predict.layouts import ModelDims, enumerate_layouts
    from autotuner.predict.prediction import Runs, load_calibration_for, load_runs, predict

    runs = load_runs(dirs) if dirs else Runs([], [], {"case": settings["case"]}, None)
    if dirs and settings.get("case") and runs.env.get("case") not in (None, settings["case"]):
        raise UserError(
            f"the runs profiled case {runs.env.get('case')}, not {settings['case']}: "
            "drop case= or pass its runs"
        )
    if not dirs and settings.get("case_dir"):
        model = ModelShape.from_case(settings["case"], settings["case_dir"])
    else:
        model = ModelShape.from_environment(runs.env)
    if settings.get("num_layers"):  # the runs' rows are per layer: they hold at any depth
        if settings["num_layers"] < 1:
            raise UserError(
                f"num_layers={settings['num_layers']} must be at least 1: give e.g. num_layers=32"
            )
        model = model.at_depth(settings["num_layers"])
    calibration = load_calibration_for(runs, settings.get("calibration"))
    cluster = load_cluster(settings["cluster"]) if settings.get("cluster") else None
    per_node = settings.get("gpus_per_node", cluster.gpus_per_node if cluster else None)
    if cluster is not None and settings.get("gpus_per_node") not in (None, cluster.gpus_per_node):
        raise UserError(
            f"gpus_per_node={settings['gpus_per_node']} and cluster {cluster.origin} has "
            f"{cluster.gpus_per_node} GPUs a node: drop one"
        )
    dtype = runs.dtype_to_predict(settings.get("dtype"))
    layouts = enumerate_layouts(
        ModelDims.from_transformer(model.config),
        settings["gpus"],
        settings["global_batch_size"],
        settings["seq_len"],
        dtype,
        max_tp=per_node,
        max_cp=settings.get("max_cp", 1),
        overlap=settings.get("overlap", False),
    )
    gpu_memory_gb, margin = settings["gpu_memory_gb"], settings.get("margin", MEMORY_MARGIN)
    ranked: list[Ranked] = []
    for layout in (lay for lay in layouts if keep is None or keep(lay)):
        pred = predict(
            runs, layout, calibration, model, calibration_from=settings.get("calibration"), cluster=cluster
        )
        pred = pred.without_schedule_boxes().against_gpu_memory(gpu_memory_gb, margin)
        fit = pred.memory_fit
        ranked.append(Ranked(pred, fit.fullest_bytes, fit.fits))
    ranked.sort(key=lambda r: (not r.fits, r.prediction.step_seconds, r.memory_bytes))
    return ranked, runs


def warnings_of(shown: Sequence[Ranked]) -> list[str]:
    """What the shown layouts' predictions warn of (an assumed peak or bandwidth, rows standing in for
    others), each once in the order met: the table's times rest on them, so they are printed with it,
    not only in ``--explain``. The links' gaps are said together, a line per bandwidth that stood in
    (:func:`autotuner.predict.links.describe_gaps`)."""
    notes = (w for r in shown for w in r.prediction.notes)
    gaps = (g for r in shown for g in r.prediction.link_gaps)
    return list(dict.fromkeys([*notes, *describe_gaps(gaps)]))


def _kinds(pred: Any) -> str:
    """How much of the prediction's time is measured: the share of each source kind, by time."""
    seconds: dict[str, float] = {}
    for stage in pred.stages:
        for _, _, time, count in stage.items:
            seconds[time.source.kind] = seconds.get(time.source.kind, 0.0) + time.seconds * count
    total = sum(seconds.values()) or 1.0
    return ", ".join(f"{kind} {100 * value / total:.0f}%" for kind, value in sorted(seconds.items()))


def table(ranked: Sequence[Ranked], top: int) -> str:
    from autotuner.results.table import text_table
    from autotuner.results.units import human_bytes, human_time

    rows = []
    for index, item in enumerate([r for r in ranked if r.fits][:top], start=1):
        pred = item.prediction
        slowest = max(pred.stages, key=lambda stage: stage.total)
        mfu = f"{100 * pred.mfu.value:.1f}%" if pred.mfu is not None else "n/a"
        rows.append(
            [
                str(index),
                pred.layout.describe(),
                human_time(pred.step_seconds * 1e6),
                mfu,
                f"{pred.tokens_per_s_per_gpu.value:.4g}",
                human_bytes(item.memory_bytes),
                slowest.dominant,
                _kinds(pred),
            ]
        )
    headers = ["#", "layout", "step", "MFU", "tokens/s/GPU", "memory", "deciding op", "time from"]
    right = [True, False, True, True, True, True, False, False]
    return text_table(headers, rows, right)


@ending_quietly_on_a_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m autotuner.tune",
        description=__doc__.split("\n\n")[0],
        epilog=f"settings (key=value): {', '.join(KEYS)}; required: {', '.join(REQUIRED)}",
    )
    parser.add_argument("args", nargs="+", help="run directories (optional), then key=value settings")
    parser.add_argument("--explain", type=int, metavar="N", help="print the whole prediction of the N-th")
    parser.add_argument("--slurm", metavar="DIR", help="write the profiling plan as SLURM array task files")
    args = parser.parse_intermixed_args(argv)  # key=value settings after an option too
    from autotuner.predict.plan import plan
    from autotuner.predict.prediction import render

    try:
        dirs, settings = parse_settings(args.args)
        if args.explain is not None and not 1 <= args.explain <= settings.get("top", 5):
            # before the ranking, which takes a while; one past the layouts that fit is found after it
            raise UserError(
                f"--explain {args.explain}: give a rank between 1 and top={settings.get('top', 5)}"
            )
        if args.slurm:
            check_writable(args.slurm, f"--slurm {args.slurm}", folder=True)
        ranked, runs = rank(dirs, settings)
        top = settings.get("top", 5)
        fitting = [r for r in ranked if r.fits]
        margin = settings.get("margin", MEMORY_MARGIN)
        header = (
            f"{len(ranked)} layouts predicted, {len(fitting)} fit in {settings['gpu_memory_gb']:g} GB "
            f"less a {100 * margin:.0f}% margin; the fastest {min(top, len(fitting))}:"
        )
        if not fitting:
            print(header)
            smallest = min(ranked, key=lambda r: r.memory_bytes)
            raise UserError(
                f"no layout fits: the smallest needs {smallest.memory_bytes / 1e9:.3g} GB per GPU "
                f"({smallest.prediction.layout.describe()}): use more GPUs, recompute, or a smaller batch"
            )
        shown = fitting[:top]
        if args.explain is not None and not 1 <= args.explain <= len(shown):
            raise UserError(f"--explain {args.explain}: give a rank between 1 and {len(shown)}")
        # the shown layouts' needs, by the cache kind their runs measure (a layout may want both)
        needs: dict[bool, set[Any]] = {True: set(), False: set()}
        for r in shown:
            for run in r.prediction.plan.runs if r.prediction.plan is not None else ():
                needs[run.flush_cache].update(run.needs)
        dirs_done = [str(d) for d in runs.dirs]
        flushed, warm = (plan(needs[kind], dirs_done, flush_cache=kind) for kind in (True, False))
        profile = flushed.merged(warm)
        # the task files written before anything is printed: kept if the reader stops reading (| head)
        arrays = profile.slurm(args.slurm) if args.slurm else ()
        print(header)
        for line in shown[0].prediction.provenance():  # one calibration and one set of runs for all
            print(line.replace("rows: ", "rows (#1): ", 1))
        print(table(ranked, top))
        for warning in warnings_of(shown):
            print(f"warning: {warning}")
        if args.explain is not None:
            print("\n" + render(shown[args.explain - 1].prediction))
        print("\nmeasurements behind this ranking: " + profile.text(arrays))
    except UserError as exc:
        print(f"autotuner.tune: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
