"""Layout ranking: does the predictor order layouts as their real steps do, measured side by side?

    python -m benchmarks.layout_ranking [--case llama_small] [--layouts pp2,pp2last1,pp2first1]
        [--rounds 6] [--repeats 5]

What ``python -m autotuner.tune`` is for is the order of the layouts, and an order can be checked where
an absolute step time cannot: this machine's speed drifts by more than the predictor's 5% target within
minutes (benchmarks.machine_noise), which moves both numbers of a predicted / measured ratio apart, but
two layouts measured back to back drift alike. Each round calibrates the machine, profiles the stage ops
once (warm and flushed, at the layouts' common point: the layouts compared differ only in how they split
the layers, so the same rows serve all of them: benchmarks.predict_accuracy.profile), predicts every
layout from those rows, and runs each layout's real training steps (autotuner.validate.steps) in the
order A B C, then C B A (a drift linear over the round moves every layout's mean alike). Per layout
after the first: its predicted step over the first's, and its measured step (the mean of its two runs)
over the first's, in the same round. Printed: the medians over the rounds, the measured ratio's 95%
confidence interval (autotuner.measure.timer.median_ci, from 6 rounds), and the verdict on the order:
"right" when that interval lies wholly on the side of 1 the prediction is on, "wrong" when wholly on
the other, "unresolved" when it holds 1 (the layouts are too close for this machine to order).

The default compares the llama-shaped 4-layer model at PP=2 split evenly (2 + 2 layers), with the last
stage relieved of a layer (3 + 1: Megatron's ``num_layers_in_last_pipeline_stage=1``) and with the first
relieved (1 + 3); the output layer and loss weigh about as much as a layer there, so the predictor puts
3 + 1 ahead and 1 + 3 behind.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from autotuner.measure.timer import median_ci
from autotuner.predict.prediction import load_calibration_for, predict
from autotuner.termination import unwinding_on_sigterm
from autotuner.validate.steps import run_steps
from benchmarks.predict_accuracy import (
    CASES,
    LAYOUTS,
    calibrate_machine,
    layout_of,
    profiled_runs,
    steps_arguments,
)


def one_round(case_name: str, names: list[str], repeats: int) -> dict[str, tuple[float, float]]:
    """{layout: (predicted step s, measured step s)} of one round (module docstring)."""
    case = CASES[case_name]
    layouts = {name: layout_of(name) for name in names}
    points = {(lay.tp, lay.pp, lay.dp, lay.ep, lay.gpus) for lay in layouts.values()}
    if len(points) != 1:
        raise SystemExit(f"the layouts {names} differ in more than their split: compare splits of one layout")
    steps_args = steps_arguments(case, layouts[names[0]])
    with tempfile.TemporaryDirectory(prefix="layout-ranking-") as folder:
        calibration = Path(folder) / "calibration.json"
        calibrate_machine(calibration)
        runs = profiled_runs(case, layouts[names[0]], Path(folder), calibration)
        cal = load_calibration_for(runs, str(calibration))
        predicted = {name: predict(runs, lay, cal).step_seconds for name, lay in layouts.items()}
        measured: dict[str, list[float]] = {name: [] for name in names}
        for order in (names, names[::-1]):
            for name in order:
                out = Path(folder) / f"{name}-{len(measured[name])}.json"
                measured[name].append(run_steps(*steps_args, layouts[name], out, repeats=repeats).step_s)
    return {name: (predicted[name], statistics.mean(measured[name])) for name in names}


def order_verdict(predicted: float, measured: list[float]) -> tuple[str, tuple[float, float] | None]:
    """("right" | "wrong" | "unresolved" | "too few rounds", the measured ratio's 95% CI) (docstring)."""
    ci = median_ci(sorted(measured))
    if ci is None:
        return "too few rounds", None
    low, high = ci
    if low <= 1 <= high or predicted == 1:
        return "unresolved", ci
    return ("right" if (predicted < 1) == (high < 1) else "wrong"), ci


@unwinding_on_sigterm()  # a SIGTERM removes the temporary folders of steps and profiles, then ends
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="llama_small", help=f"one of {', '.join(CASES)}")
    parser.add_argument(
        "--layouts",
        default="pp2,pp2last1,pp2first1",
        help=f"the first is the reference; of {', '.join(LAYOUTS)}",
    )
    parser.add_argument("--rounds", type=int, default=6, help="calibrate + profile + predict + measure")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per measurement")
    args = parser.parse_args()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS] + ([args.case] if args.case not in CASES else [])
    if unknown or len(names) < 2:
        parser.error(f"unknown {unknown}" if unknown else "give two layouts at least")
    rounds = [one_round(args.case, names, args.repeats) for _ in range(args.rounds)]
    reference = names[0]
    print(f"{args.case}, {args.rounds} rounds, each layout's step over {reference}'s in the same round")
    print(
        f"{'layout':10} {'predicted':>10} {'measured':>10} {'95% CI':>18}  {'order':12} steps ms (pred/meas)"
    )
    for name in names:
        steps = ", ".join(f"{1e3 * r[name][0]:.0f}/{1e3 * r[name][1]:.0f}" for r in rounds)
        if name == reference:
            print(f"{name:10} {'1':>10} {'1':>10} {'':>18}  {'':12} {steps}")
            continue
        predicted = [r[name][0] / r[reference][0] for r in rounds]
        measured = [r[name][1] / r[reference][1] for r in rounds]
        verdict, ci = order_verdict(statistics.median(predicted), measured)
        interval = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"
        print(
            f"{name:10} {statistics.median(predicted):10.3f} {statistics.median(measured):10.3f} "
            f"{interval:>18}  {verdict:12} {steps}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
