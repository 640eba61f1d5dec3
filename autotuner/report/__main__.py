"""``python -m autotuner.report RUN_DIR [RUN_DIR ...] [--out DIR] [--calibration FILE]``

One run directory: (re)writes its ``report.html`` and figures in place. Several: one report with every
figure overlaid per run and a speed-up table against the first, written to ``--out`` (default
``runs/compare/<time>/``). Bad input (a directory without ``results.jsonl``, a line or value in it the
report cannot use, an ``--out`` that is a file, an unreadable calibration): one line on stderr, exit code
2, nothing written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from autotuner.errors import OneLineParser, UserError
from autotuner.termination import ending_quietly_on_a_closed_pipe


def parse(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m autotuner.report",
        description="Make report.html (figures embedded) from run directories of python -m autotuner.main.",
    )
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a directory with results.jsonl"
    )
    parser.add_argument("--out", type=Path, help="the folder to write report.html and its figures into "
                        "(default: the run directory; several runs: runs/compare/<time>/)")  # fmt: skip
    parser.add_argument(
        "--calibration",
        type=Path,
        help="a calibration JSON (default: calibration.json in each run directory)",
    )
    return parser.parse_args(argv)


@ending_quietly_on_a_closed_pipe
def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from autotuner.report import build_report

    out = args.out
    if out is None and len(args.run_dirs) > 1:
        out = Path("runs") / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    started = time.perf_counter()
    try:
        page = build_report(args.run_dirs, out, args.calibration)
    except UserError as exc:
        print(f"autotuner.report: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"report: {page} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
