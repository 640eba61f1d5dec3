"""A layout's prediction: assembled from the runs (``predict``), kept as data (``Prediction``), written as
``prediction.json`` (``to_json``) and shown as a table (``render``).

Every figure carries its ``Source`` (autotuner.predict.layout): measured at the exact point, scaled from a
neighbouring point by a named rule, or modelled. What the runs lack at the layout's point is listed with
the profiling command that would measure it (``missing``), never counted as zero. The prediction names
the calibration it stands on (a file, or a preset measured on a GPU: autotuner.results.calibration), the
figures it read from it and the rows its times came from; a GPU's prediction without a calibration, or
with one that lacks the dtype's peak, is refused (:func:`check_calibration`).

MFU (Chowdhery et al. 2022, PaLM, appendix B): model FLOPs per token 6*N + 12*L*heads*head_dim*s, N the
parameters a token passes through in its matrix products (each layer's active parameters and the output
layer; not the embedding lookup), here with the attention square counted whole (Megatron's convention);
per step x global_batch*s tokens, over (step time x calibrated peak FLOP/s x GPUs). Without a calibrated
peak there is no MFU (said so).
"""

from __future__ import annotations

import shlex
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotuner.errors import UserError
from autotuner.notices import Notices
from autotuner.ops.naming import PHASES
from autotuner.predict.caches import CacheSizes, cache_plan, host_work_cached, stage_sweep
from autotuner.predict.cluster import Cluster
from autotuner.predict.inputs import Measurements, Missing, ModelShape, measured_on_cpu, row_expert_parallel
from autotuner.predict.layout import DTYPE_BYTES, Figure, Layout, Source
from autotuner.predict.links import LinkGap, LinkWarning, describe_gaps
from autotuner.predict.memory import (
    MEMORY_MARGIN,
    MegatronReport,
    StageMemory,
    layer_activation,
    megatron_report,
    stage_memory,
)
from autotuner.predict.op_time import REPEATS_APART, OpTime, TimeModel
from autotuner.predict.plan import Need, Plan, plan
from autotuner.predict.timing import OVERLAP, StageTime, StepTime, stage_times, step_time
from autotuner.results import load_run_rows
from autotuner.results.calibration import GRAD_ACCUMULATION, preset_for, presets
from autotuner.results.calibration import describe as describe_calibration
from autotuner.results.calibration import label as calibration_label
from autotuner.results.calibration import load as load_calibration
from autotuner.results.environment import load_environment
from autotuner.results.table import text_table
from autotuner.results.units import human_bytes, human_time


@dataclass
class Runs:
    """The rows of one or more run directories, the model they profiled, and the calibration they kept."""

    dirs: list[Path]
    rows: list[dict[str, Any]]
    env: dict[str, Any]
    calibration_path: Path | None

    @property
    def dtypes(self) -> list[str]:
        return sorted({str(r["dtype"]) for r in self.rows if r.get("status") == "ok" and r.get("dtype")})

    def dtype_to_predict(self, asked: str | None) -> str:
        """``asked`` (dtype=), else the one dtype of the runs' ok rows (bf16 when they have none). Runs of
        two dtypes need it said: predicting from the rows of either alone would be a silent choice."""
        if asked:
            return asked
        dtypes = self.dtypes
        if len(dtypes) > 1:
            both = " and ".join(dtypes)
            raise UserError(
                f"the runs hold rows in {both}: say which to predict with, e.g. dtype={dtypes[0]}"
            )
        return dtypes[0] if dtypes else "bf16"


def load_runs(dirs: Sequence[str | Path]) -> Runs:
    """Read each run's results.jsonl and environment.json; UserError (one line) for a folder that is not a
    run, or runs of different models."""
    rows: list[dict[str, Any]] = []
    env: dict[str, Any] = {}
    calibration = None
    paths = [Path(d) for d in dirs]
    for path in paths:
        these = load_run_rows(path, "pass the directory of a finished or interrupted run")
        # a captured call's row (capture=FILE) is at no shape point: nothing a layout's ops scale from
        these = [r for r in these if r.get("seq_len") is not None and r.get("micro_batch_size") is not None]
        this = load_environment(path)
        if not this:  # no record: the model's sizes then come from the case file the rows name
            case = next((r.get("case") for r in these if r.get("case")), None)
            _check_case_sizes(path, case, these)
            this = {"case": case, SIZES_FROM_CASE: True}
        sizes = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        ours, theirs = (e.get("transformer_config") or {} for e in (env, this))
        differ = [k for k in sizes if ours and theirs and ours.get(k) != theirs.get(k)]
        if env and (this.get("case") != env.get("case") or differ):
            this_model, first_model = (
                ", ".join([str(record.get("case")), *(f"{k} {tc.get(k)}" for k in differ)])
                for record, tc in ((this, theirs), (env, ours))
            )
            raise UserError(
                f"{path} profiled another model ({this_model}) than {paths[0]} ({first_model}): "
                "pass runs of one model"
            )
        run_ep = (this.get("transformer_config") or {}).get("expert_model_parallel_size") or 1
        for item in these:
            item["run_expert_parallel"] = int(run_ep)
            item["run_processes"] = int(this.get("world_size") or 1)  # the processes that profiled it
            item["run_dir"] = str(path)  # rows of two runs at one point are repeats (inputs.Measurements)
        env = env or this
        rows += these
        if calibration is None and (path / "calibration.json").is_file():
            calibration = path / "calibration.json"
    return Runs(paths, rows, env, calibration)


