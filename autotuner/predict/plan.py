"""The profiling plan: the runs that would measure what a prediction needs and the run directories lack.

A layout reads op rows at one shape point measured at its tensor-parallel size (and expert-parallel
size, sequence parallelism and dtype): a :class:`Need`; pipeline and data parallelism, recompute and the
optimizer change how rows combine, not the rows, so layouts share needs. The plan drops the needs a run
directory already holds (:func:`measured`), groups the rest into one profiler run per process group
(a run's shape lists are crossed, so groups split where they would measure points nobody needs), and
writes each as an argument list (:meth:`Run.argv`) with the cache mode the step runs its ops in:
``python -m autotuner.main`` for one process, ``torchrun --standalone --nproc-per-node=N`` for several
(on a GPU the least N the run's tp and ep fit; on a CPU the layout's own process count, since CPU rows
stand for as many processes sharing the host). :meth:`Plan.slurm` writes them as SLURM job arrays over
``scripts/slurm/sweep_array.sbatch``, one array per process count. Commands are never shell strings.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotuner.errors import UserError
from autotuner.predict.inputs import measured_on_cpu
from autotuner.predict.layout import Layout
from autotuner.results import load_rows
from autotuner.results.atomic import atomic_write_text
from autotuner.results.environment import load_environment

SWEEP_SCRIPT = "scripts/slurm/sweep_array.sbatch"


@dataclass(frozen=True)
class Need:
    """Rows a prediction needs: ``case`` at (``seq_len``, ``micro_batch_size``) measured with these
    parallel settings; ``dtype`` None takes rows of any dtype."""

    case: str
    seq_len: int
    micro_batch_size: int
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    dtype: str | None = None
    # on a CPU, the processes the rows are profiled beside (the layout's count; module docstring); 0 on
    # a GPU, whose ranks each have their own device: the least count the parallel sizes fit
    processes: int = 0

    @property
    def point(self) -> str:
        """The rows' ``point`` label."""
        return f"s{self.seq_len}_b{self.micro_batch_size}"

    def describe(self) -> str:
        sp = " sp" if self.sequence_parallel else ""
        beside = f" in {self.processes} processes" if self.processes else ""
        return f"{self.case} {self.point} tp={self.tp} ep={self.ep}{sp} {self.dtype or 'any dtype'}{beside}"

    def sort_key(self) -> tuple[Any, ...]:
        """Needs in a stable order (a dtype of None sorts first, as "")."""
        return (
            self.case,
            self.tp,
            self.ep,
            self.sequence_parallel,
            self.dtype or "",
            self.processes,
            self.seq_len,
            self.micro_batch_size,
        )

    @property
    def nproc(self) -> int:
        """The processes a run that measures it starts (module docstring)."""
        return math.lcm(self.tp, self.ep, self.processes or 1)


def needs_of(case: str, layouts: Iterable[Layout], cpu: bool = False) -> list[Need]:
    """The distinct needs of ``layouts`` of ``case``, sorted (``cpu``: each profiled beside its layout's
    processes)."""
    return sorted(
        {
            Need(
                case,
                lay.seq_len,
                lay.micro_batch_size,
                lay.tp,
                lay.ep,
                lay.sequence_parallel,
                lay.dtype,
                lay.gpus if cpu else 0,
            )
            for lay in layouts
        },
        key=Need.sort_key,
    )


def _rows_files(run_dir: Path) -> list[Path]:
    """The run's merged rows, else its per-rank files (a several-process run cut short before merging)."""
    if (run_dir / "results.jsonl").is_file():
        return [run_dir / "results.jsonl"]
    return sorted(run_dir.glob("results.rank*.jsonl"))


