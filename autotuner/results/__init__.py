"""Result rows: one per (case, op, phase, shape point), written as they are measured.

Files in the run directory, rewritten whole after every row through a temporary file and an atomic
rename, so each finished row is on disk before the next op starts and an interrupted run always leaves
complete, valid files (never a half-written line):

* ``results.jsonl``: one JSON object per row (the source of truth; numbers are numbers).
* ``results.csv``: the same rows and columns, for spreadsheets and pandas.

:class:`Row` is the one definition of the columns: their order (the CSV header, the JSONL keys), each
one's meaning, unit and table label. Rows travel as plain dicts (they round-trip through JSON); the
writer refuses a key that :class:`Row` does not define. docs/columns.md lists the columns
(:func:`describe_columns` writes that table; a test holds the page to it).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from autotuner.errors import UserError
from autotuner.results.atomic import atomic_write_text
from autotuner.results.reading import UnreadableRunFile, read_run_text


def _column(
    doc: str,
    unit: str | None = None,
    label: str | None = None,
    number: bool = False,
    optional: bool = False,
    call: bool = False,
    counts: bool = False,
    fullest: bool = False,
) -> Any:
    """A :class:`Row` field's metadata: ``doc`` its meaning, ``unit`` what its numbers count, ``label``
    its header in the tables (default: the name), ``number`` whether the tools read it as a number (and
    reject anything else in a rows file), ``optional`` whether only some launchers or set-ups write it
    (the report shows it only when some row has a value), ``call`` whether the op states it about its
    own call (``OpCall.row_fields``: every launcher copies it as given), ``counts`` whether it holds a
    list of counts (a JSON list in results.jsonl, ``;``-joined in results.csv), ``fullest`` whether it is
    memory one GPU holds, which the merged row of several ranks takes from the fullest rank
    (:func:`merge_ranks`)."""
    meta = {
        "doc": doc,
        "unit": unit,
        "label": label,
        "number": number,
        "optional": optional,
        "call": call,
        "counts": counts,
        "fullest": fullest,
    }
    return field(default=None, metadata=meta)


def _number(
    doc: str, unit: str | None = None, label: str | None = None, optional: bool = False, **flags: bool
) -> Any:
    return _column(doc, unit, label, number=True, optional=optional, **flags)


@dataclass(frozen=True)
class Row:
    """One result row. The field order is the column order of both files; each field's metadata says
    what the column means (see :class:`Column`). A new column is a new field here, nowhere else: the
    files, the rows-file checks and the report's tooltips follow; a metric that fills it is one function
    in autotuner.measure.metrics."""

    case: str | None = _column("the model case")
    op: str | None = _column("the canonical op name")
    phase: str | None = _column("``forward`` or ``backward``")
    point: str | None = _column("the shape point, ``s<seq>_b<mbs>``")
    seq_len: int | None = _number("the shape point's sequence length", "tokens")
    micro_batch_size: int | None = _number("the shape point's micro-batch size", "sequences")
    dtype: str | None = _column("compute dtype (fp32/bf16/fp16)")
    device: str | None = _column("device type (cpu/cuda)")
    launcher: str | None = _column("get_data, nsys or torch_profiler: who measured the times")
    measured_by: str | None = _column(
        "in a run resumed by another autotuner version or environment (resume_across_versions=true): the "
        "environment that measured the row, its key in environment.json's ``environments``; empty: the "
        "run's own ``environment``",
        label="measured by",
        optional=True,
    )
    rank: int | str | None = _column(
        "the process's rank; with several ranks, ``max`` on the merged row that carries the cross-rank "
        "figure (the slowest rank's statistics)"
    )
    tensor_parallel: int | None = _number("the tensor-parallel size")
    emulated_layout: str | None = _column(
        "without torchrun, the layout the row's rank (``rank``) was emulated in, one process standing for "
        "it: ``tp= ep= etp= sp= world=`` (docs/parallel_emulation.md); empty: a real process",
        label="emulated layout",
        optional=True,
    )
    status: str | None = _column(
        "``ok``; ``failed`` (see error); ``skipped`` (error: the reason); ``refused``: not run, its "
        "estimated peak memory is over what the process can hold (error: both; estimated_peak_bytes, "
        "memory_limit_bytes; ``run_unfit=true`` runs it)"
    )
    error: str | None = _column("a failed row's one-line error, a skipped row's reason")
    samples: int | None = _number("number of timed samples behind the statistics", label="n")
    median_us: float | None = _number(
        "median of the per-sample times: the op's time as its launcher measures it (on a GPU the device's "
        "time; nsys on a GPU: each iteration's summed durations of the kernels, memsets and copies "
        "launched in the op's range; torch_profiler on a GPU: the same, inside the op's GPU-side span)",
        "us",
        "median",
    )
    iqr_us: float | None = _number("interquartile range of the per-sample times", "us", "IQR")
    min_us: float | None = _number("fastest sample", "us", "min")
    mean_us: float | None = _number("mean of the per-sample times", "us", "mean")
    fenced_mean_us: float | None = _number(
        "mean of the per-sample times inside Tukey's outer fences (Q1 - 3 IQR, Q3 + 3 IQR): what one call "
        "adds to a sum of many, as a training step adds up its ops, without the rare far-out stalls; the "
        "time autotuner.predict reads (autotuner.measure.stats.fenced_mean)",
        "us",
        "fenced mean",
    )
    host_median_us: float | None = _number(
        "nsys: median duration of the op's NVTX ranges, the host's time to issue the op (its launches, "
        "plus any synchronisation inside it); on a CPU the same as median_us. get_data on a GPU: the "
        "host's time to issue one call (from its start event to its end event queued); over median_us "
        "the row warns launch_bound",
        "us",
        "host median",
        optional=True,
    )
    stop_reason: str | None = _column(
        "why sampling stopped: precision (the precision rule's target was reached), budget, max_samples; "
        "the launcher's name for profiler launchers",
        label="stop",
    )
    precision_rule: str | None = _column(
        "get_data's stopping rule: ci (the median's 95% CI under timing.target_rel_ci of it) or iqr (IQR "
        "under timing.target_rel_iqr of the median); empty for profiler launchers"
    )
    rel_ci: float | None = _number(
        "width of the median's 95% confidence interval over the median", "fraction", "95% CI width", True
    )
    sampled_s: float | None = _number(
        "get_data: the seconds its samples spanned, the untimed steps between them included; the span it "
        "drew the machine's speed from, which timing.min_time_s sets a floor to (autotuner.measure.timer, "
        '"A second is one draw of the machine")',
        "s",
        "sampled",
        True,
    )
    warnings: str | None = _column(
        "``;``-separated reasons to distrust the row, each with what to do in the run's summary: "
        "few_samples(n), imprecise(ci=..%), drift(+..%), launch_bound(host=..x), cuda_graph_failed(..), "
        "cuda_graph_off(..), no_kernels (nsys "
        "on a GPU: no kernel launched inside the ranges), ranges_lost(found/run) (nsys: the report holds "
        "fewer of the op's ranges than the worker ran, as when a stop signal ends the collection)"
    )
    calls_per_sample: int | None = _number(
        "back-to-back calls per timed sample (forward of short ops; 1 otherwise)"
    )
    input_sets: int | None = _number(
        "copies of the inputs the samples cycled through (cache-resident inputs)"
    )
    cache_flush: bool | None = _column("whether the last-level cache was flushed before every sample")
    idle_before_ms: float | None = _number(
        "get_data: the pause (device idle, process asleep) before every sample; 0: none "
        "(timing.idle_before_ms)",
        "ms",
    )
    forward_after_backward: bool | None = _column(
        "get_data, a forward: every sample followed the op's own backward of the previous sample, "
        "untimed, as in training (timing.forward_after_backward; autotuner.measure.timer)"
    )
    held_activation_bytes: int | None = _number(
        "get_data: the activations earlier calls saved, held while each sample ran, as a step holds its "
        "micro-batches' until their backward; empty: none (timing.held_activations_mib; "
        "autotuner.measure.timer)",
        "bytes",
        optional=True,
    )
    launch_hidden: bool | None = _column(
        "get_data on CUDA: a spin kernel was queued before every sample, so the host's delay before the "
        "first kernel is not in the sample (timing.hide_launch; autotuner.measure.timer)"
    )
    cuda_graph: bool | None = _column(
        "get_data on CUDA: the samples replayed a CUDA graph of the phase (timing.cuda_graph; "
        "autotuner.measure.graphs)"
    )
    weight_bytes: int | None = _number(
        "the op's parameters (each storage once)", "B", "weights", fullest=True
    )
    activation_bytes: int | None = _number(
        "forward rows: bytes autograd saved for backward, excluding parameters",
        "B",
        "activations",
        fullest=True,
    )
    peak_bytes: int | None = _number(
        "peak bytes in use during the phase above those in use when it began", "B", "peak", fullest=True
    )
    estimated_peak_bytes: int | None = _number(
        "the process's peak memory while it measures this row, as the fit check estimated it before the "
        "run (the resident set on a CPU, max_memory_allocated on a GPU; autotuner.runner.memory_estimate)",
        "B",
        "estimated peak",
        optional=True,
    )
    memory_limit_bytes: int | None = _number(
        "the most memory the process could hold when the fit check ran (autotuner.measure.limits)",
        "B",
        "memory limit",
        optional=True,
    )
    flops: int | None = _number(
        "floating-point operations of the phase (torch.utils.flop_counter)", "FLOP", "FLOPs"
    )
    tflops: float | None = _number("flops / median time", "TFLOP/s", "TFLOP/s")
    bytes_moved: int | None = _number(
        "counted minimum of bytes read and written (runner.Phase.bytes_moved)", "B", "bytes moved", True
    )
    gbps: float | None = _number(
        "bytes_moved / median time (a lower bound of the traffic)", "GB/s", "GB/s", optional=True
    )
    arithmetic_intensity: float | None = _number(
        "flops / bytes_moved: the op's place on a roofline (above the device's ridge point: compute-bound)",
        "FLOP/B",
        "FLOP/B",
        optional=True,
    )
    bound: str | None = _column(
        "with a calibration: compute or memory (which side of the ridge point the op's FLOPs per byte lie), "
        "or the calibration key of the ceiling an op names (a host transfer's h2d_pinned)",
        optional=True,
    )
    ceiling_fraction: float | None = _number(
        "with a calibration: the achieved fraction of the bound's calibrated ceiling",
        "fraction",
        "of ceiling",
        optional=True,
    )
    num_threads: int | None = _number("torch intra-op threads the phase ran with")
    kernel_time_us: float | None = _number(
        "nsys on a GPU: per iteration (median), the summed durations of the CUDA kernels launched inside "
        "the op's range (nested ranges included; kernels overlapping on several streams each count in "
        "full); median_us minus this is the memsets and memory copies (autotuner.launchers.nsys_rows)",
        "us",
        "kernel time",
        optional=True,
    )
    kernel_count: float | None = _number(
        "nsys on a GPU: the number of those kernels per iteration (median)", label="kernels", optional=True
    )
    top_kernels: str | None = _column(
        "nsys on a GPU: the five kernels with the most time, ``name <us>us x<count>`` joined by ``;``",
        label="top kernels",
        optional=True,
    )
    call_count: int | None = _number(
        "with ``capture=``: how often the op ran at this point in the captured training steps "
        "(autotuner.capture.replay); median x call_count ranks what matters there",
        label="calls per step",
        optional=True,
    )
    attention_backend: str | None = _column(
        "core_attention and the ops holding it (self_attention, transformer_layer, transformer_block): what "
        "computed the attention: local (Megatron-Core's DotProductAttention: the s x s scores "
        "materialised, mask and softmax apart), te (Transformer-Engine's DotProductAttention, whose own "
        "choice is not recorded), or with attention=sdpa the backend of torch's "
        "scaled_dot_product_attention that ran, read from the aten operator it called: flash (on a CPU "
        "torch's CPU flash kernel), efficient, cudnn, overrideable, or math where it called none of them "
        "(autotuner.model.sdpa_attention)",
        label="attention backend",
        optional=True,
        call=True,
    )
    # The MoE ops' columns: what the op states about its call (OpCall.row_fields; autotuner.model.routing).
    routing: str | None = _column(
        "MoE ops: where the router output came from (moe.routing): learned (the model's seeded router), "
        "uniform, balanced or zipf (forced)",
        optional=True,
        call=True,
    )
    tokens_per_expert: list[int] | None = _column(
        "MoE ops: token assignments per local expert, in expert order (results.jsonl: a list; results.csv: "
        "joined by ``;``)",
        "tokens",
        label="tokens per expert",
        optional=True,
        call=True,
        counts=True,
    )
    tokens_per_expert_min: int | None = _number(
        "MoE ops: the fewest tokens any local expert got",
        "tokens",
        "min tokens/expert",
        optional=True,
        call=True,
    )
    tokens_per_expert_max: int | None = _number(
        "MoE ops: the most tokens any local expert got (the straggler that paces a grouped GEMM)",
        "tokens",
        "max tokens/expert",
        optional=True,
        call=True,
    )
    expert_imbalance: float | None = _number(
        "MoE ops: max / mean tokens per local expert (1.0: perfectly balanced)",
        "ratio",
        "expert imbalance",
        optional=True,
        call=True,
    )
    experts_impl: str | None = _column(
        "MoE ops: the experts' implementation (SequentialMLP, GroupedMLP, TEGroupedMLP)",
        label="experts impl",
        optional=True,
        call=True,
    )
    token_dispatcher: str | None = _column(
        "MoE ops: the token dispatcher (allgather, alltoall)", optional=True, call=True
    )
    expert_parallel: int | None = _number(
        "MoE ops: the expert-parallel size", label="EP", optional=True, call=True
    )
    collectives: list[dict[str, Any]] | None = _column(
        "an emulated rank's rows: the collectives the phase issued and did not run, in order, each "
        "``{kind, bytes, group}`` (all_reduce, all_gather, reduce_scatter, all_to_all; the full buffer in "
        "bytes; Megatron's group: tp, ep, ...), recorded from the process group; modelled, priced by "
        "autotuner.predict from the cluster model (results.jsonl: a list; results.csv: its JSON)",
        optional=True,
    )


@dataclass(frozen=True)
class Column:
    """What :class:`Row` says about one column."""

    name: str
    doc: str
    unit: str | None
    label: str
    number: bool
    optional: bool
    call: bool = False
    counts: bool = False
    fullest: bool = False

    def describe(self) -> str:
        """The meaning with the unit, as a tooltip shows it."""
        return f"{self.doc} [{self.unit}]" if self.unit else self.doc


SCHEMA: dict[str, Column] = {
    f.name: Column(f.name, **{**f.metadata, "label": f.metadata["label"] or f.name.replace("_", " ")})
    for f in fields(Row)
}
COLUMNS = list(SCHEMA)
# The columns an op may state about its own call (OpCall.row_fields), copied as given into its rows.
CALL_COLUMNS = tuple(c.name for c in SCHEMA.values() if c.call)
# The columns holding a list of counts: a JSON list in results.jsonl, joined by ";" in results.csv.
COUNTS = frozenset(c.name for c in SCHEMA.values() if c.counts)
# Memory one GPU holds: the merged row of several ranks takes the fullest rank's (merge_ranks).
FULLEST = tuple(c.name for c in SCHEMA.values() if c.fullest)


def column(name: str) -> Column:
    """The :class:`Column` of ``name``; KeyError names a column that :class:`Row` does not define."""
    try:
        return SCHEMA[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a column of autotuner.results.Row") from None


def label(name: str) -> str:
    """The column's header in the tables (KeyError for a name that is not a column)."""
    return column(name).label


