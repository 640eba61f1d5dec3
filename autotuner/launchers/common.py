"""What every launcher does around the runner: the lock on the run directory, the resume check, the run
record on disk and the closing summary."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from autotuner.errors import UserError
from autotuner.model.runtime import device_name, environment, process_rank
from autotuner.notices import Notices, say_notes
from autotuner.report import REPORT_NAME
from autotuner.results import (
    ResultsWriter,
    RowKey,
    RowsFileError,
    incomplete,
    load_rows,
    merge_ranks,
    read_rows,
    unique_rows,
)
from autotuner.results.atomic import atomic_write_text
from autotuner.results.environment import load_environment
from autotuner.results.reading import check_regular
from autotuner.results.table import render
from autotuner.runner.plan import plan

# The most calls a profiling launcher (nsys, torch_profiler) makes of each op at each point: every one is a
# range the profiler keeps until the end (torch.profiler in this process's memory, nsys in its report), so
# a mistyped count (launcher.active=100000) would run for hours and then fail for memory.
MAX_PROFILED_CALLS = 1000

# The files a run writes at the top of its directory: a launcher's folder of its own may not take a name.
RUN_FILES = re.compile(
    r"results(\.rank\d+)?\.(jsonl|csv)|environment\.json|report\.html|main\.log|\.hydra|\..*\.lock"
)


def check_profiled_calls(counts: dict[str, int]) -> None:
    """UserError (one line) unless the ``counts`` (setting -> calls of each op at each point) add up to at
    most :data:`MAX_PROFILED_CALLS`."""
    total = sum(counts.values())
    if total > MAX_PROFILED_CALLS:
        given = " + ".join(f"{name}={count}" for name, count in counts.items())
        raise UserError(
            f"{given} = {total} profiled calls of each op at each point, above {MAX_PROFILED_CALLS} (each "
            "is a range the profiler keeps until the end): lower them"
        )


def results_stem(rank: int, world: int) -> str:
    """``results``, or ``results.rank<N>`` for each rank of a several-process job."""
    return f"results.rank{rank}" if world > 1 else "results"


class RunDirectory:
    """A run's folder as this process holds it: its locks, the lock files it made, and whether its fresh
    start or resume was checked. :meth:`claim` and :meth:`check` are done once, however often asked
    (autotuner.main does them before Hydra writes its record, where the folder is known in advance;
    :func:`start_writer` for the others); :meth:`release` ends the hold.

    A lock is ``fcntl.flock`` on a hidden file per results stem (``.results.lock``; under torchrun each
    rank locks ``.results.rank<N>.lock`` and rank 0 also ``.results.lock``, the merged files it writes),
    held while this process lives: the kernel drops it when the process ends, killed or not, so a crashed
    run never leaves a lock that holds. A second run into the folder, which would interleave its rows
    with the first one's, is refused instead. A lock counts only while its file is still the one at the
    path: :meth:`release` removes the files (still holding them), and a run that locked a removed file
    tries again.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._locks: dict[Path, int] = {}  # lock file -> descriptor
        self._checked = False

    def claim(self) -> RunDirectory:
        """Take the locks, or raise UserError naming the live run that holds them."""
        fix = "choose another with hydra.run.dir=..."
        try:
            self.path = self.path.resolve()
        except (OSError, RuntimeError) as exc:  # a loop of links (RuntimeError before Python 3.13)
            raise UserError(f"cannot use {self.path} as the run directory ({exc}): {fix}") from None
        rank, world = process_rank()  # autotuner.main claims the directory before any spec is resolved
        stems = [results_stem(rank, world)] + (["results"] if world > 1 and rank == 0 else [])
        made = [p for p in (self.path, *self.path.parents) if not os.path.lexists(p)]  # removed if refused
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            for stem in stems:
                lock = self.path / f".{stem}.lock"
                if lock not in self._locks:
                    self._lock(lock)
                    _sweep_temporaries(self.path, stem)
        except OSError as exc:
            self.release()
            for folder in made:  # leaf first: the folders this claim made, as they were (empty)
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise UserError(
                f"cannot use {self.path} as the run directory ({exc.strerror or exc}): {fix}"
            ) from None
        return self

    def _lock(self, path: Path) -> None:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_pid(fd)
                os.close(fd)
                self.release()
                raise UserError(
                    f"another run (pid {holder}) is writing into {self.path}: wait for it to end, or "
                    "choose another directory with hydra.run.dir=..."
                ) from None
            if path.exists() and os.path.samestat(os.fstat(fd), os.stat(path)):
                break
            os.close(fd)  # a run that ended removed this file after we opened it: lock the path's own
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # names the holder to a refused run
        self._locks[path] = fd

    def check(self, cfg: DictConfig, spec: Any) -> None:
        """:func:`check_resume` with ``resume=true``, else :func:`check_fresh`; once. Raises UserError."""
        if self._checked:
            return
        if cfg.resume:
            check_resume(cfg, spec, self.path)
        else:
            check_fresh(self.path, spec.world)
        self._checked = True

    def release(self) -> None:
        """Drop the locks and remove their files (a finished or refused run leaves no lock file behind;
        each is removed while still held, so no other run holds a lock on a file that is gone)."""
        for path, fd in self._locks.items():
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)
        self._locks.clear()
        self._checked = False