def measured(run_dirs: Iterable[str | Path]) -> set[Need]:
    """The needs the run directories hold: each point with ``ok`` rows (in every rank's file, for a run
    that has only those), under the run's case, dtype, tp, ep and sequence parallelism as its
    ``environment.json`` records them (else as its rows say: ``tensor_parallel``, ``expert_parallel``),
    and for CPU rows the processes they were profiled in (``world_size``, else the rank files).
    UserError (one line) for a directory without rows."""
    found: set[Need] = set()
    for run_dir in map(Path, run_dirs):
        files = _rows_files(run_dir)
        if not files:
            raise UserError(
                f"{run_dir} holds no results.jsonl: give run directories of python -m autotuner.main"
            )
        record = load_environment(run_dir)
        tf = record.get("transformer_config") or {}
        per_file, rows = [], []
        for path in files:
            file_rows = load_rows(path)
            rows += file_rows
            per_file.append(
                {
                    (r["case"], r["seq_len"], r["micro_batch_size"], r.get("dtype"))
                    for r in file_rows
                    if r.get("status") == "ok"
                    and r.get("seq_len")
                    and r.get("micro_batch_size")
                    and not float(r.get("idle_before_ms") or 0) > 0  # another condition (Measurements)
                }
            )
        points = set.intersection(*per_file)
        tp = int(tf.get("tensor_model_parallel_size") or _row_value(rows, "tensor_parallel"))
        ep = int(tf.get("expert_model_parallel_size") or _row_value(rows, "expert_parallel"))
        sp = bool(tf.get("sequence_parallel", False))
        processes = int(record.get("world_size") or len(files)) if measured_on_cpu(rows) else 0
        for case, seq_len, mbs, dtype in points:
            found.add(
                Need(
                    record.get("case", case), seq_len, mbs, tp, ep, sp, record.get("dtype", dtype), processes
                )
            )
    return found


def _row_value(rows: list[dict[str, Any]], column: str) -> int:
    """A parallel size as the rows state it (1 where none does: a dense model's rows carry no EP)."""
    values = {r[column] for r in rows if r.get(column)}
    return max(values) if values else 1


def _holds(have: set[Need], need: Need) -> bool:
    return any(
        (h.case, h.seq_len, h.micro_batch_size, h.tp, h.ep, h.sequence_parallel)
        == (need.case, need.seq_len, need.micro_batch_size, need.tp, need.ep, need.sequence_parallel)
        and (need.dtype is None or h.dtype == need.dtype)
        and need.processes in (0, h.processes)
        for h in have
    )


def _list(values: Iterable[int]) -> str:
    return "[" + ",".join(str(v) for v in sorted(values)) + "]"


@dataclass(frozen=True)
class Run:
    """One profiler run: its overrides, its process count and the needs it measures."""

    overrides: tuple[str, ...]
    nproc: int
    needs: tuple[Need, ...]
    flush_cache: bool = True  # its rows measured with flushed caches (``timing.flush_cache``), or warm

    def argv(self, python: str = "python") -> list[str]:
        """The command line, as an argument list."""
        if self.nproc == 1:
            return [python, "-m", "autotuner.main", *self.overrides]
        return [
            "torchrun",
            "--standalone",
            f"--nproc-per-node={self.nproc}",
            "-m",
            "autotuner.main",
            *self.overrides,
        ]


