"""Memory repeatability: the measured steps' peak memory, the same steps in fresh processes, run after run.

    python -m benchmarks.memory_repeatability [--runs 6] [--case llama_small] [--layout dp2zero]

A peak is a count of bytes, not a time: the same steps on the same shapes must read the same peak in
every process and, for data-parallel ranks, on every rank. This runs autotuner.validate.steps ``--runs``
times (torchrun for several processes, the case's and layout's definitions from
benchmarks.predict_accuracy) and prints each rank's metered peak above its resident memory, and the
largest over the smallest (target: 1.00 for DP ranks and runs; TP and EP ranks hold different shards).
It is how the profiler's missed frees under gloo were found (autotuner.measure.memory).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from autotuner.predict.layout import Layout
from autotuner.termination import unwinding_on_sigterm
from autotuner.validate.steps import run_steps
from benchmarks.predict_accuracy import CASES, LAYOUTS, MBS, MICROBATCHES, SEQ, cpu_share


@unwinding_on_sigterm()  # a SIGTERM removes the temporary folders of steps and profiles, then ends
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="fresh measurements of the same steps")
    parser.add_argument("--case", default="llama_small", choices=sorted(CASES))
    parser.add_argument("--layout", default="dp2zero", choices=sorted(LAYOUTS))
    args = parser.parse_args()
    parallel = LAYOUTS[args.layout]
    dp = parallel.get("dp", 1)
    layout = Layout(
        seq_len=SEQ, micro_batch_size=MBS, global_batch_size=MBS * MICROBATCHES * dp, dtype="fp32", **parallel
    )
    case = CASES[args.case]
    steps_args = (case[0].split("=", 1)[1], [*case[1:], *cpu_share(layout.gpus), "device=cpu"])
    peaks: list[int] = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="memory-repeatability-") as folder:
            measured = run_steps(*steps_args, layout, Path(folder) / "steps.json", repeats=2)
        ranks = [r.step_peak_bytes for r in measured.ranks]
        peaks += ranks
        print(f"run {run}: peak above resident per rank " + ", ".join(f"{p / 1e6:.3f} MB" for p in ranks))
    print(f"{args.case} {args.layout}: largest / smallest over runs and ranks {max(peaks) / min(peaks):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
