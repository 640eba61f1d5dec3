"""What the torch_profiler launcher leaves on disk for one (op, shape point), each file written whole or
not at all.

Every file is first written under a unique hidden temporary name in its final folder
(``.<name>.<random>.tmp``, :func:`autotuner.results.atomic.atomic_path`) and then renamed over the final name,
which is atomic within one file system: a reader, or a run killed half-way through a 200 MB export, sees
the previous file or the new one, never a truncated trace that a viewer rejects. Temporary names end in
``.tmp`` so that Holistic Trace Analysis, which loads every ``*.json``/``*.gz`` of a folder as one rank's
trace, never picks one up.

Files per folder ``<output_dir>/<point>/<op>/``, all named ``<op>.<point>.*`` so that a file copied out
of the folder still says what it holds:

* ``.pt.trace.json`` or, over ``compress_over_bytes``, ``.pt.trace.json.gz``: the Chrome/Perfetto trace.
  The ``.pt.trace.json`` suffix is the one TensorBoard's profiler plugin looks for.
* ``.stacks.cpu.txt`` (and ``.stacks.cuda.txt`` on a GPU): folded stacks weighted by self CPU (CUDA)
  time in microseconds, one ``frame;frame;...;frame value`` line each, the input of flamegraph.pl,
  speedscope and inferno.
* ``.ops.csv`` and ``.ops.txt``: ``key_averages(group_by_input_shape=True)``, totals over the active steps.
* ``.memory.pickle`` (GPU, ``memory_snapshot=true``): a CUDA memory snapshot for pytorch.org/memory_viz.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from autotuner.results.atomic import atomic_path

TRACE_SUFFIX = ".pt.trace.json"


@contextmanager
def _scratch(folder: Path, stem: str, kind: str) -> Iterator[Path]:
    """A uniquely named hidden file in ``folder`` for an intermediate step, removed afterwards."""
    fd, name = tempfile.mkstemp(prefix=f".{stem}.{kind}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def _write_with(final: Path, write: Callable[[str], Any]) -> Path:
    with atomic_path(final) as tmp:
        write(str(tmp))
    return final


def _with_rank(src: Path, dst: Path, rank: int) -> None:
    """Copy a trace, adding ``"distributedInfo": {"rank": rank}`` when it has none.

    torch adds distributedInfo itself when torch.distributed is initialised (our runs always are);
    without it HTA warns and assumes rank 0. Kineto writes the metadata keys before ``traceEvents``, so
    the head of the file tells; the fix is a textual insertion after the opening brace, streamed, so a
    large trace is never loaded into memory.
    """
    with open(src, "rb") as fin:
        head = fin.read(1 << 16)
        if b'"distributedInfo"' in head or not head.lstrip().startswith(b"{"):
            fin.seek(0)
            with open(dst, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            return
        brace = head.index(b"{") + 1
        with open(dst, "wb") as fout:
            fout.write(head[:brace])
            fout.write(f'\n  "distributedInfo": {{"rank": {rank}}},'.encode())
            fout.write(head[brace:])
            shutil.copyfileobj(fin, fout, 1 << 20)


def write_trace(prof: Any, folder: Path, stem: str, rank: int, compress_over_bytes: int) -> Path:
    """Export the Chrome trace as ``<stem>.pt.trace.json``, or ``.json.gz`` when larger than the threshold.

    Returns the path written. The other variant, left by an earlier run of the same folder, is removed
    so that the folder holds exactly one trace (HTA reads every trace of a folder as one rank each).
    """
    plain, packed = folder / f"{stem}{TRACE_SUFFIX}", folder / f"{stem}{TRACE_SUFFIX}.gz"
    with _scratch(folder, stem, "raw") as raw:
        prof.export_chrome_trace(str(raw))
        compress = raw.stat().st_size > compress_over_bytes
        final = packed if compress else plain
        with atomic_path(final) as tmp:
            if compress:
                with _scratch(folder, stem, "ranked") as ranked:
                    _with_rank(raw, ranked, rank)
                    # mtime=0: the same trace gives the same bytes; level 6 is gzip's default trade-off
                    with (
                        open(ranked, "rb") as fin,
                        gzip.GzipFile(tmp, "wb", compresslevel=6, mtime=0) as fout,
                    ):
                        shutil.copyfileobj(fin, fout, 1 << 20)
            else:
                _with_rank(raw, tmp, rank)
    (plain if final == packed else packed).unlink(missing_ok=True)
    return final


def write_stacks(prof: Any, folder: Path, stem: str, cuda: bool) -> list[Path]:
    """Folded stacks by self CPU time, and by self CUDA time on a GPU.

    The profiler fills frames only when it was made with ``with_stack=True`` and
    ``_ExperimentalConfig(verbose=True)``; without the latter the file is silently empty.
    """
    metrics = {"cpu": "self_cpu_time_total"}
    if cuda:
        metrics["cuda"] = "self_cuda_time_total"
    return [
        _write_with(folder / f"{stem}.stacks.{kind}.txt", lambda p, m=metric: prof.export_stacks(p, m))
        for kind, metric in metrics.items()
    ]


_TABLE_COLUMNS = [
    "name",
    "input_shapes",
    "calls",
    "self_cpu_us",
    "cpu_total_us",
    "self_device_us",
    "device_total_us",
    "self_cpu_memory_bytes",
    "cpu_memory_bytes",
    "self_device_memory_bytes",
    "device_memory_bytes",
    "flops",
]


def write_tables(prof: Any, folder: Path, stem: str, cuda: bool) -> list[Path]:
    """``key_averages`` grouped by input shape, as CSV (numbers, for pandas) and as torch's text table.

    The totals span every active step, forward and backward; ``calls`` divides them. Our ranges appear
    as rows too (one per iteration, each a distinct name); their self time is the Python between aten ops.
    """
    averages = prof.key_averages(group_by_input_shape=True)
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(_TABLE_COLUMNS)
    for avg in sorted(
        averages, key=lambda a: a.self_device_time_total if cuda else a.self_cpu_time_total, reverse=True
    ):
        writer.writerow(
            [
                avg.key,
                json.dumps(avg.input_shapes or []),
                avg.count,
                round(avg.self_cpu_time_total, 3),
                round(avg.cpu_time_total, 3),
                round(avg.self_device_time_total, 3),
                round(avg.device_time_total, 3),
                avg.self_cpu_memory_usage,
                avg.cpu_memory_usage,
                avg.self_device_memory_usage,
                avg.device_memory_usage,
                avg.flops,
            ]
        )
    text = averages.table(sort_by=sort_by, row_limit=-1, max_name_column_width=70, max_shapes_column_width=90)
    out = []
    for suffix, body in ((".ops.csv", buffer.getvalue()), (".ops.txt", text + "\n")):
        out.append(_write_with(folder / f"{stem}{suffix}", lambda p, b=body: Path(p).write_text(b)))
    return out


def write_memory_snapshot(folder: Path, stem: str) -> Path:
    """Dump the CUDA allocator history recorded since ``torch.cuda.memory._record_memory_history``."""
    return _write_with(folder / f"{stem}.memory.pickle", torch.cuda.memory._dump_snapshot)
