"""Agreement: our sampler's median over torch.utils.benchmark's blocked_autorange median, same callables.

    python benchmarks/agreement.py

Target: |ratio - 1| <= 0.03 for every op. Both measure the same forward callable of a real Megatron op
(and a plain matrix product) in alternating rounds, so machine drift hits both alike; the printed ratio is
the median over rounds of (ours / torch.utils.benchmark). Both run with the same intra-op thread count
(``--threads``, default 1: torch.utils.benchmark's own default, and the stable choice on a small shared
machine, where a 2-thread OpenMP region stalls whenever another process takes a core).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils.benchmark import Timer

from autotuner.measure.timer import DeviceTimer, SamplingPolicy, sample
from benchmarks._ops import op_callables

ROUNDS = 5
TARGET = 0.03


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    threads = parser.parse_args().threads
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    cases = [
        ("matmul 512", lambda: a @ b),
        *op_callables(["linear_qkv", "core_attention", "mlp", "transformer_layer"]),
    ]
    policy = SamplingPolicy(warmup=3, min_samples=20, budget_s=1.0, target_rel_ci=0.01)
    timer = DeviceTimer(torch.device("cpu"))
    print(
        f"{'op':28} {'ours':>10} {'torch':>10} {'ratio':>7}"
        f"  (medians, us; ratio = median over {ROUNDS} rounds)"
    )
    worst = 0.0
    for label, fn in cases:
        ratios, ours_all, theirs_all = [], [], []
        for _ in range(ROUNDS):
            ours = sample(timer, fn, policy).median_ns / 1e3
            theirs = (
                Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
                .blocked_autorange(min_run_time=1.0)
                .median
                * 1e6
            )
            ratios.append(ours / theirs)
            ours_all.append(ours)
            theirs_all.append(theirs)
        ratio = statistics.median(ratios)
        worst = max(worst, abs(ratio - 1))
        print(
            f"{label:28} {statistics.median(ours_all):10.1f} "
            f"{statistics.median(theirs_all):10.1f} {ratio:7.3f}"
        )
    print(f"worst |ratio - 1| = {worst:.3f} (target <= {TARGET}): {'met' if worst <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
