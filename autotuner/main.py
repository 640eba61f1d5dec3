"""Entry point: ``python -m autotuner.main case=<name> launcher=<get_data|nsys|torch_profiler> [overrides]``.

Before Hydra runs anything, :func:`preflight` composes the config for every job the command line asks
for (each combination of a ``-m`` sweep) and validates it, so bad input (an unknown case, op, launcher or
config field, an impossible shape) ends with one line on stderr and exit code 2 before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import errno
import io
import itertools
import os
import re
import shlex
import sys
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from autotuner.cli import invoked_as
from autotuner.config import (
    CONFIG_DIR,
    LAUNCHER_SCHEMAS,
    compose_config,
    open_dict_overrides,
    register_configs,
    settings_listing,
    short_error,
)
from autotuner.errors import OneLineParser, UserError, say_error
from autotuner.results import RunFileNotWritten
from autotuner.results.atomic import check_writable
from autotuner.termination import (
    end_on_a_closed_pipe,
    forget_stop,
    interrupting_on_sigint,
    stopping_with_torchrun,
    unwinding_on_sigterm,
)


def _hydra_flags() -> argparse.ArgumentParser:
    """Hydra 1.3's own command-line flags, as its ``hydra.main`` parses them (its ``--help`` lists them),
    so the checks before a run read the command line as Hydra's run will, and an unknown flag
    (``--dry-run`` for ``dry_run=true``) is refused before the run directory is claimed."""
    parser = OneLineParser(prog="autotuner", add_help=False)
    for flags in (("--help", "-h"), ("--hydra-help",), ("--version",), ("--resolve",), ("--run", "-r")):
        parser.add_argument(*flags, action="store_true")
    parser.add_argument("--multirun", "-m", action="store_true")
    parser.add_argument("--shell-completion", "-sc", action="store_true")
    parser.add_argument("--cfg", "-c", choices=["job", "hydra", "all"])
    parser.add_argument("--package", "-p")
    parser.add_argument("--config-path", "-cp")
    parser.add_argument("--config-name", "-cn")
    parser.add_argument("--config-dir", "-cd")
    parser.add_argument("--experimental-rerun")
    infos = ["all", "config", "defaults", "defaults-tree", "plugins", "searchpath"]
    parser.add_argument("--info", "-i", nargs="?", const="all", choices=infos)
    parser.add_argument("overrides", nargs="*")
    return parser


@dataclasses.dataclass(frozen=True)
class CommandLine:
    """The command line read once: the app's ``key=value`` overrides (``hf.``/``tf.`` ones opened, see
    autotuner.config.open_dict_overrides), Hydra's own (``hydra.*``), the user's config folders as the one
    ``hydra.searchpath`` override the compose API understands, whether it is a ``-m`` sweep, and whether
    Hydra is only asked to print something (``--help``, ``--cfg``, ``--info``, ...: nothing is checked)."""

    argv: list[str]
    overrides: list[str]
    hydra_overrides: list[str]
    search_path: list[str]
    multirun: bool
    prints_only: bool


def parse_command_line(argv: list[str]) -> CommandLine:
    """Read the command line as Hydra's run will. The checks before a run compose the shipped primary
    config, so another one (``--config-name``, ``--config-path``) would be checked as what it is not: a
    user's own groups and options come in through ``--config-dir``. Raises UserError."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args, unknown = _hydra_flags().parse_known_args(argv)
    except SystemExit:
        lines = said.getvalue().strip().splitlines() or ["a bad option"]
        message = lines[-1].split("error: ", 1)[-1].removesuffix(" (see --help)")
        raise UserError(f"{message}: see python -m autotuner.main --help") from None
    if unknown and "=" in unknown[0] and not unknown[0].startswith("-"):
        raise UserError(
            f"{unknown[0]}: the key=value settings go together, after Hydra's flags "
            "(e.g. --cfg job case=tiny dry_run=true), not on both sides of one"
        )
    if unknown:
        raise UserError(
            f"unknown option {unknown[0]}: see python -m autotuner.main --help (settings are key=value, "
            "e.g. dry_run=true)"
        )
    if args.experimental_rerun is not None:  # it loads a pickle that Hydra wrote
        raise UserError(
            "--experimental-rerun is not supported: run the command again with the run's settings (its "
            ".hydra/overrides.yaml), or finish it with resume=true hydra.run.dir=<its folder>"
        )
    if args.hydra_help and args.overrides:
        raise UserError("--hydra-help takes no settings: run python -m autotuner.main --hydra-help alone")
    doing = {o.split("=", 1)[0] for o in args.overrides}
    if args.shell_completion and not doing & {"install", "uninstall", "query"}:
        raise UserError("--shell-completion needs what to do: install=bash, uninstall=bash or query=bash")
    own = "add config groups or options of your own with --config-dir DIR"
    if args.config_name not in (None, "config", "config.yaml"):
        raise UserError(f"--config-name {args.config_name}: the one primary config is 'config'; {own}")
    if args.config_path is not None and Path(os.path.abspath(args.config_path)) != CONFIG_DIR.resolve():
        raise UserError(f"--config-path {args.config_path}: the shipped configs cannot be replaced; {own}")
    prints = args.help or args.hydra_help or args.version or args.cfg or args.info or args.shell_completion

    def is_hydra(arg: str) -> bool:
        key = arg.lstrip("+~").split("=", 1)[0]
        return key.startswith(("hydra.", "hydra/")) or key == "hydra"

    searched = [o for o in args.overrides if o.lstrip("+").split("=", 1)[0] == "hydra.searchpath"]
    return CommandLine(
        argv=list(argv),
        overrides=[o for o in args.overrides if not is_hydra(o)],
        hydra_overrides=[o for o in args.overrides if is_hydra(o) and o not in searched],
        search_path=_search_path(args.config_dir, searched),
        multirun=args.multirun,
        prints_only=bool(prints),
    )


