"""``autotuner-predict RUN_DIR ... seq_len=S [tp=.. pp=.. dp=.. ...]``: a layout's step time and memory per
GPU predicted from profiled runs (``--help`` lists every setting; docs/predict.md every term).

Prints the table (stages, step, memory, MFU, each figure's source, the commands that would measure what is
missing) and writes ``prediction.json`` and, beside it, ``prediction.html``. A GPU's prediction without a
calibration is refused, naming what measures it. ``autotuner-validate`` takes the same settings and
also runs the layout's real training steps (autotuner.validate), through :func:`run`'s ``check``.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotuner.cli import entry, parse
from autotuner.predict.command import COMMAND, run
from autotuner.termination import ending_as_a_command


@ending_as_a_command("autotuner.predict")
@entry(COMMAND)
def main(argv: Sequence[str] | None = None) -> int:
    dirs, args, _ = parse(COMMAND, argv)
    return run(COMMAND, dirs, args)


if __name__ == "__main__":
    raise SystemExit(main())
