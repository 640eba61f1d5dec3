"""Read an Nsight Systems report through its SQLite export: NVTX ranges and their kernels.

The report (``.nsys-rep``) is turned into SQLite with ``nsys export`` and read with Python's
``sqlite3``; ``nsys stats`` is not used, since its report scripts need the ``nsysstats`` module on the
path of the python that nsys starts and their names change between versions.

What the SQLite export looks like (checked with nsys 2022.4 on a CPU and 2023.4 on an H200; see
``shared/notes/nsys.md``):

- Tables are created lazily: a table exists only when it has rows. A run that recorded no NVTX range
  has no ``NVTX_EVENTS``; a CPU-only run has no ``CUPTI_ACTIVITY_KIND_*`` tables. Every reader here
  checks for its tables first and returns an empty result when they are absent.
- Timestamps are nanoseconds since the start of the capture, not wall-clock time.
- ``NVTX_EVENTS.eventType`` is 59 for push/pop ranges and 60 for start/end ranges (34 marks, 75/76
  domain create/destroy). A registered string (the ``nvtx`` package registers every name) has
  ``text`` NULL and its name in ``StringIds.value`` via ``textId``.
- nsys closes ranges that were still open when the process ended (a crash, ``os._exit``, a kill):
  their ``end`` is the end of the whole capture (``ANALYSIS_DETAILS.duration``), not NULL. After a
  SIGKILL the innermost open push/pop range can be missing altogether (its event was never flushed).
  :func:`read_open_ranges` reports both kinds of unfinished range; :func:`read_nvtx_ranges` leaves them
  out, so their fake durations never reach a statistic.
- A ``globalTid`` is a serialised id: bits 24-47 hold the process id, bits 0-23 the thread id.
  ``CUPTI_ACTIVITY_KIND_KERNEL.globalPid`` is the same with the thread bits zeroed. Correlation ids
  are unique within a process only, so kernels are joined to runtime calls on both.
"""

from __future__ import annotations

import sqlite3
import subprocess
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from autotuner.ops.naming import RangeName, parse_range

PUSH_POP_RANGE = 59
START_END_RANGE = 60
TOP_KERNELS = 5

_TID_MASK = 0xFFFFFF
_KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
_RUNTIME_TABLE = "CUPTI_ACTIVITY_KIND_RUNTIME"
# The GPU work that is not a kernel: the driver's memsets (a gradient buffer zeroed before its GEMM) and
# memory copies. They occupy the device as kernels do and the other launchers' times hold them.
_MEMORY_OP_TABLES = ("CUPTI_ACTIVITY_KIND_MEMSET", "CUPTI_ACTIVITY_KIND_MEMCPY")


def export_sqlite(nsys_bin: str, report: Path, sqlite_path: Path) -> Path:
    """Export ``report`` (``.nsys-rep``) to ``sqlite_path`` with ``nsys export``; return the path.

    The output name is taken as given (nsys adds no extension to an explicit ``-o``). The long
    flag spellings with separate values (``--type sqlite --force-overwrite true``) work with nsys
    2022.4 and later. Raises RuntimeError, with the end of nsys's output, when the export fails.
    """
    # Written under another name and renamed once checked whole: nsys 2022.4 on a full disk exits 0
    # leaving an empty file, which reads as a report without ranges (every row "no measured range").
    partial = sqlite_path.with_name(f".{sqlite_path.stem}.partial.sqlite")
    cmd = [
        nsys_bin,
        "export",
        "--type",
        "sqlite",
        "--force-overwrite",
        "true",
        "-o",
        str(partial),
        str(report),
    ]
    sqlite_path.unlink(missing_ok=True)
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
        except OSError as exc:
            raise RuntimeError(f"cannot run {nsys_bin!r} to export {report}: {exc}") from exc
        written = partial.is_file()
        problem = f"failed (exit {proc.returncode})" if proc.returncode != 0 else None
        problem = problem or (None if written else "wrote no file") or _not_whole(partial)
        if problem is not None:
            said = _tail(proc.stdout + proc.stderr)
            raise RuntimeError(
                f"nsys export of {report} {problem}, so no {sqlite_path.name} is kept{_free_space(partial)}"
                + (f":\n{said}" if said else "")
            )
        partial.replace(sqlite_path)
    finally:
        partial.unlink(missing_ok=True)
    return sqlite_path