# Marks the environment of runs that had none (load_runs): the model is its case file's, as published.
SIZES_FROM_CASE = "sizes_from_case_file"


def _check_case_sizes(path: Path, case: str | None, rows: list[dict[str, Any]]) -> None:
    """A run without its environment.json is predicted at its case's sizes as published: its layer rows'
    weights must be that case's layer, else it was run at other sizes (``hf.*`` overrides) and every
    figure would scale the wrong model. A TP rank's row holds 1/tp of the layer, its norms whole (2% at
    most of the layer's parameters). UserError (one line)."""
    if not case:
        return
    layer = ModelShape.from_case(case).layer_params
    for r in rows:
        if r.get("op") != "transformer_layer" or not r.get("weight_bytes") or row_expert_parallel(r) > 1:
            continue  # (at ep > 1 a rank holds some of the experts)
        tp = int(r.get("tensor_parallel") or 1)
        params = r["weight_bytes"] / DTYPE_BYTES.get(str(r.get("dtype")), 4) * tp
        if abs(params / layer - 1) > 0.02:
            raise UserError(
                f"{path} has no environment.json, and its transformer_layer holds {params:.6g} parameters, "
                f"not the {layer:.6g} of case {case} as published: it was run at other sizes; restore the "
                "run's environment.json"
            )
        return


@dataclass(frozen=True)
class MemoryFit:
    """Whether a prediction's fullest GPU fits ``gpu_memory_gb`` less ``margin`` (as autotuner.tune keeps
    layouts and ``num_layers=fit`` chooses depths)."""

    gpu_memory_gb: float
    margin: float
    fullest_bytes: float  # the fullest GPU's predicted total
    stage: int  # its pipeline stage

    @property
    def limit_bytes(self) -> float:
        return self.gpu_memory_gb * 1e9 * (1 - self.margin)

    @property
    def fits(self) -> bool:
        return self.fullest_bytes <= self.limit_bytes

    def said(self) -> str:
        needs = (
            f"the fullest GPU (stage {self.stage}) needs {self.fullest_bytes / 1e9:.4g} GB "
            f"({human_bytes(self.fullest_bytes)})"
        )
        limit = (
            f"gpu_memory_gb={self.gpu_memory_gb:g} less a {self.margin:.0%} margin "
            f"({self.limit_bytes / 1e9:.4g} GB)"
        )
        if self.fits:
            return f"fits: {needs}, within {limit}"
        return (
            f"does not fit: {needs}, more than {limit}: more pipeline stages, tensor parallelism, recompute, "
            "a smaller micro-batch or the distributed optimizer need less"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu_memory_gb": self.gpu_memory_gb,
            "margin": self.margin,
            "fullest_bytes": self.fullest_bytes,
            "stage": self.stage,
            "limit_bytes": self.limit_bytes,
            "fits": self.fits,
        }


@dataclass
class Prediction:
    """Everything predicted for one layout, as data; ``to_json`` and ``render`` are views of it."""

    layout: Layout
    model: ModelShape
    runs: list[str]
    calibration: str | None  # where it comes from, in words (autotuner.results.calibration.describe)
    stages: list[StageTime]
    step: StepTime
    memory: list[StageMemory]
    mfu: Figure | None
    mfu_note: str
    tokens_per_s_per_gpu: Figure
    tp_note: str
    missing: list[dict[str, Any]]
    plan: Plan | None = None
    notes: list[str] = field(default_factory=list)  # warnings other than the links'
    link_gaps: list[LinkGap] = field(default_factory=list)  # collectives timed from no link calibration
    cache_note: str = ""  # which visits took warm rows, which flushed (autotuner.predict.caches.cache_plan)
    megatron_report: MegatronReport | None = None  # what Megatron-LM's own report prints, beside ours
    calibration_figures: list[str] = field(default_factory=list)  # what the prediction read from it
    rows_note: str = ""  # which rows the times stand on, in words
    memory_fit: MemoryFit | None = None  # against a GPU's memory, where one was given (against_gpu_memory)
    cluster: str | None = None  # the cluster the collectives were priced over, in words

    @property
    def step_seconds(self) -> float:
        return self.step.total

    @property
    def warnings(self) -> list[str]:
        """What the figures rest on beyond the runs and the calibration (stand-ins, assumptions, gaps), and a
        GPU's memory the layout does not fit."""
        misfit = [self.memory_fit.said()] if self.memory_fit and not self.memory_fit.fits else []
        return [*misfit, *self.notes, *describe_gaps(self.link_gaps)]

    def provenance(self) -> list[str]:
        """What the prediction stands on, a line each: the calibration (and the figures it took from it)
        and the rows."""
        if self.calibration:
            taken = ", ".join(self.calibration_figures) or "none"
            calibration = f"calibration: {self.calibration}; figures taken: {taken}"
        else:
            calibration = "calibration: none (a CPU prediction from CPU rows: the rows are the measurement)"
        return [calibration, f"rows: {self.rows_note}"]

    def against_gpu_memory(self, gpu_memory_gb: float, margin: float = MEMORY_MARGIN) -> Prediction:
        """This prediction with whether its fullest GPU fits ``gpu_memory_gb`` less ``margin``."""
        fullest = max(self.memory, key=lambda m: m.total)
        return replace(self, memory_fit=MemoryFit(gpu_memory_gb, margin, fullest.total, fullest.stage))

    def without_schedule_boxes(self) -> Prediction:
        """This prediction with its schedule's boxes dropped (its pipeline time kept): what
        autotuner.tune keeps of every layout it ranks; ``to_json`` then writes no boxes."""
        return replace(self, step=replace(self.step, schedule=self.step.schedule.without_boxes()))

    def to_json(self) -> dict[str, Any]:
        s = self.step
        return {
            "layout": self.layout.to_json(),
            "model": {
                "case": self.model.case,
                "num_layers": self.model.num_layers,
                "hidden_size": self.model.hidden,
                "heads": self.model.heads,
                "query_groups": self.model.query_groups,
                "ffn_hidden_size": self.model.ffn,
                "vocab_size": self.model.vocab,
                "experts": self.model.experts,
                "parameters": self.model.parameters(),
            },
            "runs": self.runs,
            "calibration": self.calibration,
            "calibration_figures": self.calibration_figures,
            "rows": self.rows_note,
            "stages": [st.to_json() for st in self.stages],
            "step": {
                "total_s": s.total,
                "pipeline_s": s.pipeline,
                "formula": s.formula,
                "closed_form_s": s.closed_form,
                "bubble_fraction": s.bubble_fraction,
                "slowest_stage": s.slowest_stage,
                "exchange": s.exchange.to_json() if s.exchange else None,
                "exchange_overlapped": s.exchange_overlapped,
                "schedule": s.schedule.to_json(),
                "dp_reduction": Figure(s.dp_reduction, "s", s.dp_source).to_json(),
                "optimizer": Figure(s.optimizer, "s", s.optimizer_source).to_json(),
                "overlap": s.statement,
                "communication": [term.to_json() for term in s.terms],
            },
            "cluster": self.cluster,
            "tp_collectives": self.tp_note,
            "cache": self.cache_note,
            "memory": [m.to_json() for m in self.memory],
            "megatron_report": self.megatron_report.to_json() if self.megatron_report else None,
            "memory_fit": self.memory_fit.to_json() if self.memory_fit else None,
            "mfu": self.mfu.to_json() if self.mfu else None,
            "mfu_note": self.mfu_note,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu.to_json(),
            "missing": self.missing,
            "warnings": self.warnings,
        }


