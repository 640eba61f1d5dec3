"""Plan time: the time the runner says a plan will take, before its first row, over the time it took.

    python -m benchmarks.plan_time [--runs 1] [override ...]

The overrides are the profiler's (``case=tiny ops=[mlp]``); none runs the demo's command, ``case=tiny``
(every op of the tiny case at its shapes, get_data's defaults). The estimate (autotuner.runner.eta) is
the plan's FLOPs, bytes and operations at the rates measured at the start, and the samples the sampling
policy's defaults take at the spread measured then. Each run profiles in this process and prints
``estimated X s, took Y s, ratio``, taken from the line that says the estimate to the last row. Target: a
ratio between 0.5 and 2. A job that starts or stops after the estimate moves the time taken and not the
estimate, which is why this is a benchmark and not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

from autotuner.main import run
from autotuner.runner import Runner
from autotuner.runner.eta import Forecast

DEMO = ["case=tiny"]


def estimated_and_taken(overrides: list[str]) -> tuple[float, float]:
    """One run of ``overrides``: the plan's estimated seconds and the seconds from the estimate to its end."""
    forecasts: list[Forecast] = []
    taken: list[float] = []
    forecast, plain_run = Runner._forecast, Runner.run

    def keep(self: Runner, todo: list) -> Forecast | None:
        forecasts.append(forecast(self, todo))
        return forecasts[-1]

    def timed(self: Runner, context: Any) -> Any:
        try:
            return plain_run(self, context)
        finally:
            taken.append(time.monotonic() - forecasts[0].started)

    Runner._forecast, Runner.run = keep, timed
    try:
        with tempfile.TemporaryDirectory(prefix="plan-time-") as folder:
            code = run([*overrides, "progress=false", "report=false", f"hydra.run.dir={folder}"])
    finally:
        Runner._forecast, Runner.run = forecast, plain_run
    if code != 0 or not taken:
        raise SystemExit(f"plan_time: the run of {overrides} failed (exit {code})")
    return forecasts[0].total_s, taken[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="the profiler's overrides (default: the demo's)")
    args = parser.parse_args()
    overrides = args.overrides or DEMO
    for _ in range(args.runs):
        estimated, taken = estimated_and_taken(overrides)
        print(f"estimated {estimated:.1f} s, took {taken:.1f} s, ratio {taken / estimated:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