def _not_whole(path: Path) -> str | None:
    """What is wrong with an SQLite export (empty, no database, damaged), or None when it reads whole."""
    try:
        with _connect(path) as conn:
            if not _tables(conn):
                return f"wrote an empty database ({path.stat().st_size} bytes)"
            check = conn.execute("PRAGMA quick_check").fetchone()
    except sqlite3.DatabaseError as exc:
        return f"wrote no whole database ({exc})"
    return None if check and check[0] == "ok" else f"wrote a damaged database ({check and check[0]})"


def _free_space(path: Path) -> str:
    """``; N MiB free in FOLDER: free space, ...`` where the folder's disk is all but full, else ""."""
    import shutil

    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return ""
    if free > 64 << 20:
        return ""
    return (
        f" (only {free >> 10} KiB free in {path.parent}: a full disk? free space, then read the report "
        "again with python -m autotuner.nsys_read)"
    )


@dataclass(frozen=True)
class NvtxRange:
    """A finished NVTX range: its name, span on the capture's clock, the thread that opened it.

    ``parsed`` is the name parsed with :func:`autotuner.ops.naming.parse_range`; None for ranges
    that are not ours (Megatron's own, NCCL's, ...).
    """

    name: str
    start_ns: int
    end_ns: int
    global_tid: int
    parsed: RangeName | None

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def pid(self) -> int:
        return process_id(self.global_tid)

    @property
    def tid(self) -> int:
        return thread_id(self.global_tid)


@dataclass(frozen=True)
class OpenRange:
    """An NVTX range that was opened but never closed by the program (it crashed or was killed)."""

    name: str
    start_ns: int
    global_tid: int
    parsed: RangeName | None


def process_id(global_tid: int) -> int:
    """The operating system's process id inside an nsys ``globalTid``."""
    return (global_tid >> 24) & _TID_MASK


def thread_id(global_tid: int) -> int:
    """The operating system's thread id inside an nsys ``globalTid``."""
    return global_tid & _TID_MASK


def read_nvtx_ranges(sqlite_path: Path) -> list[NvtxRange]:
    """All push/pop and start/end ranges that the program closed, ordered by start.

    A start/end range belongs to the thread that started it, even if another thread ended it.
    Ranges left open (see :func:`read_open_ranges`) are not included. A report with no NVTX data
    gives [].
    """
    closed, _ = _read_ranges(sqlite_path)
    return closed


def read_open_ranges(sqlite_path: Path) -> list[OpenRange]:
    """Ranges the program opened and never closed, ordered by start: the ops that did not finish.

    These have a NULL ``end`` in the report, or (nsys 2022.4 does this) an ``end`` set by nsys to
    the end of the capture. After a SIGKILL the innermost open range may be absent from the report,
    so the last entry here is the innermost range nsys saw, not necessarily the one that was running.
    """
    _, still_open = _read_ranges(sqlite_path)
    return still_open


@dataclass(frozen=True)
class KernelTotal:
    """One kernel (by demangled name) within a range: total GPU time and number of launches."""

    name: str
    demangled_name: str
    total_ns: int
    count: int


@dataclass(frozen=True)
class KernelStats:
    """The GPU work launched inside one NVTX range: kernels, and the memsets and memory copies beside them.

    ``kernel_time_ns``, ``kernel_count`` and ``kernels`` are inclusive: they count every kernel
    launched (by a CUDA runtime call on the range's thread) inside the range, also those inside
    nested ranges, so a ``transformer_layer`` range sums its sub-ops. ``self_kernel_time_ns`` and
    ``self_kernel_count`` count only the kernels whose innermost range this is. Times are sums of
    kernel durations: kernels that overlap on several streams are each counted in full.
    ``memory_op_time_ns`` counts the memsets and copies the same way (inclusive);
    ``gpu_time_ns`` is both together, the device's time on the op. They matter: the backward of the
    local attention of Llama-2-7B at s2048_b1 zeroes a 256 MiB buffer, 253 us of memset beside 2057 us of
    kernels on an H200, time the CUDA events around the op and the profiler's GPU span both hold.

    ``kernels`` holds every kernel, most time first, not only the top ones: a table over several
    iterations must add up each kernel's time in all of them, and the five longest of one iteration
    need not be those of another.
    """

    kernel_time_ns: int
    kernel_count: int
    kernels: tuple[KernelTotal, ...]
    self_kernel_time_ns: int
    self_kernel_count: int
    memory_op_time_ns: int = 0

    @property
    def gpu_time_ns(self) -> int:
        """Kernels, memsets and copies: the time the device spent on the range."""
        return self.kernel_time_ns + self.memory_op_time_ns

    @property
    def top_kernels(self) -> tuple[KernelTotal, ...]:
        """The TOP_KERNELS kernels with the most time in this range."""
        return self.kernels[:TOP_KERNELS]