def _memory(
    meas: Measurements, model: ModelShape, layout: Layout, without_ep: Measurements | None = None
) -> list[StageMemory]:
    attention = meas.exact("core_attention", "forward", layout.seq_len, layout.micro_batch_size, layout.tp)
    return [stage_memory(meas, model, layout, i, attention, without_ep) for i in range(layout.pp)]


def profiling_plan(
    model: ModelShape, layout: Layout, items: Sequence[Missing], cold: bool = True, cpu: bool = False
) -> Plan:
    """The profiling runs (autotuner.predict.plan) that would measure every figure not measured at the
    layout's point and TP: one need per (point, tp), in the layout's dtype, with the caches ``cold`` or
    warm as the step runs its ops (autotuner.predict.caches.cache_plan); on a ``cpu``, beside as many
    processes as the layout runs (:func:`_processes_note`)."""
    needs = {
        Need(
            model.case,
            m.seq_len,
            m.micro_batch_size,
            m.tp,
            layout.ep,
            layout.sequence_parallel and m.tp > 1,
            layout.dtype,
            layout.gpus if cpu else 0,
        )
        for m in items
    }
    return plan(needs, flush_cache=cold)


def _missing(model: ModelShape, layout: Layout, items: Sequence[Missing], runs: Plan) -> list[dict[str, Any]]:
    """Per (point, tp): the figures not measured there and the command that measures them."""
    out = []
    for run in runs.runs:
        for need in run.needs:
            got = [
                m
                for m in items
                if (m.seq_len, m.micro_batch_size, m.tp) == (need.seq_len, need.micro_batch_size, need.tp)
            ]
            out.append(
                {
                    "figures": list(dict.fromkeys(f"{m.op}.{m.phase}" for m in got)),
                    "seq_len": need.seq_len,
                    "micro_batch_size": need.micro_batch_size,
                    "tp": need.tp,
                    "command": shlex.join(run.argv()),
                }
            )
    return out


def _memory_measurements(runs: Runs, layout: Layout) -> tuple[Measurements, Measurements | None]:
    """The rows the memory is read from, either cache mode: at the layout's ep, and (ep > 1) at ep=1."""
    single = Measurements(runs.rows, layout.dtype, ep=1) if layout.ep > 1 else None
    return Measurements(runs.rows, layout.dtype, ep=layout.ep), single


def case_depth(model: ModelShape) -> int:
    """The layers of the model's case as published (the runs' own where no case names it): the deepest
    model ``num_layers=fit`` tries."""
    return ModelShape.from_case(model.case).num_layers if model.case else model.num_layers


