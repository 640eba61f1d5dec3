"""Result rows: one per (case, op, phase, shape point), written as they are measured.

Files in the run directory, rewritten whole after every row through a temporary file and an atomic
rename, so each finished row is on disk before the next op starts and an interrupted run always leaves
complete, valid files (never a half-written line):

* ``results.jsonl``: one JSON object per row (the source of truth; numbers are numbers).
* ``results.csv``: the same rows and columns, for spreadsheets and pandas.

Columns (units in the name; empty where a value does not apply or was not measured):

=====================  ===============================================================================
case, op, phase        the model case, the canonical op name, ``forward`` or ``backward``
point, seq_len,        the shape point (label ``s<seq>_b<mbs>``) and its dimensions
micro_batch_size
dtype, device          compute dtype (fp32/bf16/fp16) and device type (cpu/cuda)
launcher               get_data, nsys or torch_profiler: who measured the times
rank, tensor_parallel  the process's rank and the TP size; with several ranks, ``rank`` is ``max`` on the
                       merged row that carries the cross-rank figure (the slowest rank's statistics)
status, error          ``ok``; ``failed`` with the error's one-line text; ``skipped`` with the reason
samples                number of timed samples behind the statistics
median_us, iqr_us,     statistics of the per-sample times, microseconds: the op's time as its launcher
min_us, mean_us        measures it (on a GPU the device's time; nsys on a GPU: each iteration's summed
                       kernel durations, as kernel_time_us)
host_median_us         nsys: median duration of the op's NVTX ranges, the host's time to issue the op (its
                       launches, plus any synchronisation inside it); on a CPU the same as median_us
stop_reason            why sampling stopped: precision (the precision rule's target was reached), budget,
                       max_samples; the launcher's name for profiler launchers
precision_rule         get_data's stopping rule: ci (the median's 95% CI under timing.target_rel_ci of it)
                       or iqr (IQR under timing.target_rel_iqr of the median); empty for profiler launchers
rel_ci                 width of the median's 95% confidence interval over the median
warnings               ``;``-separated reasons to distrust the row: few_samples(n), noisy(iqr=..),
                       drift(+..%), ci_target_missed / iqr_target_missed, cuda_graph_failed(..),
                       cuda_graph_off(..), no_kernels (nsys on a GPU: no kernel launched inside the ranges)
calls_per_sample       back-to-back calls per timed sample (forward of short ops; 1 otherwise)
input_sets             copies of the inputs the samples cycled through (cache-resident inputs)
cache_flush            whether the last-level cache was flushed before every sample
launch_hidden          get_data on CUDA: a spin kernel was queued before every sample, so the host's delay
                       before the first kernel is not in the sample (timing.hide_launch; measure.timer)
weight_bytes           the op's parameters (each storage once)
activation_bytes       forward rows: bytes autograd saved for backward, excluding parameters
peak_bytes             peak bytes in use during the phase above those in use when it began
flops                  floating-point operations of the phase (torch.utils.flop_counter)
tflops                 flops / median time, in 10^12 per second
bytes_moved            counted minimum of bytes read and written (runner.Phase.bytes_moved)
gbps                   bytes_moved / median time, in 10^9 per second (a lower bound of the traffic)
bound, ceiling_fraction  with a calibration: compute or memory (which side of the ridge point the op's
                       FLOPs per byte lie) and the achieved fraction of that calibrated ceiling
num_threads            torch intra-op threads the phase ran with
kernel_time_us,        nsys on a GPU: per iteration (median), the summed durations of the CUDA kernels
kernel_count,          launched inside the op's range (nested ranges included; kernels overlapping on
top_kernels            several streams each count in full; equal to median_us) and their number; the five
                       kernels with the most time, ``name <us>us x<count>`` joined by ``;``
                       (autotuner.launchers.nsys_rows)
call_count             with ``capture=``: how often the op ran at this point in the captured training
                       steps (autotuner.capture.replay); median x call_count ranks what matters there
=====================  ===============================================================================
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from autotuner.errors import UserError
from autotuner.results.atomic import atomic_write_text

COLUMNS = [
    "case",
    "op",
    "phase",
    "point",
    "seq_len",
    "micro_batch_size",
    "dtype",
    "device",
    "launcher",
    "rank",
    "tensor_parallel",
    "status",
    "error",
    "samples",
    "median_us",
    "iqr_us",
    "min_us",
    "mean_us",
    "host_median_us",
    "stop_reason",
    "precision_rule",
    "rel_ci",
    "warnings",
    "calls_per_sample",
    "input_sets",
    "cache_flush",
    "launch_hidden",
    "cuda_graph",
    "weight_bytes",
    "activation_bytes",
    "peak_bytes",
    "flops",
    "tflops",
    "bytes_moved",
    "gbps",
    "bound",
    "ceiling_fraction",
    "num_threads",
    "kernel_time_us",
    "kernel_count",
    "top_kernels",
    "call_count",
]

KEY = ("case", "op", "phase", "point", "rank")


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(k) for k in KEY)


class ResultsWriter:
    """Holds the run's rows and rewrites ``results.jsonl`` and ``results.csv`` atomically after each one.

    With ``resume=True`` the rows already in ``results.jsonl`` are loaded, and :meth:`done` tells the
    runner which measurements to skip (rows with status ``ok``; failed ones are measured again).
    """

    def __init__(self, run_dir: Path, resume: bool = False, stem: str = "results") -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.run_dir / f"{stem}.jsonl"
        self.csv = self.run_dir / f"{stem}.csv"
        self.rows: list[dict[str, Any]] = []
        # The start of a last line that a kill cut short, dropped on resume (the caller says so).
        self.dropped_tail: str | None = None
        if resume and self.jsonl.exists():
            self.rows, self.dropped_tail = read_rows(self.jsonl, allow_torn_tail=True)
            if self.dropped_tail is not None:
                self._flush()  # the files are valid again even if nothing is left to measure

    def done(self, key: tuple[Any, ...]) -> bool:
        """Whether a row with this key (see KEY) was measured successfully."""
        return any(row_key(r) == key and r.get("status") == "ok" for r in self.rows)

    def write(self, row: dict[str, Any]) -> None:
        """Add (or replace, by key) a row and persist every file before returning."""
        full = {c: row.get(c) for c in COLUMNS}
        self.rows = [r for r in self.rows if row_key(r) != row_key(full)] + [full]
        self._flush()

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            full = {c: row.get(c) for c in COLUMNS}
            self.rows = [r for r in self.rows if row_key(r) != row_key(full)] + [full]
        self._flush()

    def _flush(self) -> None:
        atomic_write_text(self.jsonl, "".join(json.dumps(r) + "\n" for r in self.rows))
        buffer = io.StringIO()
        # extrasaction: a resumed row may carry a key this version does not know (results.jsonl keeps it)
        writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        atomic_write_text(self.csv, buffer.getvalue())


class RowsFileError(UserError, ValueError):
    """A ``results.jsonl`` that cannot be read as rows; the one-line message names the file, the line and
    the column, and the fix."""


# The columns every view groups rows by: a missing or non-string value cannot be a table's row or column.
KEY_TEXT = ("op", "phase", "point")
# Columns the tools do arithmetic on or compare in size; names ending in NUMERIC_SUFFIXES are numeric
# too, so a time or size column added later is checked without editing this list.
NUMERIC = frozenset(
    {
        "seq_len",
        "micro_batch_size",
        "tensor_parallel",
        "samples",
        "rel_ci",
        "calls_per_sample",
        "input_sets",
        "flops",
        "tflops",
        "gbps",
        "ceiling_fraction",
        "num_threads",
    }
)
NUMERIC_SUFFIXES = ("_us", "_bytes", "_count", "_moved")
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
        if not (column in NUMERIC or column.endswith(NUMERIC_SUFFIXES)) or value is None:
            continue
        if value == "":
            checked[column] = None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RowsFileError(
                f"{where}: column {column!r} is {_kind(value)}, {json.dumps(value)[:40]}; expected a number "
                f"or null: {_FIX}"
            )
    return checked


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
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RowsFileError(f"{path} is not UTF-8 text (byte {exc.start}): {_FIX}") from None
    except OSError as exc:
        raise RowsFileError(
            f"cannot read {path}: {exc.strerror or exc}: check the path and its permissions"
        ) from None
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


def merge_ranks(rank_rows: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every rank's rows, then per (case, op, phase, point) one row with ``rank="max"``: the statistics
    of the rank whose median is the slowest (a TP op is as slow as its slowest rank, as Megatron's timers
    report the max over ranks), status ``failed`` if any rank failed."""
    merged = [row for rows in rank_rows for row in rows]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in merged:
        groups.setdefault(row_key(row)[:-1], []).append(row)
    for rows in groups.values():
        ok = [r for r in rows if r.get("status") == "ok" and r.get("median_us") is not None]
        failed = [r for r in rows if r.get("status") == "failed"]
        slowest = max(ok, key=lambda r: r["median_us"]) if ok and not failed else (failed or rows)[0]
        merged.append({**slowest, "rank": "max"})
    return merged