def attribute_kernels(sqlite_path: Path, ranges: Sequence[NvtxRange]) -> dict[NvtxRange, KernelStats]:
    """Give each range in ``ranges`` the kernels (and memsets and copies) launched inside it; {} for a
    report without GPU data.

    A kernel (a memset, a copy) is matched (correlation id and process) to the CUDA runtime call that
    launched it, and belongs to the ranges, on the same thread, that contain that call. Its innermost
    range is the containing range that started last (for push/pop ranges, the deepest). Only the ranges
    passed in take part: pass only ours and a Megatron range nested inside one of ours cannot take its
    kernels. Kernels launched on a thread with no range, e.g. backward kernels while only the main
    thread has ranges, are attributed to nothing (see shared/notes/nsys.md, "Backward ranges").

    Every range in ``ranges`` gets an entry, with zeros when no kernel was launched inside it.
    Cost: one join in SQLite per table, then a sort and one sweep per thread,
    O((K + R) log(K + R) + K * depth).
    """
    with _connect(sqlite_path) as conn:
        tables = _tables(conn)
        if _KERNEL_TABLE not in tables or _RUNTIME_TABLE not in tables:
            return {}
        launches = _read_launches(conn, tables)

    by_thread: dict[int, list[NvtxRange]] = defaultdict(list)
    for rng in ranges:
        by_thread[rng.global_tid].append(rng)
    accumulators = {rng: _Accumulator() for rng in ranges}

    launches.sort()
    for tid, thread_launches in _group_by_thread(launches):
        thread_ranges = by_thread.get(tid)
        if not thread_ranges:
            continue
        # Outer before inner when two ranges start together, so the innermost is always last.
        thread_ranges.sort(key=lambda r: (r.start_ns, -r.end_ns))
        next_range = 0
        active: list[NvtxRange] = []  # ranges started and not yet ended, in start order
        for _, call_start, call_end, duration, short, demangled, kernel in thread_launches:
            while next_range < len(thread_ranges) and thread_ranges[next_range].start_ns <= call_start:
                active.append(thread_ranges[next_range])
                next_range += 1
            active = [r for r in active if r.end_ns >= call_start]
            containing = [r for r in active if r.end_ns >= call_end]
            for rng in containing:
                if kernel:
                    accumulators[rng].add(duration, short, demangled)
                else:
                    accumulators[rng].add_memory_op(duration)
            if containing and kernel:
                accumulators[containing[-1]].add_self(duration)
    return {rng: acc.stats() for rng, acc in accumulators.items()}


# --- internals -------------------------------------------------------------------------------