def deepest_that_fits(runs: Runs, layout: Layout, model: ModelShape, gpu_memory_gb: float) -> ModelShape:
    """The runs' model at the largest depth, up to its case's own (one the layout can split:
    ``Layout.stage_layers``), whose fullest GPU is predicted within ``gpu_memory_gb`` less MEMORY_MARGIN:
    what a one-GPU validation of a real-width model can hold. UserError (one line) when not even the
    shallowest such depth fits."""
    limit = gpu_memory_gb * 1e9 * (1 - MEMORY_MARGIN)
    full = case_depth(model)
    depths = [d for d in range(1, max(full, layout.pp * layout.vpp) + 1) if layout.splits(d)]
    if not depths:
        layout.stage_layers(full)  # no depth splits as the layout says, the case's own neither: why
    step = depths[0]
    meas, single = _memory_measurements(runs, layout)
    best = None
    with warnings.catch_warnings():  # the prediction at the depth chosen says what it must
        warnings.simplefilter("ignore")
        for depth in depths:
            candidate = model.at_depth(depth)
            if max(m.total for m in _memory(meas, candidate, layout, single)) > limit:
                break  # memory grows with every layer: no deeper model fits either
            best = candidate
    if best is None:
        raise UserError(
            f"not even {step} layer{'s' if step > 1 else ''} of {model.case} fit {gpu_memory_gb:g} GB less a "
            f"{100 * MEMORY_MARGIN:.0f}% margin: give a larger gpu_memory_gb, more pipeline stages, or "
            "num_layers=N"
        )
    return best


def _at_point(rows: list[tuple[tuple, dict[str, Any]]], layout: Layout) -> list[tuple[tuple, dict[str, Any]]]:
    """The (index key, row) pairs at the layout's point where it has some, else all of them (the neighbours
    it scales from)."""
    point = (layout.seq_len, layout.micro_batch_size)
    return [(key, r) for key, r in rows if key[2:4] == point] or rows


def _processes_note(models: Sequence[TimeModel], layout: Layout) -> list[str]:
    """A CPU layout's processes share one host's memory and caches, so its ops run as fast as rows
    profiled beside as many processes (which the rows chosen prefer: ``Measurements``' ``processes``),
    not as rows profiled in fewer, which read fast, nor in more; a GPU's ranks each have their own
    device. The pipeline's stages too: on this project's CPU the llama-shaped PP2's layer rows read
    0.85-1.00 of their time inside the steps profiled in one process, 1.01-1.11 in two
    (``python -m benchmarks.predict_accuracy --layouts pp2`` prints both)."""
    rows = [(key, r) for tm in models for key, r in tm.meas.index.items() if r.get("device") == "cpu"]
    used = {r.get("run_processes") for _, r in _at_point(rows, layout)}
    other = sorted(n for n in used if n and n != layout.gpus)
    if not other:
        return []
    counts = " and ".join(map(str, other))
    mode = "slower" if max(other) < layout.gpus else "faster" if min(other) > layout.gpus else "otherwise"
    command = (
        "python -m autotuner.main ... profiles them alone"
        if layout.gpus == 1
        else f"torchrun --standalone --nproc-per-node={layout.gpus} -m autotuner.main ... profiles them "
        "beside each other"
    )
    return [
        f"the CPU rows were profiled in {counts} process{'es' if other != [1] else ''}, and this layout runs "
        f"{layout.gpus} on one host, which share its memory and caches: its ops run {mode} than those rows "
        f"({command})"
    ]


# The share of a stage's time that noisy rows must carry for the prediction to say so: below it, rows
# that moved between profiles by as much as their own time would move the stage by less than the CPU
# target's 5%.
NOISY_SHARE = 0.05


def _spread_notes(models: Sequence[TimeModel], stages: Sequence[StageTime], used: set[str]) -> list[str]:
    """Notes where rows the prediction cannot pin carry NOISY_SHARE of a stage's time or more, naming the
    four that carry the most: rows whose samples spread widely (the timer's ``noisy`` warning), whose mean
    moves between profiles by more than their samples' spread within one profile suggests (tensor-parallel
    rows over gloo on a CPU, whose collectives stall for a scheduler tick in some calls: ``python -m
    benchmarks.machine_noise``); and ops timed by several runs whose rows lie more than REPEATS_APART apart
    (autotuner.predict.inputs.repeated): the machine's speed moved between the runs by about the CPU target,
    and the median the prediction takes (of two, their mean) is as good as their number. Of the
    rows the model consulted, those ``used`` (:func:`rows_used`) count: the ones the times came from."""
    noisy = {key: said for tm in models for key, said in tm.noisy_rows.items() if key in used}
    apart = {key: said for tm in models for key, said in tm.apart_rows.items() if key in used}
    notes = []
    for rows, text in (
        (
            noisy,
            "{count} of the rows used spread widely ({named}), {share:.0%} of stage {stage}'s forward and "
            "backward: their means move between profiles by more than one profile's samples show (two TP=2 "
            "profiles of the same ops on a CPU, back to back, differed by up to 30% an op); profile again "
            "and predict from both runs (each op then takes the mean of its two rows) before trusting a "
            "difference of that size",
        ),
        (
            apart,
            "{count} of the ops used were timed by repeats (runs, or ranks profiling beside each other) more "
            "than {apart:.0%} apart ({named}), {share:.0%} of stage {stage}'s forward and backward: the "
            "machine ran at another speed in each, and each op takes their median (of two, their mean); runs "
            "at more moments narrow it",
        ),
    ):
        share, stage, named = _stage_share(stages, rows)
        if share >= NOISY_SHARE:
            notes.append(
                text.format(count=len(rows), named=named, share=share, stage=stage, apart=REPEATS_APART)
            )
    return notes


def rows_used(stages: Sequence[StageTime]) -> set[str]:
    """The rows (``op.phase``) the stages' times came from: each item's leaves (a composite op measured
    whole is its own leaf). Rows consulted only to apportion a stage's time to its dominant op, or read
    at another cache mode's preference and not taken, are not among them."""
    return {row for st in stages for name, phase, t, _ in st.items for row in _item_rows(name, phase, t)}


