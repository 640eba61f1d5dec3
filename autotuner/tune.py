"""``autotuner-tune [RUN_DIR ...] case=NAME gpus=N gpu_memory_gb=M global_batch_size=G seq_len=S``: every
layout Megatron-Core accepts on N GPUs, ranked by predicted step time (``--help`` lists every setting).

Every layout (autotuner.predict.layouts: the divisibility of heads, experts and batch, the layers' split
over the pipeline ranks; with ``gpus_per_node`` or a cluster, tensor parallelism inside a node) is predicted
from the runs' measured ops (autotuner.predict.prediction); a layout whose fullest GPU would need more than
``gpu_memory_gb`` less ``margin`` is dropped; the rest are ranked by step time, ties by memory. Where the
ranking rests on figures that were not measured, the profiling runs that would measure them are printed
(``slurm=DIR``: as SLURM array task files). Without run directories every figure is modelled from the
case's sizes and a calibration, and says so.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autotuner.cli import Command, entry, parse, setting, settings_of, split
from autotuner.errors import UserError, say_error
from autotuner.notices import Notices
from autotuner.predict.links import describe_gaps
from autotuner.predict.memory import MEMORY_MARGIN
from autotuner.results.atomic import check_writable
from autotuner.termination import ending_quietly_on_a_closed_pipe


@dataclass(frozen=True)
class TuneSettings:
    gpus: int | None = setting(None, "GPUs to lay the model out on; required", "N")
    gpu_memory_gb: float | None = setting(
        None, "each GPU's memory; a layout needing more (less margin) is dropped; required", "GB"
    )
    global_batch_size: int | None = setting(None, "sequences per step; required", "G")
    seq_len: int | None = setting(None, "the training sequence length; required", "S")
    case: str | None = setting(None, "the model, where no run directory is given (its sizes alone)", "NAME")
    case_dir: str | None = setting(None, "a folder of your own cases", "DIR")
    dtype: str | None = setting(None, "the compute dtype (default: the runs' dtype, else bf16)", "DTYPE")
    top: int = setting(5, "layouts to print", "N")
    margin: float = setting(MEMORY_MARGIN, "the share of gpu_memory_gb kept free", "X")
    gpus_per_node: int | None = setting(None, "GPUs a node: tensor parallelism kept inside one", "N")
    calibration: str | None = setting(None, "a calibration file or preset, h100 or h200", "NAME|FILE")
    cluster: str | None = setting(None, "a cluster file or preset (dgx_h100, ...)", "NAME|FILE")
    overlap: bool = setting(False, "rank with Megatron's overlaps on where they apply", "BOOL")
    max_cp: int = setting(1, "try context parallelism up to this size", "N")
    num_layers: int | None = setting(None, "rank the runs' model at this depth", "N")
    explain: int | None = setting(None, "print the whole prediction of the N-th layout", "N")
    slurm: str | None = setting(None, "write the profiling plan as SLURM array task files here", "DIR")


COMMAND = Command(
    "autotuner-tune",
    "autotuner.tune",
    "Rank every layout Megatron-Core accepts on N GPUs by predicted step time (docs/predict.md).",
    "RUN_DIR",
    TuneSettings,
    least=0,
)
REQUIRED = ("gpus", "gpu_memory_gb", "global_batch_size", "seq_len")


@dataclass(frozen=True)
class Ranked:
    """One predicted layout: its prediction, its largest stage's memory, whether that fits."""

    prediction: Any  # autotuner.predict.prediction.Prediction
    memory_bytes: float
    fits: bool


def parse_settings(items: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Run directories and the settings given (their defaults where not), as a dict; UserError (one
    line) for what is wrong."""
    dirs, _, _ = split(items)
    given = settings_of(TuneSettings, split(items)[1], COMMAND.name)
    settings = {k: v for k, v in dataclasses.asdict(given).items() if v is not None}
    missing = [key for key in REQUIRED if key not in settings]
    if missing:
        raise UserError(f"{', '.join(missing)} required: e.g. gpus=16 gpu_memory_gb=80 global_batch_size=512")
    if not dirs and "case" not in settings:
        raise UserError("give run directories of the model, or case=<name> to rank from its sizes alone")
    if settings["gpu_memory_gb"] <= 0 or not 0 <= settings["margin"] < 1:
        raise UserError(
            "gpu_memory_gb must be positive and margin in [0, 1): e.g. gpu_memory_gb=80 margin=0.1"
        )
    if settings["top"] < 1:
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
    not only in ``explain=``. The links' gaps are said together, a line per bandwidth that stood in
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
@entry(COMMAND)
def main(argv: Sequence[str] | None = None) -> int:
    parse(COMMAND, argv)  # --help, and flags where settings belong
    from autotuner.predict.plan import plan
    from autotuner.predict.prediction import render

    try:
        dirs, settings = parse_settings(sys.argv[1:] if argv is None else argv)
        explain, slurm = settings.pop("explain", None), settings.pop("slurm", None)
        if explain is not None and not 1 <= explain <= settings["top"]:
            # before the ranking, which takes a while; one past the layouts that fit is found after it
            raise UserError(f"explain={explain}: give a rank between 1 and top={settings['top']}")
        if slurm:
            check_writable(slurm, f"slurm={slurm}", folder=True)
        ranked, runs = rank(dirs, settings)
        top = settings["top"]
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
        if explain is not None and not 1 <= explain <= len(shown):
            raise UserError(f"explain={explain}: give a rank between 1 and {len(shown)}")
        # the shown layouts' needs, by the cache kind their runs measure (a layout may want both)
        needs: dict[bool, set[Any]] = {True: set(), False: set()}
        for r in shown:
            for run in r.prediction.plan.runs if r.prediction.plan is not None else ():
                needs[run.flush_cache].update(run.needs)
        dirs_done = [str(d) for d in runs.dirs]
        flushed, warm = (plan(needs[kind], dirs_done, flush_cache=kind) for kind in (True, False))
        profile = flushed.merged(warm)
        # the task files written before anything is printed: kept if the reader stops reading (| head)
        arrays = profile.slurm(slurm) if slurm else ()
        print(header)
        for line in shown[0].prediction.provenance():  # one calibration and one set of runs for all
            print(line.replace("rows: ", "rows (#1): ", 1))
        print(table(ranked, top))
        Notices().warn(*warnings_of(shown)).print()
        if explain is not None:
            print("\n" + render(shown[explain - 1].prediction))
        print("\nmeasurements behind this ranking: " + profile.text(arrays))
    except UserError as exc:
        say_error(COMMAND.name, exc)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
