"""Machine noise: how far this CPU's own speed moves, before any prediction is judged against it.

    python -m benchmarks.machine_noise [--seconds 10] [--block 30] [--gaps 0.1,1,5,20]

A predicted step is built from ops profiled at one moment and compared with steps run at another, so
the machine's drift between the two moments bounds what a comparison can show (benchmarks.predict_accuracy
calls that its A/A spread). This times four probes, one intra-op thread each, in back-to-back blocks
of ``--block`` calls for ``--seconds``, and prints each probe's median call, how far its block medians
spread (90th over 10th percentile, and largest over smallest), and its median beside a second process
running the same probe on another core over its median alone:

* ``l2_gemm``: a 128x256 by 256x512 product, its 0.5 MiB weight in a core's own cache: compute;
* ``l3_gemm``: the same with 4096 outputs, a 4 MiB weight that only the shared last-level cache holds;
* ``dram_copy``: a copy of 64 MiB, far beyond the caches: memory bandwidth;
* ``dispatch``: thirty element-wise ops on 8 KiB tensors: the framework's own cost per op.

Then how a core's caches fare while it waits: a small MLP forward (weights, input and intermediates
about 0.5 MiB, in a core's own cache) timed back to back, and its first call after a gap of ``--gaps``
milliseconds spent sleeping (the virtual core halts) or spinning (it keeps running), as a pipeline
stage waits for its neighbour between its forwards and backwards.

What it showed on this project's VM (2-core AMD EPYC, a Firecracker microVM; session 14, otherwise
quiet; docs/predictor_accuracy.md): within 10 s the GEMMs' and the copy's block medians moved by 6-19%
(90th over 10th percentile), the small ops' by 1.5-2%; beside a second process only the copy slowed
(1.44-1.61x), so the two virtual cores are not one core's hyper-threads; and the MLP's first call after
5 ms asleep took 1.5-2.2x its back-to-back time, after 20 ms 2.7-3.0x (1.2-1.9x and 1.45-2.65x
spinning; two runs): a waiting core does not keep its cache here, which is what a pipeline stage's ops
pay after each wait for a neighbour.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PROBES = ("l2_gemm", "l3_gemm", "dram_copy", "dispatch")
# first calls after each gap, per gap and way of waiting
RESUMES = 100


def make_probe(name: str, cpu: int) -> Callable[[], object]:
    """The call ``name`` names (PROBES, or ``small_mlp``: the waits' probe), this process pinned to core
    ``cpu`` with one intra-op thread."""
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    if name == "small_mlp":  # a SwiGLU MLP forward: h=64, FFN 176, 128 tokens
        x, up, down = torch.randn(128, 64), torch.randn(2 * 176, 64), torch.randn(64, 176)

        def mlp() -> torch.Tensor:
            gate, value = torch.nn.functional.linear(x, up).chunk(2, dim=-1)
            return torch.nn.functional.linear(torch.nn.functional.silu(gate) * value, down)

        return mlp
    if name in ("l2_gemm", "l3_gemm"):
        x = torch.randn(128, 256)
        weight = torch.randn(512 if name == "l2_gemm" else 4096, 256)
        return lambda: torch.nn.functional.linear(x, weight)
    if name == "dram_copy":
        source = torch.randn(16 * 2**20)
        target = torch.empty_like(source)
        return lambda: target.copy_(source)
    small = torch.randn(2048)

    def dispatch() -> None:
        for _ in range(10):
            small.add(1.0).mul(2.0).relu()

    return dispatch


def block_medians(name: str, seconds: float, block: int, cpu: int, warm: Any = None) -> list[float]:
    """Median seconds of a call, per block of ``block`` calls, for ``seconds`` on core ``cpu`` (``warm``, an
    event: set once warmed up)."""
    call = make_probe(name, cpu)
    for _ in range(3 * block):  # warm: the allocator, the caches, the CPU's clock
        call()
    if warm is not None:
        warm.set()
    medians = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        times = []
        for _ in range(block):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return medians


def resumed_calls(gap_s: float, spin: bool, cpu: int) -> tuple[float, float]:
    """(median seconds of the first call after a gap of ``gap_s``, of the calls back to back) of the
    ``small_mlp`` probe on core ``cpu``."""
    mlp = make_probe("small_mlp", cpu)
    for _ in range(1000):
        mlp()
    first, after = [], []
    for _ in range(RESUMES):
        if spin:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(gap_s)
        start = time.perf_counter()
        mlp()
        middle = time.perf_counter()
        for _ in range(4):
            mlp()
        first.append(middle - start)
        after.append((time.perf_counter() - middle) / 4)
    return statistics.median(first), statistics.median(after)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per probe, alone and again beside")
    parser.add_argument("--block", type=int, default=30, help="calls per block")
    parser.add_argument("--gaps", default="0.1,1,5,20", help="milliseconds, comma-separated")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"torch {torch.__version__}, one thread a process, cores {cpus}, {args.seconds:g} s a probe")
    print(f"{'probe':10} {'median':>10} {'p90/p10':>8} {'max/min':>8} {'beside/alone':>13}")
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no state shared with this one
    for name in PROBES:
        alone = block_medians(name, args.seconds, args.block, cpus[0])
        ratio = "one core"
        if len(cpus) > 1:
            # the second process runs a little longer than this one's blocks, so they overlap throughout
            warm = context.Event()
            other = context.Process(
                target=block_medians, args=(name, args.seconds + 1, args.block, cpus[1], warm)
            )
            other.start()
            warm.wait()
            beside = block_medians(name, args.seconds, args.block, cpus[0])
            other.join()
            ratio = f"{statistics.median(beside) / statistics.median(alone):.3f}"
        deciles = statistics.quantiles(alone, n=10)
        print(
            f"{name:10} {statistics.median(alone) * 1e6:8.1f}us {deciles[-1] / deciles[0]:8.3f} "
            f"{max(alone) / min(alone):8.3f} {ratio:>13}"
        )
    print(f"\na small MLP's first call after a gap / its calls back to back (medians of {RESUMES})")
    print(f"{'gap':>8} {'sleeping':>9} {'spinning':>9}  back to back")
    for gap_ms in (float(g) for g in args.gaps.split(",")):
        slept, back_to_back = resumed_calls(gap_ms / 1e3, False, cpus[0])
        spun, _ = resumed_calls(gap_ms / 1e3, True, cpus[0])
        print(
            f"{gap_ms:6g}ms {slept / back_to_back:9.2f} {spun / back_to_back:9.2f} {back_to_back * 1e6:.1f}us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
