"""Time to result: wall time our sampler needs to reach a relative precision, over the time
torch.utils.benchmark's adaptive_autorange needs for the same precision, on the same ops.

    python benchmarks/time_to_result.py

adaptive_autorange stops when its blocks' IQR/median falls under ``threshold``. For a like-for-like
comparison we take the precision it actually reached, expressed as our metric (the width of the 95%
confidence interval of the median over the median, from its block times), and ask our sampler for that
same precision. Target: ratio <= 1.0 (ours is at least as fast).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.benchmark import Timer

from autotuner.measure.timer import DeviceTimer, Measurement, SamplingPolicy, sample
from benchmarks._ops import op_callables

ROUNDS = 3


def main() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    cases = [
        ("matmul 256", lambda: a @ b),
        *op_callables(["linear_qkv", "core_attention", "mlp", "transformer_layer"]),
    ]
    timer = DeviceTimer(torch.device("cpu"))
    print(f"{'op':28} {'precision':>9} {'ours s':>8} {'torch s':>8} {'ratio':>6}")
    ratios = []
    for label, fn in cases:
        per_round = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            theirs = Timer(stmt="fn()", globals={"fn": fn}).adaptive_autorange(threshold=0.1, max_run_time=10)
            theirs_s = time.perf_counter() - started
            reached = Measurement(times_ns=[t * 1e9 for t in theirs.times]).rel_ci or 0.05
            policy = SamplingPolicy(
                warmup=1, min_samples=6, budget_s=10, target_rel_ci=reached, check_every=2
            )
            started = time.perf_counter()
            sample(timer, fn, policy)
            ours_s = time.perf_counter() - started
            per_round.append((reached, ours_s, theirs_s))
        reached = statistics.median(r[0] for r in per_round)
        ours_s = statistics.median(r[1] for r in per_round)
        theirs_s = statistics.median(r[2] for r in per_round)
        ratios.append(ours_s / theirs_s)
        print(f"{label:28} {reached:9.3%} {ours_s:8.3f} {theirs_s:8.3f} {ours_s / theirs_s:6.2f}")
    worst = max(ratios)
    print(
        f"worst ratio = {worst:.2f}, median {statistics.median(ratios):.2f} (target <= 1.0): "
        f"{'met' if worst <= 1.0 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