def _item_rows(name: str, phase: str, time: OpTime) -> list[str]:
    """The rows (``op.phase``) a stage item's time came from: its leaves, in its phase (a recompute inside
    the backward re-runs a forward: the forward's rows)."""
    phase = "forward" if name.startswith("recompute:") else phase
    return [f"{leaf}.{phase}" for leaf in time.parts]


def _stage_share(stages: Sequence[StageTime], rows: dict[str, str]) -> tuple[float, int, str]:
    """The largest share of a stage's forward and backward that the ``rows`` (``op.phase``: what to say of
    it) carry, that stage, and the four rows that carry the most time a step, named with what is said."""
    if not rows:
        return 0.0, 0, ""
    shares, held = [], dict.fromkeys(rows, 0.0)  # per stage its rows' share; per row its seconds a step
    for st in stages:
        mine = 0.0
        for name, phase, t, count in st.items:
            for row, seconds in zip(_item_rows(name, phase, t), t.parts.values(), strict=True):
                if row in rows:
                    mine += seconds * count
                    held[row] += seconds * count
        shares.append((mine / st.total if st.total > 0 else 0.0, st.index))
    share, stage = max(shares)
    weightiest = sorted(rows, key=lambda key: (-held[key], key))
    named = ", ".join(f"{key} ({rows[key]})" for key in weightiest[:4]) + (", ..." if len(rows) > 4 else "")
    return share, stage, named


def _forward_order_note(warm: TimeModel | None, layout: Layout) -> list[str]:
    """Inside a step every forward of an op follows its previous micro-batch's backward; on a CPU a warm
    forward timed back to back reads below that (autotuner.measure.timer, "A forward follows its
    backward"), so where the warm forward rows chosen at the layout's point were timed so, say it."""
    if warm is None:
        return []
    forwards = [
        (key, r) for key, r in warm.meas.index.items() if key[1] == "forward" and r.get("device") == "cpu"
    ]
    back_to_back = sorted(
        {
            key[0]
            for key, r in _at_point(forwards, layout)
            if not r.get("cache_flush") and not r.get("forward_after_backward")
        }
    )
    if not back_to_back:
        return []
    return [
        f"the warm forward rows of {', '.join(back_to_back)} were timed back to back; inside a step each "
        "forward follows the op's backward, which runs it slower on a CPU: profile them with "
        "timing.forward_after_backward=true"
    ]


def timed_after_backward(warm: Measurements) -> frozenset[str]:
    """The ops whose warm forward rows (those ``warm`` chose) were all timed each after the op's backward
    (``timing.forward_after_backward``): a stage's first forward op, which follows the stage's backward
    ending with its own, runs as those rows ran (autotuner.predict.caches.warm_visits)."""
    forwards: dict[str, list[bool]] = {}
    for key, r in warm.index.items():
        if key[1] == "forward":
            forwards.setdefault(key[0], []).append(
                not r.get("cache_flush") and bool(r.get("forward_after_backward"))
            )
    return frozenset(op for op, after in forwards.items() if all(after))


