"""Time to result: wall time our sampler needs to reach a relative precision, over the time
torch.utils.benchmark's adaptive_autorange needs for the same precision, on the same ops.

    python benchmarks/time_to_result.py

The two define precision differently: adaptive_autorange stops when the IQR of its block times is under
``threshold`` of their median; our sampler when the 95% confidence interval of the median is under
``target_rel_ci`` of it. Both are asked for the same number (``--precision``, default 5%), and for each
result we also print the precision it reached by the other's yardstick where it can be computed (the
CI needs 6 samples). Both run with the same thread count (``--threads``, default 1). Target: wall-time
ratio ours/torch <= 1.0.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.benchmark import Timer

from autotuner.measure.timer import DeviceTimer, Measurement, SamplingPolicy, sample
from benchmarks._ops import op_callables

ROUNDS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    cases = [
        ("matmul 256", lambda: a @ b),
        *op_callables(["linear_qkv", "core_attention", "mlp", "transformer_layer"]),
    ]
    timer = DeviceTimer(torch.device("cpu"))
    print(
        f"{'op':28} {'ours s':>8} {'torch s':>8} {'ratio':>6}"
        f"  {'ours ci':>8} {'torch iqr':>9} {'torch ci':>8}"
    )
    ratios = []
    for label, fn in cases:
        rounds = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            timer_ = Timer(stmt="fn()", globals={"fn": fn}, num_threads=args.threads)
            theirs = timer_.adaptive_autorange(threshold=args.precision, max_run_time=10)
            theirs_s = time.perf_counter() - started
            policy = SamplingPolicy(warmup=1, budget_s=10, target_rel_ci=args.precision)
            started = time.perf_counter()
            ours = sample(timer, fn, policy)
            ours_s = time.perf_counter() - started
            their_ci = Measurement(times_ns=[t * 1e9 for t in theirs.times]).rel_ci
            rounds.append((ours_s, theirs_s, ours.rel_ci, theirs.iqr / theirs.median, their_ci))
        ours_s, theirs_s = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        ratios.append(ours_s / theirs_s)
        ci = statistics.median(r[2] for r in rounds if r[2] is not None)
        iqr = statistics.median(r[3] for r in rounds)
        their_cis = [r[4] for r in rounds if r[4] is not None]
        their_ci = f"{statistics.median(their_cis):8.2%}" if their_cis else f"{'n<6':>8}"
        print(
            f"{label:28} {ours_s:8.3f} {theirs_s:8.3f} {ours_s / theirs_s:6.2f}"
            f"  {ci:8.2%} {iqr:9.2%} {their_ci}"
        )
    worst = max(ratios)
    print(
        f"worst ratio = {worst:.2f}, median {statistics.median(ratios):.2f} (target <= 1.0): "
        f"{'met' if worst <= 1.0 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
