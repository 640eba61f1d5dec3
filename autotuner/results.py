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
median_us, iqr_us,     statistics of the per-sample times, microseconds
min_us, mean_us
stop_reason            why sampling stopped: precision (the precision rule's target was reached), budget,
                       max_samples; the launcher's name for profiler launchers
precision_rule         get_data's stopping rule: ci (the median's 95% CI under timing.target_rel_ci of it)
                       or iqr (IQR under timing.target_rel_iqr of the median); empty for profiler launchers
rel_ci                 width of the median's 95% confidence interval over the median
warnings               ``;``-separated reasons to distrust the row: few_samples(n), noisy(iqr=..),
                       drift(+..%), ci_target_missed / iqr_target_missed, cuda_graph_failed(..),
                       cuda_graph_off(..)
calls_per_sample       back-to-back calls per timed sample (forward of short ops; 1 otherwise)
input_sets             copies of the inputs the samples cycled through (cache-resident inputs)
cache_flush            whether the last-level cache was flushed before every sample
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
kernel_count,          launched inside the op's range and their number; the five kernels with the most
top_kernels            time, ``name <us>us x<count>`` joined by ``;`` (autotuner.launchers.nsys)
call_count             with ``capture=``: how often the op ran at this point in the captured training
                       steps (autotuner.capture.replay); median x call_count ranks what matters there
=====================  ===============================================================================
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
    "stop_reason",
    "precision_rule",
    "rel_ci",
    "warnings",
    "calls_per_sample",
    "input_sets",
    "cache_flush",
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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


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
        if resume and self.jsonl.exists():
            self.rows = load_rows(self.jsonl)

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
        _atomic_write(self.jsonl, "".join(json.dumps(r) + "\n" for r in self.rows))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        _atomic_write(self.csv, buffer.getvalue())


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``results.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


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