def describe_columns() -> str:
    """The columns as the Markdown table docs/columns.md holds: name, unit, meaning (empty cells of a row
    are values that do not apply or were not measured)."""
    lines = ["| column | unit | meaning |", "|---|---|---|"]
    lines += [f"| `{c.name}` | {c.unit or ''} | {c.doc.replace('|', '/')} |" for c in SCHEMA.values()]
    return "\n".join(lines)


class UnknownColumnError(ValueError):
    """A row handed to the writer with a key that :class:`Row` does not define: a bug in the code that made
    the row (add the column to Row, or fix the name)."""


def as_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` with every column of :class:`Row`, in order (None where it has no value);
    :class:`UnknownColumnError` for a key that is not a column."""
    unknown = [key for key in row if key not in SCHEMA]
    if unknown:
        raise UnknownColumnError(
            f"row {row.get('op')}.{row.get('phase')} has keys that are not columns of autotuner.results.Row: "
            f"{', '.join(map(str, unknown))}: add them to Row or fix their names"
        )
    return {c: row.get(c) for c in COLUMNS}


class RowKey(NamedTuple):
    """What names one measurement's row in a run: a resume finds a row by it, a file holds one row per key,
    and the ranks' rows of one :attr:`measurement` merge into one (rank ``max``)."""

    case: str
    op: str
    phase: str
    point: str
    rank: int | str

    @classmethod
    def of(cls, row: dict[str, Any]) -> RowKey:
        return cls(row.get("case"), row.get("op"), row.get("phase"), row.get("point"), row.get("rank"))

    @property
    def measurement(self) -> tuple[str, str, str, str]:
        """(case, op, phase, point): the same on every rank."""
        return (self.case, self.op, self.phase, self.point)


class ResultsWriter:
    """Holds the run's rows and rewrites ``results.jsonl`` and ``results.csv`` atomically after each one.

    With ``resume=True`` the rows already in ``results.jsonl`` are loaded (a row found twice, kept once:
    :func:`unique_rows`), and :meth:`done` tells the runner which measurements to skip: rows with status
    ``ok`` and their ``median_us``. Failed ones are measured again, and so are :func:`incomplete` ones.
    """

    def __init__(self, run_dir: Path, resume: bool = False, stem: str = "results") -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.run_dir / f"{stem}.jsonl"
        self.csv = self.run_dir / f"{stem}.csv"
        self.rows: list[dict[str, Any]] = []
        # The start of a last line that a kill cut short, dropped on resume (the caller says so).
        self.dropped_tail: str | None = None
        # The environment that measures the rows written from now on, where a resumed run's earlier rows
        # were measured in another one (the ``measured_by`` column); None: the run's own.
        self.measured_by: str | None = None
        # How many rows the file held twice, dropped on resume (the caller says so).
        self.duplicates = 0
        if resume and self.jsonl.exists():
            rows, self.dropped_tail = read_rows(self.jsonl, allow_torn_tail=True)
            self.rows, self.duplicates = unique_rows(rows, self.jsonl)
            if self.dropped_tail is not None or self.duplicates:
                self._flush()  # the files are valid again even if nothing is left to measure

    def done(self, key: RowKey) -> bool:
        """Whether a row with this key was measured successfully: ``ok``, with its median."""
        return any(
            RowKey.of(r) == key and r.get("status") == "ok" and r.get("median_us") is not None
            for r in self.rows
        )

    def write(self, row: dict[str, Any]) -> None:
        """Add (or replace, by key) a row and persist every file before returning."""
        full = as_row({"measured_by": self.measured_by, **row})
        self.rows = [r for r in self.rows if RowKey.of(r) != RowKey.of(full)] + [full]
        self._flush()

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            full = as_row(row)
            self.rows = [r for r in self.rows if RowKey.of(r) != RowKey.of(full)] + [full]
        self._flush()

    def _flush(self) -> None:
        target = self.jsonl
        try:
            atomic_write_text(self.jsonl, "".join(json.dumps(r) + "\n" for r in self.rows))
            target = self.csv
            atomic_write_text(self.csv, _csv_text(self.rows))
        except BaseException as exc:
            # A signal between the two writes (SIGTERM's handler raises, so does SIGINT) would leave
            # results.csv a row behind: each write is atomic, so results.jsonl holds the old rows or the
            # new ones, and results.csv is written again from whichever it holds before the signal goes on.
            # A full disk may refuse that too: results.csv then stays whole, at most a row behind.
            with contextlib.suppress(OSError):
                if self.jsonl.exists():
                    atomic_write_text(self.csv, _csv_text(read_rows(self.jsonl, allow_torn_tail=True)[0]))
            if isinstance(exc, OSError):
                raise self.not_written(exc, target) from exc
            raise

    def not_written(self, exc: OSError, path: Path) -> RunFileNotWritten:
        """``exc``, raised writing ``path`` of this run, as :class:`RunFileNotWritten` counting the rows
        that ``results.jsonl`` keeps."""
        try:
            kept = len(read_rows(self.jsonl, allow_torn_tail=True)[0]) if self.jsonl.exists() else 0
        except UserError:
            kept = 0
        return RunFileNotWritten(exc, Path(path), kept, self.jsonl)


class RunFileNotWritten(OSError):
    """A file of a run that could not be written while it ran (a full disk, a quota, a file size limit):
    what was written before stays whole (every write is atomic), ``kept`` rows in ``results``. The
    command reports it in one line, with how to finish the run (autotuner.main)."""

    def __init__(self, exc: OSError, path: Path, kept: int, results: Path) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc), str(path))
        self.path, self.kept, self.results = path, kept, results

    def __str__(self) -> str:
        return (
            f"cannot write {self.path} ({self.strerror}): {self.kept} row(s) kept in {self.results}, "
            "every file whole"
        )


def incomplete(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that say ``ok`` without the ``median_us`` every reader takes, or say no status at all: what
    an edit or a cut leaves, never what a launcher writes. A resume measures them again, saying so."""
    return [
        r for r in rows if r.get("status") is None or (r["status"] == "ok" and r.get("median_us") is None)
    ]


def unique_rows(rows: list[dict[str, Any]], path: Path) -> tuple[list[dict[str, Any]], int]:
    """``rows`` with each row found more than once kept once (the first), and how many were dropped: a
    file appended to itself, or two copies of a run concatenated, hold the same row twice. Two different
    rows of one key (:class:`RowKey`) are :class:`RowsFileError`: which one the run measured cannot be
    told, and keeping either would lose the other."""
    kept: dict[RowKey, dict[str, Any]] = {}
    for row in rows:
        first = kept.setdefault(key := RowKey.of(row), row)
        if first != row:
            raise RowsFileError(
                f"{path} holds two different rows of {key.op}.{key.phase} {key.point} (case {key.case}, "
                f"rank {key.rank}): "
                "delete the one this run did not measure"
            )
    return list(kept.values()), len(rows) - len(kept)


def _csv_text(rows: Iterable[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    # extrasaction: a resumed row may carry a key this version does not know (results.jsonl keeps it)
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_value(v) for k, v in row.items()})
    return buffer.getvalue()


def _csv_value(value: Any) -> Any:
    """A value as results.csv holds it: empty for None, a list of counts joined by ``;``."""
    if value is None:
        return ""
    if isinstance(value, list):
        if any(isinstance(v, dict) for v in value):  # the collectives: a list of objects, as JSON
            return json.dumps(value)
        return ";".join(str(v) for v in value)
    return value


class RowsFileError(UserError, ValueError):
    """A ``results.jsonl`` that cannot be read as rows; the one-line message names the file, the line and
    the column, and the fix."""


# The columns every view groups rows by: a missing or non-string value cannot be a table's row or column.
KEY_TEXT = ("op", "phase", "point")
# Columns the tools do arithmetic on or compare in size (Row's numbers); in a rows file, names ending in
# NUMERIC_SUFFIXES are numeric too, so a time or size column of another version is checked as well.
NUMERIC = frozenset(c.name for c in SCHEMA.values() if c.number)
NUMERIC_SUFFIXES = ("_us", "_bytes", "_count", "_moved")
POINT_SIZES = frozenset({"seq_len", "micro_batch_size", "tensor_parallel"})  # null in a captured call's row
# What an op holds, in bytes: never negative, and no GPU or host holds an exbibyte (an edited 1e30 was
# predicted as PiB of memory and an MFU of 0%).
MEMORY_SIZES = frozenset(
    {
        "weight_bytes",
        "activation_bytes",
        "peak_bytes",
        "held_activation_bytes",
        "estimated_peak_bytes",
        "memory_limit_bytes",
    }
)
MAX_MEMORY_BYTES = 2**60
_FIX = "fix or delete that line, or measure the run again"


def _kind(value: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number"}
    return kinds.get(type(value), "a number" if isinstance(value, float) else "a value")


def check_row(row: Any, where: str) -> dict[str, Any]:
    """``row`` checked for what the tools rely on (a JSON object; ``op``, ``phase``, ``point`` strings;
    the numeric columns numbers or empty), with empty strings in numeric columns read as None (as a
    spreadsheet writes them). ``where`` names it in errors (``FILE line N``)."""
    if not isinstance(row, dict):
        raise RowsFileError(f"{where} is {_kind(row)}, not a row (a JSON object): {_FIX}")
    for column in KEY_TEXT:
        value = row.get(column)
        if not isinstance(value, str):
            found = "missing" if value is None else f"{_kind(value)}, {json.dumps(value)[:40]}"
            raise RowsFileError(f"{where}: column {column!r} is {found}; expected a string: {_FIX}")
    checked = dict(row)
    for column, value in row.items():
        if column in COUNTS and value is not None:
            checked[column] = _counts(value, column, where)
            continue
        if column == "collectives" and value is not None:
            checked[column] = _collectives(value, where)
            continue
        if not (column in NUMERIC or column.endswith(NUMERIC_SUFFIXES)) or value is None:
            continue
        if value == "":
            checked[column] = None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RowsFileError(
                f"{where}: column {column!r} is {_kind(value)}, {json.dumps(value)[:40]}; expected a number "
                f"or null: {_FIX}"
            )
        elif column.endswith("_us") and not (math.isfinite(value) and value >= 0):
            # a time is never negative, and NaN passes every comparison: a step of "nan us" ranked first
            raise RowsFileError(
                f"{where}: column {column!r} is {value}; expected a time >= 0 or null: {_FIX}"
            )
        elif column in MEMORY_SIZES and not (math.isfinite(value) and 0 <= value <= MAX_MEMORY_BYTES):
            raise RowsFileError(
                f"{where}: column {column!r} is {value}; expected a size from 0 to 2^60 bytes or null: {_FIX}"
            )
        elif column in POINT_SIZES and not (isinstance(value, int) and value > 0):
            raise RowsFileError(
                f"{where}: column {column!r} is {value}; expected a whole number above 0 or null: {_FIX}"
            )
        elif not math.isfinite(value):
            checked[column] = None  # a statistic that had no value (what json.dumps writes for NaN)
    return checked


def _counts(value: Any, column: str, where: str) -> list[int] | None:
    """A counts column as a list of ints: a JSON list as written, or the ``;``-joined text results.csv
    holds (pasted back, or written by another tool); empty text is None."""
    items: Any = value
    if isinstance(value, str):
        items = [part.strip() for part in value.split(";")] if value.strip() else []
        if not items:
            return None
        try:
            items = [int(part) for part in items]
        except ValueError:
            items = None
    if isinstance(items, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        return list(items)
    raise RowsFileError(
        f"{where}: column {column!r} is {_kind(value)}, {json.dumps(value)[:40]}; expected a list of whole "
        f"numbers (or them joined by ';'): {_FIX}"
    )


def _collectives(value: Any, where: str) -> list[dict[str, Any]] | None:
    """The ``collectives`` column as a list of ``{kind, bytes, group}`` objects: a JSON list as written,
    or its JSON text (results.csv's); empty text is None."""
    items: Any = value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            items = json.loads(value)
        except ValueError:
            items = None
    if isinstance(items, list) and all(
        isinstance(v, dict)
        and isinstance(v.get("kind"), str)
        and isinstance(v.get("group"), str)
        and isinstance(v.get("bytes"), int)
        and not isinstance(v.get("bytes"), bool)
        and v["bytes"] >= 0
        for v in items
    ):
        return [dict(v) for v in items]
    raise RowsFileError(
        f"{where}: column 'collectives' is {_kind(value)}, {json.dumps(value)[:40]}; expected a list of "
        f'{{"kind": str, "bytes": whole number >= 0, "group": str}} objects: {_FIX}'
    )


def read_rows(path: Path, allow_torn_tail: bool = False) -> tuple[list[dict[str, Any]], str | None]:
    """Rows of a ``results.jsonl`` file, each checked (:func:`check_row`), and the text of a torn last
    line that was dropped (else None). Blank lines are skipped; the file is never changed.

    A results file is input like any other (copied, edited by hand, cut short, written by another tool),
    so every problem is found here and raised as one :class:`RowsFileError`, before a tool renders or
    writes anything. A torn last line, one without its newline that does not parse, is what a writer
    killed half-way through an append leaves (ours rewrite whole files, but a copy or another tool may
    not); with ``allow_torn_tail`` it is dropped and returned. Any other bad line raises: a row cannot be
    guessed, and rewriting the file would lose it.
    """
    path = Path(path)
    try:
        text = read_run_text(path, fix=_FIX)
    except UnreadableRunFile as exc:  # a FIFO, a device, a folder, a file too large: never opened
        raise RowsFileError(str(exc)) from None
    lines = text.split("\n")
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            if allow_torn_tail and number == len(lines):  # the last line, without its newline
                return rows, line
            if isinstance(exc, json.JSONDecodeError):
                where = f"{where} column {exc.colno}"
            raise RowsFileError(f"{where} is not valid JSON ({getattr(exc, 'msg', exc)}): {_FIX}") from None
        rows.append(check_row(row, where))
    return rows, None


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``results.jsonl`` file, checked; :class:`RowsFileError` (a UserError: one line, exit 2)
    names the first line or value that is not a usable row."""
    return read_rows(path)[0]


def load_run_rows(run_dir: str | Path, fix: str) -> list[dict[str, Any]]:
    """The rows of a run directory, for the tools that read runs (compare, report, predict): its
    ``results.jsonl``; else, from a torchrun job stopped before rank 0 merged its ranks' files, every
    rank's ``results.rank<N>.jsonl`` merged as the job would have (:func:`merge_ranks`), over the
    measurements every rank has (a rank stopped a row earlier has not measured the rest: a TP op's time
    is its slowest rank's). Without either, a UserError (one line) ending with ``fix``."""
    run_dir = Path(run_dir)
    if os.path.lexists(run_dir / "results.jsonl"):  # whatever it is: a FIFO is refused, not passed over
        return load_rows(run_dir / "results.jsonl")
    found = ((_RANK_FILE.fullmatch(p.name), p) for p in run_dir.glob("results.rank*.jsonl"))
    ranked = {int(match.group(1)): p for match, p in found if match}
    if not ranked:
        raise UserError(f"{run_dir} has no results.jsonl: {fix}")
    per_rank = [load_rows(ranked[rank]) for rank in sorted(ranked)]
    everyone = set.intersection(*({RowKey.of(row).measurement for row in rows} for rows in per_rank))
    return merge_ranks([[row for row in rows if RowKey.of(row).measurement in everyone] for rows in per_rank])


_RANK_FILE = re.compile(r"results\.rank(\d+)\.jsonl")


def merge_ranks(rank_rows: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every rank's rows, then per (case, op, phase, point) one row with ``rank="max"``: the statistics
    of the rank whose median is the slowest (a TP op is as slow as its slowest rank, as Megatron's timers
    report the max over ranks), its memory columns (:data:`FULLEST`) the largest over the ranks (what fits
    is the fullest GPU's: under expert parallelism each rank's experts save what their share of the
    tokens makes, and the slowest rank need not be the fullest), status ``failed`` if any rank failed."""
    # Rows read back from files may hold a column of another version: the merged file has this one's.
    merged = [{c: row.get(c) for c in COLUMNS} for rows in rank_rows for row in rows]
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in merged:
        groups.setdefault(RowKey.of(row).measurement, []).append(row)
    for rows in groups.values():
        ok = [r for r in rows if r.get("status") == "ok" and r.get("median_us") is not None]
        failed = [r for r in rows if r.get("status") == "failed"]
        if failed or not ok:  # the op's row as one rank left it: the failure, or no timing at all
            merged.append({**(failed or rows)[0], "rank": "max"})
            continue
        slowest = max(ok, key=lambda r: r["median_us"])
        fullest = {c: max(v) for c in FULLEST if (v := [r[c] for r in ok if r.get(c) is not None])}
        merged.append({**slowest, **fullest, "rank": "max"})
    return merged