@contextmanager
def _connect(sqlite_path: Path) -> Iterator[sqlite3.Connection]:
    """Open read-only: a plain ``sqlite3.connect`` would create an empty file for a wrong path."""
    path = Path(sqlite_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no nsys SQLite export at {path}")
    with closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as conn:
        yield conn


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def _capture_end(conn: sqlite3.Connection, tables: set[str]) -> set[int]:
    """The times nsys gives as the end of ranges it closed itself: the end of the capture.

    Relative (``duration``) and absolute (``stopTime``) forms are both returned, so the check holds
    whichever clock a version of nsys uses for event timestamps.
    """
    if "ANALYSIS_DETAILS" not in tables:
        return set()
    wanted = [c for c in ("duration", "stopTime") if c in _columns(conn, "ANALYSIS_DETAILS")]
    ends: set[int] = set()
    for column in wanted:
        ends.update(
            row[0] for row in conn.execute(f"SELECT {column} FROM ANALYSIS_DETAILS") if row[0] is not None
        )
    return ends


def _read_ranges(sqlite_path: Path) -> tuple[list[NvtxRange], list[OpenRange]]:
    with _connect(sqlite_path) as conn:
        tables = _tables(conn)
        if "NVTX_EVENTS" not in tables:
            return [], []
        if "StringIds" in tables and "textId" in _columns(conn, "NVTX_EVENTS"):
            name = "COALESCE(e.text, s.value)"
            join = "LEFT JOIN StringIds AS s ON s.id = e.textId"
        else:
            name, join = "e.text", ""
        rows = conn.execute(
            f"SELECT e.start, e.end, e.globalTid, {name} FROM NVTX_EVENTS AS e {join} "
            f"WHERE e.eventType IN ({PUSH_POP_RANGE}, {START_END_RANGE}) ORDER BY e.start"
        ).fetchall()
        capture_end = _capture_end(conn, tables)

    closed: list[NvtxRange] = []
    still_open: list[OpenRange] = []
    for start, end, global_tid, text in rows:
        if not isinstance(start, int) or not isinstance(end, (int, type(None))):  # nsys writes integer ns
            raise sqlite3.DatabaseError(
                f"NVTX_EVENTS holds a time that is not a whole number: {start!r}, {end!r}"
            )
        text = text or ""
        if end is None or end in capture_end:
            still_open.append(OpenRange(text, start, global_tid, parse_range(text)))
        else:
            closed.append(NvtxRange(text, start, end, global_tid, parse_range(text)))
    return closed, still_open


# (globalTid of the launching call, call start, call end, duration, short name, demangled, is a kernel)
_Launch = tuple[int, int, int, int, str, str, int]


def _same_process(conn: sqlite3.Connection, table: str) -> str:
    """The join's process condition: correlation ids are unique within a process only."""
    if "globalPid" not in _columns(conn, table):
        return ""
    return "AND (r.globalTid >> 24) = (k.globalPid >> 24)"  # a shift: SQLite reads a 64-bit mask as REAL


def _read_launches(conn: sqlite3.Connection, tables: set[str]) -> list[_Launch]:
    """Each kernel, memset and copy joined to its runtime call. SQLite builds a transient index per join."""
    same_process = _same_process(conn, _KERNEL_TABLE)
    if "StringIds" in tables:
        names = "COALESCE(sn.value, ''), COALESCE(dn.value, sn.value, '')"
        joins = (
            "LEFT JOIN StringIds AS sn ON sn.id = k.shortName "
            "LEFT JOIN StringIds AS dn ON dn.id = k.demangledName"
        )
    else:
        names, joins = "CAST(k.shortName AS TEXT), CAST(k.demangledName AS TEXT)", ""
    query = (
        f"SELECT r.globalTid, r.start, r.end, k.end - k.start, {names}, 1 "
        f"FROM {_KERNEL_TABLE} AS k "
        f"JOIN {_RUNTIME_TABLE} AS r ON r.correlationId = k.correlationId {same_process} "
        f"{joins}"
    )
    launches = conn.execute(query).fetchall()
    for table in _MEMORY_OP_TABLES:
        if table in tables:
            launches += conn.execute(
                f"SELECT r.globalTid, r.start, r.end, k.end - k.start, '', '', 0 FROM {table} AS k "
                f"JOIN {_RUNTIME_TABLE} AS r ON r.correlationId = k.correlationId "
                f"{_same_process(conn, table)}"
            ).fetchall()
    return launches


def _group_by_thread(launches: list[_Launch]) -> Iterator[tuple[int, list[_Launch]]]:
    """Split launches sorted by thread into one run per thread."""
    begin = 0
    for i in range(1, len(launches) + 1):
        if i == len(launches) or launches[i][0] != launches[begin][0]:
            yield launches[begin][0], launches[begin:i]
            begin = i


class _Accumulator:
    """Running totals for one range while kernels are swept in."""

    __slots__ = (
        "count",
        "memory_time",
        "per_kernel",
        "self_count",
        "self_time",
        "short_names",
        "time",
    )

    def __init__(self) -> None:
        self.time = 0
        self.count = 0
        self.memory_time = 0
        self.self_time = 0
        self.self_count = 0
        self.per_kernel: dict[str, list[int]] = {}
        self.short_names: dict[str, str] = {}

    def add(self, duration: int, short: str, demangled: str) -> None:
        self.time += duration
        self.count += 1
        totals = self.per_kernel.get(demangled)
        if totals is None:
            self.per_kernel[demangled] = [duration, 1]
            self.short_names[demangled] = short
        else:
            totals[0] += duration
            totals[1] += 1

    def add_memory_op(self, duration: int) -> None:
        self.memory_time += duration

    def add_self(self, duration: int) -> None:
        self.self_time += duration
        self.self_count += 1

    def stats(self) -> KernelStats:
        top = sorted(self.per_kernel.items(), key=lambda item: (-item[1][0], item[0]))
        return KernelStats(
            kernel_time_ns=self.time,
            kernel_count=self.count,
            kernels=tuple(
                KernelTotal(self.short_names[name], name, total, count) for name, (total, count) in top
            ),
            self_kernel_time_ns=self.self_time,
            self_kernel_count=self.self_count,
            memory_op_time_ns=self.memory_time,
        )


def _tail(output: str, lines: int = 20) -> str:
    """The last lines of nsys's output; its progress bars redraw with carriage returns."""
    text = output.replace("\r", "\n")
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])