def predict(
    runs: Runs,
    layout: Layout,
    calibration: Mapping[str, Any] | None = None,
    model: ModelShape | None = None,
    calibration_from: str | Path | None = None,
    cluster: Cluster | None = None,
) -> Prediction:
    """The prediction of ``layout`` from ``runs`` (see the module docstrings of timing and memory), with
    ``calibration`` (read from ``calibration_from``, a file or a preset's name; by default the one the
    runs kept) and the collectives over ``cluster``'s links where one is given (autotuner.predict.
    collectives; else the calibration's). A context-parallel layout is predicted as one rank computes it
    (``Layout.context_rank_view``) with its attention's ring steps added. UserError (one line) where the
    device's figures it needs are missing (:func:`check_calibration`)."""
    model = model or ModelShape.from_environment(runs.env)
    layout.check(model.num_layers, model.heads, model.query_groups, model.experts)
    if calibration_from is None and calibration is not None:
        calibration_from = runs.calibration_path
    check_calibration(runs, calibration, layout.dtype, calibration_from, model.case)
    if layout.overlap_grad_reduce and layout.ep > 1:
        raise UserError(
            "overlap_grad_reduce=true at ep>1 is not modelled (the experts' gradients are bucketed over "
            "their own group): give overlap_grad_reduce=false"
        )
    if cluster is not None:
        cluster.nodes_for(layout.gpus)
    read = FiguresRead(calibration) if calibration is not None else None
    calibration = read
    whole, layout = layout, layout.context_rank_view()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the memory first (no cache mode changes it); which rows each visit of an op wants follows from
        # the bytes of the stage's ops (autotuner.predict.caches.cache_plan)
        either_cache, single = _memory_measurements(runs, layout)
        memory = _memory(either_cache, model, layout, single)
        activations = layer_activation(either_cache, model, layout, single).value
        sweeps = [stage_sweep(model, layout, stage, activations) for stage in range(layout.pp)]
        cpu = measured_on_cpu(runs.rows)
        processes = layout.gpus if cpu else None  # on a CPU, rows profiled beside as many win
        warm_rows = Measurements(runs.rows, layout.dtype, cold=False, ep=layout.ep, processes=processes)
        # a CPU layout's processes share one host's cache, each sweeping its own stage; a GPU's L2 is its own
        caches = CacheSizes.from_calibration(calibration, processes or 1)
        warm, wants_warm, wants_cold, why = cache_plan(
            sweeps, caches, calibration, timed_after_backward(warm_rows)
        )

        def time_model(cold: bool) -> TimeModel:
            """The rows of one cache mode preferred (the other's stand in, with a warning)."""
            meas = (
                Measurements(runs.rows, layout.dtype, cold=cold, ep=layout.ep, processes=processes)
                if cold
                else warm_rows
            )
            ep1 = (
                Measurements(runs.rows, layout.dtype, cold=cold, ep=1, processes=processes)
                if layout.ep > 1
                else None
            )
            tm = TimeModel(meas, model, layout, calibration, without_ep=ep1, cluster=cluster, cp=whole.cp)
            tm.set_cache_mode(cold, why)
            return tm

        cold = wants_cold or not wants_warm
        tm = time_model(cold)
        meas = tm.meas
        warm_tm = time_model(False) if cold and wants_warm else None
        host_cached = [host_work_cached(sweep, caches) for sweep in sweeps]
        stages = stage_times(tm, [m.params.value for m in memory], warm_tm, warm, host_cached)
        experts = [model.stage_expert_params(layout.tp, layout.ep, st.layers) for st in stages]
        step = step_time(tm, stages, [m.params.value for m in memory], experts)
    models = [tm, *([warm_tm] if warm_tm else [])]
    used = rows_used(stages)  # what the warnings about rows count: the rows the times came from
    cache = [said for said in (t.cache_warning(used) for t in models) if said]
    gaps = list(dict.fromkeys(w.message.gap for w in caught if isinstance(w.message, LinkWarning)))
    others = [str(w.message) for w in caught if not isinstance(w.message, LinkWarning)]
    notes = list(dict.fromkeys([*(w for t in models for w in t.warnings), *others, *cache]))
    missing_items = [m for st in stages for _, _, t, _ in st.items for m in t.missing]
    # the rows of the other cache mode that stood in (the cache warnings): planned as the step wants them
    point = (layout.seq_len, layout.micro_batch_size, layout.tp)
    other_mode = "measured with the other cache mode than the step's"
    missing_items += [
        Missing(*key.split("."), *point, other_mode)
        for t in models
        for key in sorted(t.other_cache_rows & used)
    ]
    profile = profiling_plan(model, layout, missing_items, cold, cpu)
    if warm_tm is not None:  # some visits take flushed rows, others warm ones: a run of each kind
        profile = profile.merged(profiling_plan(model, layout, missing_items, cold=False, cpu=cpu))
    notes += _processes_note(models, layout)
    notes += _spread_notes(models, stages, used)
    notes += _forward_order_note(warm_tm if cold else tm, layout)
    positions = (runs.env.get("model_args") or {}).get("max_sequence_length")
    if isinstance(positions, int) and whole.seq_len > positions:  # the profiler refuses such a shape
        notes.append(
            f"seq_len={whole.seq_len} is above the model's max_position_embeddings={positions}: a longer "
            "context than it was made for (its times scaled from the rows as any length's)"
        )
    calibrated_on = (calibration or {}).get("device_type")
    if calibrated_on and meas.profiled_on and calibrated_on not in meas.profiled_on:
        notes.append(
            f"the calibration is of a {calibrated_on} device, the rows were profiled on "
            f"{', '.join(sorted(meas.profiled_on))}: what is modelled from it (bandwidths, Adam, links) is "
            "another machine's; calibrate where the rows were profiled (python -m autotuner.calibrate)"
        )
    calibrated_name = ((calibration or {}).get("environment") or {}).get("device_name")
    profiled_name = (runs.env.get("environment") or {}).get("device_name")
    if calibrated_on in meas.profiled_on and calibrated_name and profiled_name not in (None, calibrated_name):
        notes.append(
            f"the calibration is of an {calibrated_name}, the rows were profiled on an {profiled_name}: what "
            "is modelled from it (bandwidths, Adam, links) is another GPU's; calibrate where the rows were "
            "profiled (python -m autotuner.calibrate)"
        )
    if runs.env.get(SIZES_FROM_CASE):
        notes.append(
            f"the runs have no environment.json: the model is case {model.case}'s as published, "
            f"{model.num_layers} layers of hidden size {model.hidden} (its layer rows agree)"
        )
    if runs.dirs and not meas.index:  # (without runs, the rows line says so)
        notes.append(
            f"the runs hold no ok rows in {layout.dtype} (they have {', '.join(runs.dtypes) or 'none'}): "
            "no time comes from a row, every op's is modelled from the calibration"
        )
    # TP collectives: measured inside the rows under torchrun at this TP, else modelled (said per item).
    if layout.tp == 1:
        tp_note = "tp=1: no tensor-parallel collectives"
    elif all(tm.measured_at_tp("transformer_layer", p) for p in PHASES):
        tp_note = (
            f"measured: the layer rows were measured under torchrun at tp={layout.tp} (collectives inside)"
        )
    else:
        tp_note = f"modelled: TP=1 rows / tp={layout.tp} plus all-reduces from the link calibration"
    if tm.op("transformer_layer", "forward").recorded:
        tp_note = (
            f"rows of an emulated rank at tp={layout.tp}: the collectives its ops recorded, priced over "
            + (cluster.origin if cluster is not None else "the calibration's links")
        )
    if cluster is not None and cluster.nominal:
        notes.append(cluster.describe())
    layout = whole  # the figures of the whole step: its tokens and GPUs, its attention over s
    tokens = layout.global_batch_size * layout.seq_len
    kinds = {t.source.kind for st in stages for _, _, t, _ in st.items}
    kind = "modelled" if "modelled" in kinds else ("scaled" if "scaled" in kinds else "measured")
    step_src = Source(kind, f"{tokens} tokens / predicted step {step.total:.4g} s / {layout.gpus} GPUs")
    tps = Figure(tokens / step.total / layout.gpus, "tokens/s/GPU", step_src)
    peak = (calibration or {}).get("peak_flops", {}).get(layout.dtype)
    per_token = 3 * (
        model.num_layers * model.forward_flops("transformer_layer", layout.seq_len, 1) / layout.seq_len
        + 2.0 * model.hidden * model.vocab
    )
    if peak:
        flops = per_token * tokens
        mfu = Figure(
            flops / (step.total * peak * layout.gpus),
            "fraction",
            Source(
                kind,
                f"{flops:.4g} model FLOP per step / ({step.total:.4g} s x {peak / 1e12:.4g} TFLOP/s x "
                f"{layout.gpus})",
            ),
        )
        mfu_note = (
            "6*N + 12*L*heads*head_dim*s FLOP per token (PaLM appendix B), attention square counted whole"
        )
    else:  # a CPU prediction without a calibration (check_calibration refuses one without the dtype)
        mfu, mfu_note = None, f"no MFU: no calibration ({tm.calibrate_command()} measures the peak)"
    return Prediction(
        layout=layout,
        model=model,
        runs=[str(d) for d in runs.dirs],
        calibration=describe_calibration(read, calibration_from) if read is not None else None,
        calibration_figures=read.named(layout.dtype) if read is not None else [],
        rows_note=_rows_note(runs, meas, used),
        stages=stages,
        step=step,
        memory=memory,
        mfu=mfu,
        mfu_note=mfu_note,
        tokens_per_s_per_gpu=tps,
        tp_note=tp_note,
        missing=_missing(model, layout, missing_items, profile),
        plan=profile,
        notes=notes,
        link_gaps=gaps,
        cache_note=why,
        megatron_report=megatron_report(model, layout.context_rank_view(), memory[0].params.value),
        cluster=cluster.describe() if cluster is not None else None,
    )


