"""What every launcher does around the runner: the lock on the run directory, the resume check, the run
record on disk and the closing summary."""

from __future__ import annotations

import fcntl
import glob
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
from autotuner.report import REPORT_NAME
from autotuner.results import ResultsWriter, RowsFileError, load_rows, merge_ranks, read_rows
from autotuner.results.atomic import atomic_write_text
from autotuner.results.environment import load_environment
from autotuner.results.table import render

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


# Locks this process holds on run directories (lock file -> descriptor), and the run directories whose
# resume was already checked (autotuner.main checks before Hydra writes; start_writer again, for runs
# main could not place in advance): both end with the run (release_run_dirs) or with the process.
_HELD: dict[Path, int] = {}
_CREATED: set[Path] = set()  # the lock files this process made, removed again if its run is refused
_RESUME_CHECKED: set[Path] = set()


def claim_run_dir(run_dir: Path) -> None:
    """Take this process's locks on ``run_dir``, or raise UserError naming the live run that holds them.

    A lock is ``fcntl.flock`` on a hidden file per results stem (``.results.lock``; under torchrun each
    rank locks ``.results.rank<N>.lock`` and rank 0 also ``.results.lock``, the merged files it writes),
    held as long as this process lives: the kernel drops it when the process ends, killed or not, so a
    crashed run never leaves a stale lock to clean up. A second run into the directory, which would
    interleave its rows with the first one's and each rewrite the other's files, is refused instead.
    A lock counts only while its file is still the one at the path: a refused run removes the lock files
    it made (:func:`release_run_dirs`), and one that locked the removed file tries again.
    """
    run_dir = Path(run_dir).resolve()
    rank, world = process_rank()  # autotuner.main claims the directory before any spec is resolved
    stems = [results_stem(rank, world)] + (["results"] if world > 1 and rank == 0 else [])
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stem in stems:
            path = run_dir / f".{stem}.lock"
            if path in _HELD:
                continue
            while True:
                try:
                    fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), True
                except FileExistsError:
                    fd, created = os.open(path, os.O_RDWR), False
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _holder_pid(fd)
                    os.close(fd)
                    raise UserError(
                        f"another run (pid {holder}) is writing into {run_dir}: wait for it to end, or "
                        "choose another directory with hydra.run.dir=..."
                    ) from None
                if path.exists() and os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
                os.close(fd)  # a refused run removed this file after we opened it: lock the path's own
            if created:
                _CREATED.add(path)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # names the holder to a refused run
            _HELD[path] = fd
            _sweep_temporaries(run_dir, stem)
    except OSError as exc:
        raise UserError(
            f"cannot use {run_dir} as the run directory ({exc.strerror or exc}): "
            "choose another with hydra.run.dir=..."
        ) from None


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


def release_run_dirs(refused: bool = False) -> None:
    """Drop every lock of :func:`claim_run_dir` (at the end of a run started in-process). A ``refused``
    run also removes the lock files it made, so that it leaves the directory as it found it; it still
    holds each one while removing it."""
    for path, fd in _HELD.items():
        if refused and path in _CREATED:
            path.unlink(missing_ok=True)
        os.close(fd)
    _HELD.clear()
    _CREATED.clear()
    _RESUME_CHECKED.clear()