@dataclass(frozen=True)
class SlurmArray:
    """One job array: ``env`` and ``argv`` submit it (``sbatch`` reads ``SWEEP_FILE`` and ``NPROC`` from
    the environment it is called with); ``task_file`` lists its tasks, one per line."""

    task_file: Path
    argv: list[str]
    env: dict[str, str]
    runs: tuple[Run, ...]

    def shell(self) -> str:
        """The submission as one line a person can paste (shell-quoted)."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), shlex.join(self.argv)])


@dataclass(frozen=True)
class Plan:
    """The runs that measure the missing needs, and the needs already measured."""

    runs: tuple[Run, ...]
    already: tuple[Need, ...] = field(default=())

    def merged(self, other: Plan) -> Plan:
        """This plan's runs, then ``other``'s (e.g. the same points measured with the other cache kind)."""
        return Plan(self.runs + other.runs, tuple(dict.fromkeys(self.already + other.already)))

    @property
    def missing(self) -> list[Need]:
        # a point may be measured twice, with warm and with flushed caches: one need
        return sorted({n for run in self.runs for n in run.needs}, key=Need.sort_key)

    def commands(self, python: str = "python") -> list[list[str]]:
        return [run.argv(python) for run in self.runs]

    def text(self, arrays: Sequence[SlurmArray] = ()) -> str:
        """The plan for a person: what is measured, what is missing, the commands (shell-quoted, to
        paste) and the SLURM submissions of ``arrays`` (from :meth:`slurm`)."""
        if not self.runs:
            return f"every needed point is measured ({len(self.already)} point(s))"
        lines = [
            f"{len(self.missing)} needed point(s) not measured ({len(self.already)} measured); "
            f"{len(self.runs)} profiling run(s) measure them:"
        ]
        lines += [f"  {shlex.join(argv)}" for argv in self.commands()]
        if arrays:
            lines.append("or as SLURM job arrays (one per process count; run from the checkout):")
            lines += [f"  {array.shell()}" for array in arrays]
        return "\n".join(lines)

    def slurm(self, folder: str | Path, gpus: bool = True) -> list[SlurmArray]:
        """Write one task file per process count into ``folder`` and return the arrays that run them
        (``gpus`` False: CPU processes, ``--gpus-per-node=0``, as on a machine without GPUs)."""
        folder = Path(folder).resolve()
        by_nproc: dict[int, list[Run]] = {}
        for run in self.runs:
            by_nproc.setdefault(run.nproc, []).append(run)
        arrays = []
        for nproc, runs in sorted(by_nproc.items()):
            task_file = folder / f"profile_tasks_n{nproc}.txt"
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(task_file, "".join(" ".join(run.overrides) + "\n" for run in runs))
            argv = [
                "sbatch",
                f"--array=0-{len(runs) - 1}",
                f"--gpus-per-node={nproc if gpus else 0}",
                SWEEP_SCRIPT,
            ]
            env = {"SWEEP_FILE": str(task_file), "NPROC": str(nproc)}
            arrays.append(SlurmArray(task_file, argv, env, tuple(runs)))
        return arrays


def plan(
    needs: Iterable[Need],
    run_dirs: Iterable[str | Path] = (),
    extra: Sequence[str] = (),
    launcher: str = "get_data",
    flush_cache: bool = True,
) -> Plan:
    """The profiling plan for ``needs`` given the run directories already measured (module docstring).
    ``extra`` overrides go into every run (``device=cpu``, ``timing.budget_s=2``, ...); they may hold no
    spaces, as the SLURM task files separate overrides by spaces."""
    spaced = [o for o in extra if any(c.isspace() for c in o)]
    if spaced:
        raise UserError(f"override {spaced[0]!r} holds a space: write lists without spaces, e.g. [1,2]")
    have = measured(run_dirs)
    needs = sorted(set(needs), key=Need.sort_key)
    already = tuple(n for n in needs if _holds(have, n))
    groups: dict[tuple[Any, ...], dict[int, set[int]]] = {}
    for need in needs:
        if need not in already:
            key = (need.case, need.tp, need.ep, need.sequence_parallel, need.dtype or "", need.processes)
            groups.setdefault(key, {}).setdefault(need.seq_len, set()).add(need.micro_batch_size)
    runs = []
    for (case, tp, ep, sp, dtype, processes), by_seq in sorted(groups.items()):
        by_batches: dict[tuple[int, ...], list[int]] = {}
        for seq_len, batches in sorted(by_seq.items()):
            by_batches.setdefault(tuple(sorted(batches)), []).append(seq_len)
        for batches, seq_lens in sorted(by_batches.items(), key=lambda item: item[1]):
            overrides = [
                f"case={case}",
                f"launcher={launcher}",
                f"timing.flush_cache={str(flush_cache).lower()}",
            ]
            # warm forwards as a step runs them, each after the op's backward (autotuner.measure.timer)
            overrides += [] if flush_cache else ["timing.forward_after_backward=true"]
            overrides += [f"tf.tensor_model_parallel_size={tp}"] if tp > 1 else []
            overrides += [f"tf.expert_model_parallel_size={ep}"] if ep > 1 else []
            overrides += ["tf.sequence_parallel=true"] if sp else []
            overrides += [f"dtype={dtype}"] if dtype else []
            overrides += [f"shapes.seq_len={_list(seq_lens)}", f"shapes.micro_batch_size={_list(batches)}"]
            covered = tuple(
                Need(case, s, b, tp, ep, sp, dtype or None, processes) for s in seq_lens for b in batches
            )
            runs.append(Run(tuple([*overrides, *extra]), covered[0].nproc, covered, flush_cache))
    return Plan(tuple(runs), already)