def _sweep_temporaries(run_dir: Path, stem: str) -> None:
    """Remove the temporary files a killed writer of ``stem``'s files left (autotuner.results.atomic: a
    SIGKILL ends it before its cleanup). None is live: this process holds the stem's lock. The ``results``
    stem's holder (rank 0) also writes ``environment.json`` and the report."""
    names = [f"{stem}.jsonl", f"{stem}.csv"]
    if stem == "results":
        names += ["environment.json", REPORT_NAME]
    for name in names:
        for left in run_dir.glob(f".{glob.escape(name)}.*.tmp"):
            left.unlink(missing_ok=True)


def _holder_pid(fd: int) -> str:
    """The pid a live run wrote into its lock file, or "unknown".

    The holder writes its pid just after its flock succeeds, so a run refused in between reads an empty
    file: it waits for the line (up to a second; a busy machine can hold the holder between the two
    calls) rather than name nobody."""
    deadline = time.monotonic() + 1.0
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace")
        if text.endswith("\n") or time.monotonic() > deadline:
            return text.strip() or "unknown"
        time.sleep(0.01)


# Config keys that never change a measurement, so a resumed run may change them (that is how a run is
# extended): which ops and shapes, what is shown, resume itself. hf, tf, device and dtype are compared
# resolved (the model config Megatron builds; cuda and bf16 rather than auto), case_dir as the case.
_RESUMABLE_KEYS = {
    *("ops", "shapes", "progress", "report", "resume", "resume_across_versions"),
    *("case_dir", "hf", "tf", "device", "dtype", "run_unfit", "memory_limit_gib"),
}
_VERSIONED = ("torch", "megatron-core", "transformers", "transformer-engine")


def _stable(value: Any) -> Any:
    """A JSON value that is the same in every process for the same setting: objects by their repr
    without memory addresses (``<function silu at 0x7f..>`` -> ``<function silu>``)."""
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if hasattr(value, "__dict__") and not callable(value):
        return _stable(vars(value))
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for key, sub in value.items():
            _flat(f"{prefix}.{key}" if prefix else str(key), sub, out)
    else:
        out[prefix] = value
    return out


def fingerprint(cfg: DictConfig, spec: Any) -> dict[str, Any]:
    """Everything that changes a measurement, as flat ``key: value`` pairs (recorded in environment.json
    and compared by :func:`check_resume`): every config key but :data:`_RESUMABLE_KEYS` (so a key added
    later is compared unless listed there), the resolved model config, dtype, device, world size and
    the versions of the libraries that run the ops."""
    from importlib import metadata

    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    out: dict[str, Any] = {}
    _flat("", {k: v for k, v in plain.items() if k not in _RESUMABLE_KEYS}, out)
    # the mapped model; its "transformer" part is what TransformerConfig holds (tf.*), not named twice
    _flat("model", {k: _stable(v) for k, v in vars(spec.model_args).items() if k != "transformer"}, out)
    _flat("tf", {k: _stable(v) for k, v in vars(spec.tf_config).items() if not k.startswith("_")}, out)
    out.update(
        dtype=spec.dtype,
        device=spec.device.type,
        device_name=device_name(spec.device),
        transformer_engine_spec=spec.use_transformer_engine,
        attention_built=spec.attention,
        world_size=spec.world,
    )
    for package in _VERSIONED:
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return json.loads(json.dumps(_stable(out)))  # as it reads back from the file


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _every_rank_stem(world: int) -> list[str]:
    """The results stems of a job's ``world`` processes (``results``, or ``results.rank<N>`` for each).

    A check of the run directory reads them all on every rank, so that the ranks decide alike without a
    word between them: a rank that refused alone, before the process group exists, would leave the others
    waiting in init_process_group until its timeout or torchrun's SIGKILL."""
    return [results_stem(rank, world) for rank in range(world)]


