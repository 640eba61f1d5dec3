"""Machine noise: how far this CPU's own speed moves, before any prediction is judged against it.

    python -m benchmarks.machine_noise [--seconds 10] [--block 30] [--gaps 0.1,1,5,20] [--pairs 3]
        [--span-seconds 120] [--windows 0.2,1,5,10,30]

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

Then how long a sample must span to draw the machine's speed rather than one moment of it: the ``l3_gemm``
probe in blocks for ``--span-seconds``, its calls pooled into consecutive windows of each of ``--windows``
seconds (a block's calls in the window it starts in), and how far the windows' medians spread around the
median of all (10th and 90th percentile, smallest and largest). A get_data row samples for about a second by
default (``timing.budget_s``); ``timing.min_time_s`` makes it span longer (autotuner.measure.timer, "A second
is one draw of the machine"). On a 2-core AMD EPYC VM (32 MiB L3), see the timer's docstring.

Then how a core's caches fare while it waits: a small MLP forward (weights, input and intermediates
about 0.5 MiB, in a core's own cache) timed back to back, and its first call after a gap of ``--gaps``
milliseconds spent sleeping (the virtual core halts) or spinning (it keeps running), as a pipeline
stage waits for its neighbour between its forwards and backwards.

What it showed on a 2-core AMD EPYC VM (a Firecracker microVM, otherwise quiet): within 10 s the GEMMs' and
the copy's block medians moved by 6-19% (90th over 10th percentile), the small ops' by 1.5-2%; beside a second
process only the copy slowed (1.44-1.61x), so the two virtual cores are not one core's hyper-threads; and the
MLP's first call after 5 ms asleep took 1.5-2.2x its back-to-back time, after 20 ms 2.7-3.0x (1.2-1.9x and
1.45-2.65x spinning; two runs): a waiting core does not keep its cache here, which is what a pipeline stage's
ops pay after each wait for a neighbour.

Last, a collective between two processes, as a tensor-parallel op's rows and steps run them: gloo's all-reduce
of one layer's activations at the benchmark's point (128 tokens x 256, fp32: 128 KiB), each call after a
barrier as the sampler starts a sample under torchrun (autotuner.measure.timer), in ``--pairs`` fresh pairs of
processes under torchrun one after the other; per pair the median call, the share of calls over STALLED_S and
their median, and the mean over the median. On a 2-core AMD EPYC VM (two runs of four pairs) the
median call took 0.28-0.31 ms and 7-22% of the calls stalled for 3.8-4.2 ms: one tick of the guest's 250 Hz
clock (its kernel runs without preemption and halts an idle virtual core at once:
``haltpoll.guest_halt_poll_ns=0``), so a waiting rank's wake-up can wait for the tick; the mean call read
1.8-3.4x the median. (Pairs started by Python's multiprocessing instead, with a file store, stalled in 2-7% of
calls over eleven pairs the same hour.) The share moves between pairs and runs, and with it a TP=2 op's rows:
two TP=2 profiles of the llama-shaped stage's ops, back to back, had IQRs of 33-57% of their medians (the
layer's and the output layer's) and fenced means 9-28% apart (the layer's forward 5.96 ms and 4.64), which no
number of samples in one profile narrows.

Each of the ``--pairs`` runs twice, in fresh processes each time: with the kernel's default scheduling, then
with both processes (and the threads they start: gloo's worker and transport threads) at real-time priority
(:func:`run_realtime`, SCHED_FIFO's lowest level; ``realtime`` in the table), where the system lets this user
set it. On the same VM (three pairs) the stalls were gone at real-time priority: no call
over STALLED_S, the median call 0.213-0.234 ms, against 7-17% of calls stalled for 3.8-4.2 ms and medians of
0.276-0.299 ms with the default scheduling in the pairs started between them. That fits a woken thread waiting
behind an ordinary thread running on its core until the kernel's next tick (Linux 6.18's EEVDF scheduler lets
the running one finish its slice), which a real-time thread does not: it preempts an ordinary one at once.
``python -m benchmarks.predict_accuracy --realtime`` runs a whole validation (profiles, calibration and steps
alike) that way.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

PROBES = ("l2_gemm", "l3_gemm", "dram_copy", "dispatch")
# first calls after each gap, per gap and way of waiting
RESUMES = 100
# the collective probe: calls per pair of processes, and what counts as a stalled call (a fast one takes
# a few tenths of a millisecond here; a stall, a scheduler tick of 4 ms)
COLLECTIVE_CALLS = 300
STALLED_S = 1e-3
# run_realtime's priority: SCHED_FIFO's lowest level, above every ordinary (SCHED_OTHER) thread.
REALTIME_PRIORITY = 1
# What to say where run_realtime is refused.
REALTIME_REFUSED = "this user may not set SCHED_FIFO: run as root, or raise ulimit -r to 1"


def run_realtime() -> None:
    """This process at real-time priority (SCHED_FIFO, :data:`REALTIME_PRIORITY`), and with it every thread
    and process it starts afterwards (they inherit the policy): a thread woken while an ordinary one runs
    on its core takes the core at once, not at the kernel's next tick (module docstring). Raises
    PermissionError where this user may not (not root, and no real-time limit: ``ulimit -r``)."""
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))


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


def timed_blocks(
    name: str, seconds: float, block: int, cpu: int, warm: Any = None
) -> list[tuple[float, list[float]]]:
    """(seconds from the start to the block's start, its calls' seconds) per block of ``block`` calls of
    ``name`` on core ``cpu``, for ``seconds`` and at least two blocks (``warm``, an event: set once warmed
    up)."""
    call = make_probe(name, cpu)
    for _ in range(3 * block):  # warm: the allocator, the caches, the CPU's clock
        call()
    if warm is not None:
        warm.set()
    blocks = []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds or len(blocks) < 2:
        times = []
        for _ in range(block):
            begin = time.perf_counter()
            call()
            times.append(time.perf_counter() - begin)
        blocks.append((now - start, times))
    return blocks


def block_medians(name: str, seconds: float, block: int, cpu: int, warm: Any = None) -> list[float]:
    """Median seconds of a call, per block of :func:`timed_blocks`, whose spread main() prints."""
    return [statistics.median(times) for _, times in timed_blocks(name, seconds, block, cpu, warm)]


def window_spread(
    name: str, seconds: float, block: int, cpu: int, windows: list[float]
) -> dict[float, list[float]]:
    """Per window length of ``windows`` (seconds): the median of ``name``'s calls in each consecutive
    window of that length (a block's calls in its start's window) over the median of all its calls,
    sorted, from one run of :func:`timed_blocks` for ``seconds``."""
    blocks = timed_blocks(name, seconds, block, cpu)
    overall = statistics.median(t for _, times in blocks for t in times)
    spread = {}
    for window in windows:
        groups: dict[int, list[float]] = {}
        for at, times in blocks:
            groups.setdefault(int(at // window), []).extend(times)
        spread[window] = sorted(statistics.median(g) / overall for g in groups.values())
    return spread


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


def collective_calls(calls: int, realtime: bool) -> None:
    """Under torchrun (two processes, one intra-op thread each): ``calls`` gloo all-reduces of 128 KiB,
    each after a barrier, at real-time priority if ``realtime`` (set before gloo starts its threads, which
    inherit it); rank 0 prints their seconds as one JSON line."""
    import torch.distributed as dist

    if realtime:
        run_realtime()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    activations = torch.ones(128 * 256)
    times = []
    for _ in range(10 + calls):  # the first ten warm up the connection
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(activations)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(json.dumps(times[10:]), flush=True)
    dist.destroy_process_group()


def collective_pair(calls: int, realtime: bool) -> list[float]:
    """The seconds of each call of :func:`collective_calls` in a fresh pair of processes under torchrun, as
    a TP=2 profile and its steps run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "benchmarks.machine_noise", "--collective-worker", str(calls)]
    command += ["--collective-realtime"] if realtime else []
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per probe, alone and again beside")
    parser.add_argument("--block", type=int, default=30, help="calls per block")
    parser.add_argument("--gaps", default="0.1,1,5,20", help="milliseconds, comma-separated")
    parser.add_argument("--pairs", type=int, default=3, help="fresh pairs of processes for the collective")
    parser.add_argument("--span-seconds", type=float, default=120.0, help="the windows' probe run (0: none)")
    parser.add_argument("--windows", default="0.2,1,5,10,30", help="window lengths, seconds, comma-separated")
    parser.add_argument("--collective-worker", type=int, metavar="CALLS", help=argparse.SUPPRESS)
    parser.add_argument("--collective-realtime", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collective_worker:  # one process of a pair (collective_pair)
        collective_calls(args.collective_worker, args.collective_realtime)
        return 0
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
    if args.span_seconds > 0:
        windows = [float(w) for w in args.windows.split(",")]
        print(f"\nl3_gemm for {args.span_seconds:g} s: windows' medians over the median of all calls")
        print(f"{'window':>8} {'windows':>8} {'p10':>6} {'p90':>6} {'min':>6} {'max':>6}")
        for window, medians in window_spread(
            "l3_gemm", args.span_seconds, args.block, cpus[0], windows
        ).items():
            deciles = statistics.quantiles(medians, n=10) if len(medians) > 1 else medians * 9
            print(
                f"{window:7g}s {len(medians):8} {deciles[0]:6.3f} {deciles[-1]:6.3f} {medians[0]:6.3f} "
                f"{medians[-1]:6.3f}"
            )
    print(f"\na small MLP's first call after a gap / its calls back to back (medians of {RESUMES})")
    print(f"{'gap':>8} {'sleeping':>9} {'spinning':>9}  back to back")
    for gap_ms in (float(g) for g in args.gaps.split(",")):
        slept, back_to_back = resumed_calls(gap_ms / 1e3, False, cpus[0])
        spun, _ = resumed_calls(gap_ms / 1e3, True, cpus[0])
        print(
            f"{gap_ms:6g}ms {slept / back_to_back:9.2f} {spun / back_to_back:9.2f} {back_to_back * 1e6:.1f}us"
        )
    print(
        f"\ngloo all-reduce of 128 KiB between two processes under torchrun, each call after a barrier "
        f"({COLLECTIVE_CALLS} a pair)"
    )
    print(f"{'pair':>4} {'scheduling':>10} {'median':>9} {'stalled':>8} {'stall':>8} {'mean/median':>12}")
    policies = {"default": False, "realtime": True}
    try:  # may this user set a real-time priority? (then back to the default: this process times nothing)
        run_realtime()
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        del policies["realtime"]
        print(f"(no realtime pairs: {REALTIME_REFUSED})")
    for pair in range(args.pairs):
        for policy, realtime in policies.items():
            times = collective_pair(COLLECTIVE_CALLS, realtime)
            median = statistics.median(times)
            stalls = [t for t in times if t > STALLED_S]
            stall = f"{statistics.median(stalls) * 1e3:6.2f}ms" if stalls else "-"
            print(
                f"{pair + 1:>4} {policy:>10} {median * 1e3:7.3f}ms {len(stalls) / len(times):8.0%} "
                f"{stall:>8} {statistics.fmean(times) / median:12.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
