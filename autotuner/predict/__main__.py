"""Predict a layout's step time and memory from profiled runs.

    python -m autotuner.predict RUN_DIR [RUN_DIR ...] seq_len=2048 tp=2 pp=4 dp=8 micro_batch_size=1 \\
        global_batch_size=512 [vpp=1] [recompute=none|selective|full] [sequence_parallel=false] \\
        [distributed_optimizer=false] [dtype=bf16] [calibration=FILE] [validate=false] [repeats=5] \\
        [--json OUT]

Prints the table (stages, step, memory, MFU, each figure's source, the commands that would measure what
is missing; ``--slurm DIR``: also as SLURM arrays) and writes ``prediction.json`` (``--json``; default: in
the first run directory). dtype defaults to the runs' dtype; the calibration to the one the first run
kept (calibration.json). ``validate=true`` also runs the layout's real training steps on this machine
and prints predicted against measured step time and peak memory (autotuner.predict.validate).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotuner.errors import UserError
from autotuner.predict.layout import Layout
from autotuner.predict.prediction import load_calibration_for, load_runs, predict, render
from autotuner.predict.settings import parse_settings as parse_key_values
from autotuner.results.atomic import atomic_write_text

INT_KEYS = ("seq_len", "tp", "pp", "vpp", "dp", "ep", "micro_batch_size", "global_batch_size", "repeats")
BOOL_KEYS = ("sequence_parallel", "distributed_optimizer", "validate")
STR_KEYS = ("recompute", "dtype", "calibration")
KEYS = (*INT_KEYS, *BOOL_KEYS, *STR_KEYS)


def parse_settings(items: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split the arguments into run directories and ``key=value`` settings, typed; UserError (one line)
    for an unknown key, a value of the wrong type, or what is missing."""
    kinds = {**dict.fromkeys(INT_KEYS, int), **dict.fromkeys(BOOL_KEYS, bool), **dict.fromkeys(STR_KEYS, str)}
    dirs, settings = parse_key_values(items, kinds)
    if not dirs:
        raise UserError("no run directory given: pass the directory of a run of python -m autotuner.main")
    if "seq_len" not in settings:
        raise UserError("seq_len= is required: give the training sequence length, e.g. seq_len=2048")
    return dirs, settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autotuner.predict",
        description=__doc__.split("\n\n")[0],
        epilog=f"settings (key=value): {', '.join(KEYS)}",
    )
    parser.add_argument("args", nargs="+", help="run directories, then key=value settings")
    parser.add_argument("--json", help="write the prediction here (default: <first run>/prediction.json)")
    parser.add_argument(
        "--slurm",
        metavar="DIR",
        help="write the profiling runs that would measure what is missing as SLURM array task files here",
    )
    args = parser.parse_args(argv)
    try:
        dirs, settings = parse_settings(args.args)
        runs = load_runs(dirs)
        calibration = load_calibration_for(runs, settings.pop("calibration", None))
        validating, repeats = settings.pop("validate", False), settings.pop("repeats", 5)
        if "dtype" not in settings:
            dtypes = runs.dtypes
            settings["dtype"] = dtypes[0] if len(dtypes) == 1 else "bf16"
        layout = Layout(**settings)
        out = Path(args.json) if args.json else Path(dirs[0]) / "prediction.json"
        if out.is_dir() or not out.parent.is_dir():
            raise UserError(f"--json {out}: give a file in an existing folder")
        pred = predict(runs, layout, calibration)
        print(render(pred))
        record = pred.to_json()
        if validating:  # the real steps of this layout (autotuner.predict.validate)
            from autotuner.predict.validate import model_overrides, validate
            from autotuner.predict.validate import render as render_validation

            case = str(runs.env.get("case") or pred.model.case)
            checked = validate(pred, case, model_overrides(Path(dirs[0])), repeats=repeats)
            print("\n" + render_validation(checked))
            record["validation"] = checked.to_json()
        atomic_write_text(out, json.dumps(record, indent=1) + "\n")
        if args.slurm and pred.plan is not None and pred.plan.runs:
            print("\n" + pred.plan.text(pred.plan.slurm(args.slurm)))
    except UserError as exc:
        print(f"autotuner.predict: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(
            f"autotuner.predict: error: cannot write the prediction: {exc.strerror or exc}: "
            "give a path you can write",
            file=sys.stderr,
        )
        return 2
    print(f"\nprediction written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
