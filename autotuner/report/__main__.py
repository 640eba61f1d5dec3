"""``autotuner-report RUN_DIR [RUN_DIR ...] [out=DIR] [calibration=FILE]``

One run directory: (re)writes its ``report.html`` and figures in place. Several: one report with every
figure overlaid per run and a speed-up table against the first, written to ``out`` (default
``runs/compare/<time>/``). Bad input (a directory without ``results.jsonl``, a line or value in it the
report cannot use, an ``out`` that is a file, an unreadable calibration): one line on stderr, exit code
2, nothing written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from autotuner.cli import Command, entry, parse, setting
from autotuner.errors import UserError, say_error
from autotuner.termination import ending_quietly_on_a_closed_pipe


@dataclass(frozen=True)
class ReportSettings:
    out: str | None = setting(
        None,
        "the folder to write report.html and its figures into (default: the run directory; several "
        "runs: runs/compare/<time>/)",
        "DIR",
    )
    calibration: str | None = setting(
        None, "a calibration file or preset name (default: calibration.json in each run directory)", "FILE"
    )


COMMAND = Command(
    "autotuner-report",
    "autotuner.report",
    "Make report.html (figures embedded) from run directories of autotuner (several: overlaid, with "
    "speed-ups against the first).",
    "RUN_DIR",
    ReportSettings,
)


@ending_quietly_on_a_closed_pipe
@entry(COMMAND)
def main(argv: list[str] | None = None) -> int:
    paths, args, _ = parse(COMMAND, argv)
    from autotuner.report import build_report

    run_dirs = [Path(p) for p in paths]
    out = Path(args.out) if args.out else None
    calibration = Path(args.calibration) if args.calibration else None
    if out is None and len(run_dirs) > 1:
        out = Path("runs") / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    started = time.perf_counter()
    try:
        page = build_report(run_dirs, out, calibration)
    except UserError as exc:
        say_error(COMMAND.name, exc)
        return exc.exit_code
    print(f"report: {page} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