# Files a run opens in place, not through autotuner.results.atomic: Hydra's record of the config and its
# log. A FIFO there holds Hydra's open for ever, so each must be a regular file, or absent.
_OPENED_IN_PLACE = ("main.log", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


def _check_opened_in_place(run_dir: Path) -> None:
    for name in _OPENED_IN_PLACE:
        check_regular(Path(run_dir) / name, "move it away, or choose another hydra.run.dir")


def check_fresh(run_dir: Path, world: int) -> None:
    """Without ``resume=true``, before anything is written: a directory that holds an earlier run's
    results is refused (one line), since a new run would replace them: finished rows are never lost.
    Under torchrun every rank checks every rank's file (``results.rank<N>.jsonl``, :func:`_every_rank_stem`)
    and the merged ``results.jsonl``; no rank writes a row before all have passed here, since every row
    takes all ranks' collectives."""
    _check_opened_in_place(run_dir)
    names = {f"{stem}.jsonl" for stem in [*_every_rank_stem(world), "results"]}
    earlier = sorted(n for n in names if (Path(run_dir) / n).is_file() and (Path(run_dir) / n).stat().st_size)
    if earlier:
        raise UserError(
            f"{run_dir} holds an earlier run's results ({earlier[0]}), which a new run would replace: add "
            "resume=true to finish or extend that run, or choose another hydra.run.dir"
        )


def check_resume(cfg: DictConfig, spec: Any, run_dir: Path) -> None:
    """With ``resume=true``, before anything is written: is there a run to resume, are its rows readable,
    and was it measured with this configuration? Raises UserError (one line, files untouched) if not.

    Rows match on (case, op, phase, point, rank) only, so resuming with another model, dtype, seed or
    sampler would keep the earlier rows as if measured with the new settings; the earlier run's
    :func:`fingerprint` in its environment.json must equal this one's. A torn last line of the results
    is left to ResultsWriter, which drops it with a warning (start_writer).
    """
    run_dir = Path(run_dir).resolve()
    rank, world = spec.rank, spec.world
    _check_opened_in_place(run_dir)
    rows = []
    # every rank's, so the ranks decide alike; and any other results file there, so that a run of another
    # process count is not taken for nothing to resume (and its merged results.jsonl then replaced)
    found = sorted(p.name.removesuffix(".jsonl") for p in run_dir.glob("results.rank*.jsonl"))
    for stem in dict.fromkeys([*_every_rank_stem(world), "results", *found]):
        results = run_dir / f"{stem}.jsonl"
        try:
            check_regular(results, "move it away, or start a new run elsewhere")
        except UserError as exc:  # a folder, a FIFO: never opened
            raise UserError(f"cannot resume: {exc}") from None
        try:
            rows += (
                unique_rows(read_rows(results, allow_torn_tail=True)[0], results)[0]
                if results.is_file()
                else []
            )
        except RowsFileError as exc:  # its message names the line and the fix
            raise UserError(f"cannot resume: {exc}, or start a new run without resume=true") from None
    if not rows:
        if rank == 0:
            say_notes(
                f"resume=true but nothing to resume in {run_dir}; starting a new run", stream=sys.stderr
            )
        return
    try:
        recorded = load_environment(run_dir).get("fingerprint")
    except UserError as exc:  # a FIFO, a device, a damaged record: its message names the file and why
        raise UserError(f"cannot resume: {exc}") from None
    if not isinstance(recorded, dict):
        raise UserError(
            f"cannot resume {run_dir}: its environment.json holds no configuration fingerprint (missing, "
            "or written by an older autotuner), so a changed configuration cannot be ruled out: "
            "start a new run without resume=true"
        )
    current = fingerprint(cfg, spec)
    absent = object()
    # the libraries' versions are in the environment too, which _check_environment compares
    differ = sorted(
        k
        for k in (recorded.keys() | current.keys()) - set(_VERSIONED)
        if recorded.get(k, absent) != current.get(k, absent)
    )
    if differ:
        shown = ", ".join(
            f"{k} {_shown(recorded.get(k))} -> {_shown(current.get(k))}" for k in differ[:6]
        ) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
        # the process count is torchrun's, not a setting in .hydra/overrides.yaml
        processes = f"--nproc-per-node={recorded.get('world_size')} and " if "world_size" in differ else ""
        raise UserError(
            f"cannot resume {run_dir} with a different configuration ({shown}): resume with {processes}the "
            "settings of that run (its .hydra/overrides.yaml), or start a new run without resume=true"
        )
    _check_environment(cfg, spec, run_dir, rows)


# What of a run's environment (autotuner.model.runtime.environment) is the process's, not what measured:
# its command line, the node (SLURM requeues a job onto another node of its kind; the device's name is
# compared), its thread count (each row has its own; timing.threads is in the fingerprint) and its host
# heap (set up after the check, from the device and the platform, both compared).
_INCIDENTAL = frozenset({"command", "hostname", "num_threads", "host_heap"})


def _measuring(env: Any) -> dict[str, Any]:
    """The part of an environment record that a resume compares (all but :data:`_INCIDENTAL`)."""
    return {k: v for k, v in env.items() if k not in _INCIDENTAL} if isinstance(env, dict) else {}


def environment_key(env: dict[str, Any]) -> str:
    """The name of an environment in environment.json's ``environments`` and in the rows it measured
    (``measured_by``): the autotuner version and revision, then a digest of what was compared."""
    digest = hashlib.sha1(json.dumps(_measuring(env), sort_keys=True, default=repr).encode()).hexdigest()
    return f"{env.get('autotuner')}+{env.get('autotuner_revision')}-{digest[:8]}"


def _environments_of(rows: list[dict[str, Any]], record: dict[str, Any]) -> list[dict[str, Any]]:
    """The environments that measured ``rows``: the record's ``environment`` for a row without
    ``measured_by``, else the one its ``measured_by`` names in ``environments`` (unknown: an empty one)."""
    named = record.get("environments") if isinstance(record.get("environments"), dict) else {}
    keys = dict.fromkeys(row.get("measured_by") for row in rows)
    return [record.get("environment") if key is None else named.get(key) or {} for key in keys]


def _check_environment(cfg: DictConfig, spec: Any, run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """The resumed rows' environments against this process's: another autotuner version or revision,
    Python, platform or library would credit the earlier rows to this one (environment.json keeps the
    environment that measured them). Refused in one line unless ``resume_across_versions=true``, under
    which each new row names its own (``measured_by``)."""
    if cfg.get("resume_across_versions", False):
        return
    current = _measuring(environment(spec.device))
    for earlier in map(_measuring, _environments_of(rows, load_environment(run_dir))):
        differ = sorted(k for k in earlier.keys() | current.keys() if earlier.get(k) != current.get(k))
        if differ:
            shown = ", ".join(
                f"{k} {_shown(earlier.get(k))} -> {_shown(current.get(k))}" for k in differ[:4]
            ) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
            raise UserError(
                f"cannot resume {run_dir}: its rows were measured in another environment ({shown}): resume "
                "with the versions of that run (its environment.json), or add resume_across_versions=true "
                "to record the new rows with their own, or start a new run without resume=true"
            )


def _say_what_a_resume_drops(writer: ResultsWriter, spec: Any) -> None:
    """One note for the rows a resume found twice (kept once) and one for those it found incomplete
    (:func:`autotuner.results.incomplete`; measured again where this run's plan has them)."""
    if writer.duplicates:
        say_notes(
            f"{writer.jsonl} held {writer.duplicates} row(s) twice (the same row, as a file appended "
            "to itself holds it): kept once",
            stream=sys.stderr,
        )
    lacking = incomplete(writer.rows)
    if not lacking:
        return
    planned = {
        RowKey(spec.case, op.name, phase, point.label, spec.row_rank) for point, op, phase in plan(spec)
    }
    again = [f"{r['op']}.{r['phase']} {r['point']}" for r in lacking if RowKey.of(r) in planned]
    said = (
        [f"{len(again)} measured again ({', '.join(again[:3])}{' ...' if len(again) > 3 else ''})"]
        if again
        else []
    )
    if len(lacking) > len(again):
        said.append(f"{len(lacking) - len(again)} outside this run's ops and points left as they are")
    say_notes(
        f"{len(lacking)} row(s) of {writer.jsonl} lack their median_us or status (an edited or cut "
        f"file), so they do not count as measured: {'; '.join(said)}",
        stream=sys.stderr,
    )


def start_writer(
    cfg: DictConfig, spec: Any, run: RunDirectory, tools: dict[str, tuple[str, str]] | None = None
) -> ResultsWriter:
    """Lock the run directory, check a resume, then write ``environment.json`` (versions, device, the
    derived model config, the ``tools`` the launcher runs: see :func:`autotuner.model.runtime.environment`;
    the :func:`fingerprint` a resume is checked against) and open the results.

    Every check comes before the first write, so a refused run leaves the directory as it was.
    With several processes each rank writes its own ``results.rank<N>.{jsonl,csv}``; :func:`finish`
    merges them into ``results.{jsonl,csv}`` on rank 0.
    """
    run.claim().check(cfg, spec)
    run_dir = run.path
    rank, world = spec.rank, spec.world
    writer = ResultsWriter(run_dir, resume=bool(cfg.resume), stem=results_stem(rank, world))
    if writer.dropped_tail is not None:
        Notices().warn(
            f"dropped the torn last line of {writer.jsonl} (what a killed writer leaves): "
            f"{writer.dropped_tail[:60]!r}"
        ).print(sys.stderr)
    _say_what_a_resume_drops(writer, spec)
    this = environment(spec.device, tools)
    earlier = load_environment(run_dir) if cfg.resume else {}
    # The environment that measured the earlier rows stays the run's; another one (resume_across_versions,
    # checked by check_resume) is added to its environments and named in each row it measures.
    kept = (
        earlier.get("environment") if writer.rows and isinstance(earlier.get("environment"), dict) else None
    )
    if kept is not None and _measuring(kept) != _measuring(this):
        writer.measured_by = environment_key(this)
    if rank != 0:
        return writer
    record = {
        "environment": kept or this,
        "case": spec.case,
        "dtype": spec.dtype,
        "points": [p.label for p in spec.points],
        "ops": [op.name for op in spec.ops],
        "transformer_engine_spec": spec.use_transformer_engine,
        "attention": spec.attention,  # the core attention built (attention=auto resolved)
        "routing": {"mode": spec.routing.mode, "zipf_s": spec.routing.zipf_s},  # moe.*: MoE ops' input
        "transformer_config": {
            k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
            for k, v in vars(spec.tf_config).items()
            if not k.startswith("_")
        },
        "model_args": {k: v for k, v in vars(spec.model_args).items()},
        "notes": spec.notes,
        "world_size": world,
        # without torchrun, the layout this process stood for one rank of (autotuner.model.emulation)
        "emulated_rank": spec.emulation.to_json() if getattr(spec, "emulation", None) else None,
        "fingerprint": fingerprint(cfg, spec),
    }
    named = earlier.get("environments") if writer.rows else None
    if writer.measured_by or isinstance(named, dict):
        record["environments"] = {**(named if isinstance(named, dict) else {})}
        if writer.measured_by:
            record["environments"][writer.measured_by] = this
    if cfg.resume:  # a resume may measure other ops or points: the record lists what the run holds
        for key in ("points", "ops"):
            listed = earlier.get(key)
            had = [x for x in listed if isinstance(x, str)] if isinstance(listed, list) else []
            record[key] = list(dict.fromkeys([*had, *record[key]]))
    try:
        atomic_write_text(run_dir / "environment.json", json.dumps(record, indent=2, default=repr) + "\n")
    except OSError as exc:
        raise writer.not_written(exc, run_dir / "environment.json") from exc
    say_notes(*spec.notes, stream=sys.stderr)
    return writer


def finish(writer: ResultsWriter, spec: Any) -> int:
    """Print the summary table and where the files are; 1 if any measurement failed, else 0.

    With several ranks: wait for all, then rank 0 merges every rank's rows (plus the cross-rank
    ``max`` rows) into ``results.{jsonl,csv}`` and prints the table of those; other ranks print nothing.
    """
    rank, world = spec.rank, spec.world
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        if rank != 0:
            return 0
        merged = ResultsWriter(writer.run_dir)
        per_rank = [load_rows(writer.run_dir / f"results.rank{r}.jsonl") for r in range(world)]
        merged.extend(merge_ranks(per_rank))
        writer = merged
        rows = [r for r in writer.rows if r.get("case") == spec.case and r.get("rank") == "max"]
    else:
        rows = [r for r in writer.rows if r.get("case") == spec.case]
    print(render(rows))
    failed = [r for r in rows if r.get("status") == "failed"]
    refused = [r for r in rows if r.get("status") == "refused"]
    why = ""
    if refused:  # the fit check's (autotuner.runner.fit): over the memory the process could hold
        ops = ", ".join(dict.fromkeys(f"{r['op']} {r['point']}" for r in refused))
        why = f", {len(refused)} refused: estimated over the memory limit ({ops}; run_unfit=true runs them)"
    print(f"\n{len(rows)} rows ({len(failed)} failed{why}) in {writer.run_dir}/results.csv and results.jsonl")
    return 1 if failed else 0
