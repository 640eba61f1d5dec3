"""``autotuner-validate RUN_DIR ... seq_len=S [tp=.. pp=.. dp=.. ...] [repeats=5]``: a layout predicted as
``autotuner-predict`` predicts it, then its real training steps run here, and predicted against measured
is printed and recorded in ``prediction.json`` (``"validation"``); the measured steps are kept beside it
(``prediction.steps.json``). Steps that fail are one line, exit 1, the prediction kept.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.cli import Command, UsageError, entry, parse, setting
from autotuner.predict.command import CheckFailed, PredictSettings, run
from autotuner.predict.inputs import ModelShape
from autotuner.predict.prediction import Prediction
from autotuner.termination import ending_as_a_command
from autotuner.validate.steps import StepsFailed
from autotuner.validate.validate import model_overrides, render, validate


@dataclass(frozen=True)
class ValidateSettings(PredictSettings):
    """autotuner-predict's settings, then how many steps to measure."""

    repeats: int = setting(5, "timed steps, after the warm-up and the metered one", "N")


COMMAND = Command(
    "autotuner-validate",
    "autotuner.validate",
    "Predict a layout from profiled runs, run its real training steps here and compare (docs/predict.md).",
    "RUN_DIR",
    ValidateSettings,
)


def real_steps(
    pred: Prediction, runs: Any, dirs: list[str], args: Any, out: Path, profiled: ModelShape
) -> dict[str, Any]:
    """The prediction's layout run for real: the profiled run's model (its hf./tf. overrides), at the
    predicted depth where that is not the runs'."""
    case = str(runs.env.get("case") or pred.model.case)
    depth = pred.model.num_layers if pred.model.num_layers != profiled.num_layers else None
    try:
        overrides = model_overrides(Path(dirs[0]), depth)
        checked = validate(
            pred, case, overrides, repeats=args.repeats, steps_out=out.with_suffix(".steps.json")
        )
    except StepsFailed as exc:
        raise CheckFailed(str(exc)) from exc
    print("\n" + render(checked))
    return checked.to_json()


@ending_as_a_command("autotuner.validate")
@entry(COMMAND)
def main(argv: Sequence[str] | None = None) -> int:
    dirs, args, _ = parse(COMMAND, argv)
    if args.repeats < 1:  # refused here, before the prediction, not by the steps' process after it
        raise UsageError(f"repeats={args.repeats} must be at least 1: give e.g. repeats=5")
    return run(COMMAND, dirs, args, check=real_steps)


if __name__ == "__main__":
    sys.exit(main())