def _register_resolvers() -> None:
    from autotuner.model.cases import available_cases

    def ops() -> str:
        from autotuner.op_mapping import ordered_tests

        return "\n  ".join(
            "\n".join(textwrap.wrap(f"{t.name:18} {t.description}", 108, subsequent_indent=" " * 21))
            for t in ordered_tests()
        )

    def cases() -> str:
        return "\n  ".join(textwrap.wrap(", ".join(available_cases()), 108))

    OmegaConf.register_new_resolver("autotuner_cases", cases, replace=True)
    OmegaConf.register_new_resolver("autotuner_ops", ops, replace=True)
    OmegaConf.register_new_resolver("autotuner_settings", settings_listing, replace=True)
    OmegaConf.register_new_resolver("autotuner_launchers", lambda: ", ".join(LAUNCHER_SCHEMAS), replace=True)
    OmegaConf.register_new_resolver(
        "autotuner_prog", lambda: invoked_as("autotuner", "autotuner.main"), replace=True
    )


def _expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """Every job of a ``-m`` sweep as a plain override list (``case=a,b`` gives two jobs)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([f"{key}={override.get_value_element_as_str()}"])
    return [list(combo) for combo in itertools.product(*choices)] or [[]]


@dataclasses.dataclass
class Job:
    """One job of the command line (each combination of a ``-m`` sweep): its overrides, its config composed
    once (``hydra``: Hydra's own node, for where the run goes), and its RunSpec resolved once, on first use
    (autotuner.runner.spec.resolve_spec)."""

    overrides: list[str]
    cfg: DictConfig
    hydra: DictConfig
    _spec: Any = None
    run: Any = None  # the RunDirectory held before Hydra's run, where its folder is known in advance

    @property
    def spec(self) -> Any:
        if self._spec is None:
            from autotuner.runner.spec import resolve_spec

            self._spec = resolve_spec(self.cfg)
        return self._spec


def compose_jobs(line: CommandLine) -> list[Job]:
    """Every job of the command line, composed. Raises UserError."""
    from hydra.errors import HydraException

    try:
        combos = _expand_sweeps(line.overrides)
    except HydraException as exc:
        raise UserError(f"cannot parse the overrides: {short_error(exc)}") from exc
    jobs = []
    for combo in combos:
        cfg = compose_config([*combo, *line.search_path, *line.hydra_overrides], with_hydra=True)
        with open_dict(cfg):
            hydra_node = cfg.pop("hydra")
        jobs.append(Job(combo, cfg, hydra_node))
    return jobs


def preflight(line: CommandLine) -> list[Job]:
    """Compose and validate every job the command line asks for; the jobs. Raises UserError."""
    import autotuner.capture.replay  # noqa: F401  (registers capture=<file> with autotuner.runner.spec)
    from autotuner.launchers import check_settings as check_launcher_settings
    from autotuner.results import calibration

    jobs = compose_jobs(line)
    for job in jobs:
        _check_added_keys(job.cfg, job.overrides)
        check_launcher_settings(job.cfg, job.spec)
        if job.cfg.calibration:  # a file named on the command line: refused before Hydra makes the run folder
            calibration.load(job.cfg.calibration)
    _check_output_dir(line, jobs[0], resume=any(job.cfg.resume for job in jobs))
    return jobs


def _check_added_keys(cfg: DictConfig, job: list[str]) -> None:
    """Hydra's ``+key=`` (and ``++key=``) adds a key where the schema has none, and nothing reads it:
    ``+timing.budget=0.1`` ran with the default budget, without a word. The schema's own settings, and
    the model's (``hf.*``, ``tf.*``: checked against the real configs), pass; so does a key without a dot
    or with a package (``+extra=fast``, ``+group@pkg=x``), which may append a config group of the user's
    (--config-dir). Raises UserError."""
    for override in job:
        if not override.startswith("+"):
            continue
        key = override.lstrip("+").split("=", 1)[0]
        if key.startswith(("hf.", "tf.", "hydra.")) or "." not in key or "/" in key or "@" in key:
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if schema is None or not dataclasses.is_dataclass(schema):
            continue
        names = [f.name for f in dataclasses.fields(schema)]
        if leaf not in names:
            close = difflib.get_close_matches(leaf, names, n=1)
            hint = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else "see --help"
            raise UserError(f"{key} is not a setting (the + adds a key nothing reads): {hint}")


def _search_path(config_dir: str | None, searched: list[str]) -> list[str]:
    """A user's own config folders as the one override the compose API understands: ``--config-dir DIR``
    (a flag only Hydra's command line reads) joined to any ``hydra.searchpath=[...]``, in the order Hydra's
    run searches them, after the shipped configs. So a launcher or config group option a user adds there
    passes the checks here as it will pass Hydra's own composition. Raises UserError."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    paths: list[str] = []
    if config_dir is not None:
        folder = Path(os.path.abspath(config_dir))  # as Hydra resolves it
        if not folder.is_dir():
            raise UserError(
                f"--config-dir {config_dir} is not a folder: point it at a folder of config YAML files"
            )
        paths.append(f"file://{folder}")
    for arg in searched:
        try:
            entries = OverridesParser.create().parse_override(arg).value()
        except HydraException:
            entries = None
        if not isinstance(entries, list):
            raise UserError(f"bad {arg}: give a list of folders, hydra.searchpath=[file:///abs/dir]")
        paths += [str(p) for p in entries]
    if not paths:
        return []
    quoted = ("'" + p.replace("'", "\\'") + "'" for p in paths)
    return [f"hydra.searchpath=[{','.join(quoted)}]"]


def _check_output_dir(line: CommandLine, job: Job, resume: bool) -> None:
    """The folder Hydra will write into (``hydra.run.dir``, or ``hydra.sweep.dir`` under ``-m``) must be a
    folder, or creatable: Hydra creates it after our checks and fails with a traceback. Nothing is created
    here. With ``resume=true`` it must name an earlier run: a folder named by the clock (``${now:}``, the
    default) is a new one, where a resume would find nothing and quietly measure everything again. Raises
    UserError."""
    group, leaf = ("sweep", "dir") if line.multirun else ("run", "dir")
    key = f"hydra.{group}.{leaf}"
    node = OmegaConf.select(job.hydra, group)
    pattern = OmegaConf.to_container(node, resolve=False).get(leaf) if node is not None else None
    anew = _named_anew(pattern) if resume and isinstance(pattern, str) else None
    if anew is not None:
        folder = pattern[: pattern.index(anew)]
        OmegaConf.update(job.hydra, f"{group}.{leaf}", folder[: folder.rfind("/") + 1] or ".", force_add=True)
        raise UserError(_no_run_to_resume(key, Path(str(OmegaConf.select(job.hydra, f"{group}.{leaf}")))))
    try:
        value = OmegaConf.select(job.hydra, f"{group}.{leaf}")
    except Exception:  # noqa: BLE001 - a value only Hydra's own launch resolves (its runtime): Hydra reports it
        return
    if value is None:
        return
    if not str(value).strip():  # Hydra would write the run into the current folder, among its files
        raise UserError(f"{key}= is empty: give the run a folder of its own, e.g. {key}=runs/mine")
    check_writable(value, f"{key}={value}", folder=True)


def _named_anew(pattern: str) -> str | None:
    """The part of a run folder's pattern that names each run anew, or None: the clock (``${now:}``, the
    default), or the run id ``torchrun --standalone`` draws for each job (a uuid4; _shared_run_dir names
    the folder by it when no hydra.run.dir is given and SLURM gives no job id)."""
    if "${now:" in pattern:
        return "${now:"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    drawn = not os.environ.get("SLURM_JOB_ID") and re.fullmatch(
        r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", run_id
    )
    return run_id if drawn and f"job-{run_id}" in pattern else None


def _no_run_to_resume(key: str, parent: Path) -> str:
    """The one line refusing ``resume=true`` without the run's folder, naming the newest candidate."""
    earlier = (
        [d for d in parent.glob("*") if d.is_dir() and not d.name.startswith(".")] if parent.is_dir() else []
    )
    newest = f" (the newest in {parent}: {max(earlier, key=lambda d: d.stat().st_mtime)})" if earlier else ""
    return f"resume=true needs the folder of the run to resume: add {key}=<that folder>{newest}"


_JOBS: list[Job] = []  # this command's jobs (main), whose specs Hydra's run of each job takes up


def _job_of(cfg: DictConfig) -> Job:
    """The job Hydra runs: the one preflight composed for the same config, or, for a job that started in
    a process of its own (a sweep's job sent to SLURM), a new one."""
    for job in _JOBS:
        if job.cfg == cfg:
            return job
    _JOBS.append(Job([], cfg, OmegaConf.create()))
    return _JOBS[-1]


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def _app(cfg: DictConfig) -> None:
    import autotuner.capture.replay  # noqa: F401  (registers capture=<file>; a sweep's job may start here)
    from autotuner.launchers import launch
    from autotuner.launchers.common import RunDirectory
    from autotuner.model.host_heap import keep_freed_memory

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    job = _job_of(cfg)
    if job.run is None or job.run.path != run_dir.resolve():
        job.run = RunDirectory(run_dir)
    try:
        spec = job.spec
        keep_freed_memory(spec.device)  # before the run's environment records it (autotuner.model.host_heap)
        code = launch(cfg, spec, job.run)
    except UserError as exc:
        say_error("autotuner", exc)
        raise SystemExit(exc.exit_code) from None
    except BrokenPipeError:  # the reader of the run's table stopped reading (| head): its rows are on disk
        end_on_a_closed_pipe(at_once=int(os.environ.get("WORLD_SIZE", 1)) > 1)
    except RunFileNotWritten as exc:  # a full disk mid-run: what was measured is on disk, whole
        _end_not_written(exc)
    except Exception:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            # The other ranks may be waiting for this one in a collective, and a normal exit can block
            # in the process group's teardown: leave at once, so torchrun stops the job and names us.
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        raise
    # Also after failed ops (the report lists them); under torchrun only rank 0, which merged the rows.
    if cfg.report and spec.rank == 0 and (run_dir / "results.jsonl").exists():
        _report(run_dir)
    if code and HydraConfig.get().mode == RunMode.MULTIRUN:
        # Hydra's sweep (and submitit) stop at a SystemExit: the other jobs still deserve their run.
        print(
            f"autotuner: some ops failed in {run_dir} (see its results); the sweep goes on", file=sys.stderr
        )
    elif code:
        raise SystemExit(code)


# The exit status of a run that could not write its files (sysexits.h's EX_IOERR): neither bad input (2)
# nor a finished run with failed ops (1).
EXIT_NOT_WRITTEN = 74
_FIX_NOT_WRITTEN = {
    errno.ENOSPC: "free space there",
    errno.EDQUOT: "free space there (the quota is full)",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
}


def _end_not_written(exc: RunFileNotWritten) -> NoReturn:
    """One line for a run file that could not be written (what, the rows kept, how to finish), then end
    with :data:`EXIT_NOT_WRITTEN`; a rank of several leaves at once (its peers may wait in a collective)."""
    fix = _FIX_NOT_WRITTEN.get(exc.errno or 0, "fix that")
    command = _resume_command(_ORIGINAL_ARGV)
    finish = f"{fix}, then finish the run with: {command}" if command else f"{fix}, then run it again"
    if os.environ.get("RANK", "0") == "0" or int(os.environ.get("WORLD_SIZE", 1)) == 1:
        say_error("autotuner", f"{exc}: {finish}")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.stderr.flush()
        os._exit(EXIT_NOT_WRITTEN)
    raise SystemExit(EXIT_NOT_WRITTEN) from None


def _report(run_dir: Path) -> None:
    """Write the run's report. A report bug must never fail a measured run: it is one line on stderr."""
    try:
        from autotuner.report import write_report

        page = write_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the measurements are on disk whatever happens here
        print(f"autotuner: report not written: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return
    try:
        print(f"report: {page}")
    except BrokenPipeError:  # inside Hydra's job, which would report it as the run's failure
        end_on_a_closed_pipe()


def _shared_run_dir(argv: list[str]) -> list[str]:
    """Under torchrun every rank is a process with its own clock: without an explicit run directory
    they would pick different ``${now:}`` folders. Name it by the job's id instead (SLURM's job id, or
    torchrun's run id, which ``--standalone`` makes unique), so all ranks write into one folder."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 or any(a.startswith("hydra.run.dir=") for a in argv):
        return argv
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if job == "none":
        raise UserError(
            "several processes but no job id to name their shared run directory: "
            "use torchrun --standalone, or pass hydra.run.dir=<folder>"
        )
    return [*argv, f"hydra.run.dir=runs/${{case}}/${{launcher.name}}/job-{job}"]


_ORIGINAL_ARGV: list[str] = []  # the command line as given (main), for the commands that finish a run


def _claim_run_dir(line: CommandLine, jobs: list[Job]) -> None:
    """Lock the run directory and check a resume before Hydra writes its ``.hydra/`` files there.

    Hydra saves the composed config into the run directory before our task starts, and the nsys worker
    and a resume read it back: a second run into a directory a live run holds would already have
    replaced it, and a refused resume would leave its own config in place of the earlier run's. So
    where the directory is known in advance (``hydra.run.dir=`` given, as every resume and torchrun job
    has it, without ``${now:}``; not a ``-m`` sweep) the checks of
    :func:`autotuner.launchers.common.start_writer` run here first; start_writer repeats them for the
    other runs (each check is done once per process). Raises UserError.
    """
    from omegaconf.errors import OmegaConfBaseException

    from autotuner.launchers.common import RunDirectory

    given = [a.split("=", 1)[1] for a in line.hydra_overrides if a.lstrip("+").startswith("hydra.run.dir=")]
    if not given or "now:" in given[-1] or line.multirun:
        return
    (job,) = jobs
    try:
        run_dir = Path(str(OmegaConf.select(job.hydra, "run.dir")))
    except OmegaConfBaseException as exc:
        raise UserError(f"bad hydra.run.dir: {short_error(exc)}: give a folder path") from exc
    run = RunDirectory(run_dir).claim()
    try:
        if not (job.cfg.resume and job.cfg.launcher.name == "nsys"):  # nsys refuses resume=true itself
            run.check(job.cfg, job.spec)
    except UserError:
        run.release()
        raise
    job.run = run


def _dry_run(jobs: list[Job]) -> bool:
    """With ``dry_run=true``, print each job's preview (autotuner.runner.dry_run) and say so; nothing is
    measured and no run directory is made, so this runs before Hydra's run (which creates one). The
    launcher plays no part in it. Raises UserError."""
    if not any(job.cfg.dry_run for job in jobs):
        return False
    if not all(
        job.cfg.dry_run for job in jobs
    ):  # else the jobs asked to measure would be previewed, silently
        raise UserError(
            "a sweep of dry_run=true and dry_run=false jobs: a dry run measures nothing and makes no run "
            "directory; preview with dry_run=true and measure without it, as two commands"
        )
    from autotuner.runner.dry_run import dry_run
    from autotuner.runner.fit import run_limit
    from autotuner.runner.memory_estimate import Workspace

    for job in jobs:  # the job's launcher's workspace (what its observer holds beside the model) and limit
        device = job.spec.device
        print(dry_run(job.spec, Workspace.of(job.cfg, device), run_limit(job.cfg, device)))
    return True


def _resume_command(original: list[str]) -> str | None:
    """The command that finishes this run (the original arguments, ``resume=true`` and its directory; in a
    ``-m`` sweep the sweep's directory, under which each job resumes its own), or None before Hydra named
    the directory, or for nsys (which cannot resume)."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.runtime.choices.get("launcher") == "nsys":
        return None
    dirs = ("resume", "hydra.run.dir", "hydra.sweep.dir")
    kept = [a for a in original if a.lstrip("+~").split("=", 1)[0] not in dirs]
    if hydra_cfg.mode == RunMode.MULTIRUN:
        where = f"hydra.sweep.dir={os.path.abspath(hydra_cfg.sweep.dir)}"
    else:
        where = f"hydra.run.dir={hydra_cfg.runtime.output_dir}"
    args = shlex.join([*kept, "resume=true", where])
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return f"torchrun <the same torchrun options> -m autotuner.main {args}"
    return f"python -m autotuner.main {args}"


@contextlib.contextmanager
def _guarded_run(original: list[str]) -> Iterator[None]:
    """Around Hydra's run: on SIGTERM (what SLURM sends at the time limit or on preemption) say how to
    finish the run, unwind (files being written are cleaned up: autotuner.results.atomic) and end as the
    signal would have, exit status 143 (autotuner.termination); on Ctrl-C the same in one line, no
    traceback, exit status 130; pass the user's umask on to processes that reset it (nsys)."""
    from autotuner.results.atomic import remember_user_umask

    def say_how_to_finish() -> bool:
        command = _resume_command(original)
        if command is None:  # nothing to resume (no directory yet, a sweep, nsys): end as by default
            return False
        if os.environ.get("RANK", "0") == "0":
            # os.write, not print: the handler may interrupt a print to stderr, which must not re-enter
            os.write(2, f"autotuner: terminated; finish the run with: {command}\n".encode())
        return True

    resume_command: list[str | None] = [None]  # read in the handler: Hydra's run is over when it is printed

    def remember_how_to_finish() -> None:
        resume_command[0] = _resume_command(original)

    remember_user_umask()
    try:
        with interrupting_on_sigint(remember_how_to_finish), unwinding_on_sigterm(say_how_to_finish):
            yield
    except KeyboardInterrupt:
        forget_stop()
        if os.environ.get("RANK", "0") == "0":
            finish = f"; finish the run with: {resume_command[0]}" if resume_command[0] else ""
            print(f"autotuner: interrupted{finish}", file=sys.stderr)
        raise SystemExit(130) from None


def main(argv: list[str] | None = None) -> None:
    """Read and check the command line, then hand it to Hydra."""
    original = list(sys.argv[1:] if argv is None else argv)
    stopping_with_torchrun()  # a rank orphaned by torchrun killed outright ends, not runs the plan out
    register_configs()
    _register_resolvers()
    try:
        argv = _shared_run_dir(open_dict_overrides(original))
        line = parse_command_line(argv)
        jobs = [] if line.prints_only else preflight(line)
        if jobs and _dry_run(jobs):
            return
        if jobs:
            _claim_run_dir(line, jobs)
    except UserError as exc:
        say_error("autotuner", exc)
        raise SystemExit(exc.exit_code) from None
    sys.argv = [sys.argv[0], *argv]
    _ORIGINAL_ARGV[:] = original  # for the one line of a run that cannot write its files
    _JOBS[:] = jobs
    try:
        with _guarded_run(original):
            _app()
    finally:
        for job in _JOBS:  # a job Hydra ran in this process holds its folder until here (the report too)
            if job.run is not None:
                job.run.release()
        _JOBS.clear()


def run(argv: list[str]) -> int:
    """Run the CLI in this process and return its exit code (for tests and notebooks: one Megatron import
    serves many runs). ``argv`` as on the command line, without the program name."""
    from hydra.core.global_hydra import GlobalHydra

    saved = sys.argv
    try:
        main(argv)
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()


if __name__ == "__main__":
    main()