# Config keys that never change a measurement, so a resumed run may change them (that is how a run is
# extended): which ops and shapes, what is shown, resume itself. hf, tf, device and dtype are compared
# resolved (the model config Megatron builds; cuda and bf16 rather than auto), case_dir as the case.
_RESUMABLE_KEYS = {
    "ops",
    "shapes",
    "progress",
    "report",
    "resume",
    "case_dir",
    "hf",
    "tf",
    "device",
    "dtype",
    "run_unfit",
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


def check_fresh(run_dir: Path, world: int) -> None:
    """Without ``resume=true``, before anything is written: a directory that holds an earlier run's
    results is refused (one line), since a new run would replace them: finished rows are never lost.
    Under torchrun every rank checks every rank's file (``results.rank<N>.jsonl``, :func:`_every_rank_stem`)
    and the merged ``results.jsonl``; no rank writes a row before all have passed here, since every row
    takes all ranks' collectives."""
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
    if run_dir in _RESUME_CHECKED:
        return
    rank, world = spec.rank, spec.world
    rows = []
    # every rank's, so the ranks decide alike; and any other results file there, so that a run of another
    # process count is not taken for nothing to resume (and its merged results.jsonl then replaced)
    found = sorted(p.name.removesuffix(".jsonl") for p in run_dir.glob("results.rank*.jsonl"))
    for stem in dict.fromkeys([*_every_rank_stem(world), "results", *found]):
        results = run_dir / f"{stem}.jsonl"
        if results.exists() and not results.is_file():
            raise UserError(
                f"cannot resume: {results} is not a file: move it away, or start a new run elsewhere"
            )
        try:
            rows += read_rows(results, allow_torn_tail=True)[0] if results.is_file() else []
        except RowsFileError as exc:  # its message names the line and the fix
            raise UserError(f"cannot resume: {exc}, or start a new run without resume=true") from None
    if not rows:
        if rank == 0:
            print(
                f"note: resume=true but nothing to resume in {run_dir}; starting a new run", file=sys.stderr
            )
        _RESUME_CHECKED.add(run_dir)
        return
    try:
        recorded = json.loads((run_dir / "environment.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if not isinstance(recorded, dict):
        raise UserError(
            f"cannot resume {run_dir}: its environment.json holds no configuration fingerprint (missing, "
            "or written by an older autotuner), so a changed configuration cannot be ruled out: "
            "start a new run without resume=true"
        )
    current = fingerprint(cfg, spec)
    absent = object()
    differ = sorted(
        k for k in recorded.keys() | current.keys() if recorded.get(k, absent) != current.get(k, absent)
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
    _RESUME_CHECKED.add(run_dir)


def start_writer(
    cfg: DictConfig, spec: Any, run_dir: Path, tools: dict[str, tuple[str, str]] | None = None
) -> ResultsWriter:
    """Lock the run directory, check a resume, then write ``environment.json`` (versions, device, the
    derived model config, the ``tools`` the launcher runs: see :func:`autotuner.model.runtime.environment`;
    the :func:`fingerprint` a resume is checked against) and open the results.

    Every check comes before the first write, so a refused run leaves the directory as it was.
    With several processes each rank writes its own ``results.rank<N>.{jsonl,csv}``; :func:`finish`
    merges them into ``results.{jsonl,csv}`` on rank 0.
    """
    run_dir = Path(run_dir)
    claim_run_dir(run_dir)
    if cfg.resume:
        check_resume(cfg, spec, run_dir)
    else:
        check_fresh(run_dir, spec.world)
    rank, world = spec.rank, spec.world
    record = None
    if rank == 0:
        record = {
            "environment": environment(spec.device, tools),
            "case": spec.case,
            "dtype": spec.dtype,
            "points": [p.label for p in spec.points],
            "ops": [op.name for op in spec.ops],
            "transformer_engine_spec": spec.use_transformer_engine,
            "routing": {"mode": spec.routing.mode, "zipf_s": spec.routing.zipf_s},  # moe.*: MoE ops' input
            "transformer_config": {
                k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                for k, v in vars(spec.tf_config).items()
                if not k.startswith("_")
            },
            "model_args": {k: v for k, v in vars(spec.model_args).items()},
            "notes": spec.notes,
            "world_size": world,
            "fingerprint": fingerprint(cfg, spec),
        }
        if cfg.resume:  # a resume may measure other ops or points: the record lists what the run holds
            earlier = load_environment(run_dir)
            for key in ("points", "ops"):
                listed = earlier.get(key)
                had = [x for x in listed if isinstance(x, str)] if isinstance(listed, list) else []
                record[key] = list(dict.fromkeys([*had, *record[key]]))
    writer = ResultsWriter(run_dir, resume=bool(cfg.resume), stem=results_stem(rank, world))
    if writer.dropped_tail is not None:
        print(
            f"warning: dropped the torn last line of {writer.jsonl} (what a killed writer leaves): "
            f"{writer.dropped_tail[:60]!r}",
            file=sys.stderr,
        )
    if record is None:
        return writer
    atomic_write_text(run_dir / "environment.json", json.dumps(record, indent=2, default=repr) + "\n")
    for note in spec.notes:
        print(f"note: {note}", file=sys.stderr)
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