def load_calibration_for(runs: Runs, path: str | None) -> dict[str, Any] | None:
    """The calibration given (a file, or a preset's name), else the one the first run kept, else none."""
    if path:
        return load_calibration(path)
    if runs.calibration_path is not None:
        return load_calibration(runs.calibration_path)
    return None


class FiguresRead(dict):
    """A calibration that notes which of its entries the prediction read, so that it can name them."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def named(self, dtype: str) -> list[str]:
        """The figures read, by name (a per-dtype one with the dtype predicted); not what names the device."""
        per_dtype = ("peak_flops", GRAD_ACCUMULATION)
        return sorted(
            f"{key}[{dtype}]" if key in per_dtype else key
            for key in self.read - {"device_type", "environment", "preset"}
            if key not in per_dtype or dtype in (dict.get(self, key) or {})
        )


def check_calibration(
    runs: Runs, calibration: Mapping[str, Any] | None, dtype: str, given: str | Path | None, case: str
) -> None:
    """Refuse, in one line naming what measures it, a prediction whose device figures are missing: without a
    calibration, any but a CPU prediction from CPU rows (those rows are the measurement; a GPU's step needs
    its calibrated peak and bandwidth, and with no rows nothing is measured at all); with one, a dtype it
    has no matmul peak for (another dtype's would be ten times off)."""
    if calibration is not None:
        peak = calibration.get("peak_flops") or {}
        if dtype not in peak:
            device = calibration.get("device_type") or "cuda"
            raise UserError(
                f"the calibration {calibration_label(calibration, given)} has no peak_flops for {dtype}, "
                f"the dtype predicted (it has {', '.join(peak) or 'none'}): calibrate with "
                f"python -m autotuner.calibrate device={device} (it times fp32, bf16 and fp16), or "
                f"predict dtype={next(iter(peak), 'fp32')}"
            )
        return
    if measured_on_cpu(runs.rows):
        return
    named = " or ".join(f"calibration={name}" for name in presets())
    if not any(r.get("status") == "ok" for r in runs.rows):
        raise UserError(
            f"no profile and no calibration of the GPU to predict {case} on: give {named} (presets measured "
            "on those GPUs: docs/predict_presets.md), or calibration=FILE (python -m autotuner.calibrate "
            "device=cuda on the GPU writes one)"
        )
    device = (runs.env.get("environment") or {}).get("device_name") or "a GPU"
    preset = preset_for(device)
    instead = f"calibration={preset} (the preset measured on an {device})" if preset else named
    raise UserError(
        f"the runs were profiled on {device} and keep no calibration.json, and a GPU's step needs its "
        f"calibrated peak and bandwidth: give {instead}, or calibration=FILE (python -m autotuner.calibrate "
        "device=cuda on it writes one)"
    )


def _rows_note(runs: Runs, meas: Measurements, used: set[str]) -> str:
    """Which rows the times stand on, in one line."""
    if not runs.dirs:
        return "none: every op's time is modelled from the calibration"
    taken = {f"{op}.{phase}" for op, phase, *_ in meas.index} & used
    device = (runs.env.get("environment") or {}).get("device_name")
    where = ", ".join(sorted(meas.profiled_on)) + (f", {device}" if device else "")
    return (
        f"{len(taken)} op row{'s' if len(taken) != 1 else ''} in {meas.dtype} of "
        f"{', '.join(map(str, runs.dirs))} (profiled on {where or 'no device'}); each is named under sources"
    )


def _t(seconds: float) -> str:
    return human_time(seconds * 1e6)


def render(pred: Prediction) -> str:
    """The prediction as text: stages, step, memory, MFU, every figure's source, what to profile."""
    lay = pred.layout
    out = [f"prediction for {pred.model.case}: {lay.describe()}", *pred.provenance(), ""]
    lines = []
    for st in pred.stages:
        kinds = sorted({t.source.kind for _, _, t, _ in st.items})
        lines.append(
            [
                str(st.index),
                str(st.layers),
                _t(st.forward),
                _t(st.backward),
                _t(st.total),
                "/".join(kinds),
                st.dominant,
            ]
        )
    headers = ["stage", "layers", "forward/mb", "backward/mb", "f+b", "source", "dominant op"]
    out += [text_table(headers, lines, [True, True, True, True, True, False, False]), ""]
    if lay.vpp > 1:  # the schedule's boxes: each chunk its own ops (autotuner.predict.timing.chunk_times)
        chunks = "; ".join(
            f"stage {st.index}: " + ", ".join(f"{_t(f)} / {_t(b)}" for f, b in st.chunks)
            for st in pred.stages
        )
        out += [f"model chunks (forward / backward per micro-batch, chunk 0 first): {chunks}", ""]
    s = pred.step
    out += [
        f"step time        {_t(s.total)}  ({'upper bound: ' if s.statement == OVERLAP else ''}{s.statement})",
        f"  pipeline       {_t(s.pipeline)}  {s.formula}; bubble and exchanges {s.bubble_fraction:.1%} "
        f"of stage {s.slowest_stage}'s m x (t_f + t_b)",
        f"  DP reduction   {_t(s.dp_reduction)}  [{s.dp_source.kind}] {s.dp_source.detail}",
        f"  optimizer      {_t(s.optimizer)}  [{s.optimizer_source.kind}] {s.optimizer_source.detail}",
        f"  TP collectives {pred.tp_note}",
        *(
            f"  {term.name:14} {_t(term.exposed)} exposed of {_t(term.total)} [modelled] beside "
            f"{term.overlaps_with}: {term.rule}"
            for term in s.terms
        ),
        f"  cache          {pred.cache_note}",
        f"tokens/s per GPU {pred.tokens_per_s_per_gpu.value:.4g}",
        f"MFU              {pred.mfu.value:.1%}  ({pred.mfu_note})"
        if pred.mfu
        else f"MFU              {pred.mfu_note}",
        "",
    ]
    lines = []
    for m in pred.memory:
        lines.append(
            [
                str(m.stage),
                human_bytes(m.weights.value),
                human_bytes(m.gradients.value),
                human_bytes(m.optimizer.value),
                f"{human_bytes(m.activations.value)} [{m.activations.source.kind}]",
                human_bytes(m.korthikanti_activations.value),
                human_bytes(m.logits.value),
                human_bytes(m.in_flight.value),
                human_bytes(m.optimizer_step.value),
                human_bytes(m.total),
            ]
        )
    headers = [
        "stage",
        "weights",
        "grads",
        "optimizer",
        "activations",
        "Korthikanti",
        "logits",
        "in flight",
        "Adam step",
        "total/GPU",
    ]
    out += [
        "memory per GPU: weights + grads + optimizer, + the larger of (activations + logits + in flight) "
        "and the Adam step's own",
        text_table(headers, lines, [True] * 10),
    ]
    if pred.megatron_report is not None:
        report, first = pred.megatron_report, pred.memory[0]
        out.append(
            f"Megatron-LM's theoretical-memory report, stage 0: {human_bytes(report.total)} "
            f"(activations {human_bytes(report.activations.value)}, weights and optimizer "
            f"{human_bytes(report.weights_and_optimizer.value)}) against {human_bytes(first.total)} here"
        )
    if pred.memory_fit is not None:
        out.append(f"memory against the GPU: {pred.memory_fit.said()}")
    out.append("")
    out.append("sources")
    for st in pred.stages:
        for name, phase, t, count in st.items:
            out.append(
                f"  stage {st.index} {name}.{phase} x{count}: {_t(t.seconds)} [{t.source.kind}] "
                f"{t.source.detail}"
            )
    for m in pred.memory:
        out.append(
            f"  stage {m.stage} activations: [{m.activations.source.kind}] {m.activations.source.detail}"
        )
        out.append(f"  stage {m.stage} parameters: [{m.params.source.kind}] {m.params.source.detail}")
        out.append(f"  stage {m.stage} in flight: [{m.in_flight.source.kind}] {m.in_flight.source.detail}")
        step = m.optimizer_step.source
        out.append(f"  stage {m.stage} Adam step: [{step.kind}] {step.detail}")
    if pred.megatron_report is not None:
        for figure in (pred.megatron_report.activations, pred.megatron_report.weights_and_optimizer):
            out.append(f"  stage 0, {figure.source.detail}")
    if pred.missing:
        out += ["", "not measured at this layout's point, or not as its step runs it; to measure:"]
        out += [f"  {command}" for command in dict.fromkeys(item["command"] for item in pred.missing)]
    said = [w for w in pred.warnings if pred.memory_fit is None or w != pred.memory_fit.said()]  # above
    if said:
        out += ["", *Notices().warn(*said).lines()]
    return "\n".join(out)
