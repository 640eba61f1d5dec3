"""Timing one phase of one op: device-correct timers, adaptive sampling, plain-data results.

Gotchas this guards against (and records in the row, so a reader knows they were guarded):

* Asynchronous devices. On CUDA, ``time.perf_counter`` around a call measures how long the host took to
  *launch* the kernels, not how long they ran. We record CUDA events on the stream before and after the
  call and read the elapsed time after synchronising, so host launch time is never reported as op time.
  On CPU the op runs synchronously and ``perf_counter_ns`` brackets it.
* Work that belongs to the next sample. Each sample may have an untimed ``prepare`` step (the backward
  phase runs its forward there; the timed call is the backward alone); we synchronise after ``prepare``
  so none of its queued kernels leak into the timed window.
* Timer overhead on short ops. An event pair plus a synchronisation costs single to low double digit
  microseconds on a GPU, ``perf_counter_ns`` well under one on a CPU. Where there is no ``prepare`` (the
  forward phase) a sample is a block of back-to-back calls sized so that the block lasts at least
  ``min_block_s``, and the sample is the block's time divided by its calls.
* Warm caches. With ``flush_cache`` each sample starts after a write over a buffer twice the size of the
  last-level cache (GPU L2, CPU LLC; autotuner.measure.cache) in the untimed step, so no sample reads the
  previous sample's data from cache; blocks are then one call. Without it, small inputs are rotated
  instead (autotuner.runner.Phase): each call reads a different copy.
* The host's launch delay. After the untimed step's synchronisation the GPU is idle, so a sample's start
  event runs at once and the GPU then waits for the host to launch the first kernel: for a backward, the
  autograd engine's start and its hand-over to the device thread, hundreds of microseconds that no kernel
  occupies and that a training step hides behind earlier work. With ``hide_launch`` (CUDA, the default
  there) a spin kernel is queued before the start event, lasting 1.5 times the host's launch time of the
  previous sample; the host queues the sample's kernels while the GPU spins, and the span between the
  events is the GPU running them. It also keeps the GPU busy, so its clocks do not drop between samples.
  On an H100 (Llama-2-7B layer, bf16, s2048_b1) it took get_data from 2 to 8 of 10 rows within 10% of
  nsys's GPU time (linear_qkv backward 735 -> 510 us against 505). As the launches are hidden, an op the
  host issues more slowly than the GPU runs it also reads its GPU time: the host's time per call is kept
  (``host_median_us``), and a row where it exceeds the GPU time is flagged ``launch_bound``; in a step
  such an op costs the host's time unless the host is running ahead.
* Back to back is not how every op runs. Samples follow each other at once, so they time an op whose
  core (or GPU) has just run it; a pipeline stage calls an op after waiting for its neighbour.
  ``timing.idle_before_ms`` (autotuner.launchers.get_data.IdlePause) puts a pause, untimed, before every
  sample, and the rows record it (on this project's CPU VM the tiny case's layer forward, one thread,
  took 3.0-3.3 ms after 2 ms asleep against 2.1-2.8 back to back and 3.3 with the caches flushed). The
  predictor leaves such rows out of a step's back-to-back ops (autotuner.predict.inputs.Measurements):
  inside real pipeline steps the visits after a wait did not run as after a sleep (``python -m
  benchmarks.predict_accuracy --layouts pp2`` prints the stages' visits beside their rows).
* A forward follows its backward. Back to back, each forward sample finds what the op's previous forward
  left: its code and data in the core's caches, the blocks it freed ready for the same allocations. In
  a training step every forward of an op follows the op's backward of the previous micro-batch, which
  touched its weights' gradients and freed its saved activations in between.
  ``timing.forward_after_backward`` runs that backward, untimed, after every forward sample
  (autotuner.runner.Phase.training_order), so each sample is one call after one; the rows record it
  (``forward_after_backward``), the predictor prefers such rows and its profiling plan asks for them in
  its warm runs (autotuner.predict). On this project's CPU VM (one thread, the steps' own
  layers alternated with the steps in one process: ``python -m benchmarks.row_in_step``) the tiny
  layer's forward back to back read 0.84 of its time inside the steps and 0.96 after its backward; the
  llama-shaped layer's 0.96 and 1.09: back to back is a lower bound of a step's forward, after the
  backward near it or above. Off by default: the back-to-back forward is the op's own time, as
  torch.utils.benchmark times it.
* Activations a step holds. A training step keeps every micro-batch's saved activations until its
  backward, so each forward writes them into memory the allocator hands out afresh and each backward reads
  them back after everything the stage ran between; once that is more than the shared cache holds, the
  memory is no longer cached. A sample after its own backward writes into the blocks that backward has
  just freed, still in the cache. ``timing.held_activations_mib`` holds earlier calls' graphs, at least
  that many MiB of what the forward saves (autotuner.runner.Phase.training_order,
  autotuner.measure.memory.graphs_to_hold): a forward sample follows the backward of the oldest held
  graph and writes where that graph's activations lay, a backward sample runs the oldest graph's backward;
  the rows record the bytes held (``held_activation_bytes``). On a 2-core Intel VM (one
  thread, 20 rounds, the rows alternated with the steps in one process: ``python -m
  benchmarks.row_in_step``, two runs an hour apart) the llama-shaped layer's rows read 0.984 and 0.962
  (forward after its backward) and 0.942 and 0.923 (backward) of its time inside the steps by default,
  0.999 and 0.976, 0.991 and 0.959 held (52 and 24 MiB); but the steps predicted from held rows profiled in
  their own processes read no nearer in the same rounds of ``python -m benchmarks.predict_accuracy``, and
  the predictor takes the rows without. Off (0) by default.
* Freeing what a call returns. A forward's output holds its autograd graph and every activation saved
  for the backward; a bare ``run()`` drops it at once, inside the timed window, so the graph's teardown
  and the frees of its tensors were timed as the forward. In training they live until the backward,
  which frees them (as the backward phase's samples do, inside their window). So
  :meth:`DeviceTimer.time_ns` keeps a sample's result until after its end mark; a backward returns its
  spent outputs, whose graph nodes go with them, as a step drops them after the layer's backward. On
  this project's CPU VM (one thread; ``python -m benchmarks.row_in_step`` times both ways side by side,
  in one process with the steps) a forward freed inside its window read 1.7-6.7% longer for the
  llama-shaped layer (median 2.5% over seven runs) and 1-11% for tiny's (3%); a backward's spent graph,
  under 1%. In a block of calls only the last call's result is kept: keeping all of them made every
  call write memory no call had just freed (and, where glibc had given the heap's top back to the
  system, fault its pages in again), and short ops read 1-19% slower for it; the
  block's other calls free theirs as they return, as before.
* The system's page faults. Memory the C library gave back to the system faults its pages in again when
  written, so whether a sample pays faults depends on what the process freed before it: every process
  that times on a CPU keeps its freed memory (autotuner.model.host_heap, which names what it cost).
* A sum of calls is not a sum of medians. The median is the op's own time, robust to the machine's
  stalls; but a training step adds up dozens of visits, and the typical value of a sum of skewed times is
  near the sum of their means. Where the times skew (a CPU; ranks that wait for each other in their
  collectives), medians added up fall short of the step: on this project's CPU VM the tiny case's TP=2
  rows of the layer and the output layer read mean over median 1.05-1.16, and the same ops' visits
  inside its real TP=2 steps 1.04-1.42, alike (in one process both 0.98-1.04). The mean alone carries a
  rare stall a typical step does not contain, so each row also keeps its fenced mean, the mean inside
  Tukey's outer fences (autotuner.measure.stats), which autotuner.predict adds up.
* A second is one draw of the machine. Samples taken within a second share that second's speed, so on a
  machine whose speed moves from second to second (a VM whose host cores and caches other tenants share) a row
  sampled for a second is one draw of it, however many samples it holds, and its confidence interval, computed
  as if the samples were independent, says how well it knows that second, not the machine. On a
  2-core AMD VM a GEMM whose weight sits in the shared cache (``python -m benchmarks.machine_noise``, its
  windows: ``l3_gemm``, 120 s) had medians over 1-second windows of 0.86-1.12 of its median (10th-90th
  percentile), over 10-second ones 0.89-1.06, over 30-second ones 0.90-1.04; one whose weight a core keeps
  (scratch, an hour earlier) 0.95-1.14 over 1 s and 0.98-1.02 over 10 s. The llama-shaped layer's and
  output layer's rows moved between six profiles by 0.12 of their mean (relative standard deviation, the
  four rows' mean) sampled for the default second, by 0.085 with their samples spanning 5 s.
  ``min_time_s`` makes a row's samples span at least that long (no stop on precision or ``max_samples``
  before it, and a budget of at least it), as ``torch.utils.benchmark``'s ``min_run_time`` does; each row
  records the seconds its samples spanned (``sampled_s``). Off by default: a row then costs what it did.
* Cold starts. Warm-up calls (lazy initialisation, first-call allocations, the allocator growing its pool)
  run before any sample is kept.

Sampling is adaptive (:func:`sample`): after warm-up, samples come in blocks of ``check_every`` (one by one
once a sample lasts over a millisecond) until the median is precise enough ("precision"), or the time budget
runs out ("budget"), or ``max_samples`` were taken ("max_samples"), but neither precision nor ``max_samples``
stops it before ``min_time_s`` of sampling, and the budget is at least that; at least ``min_samples`` are
always taken. "Precise enough" is one of two rules (``precision_rule``):

* ``ci`` (the default): the 95% confidence interval of the median is narrower than ``target_rel_ci`` of
  the median. The interval is distribution-free (order statistics), so a skewed or bimodal distribution of
  times does not fool it; it needs at least 6 samples.
* ``iqr``: the interquartile range is under ``target_rel_iqr`` of the median, from at least 4 samples:
  the rule of ``torch.utils.benchmark``'s ``adaptive_autorange``. It can stop after 4 samples, but it
  bounds the spread of the times, not the uncertainty of their median: the spread is the op's and the
  machine's and does not shrink with more samples, so an op that spreads wider than the target stops only
  when a few samples happen to agree, or at the budget. The CI narrows as samples come in.

Several ranks (tensor or expert parallelism under torchrun) call the op together: its collectives pair
one rank's n-th call with every other rank's n-th call. So every decision that changes how often a rank
calls the op is taken by the group, never by one rank (:class:`RankAgreement`): the calls per sample
(the largest any rank's probe asks for), whether samples are checked one by one (any rank's first
sample over a millisecond), and the stop (one small all-reduce per check: stop on precision only when
every rank's rule holds, on budget when the slowest rank's budget is spent). All ranks therefore take
the same samples and give the same ``stop_reason``. A rank that decided alone would leave the loop
while its peers still wait in the op's collectives: a deadlock.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autotuner.measure.stats import fenced_mean

PRECISION_RULES = ("ci", "iqr")

# Warning thresholds (documented in docs/measurement.md's table of warnings).
NOISY_IQR_FRACTION = 0.10
DRIFT_FRACTION = 0.10
FEW_SAMPLES = 10


def median_ci(sorted_times: list[float], z: float = 1.96) -> tuple[float, float] | None:
    """Distribution-free 95% confidence interval of the median from order statistics (None if n < 6).

    The ranks ``n/2 -+ z*sqrt(n)/2`` come from the normal approximation of the binomial count of samples
    below the median.
    """
    n = len(sorted_times)
    if n < 6:
        return None
    half = z * math.sqrt(n) / 2
    lower = max(0, math.floor(n / 2 - half))
    upper = min(n - 1, math.ceil(n / 2 + half) - 1)
    return sorted_times[lower], sorted_times[upper]


@dataclass
class Measurement:
    """Raw per-call times of one (op, phase, point) plus derived statistics. Times in nanoseconds."""

    times_ns: list[float] = field(default_factory=list)
    calls_per_sample: int = 1
    warmup: int = 0
    stop_reason: str = ""
    target_rel_ci: float | None = None
    precision_rule: str = "ci"
    target_rel_iqr: float | None = None
    # On a GPU: per sample, the host's time to issue one call (its launches; the device runs them later)
    host_times_ns: list[float] = field(default_factory=list)
    # get_data: the seconds the sampling loop ran after the warm-up, untimed steps included (the span the
    # samples drew the machine's speed from); None where a launcher does not sample in time
    sampled_s: float | None = None

    @property
    def samples(self) -> int:
        return len(self.times_ns)

    @property
    def median_ns(self) -> float:
        return float(statistics.median(self.times_ns))

    @property
    def mean_ns(self) -> float:
        return float(statistics.fmean(self.times_ns))

    @property
    def fenced_mean_ns(self) -> float:
        return fenced_mean(self.times_ns)

    @property
    def min_ns(self) -> float:
        return float(min(self.times_ns))

    @property
    def iqr_ns(self) -> float:
        if self.samples < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times_ns, n=4, method="inclusive")
        return float(q3 - q1)

    @property
    def rel_ci(self) -> float | None:
        """Width of the median's 95% confidence interval over the median (None: too few samples)."""
        interval = median_ci(sorted(self.times_ns))
        if interval is None or self.median_ns <= 0:
            return None
        return (interval[1] - interval[0]) / self.median_ns

    @property
    def rel_iqr(self) -> float | None:
        """IQR over the median (None: fewer than 4 samples, too few for quartiles to mean anything)."""
        if self.samples < 4 or self.median_ns <= 0:
            return None
        return self.iqr_ns / self.median_ns

    @property
    def precision(self) -> float | None:
        """The statistic the precision rule compares with its target (rel_ci or rel_iqr)."""
        return self.rel_iqr if self.precision_rule == "iqr" else self.rel_ci

    @property
    def target(self) -> float | None:
        """The precision rule's target (None: none, the profiler launchers take a fixed count)."""
        return self.target_rel_iqr if self.precision_rule == "iqr" else self.target_rel_ci

    @property
    def drift(self) -> float | None:
        """Change between the medians of the first and last thirds of the samples, over the median."""
        third = self.samples // 3
        if third < 3 or self.median_ns <= 0:
            return None
        first = statistics.median(self.times_ns[:third])
        last = statistics.median(self.times_ns[-third:])
        return (last - first) / self.median_ns

    @property
    def warnings(self) -> list[str]:
        """Reasons to distrust this measurement (empty when none)."""
        found = []
        if self.samples < FEW_SAMPLES:
            found.append(f"few_samples({self.samples})")
        if self.median_ns > 0 and self.iqr_ns / self.median_ns > NOISY_IQR_FRACTION:
            found.append(f"noisy(iqr={self.iqr_ns / self.median_ns:.0%})")
        drift = self.drift
        if drift is not None and abs(drift) > DRIFT_FRACTION:
            found.append(f"drift({drift:+.0%})")
        precision, target = self.precision, self.target
        reached = precision is not None and target is not None and precision <= target
        if target is not None and self.stop_reason != "precision" and not reached:
            found.append(f"{self.precision_rule}_target_missed")
        host = self.host_median_ns
        if host is not None and self.median_ns > 0 and host > self.median_ns:
            found.append(f"launch_bound(host={host / self.median_ns:.2g}x)")
        return found

    @property
    def host_median_ns(self) -> float | None:
        """Median host time to issue one call (GPU samples only)."""
        return float(statistics.median(self.host_times_ns)) if self.host_times_ns else None

    def columns(self) -> dict[str, Any]:
        """The result-row columns of these times (see autotuner.results), microseconds."""
        return {
            "samples": self.samples,
            "median_us": self.median_ns / 1e3,
            "iqr_us": self.iqr_ns / 1e3,
            "min_us": self.min_ns / 1e3,
            "mean_us": self.mean_ns / 1e3,
            "fenced_mean_us": self.fenced_mean_ns / 1e3,
            "rel_ci": self.rel_ci,
            "stop_reason": self.stop_reason,
            "precision_rule": self.precision_rule if self.target is not None else None,
            "warnings": ";".join(self.warnings),
            **({"host_median_us": self.host_median_ns / 1e3} if self.host_times_ns else {}),
            **({"sampled_s": self.sampled_s} if self.sampled_s is not None else {}),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RankAgreement:
    """Decisions all ranks of the default process group take together (a single process agrees with
    itself, without communication). Each call is one all-reduce of a few numbers, so every rank must
    reach every call: call it only from code all ranks run in step."""

    def __init__(self, device: torch.device) -> None:
        dist = torch.distributed
        self.ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        # gloo reduces host tensors; NCCL only device ones (a "cpu:gloo,cuda:nccl" group takes both).
        self.device = device if device.type == "cuda" else torch.device("cpu")

    def max(self, *values: float) -> list[float]:
        """The largest of each value over the ranks."""
        if self.ranks == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tensor.tolist()

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return self.max(0.0 if flag else 1.0)[0] == 0.0


def _last_result(run: Callable[[], Any], calls: int) -> Any:
    """``calls`` calls of ``run``, the results of all but the last dropped as they return; the last's."""
    for _ in range(calls - 1):
        run()
    return run()


class DeviceTimer:
    """Times a single call (or a block of calls) on the device it runs on.

    With ``barrier`` (several tensor-parallel ranks) every sample starts after a barrier, so all ranks
    enter the op together and no rank's time includes waiting for a late peer in the op's collectives.
    ``clock_ns`` is the host's clock: it times CPU calls and the host's launches, and :func:`sample`
    reads its time budget from it. A test passes a clock that the timed call itself advances, so the
    sampler's rules can be checked on exact, scripted times instead of sleeps on a busy machine.
    """

    def __init__(
        self,
        device: torch.device,
        barrier: bool = False,
        hide_launch: bool = True,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self.cuda = device.type == "cuda"
        self.clock_ns = clock_ns
        self.barrier = barrier
        self.hide_launch = hide_launch and self.cuda
        self._launch_ns = SPIN_FLOOR_NS  # the host's launch time of the last timed call (hide_launch)
        self.last_launch_ns: int | None = None  # the same, unclamped; None on a CPU
        self._spin_cycles_per_ns: float | None = None

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        if self.barrier:
            torch.distributed.barrier()

    def time_ns(self, run: Callable[[], Any], calls: int = 1) -> int:
        """Total time of ``calls`` back-to-back calls of ``run``. The last call's result is freed after the
        end mark, not inside the window (module docstring: "Freeing what a call returns")."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.hide_launch:
                self._spin(SPIN_MARGIN * self._launch_ns)
            launching = self.clock_ns()
            start.record()
            result = _last_result(run, calls)
            end.record()
            self.last_launch_ns = self.clock_ns() - launching
            self._launch_ns = min(max(self.last_launch_ns, SPIN_FLOOR_NS), SPIN_CEILING_NS)
            del result
            end.synchronize()
            return int(start.elapsed_time(end) * 1e6)
        begin = self.clock_ns()
        result = _last_result(run, calls)
        elapsed = self.clock_ns() - begin
        del result
        return elapsed

    def _spin(self, ns: float) -> None:
        """Queue a kernel that keeps the GPU busy for about ``ns`` (``torch.cuda._sleep`` counts clock
        cycles; their rate is measured once with events)."""
        if self._spin_cycles_per_ns is None:
            cycles = 1_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)  # the first launch loads the kernel
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._spin_cycles_per_ns = cycles / max(start.elapsed_time(end) * 1e6, 1.0)
        torch.cuda._sleep(int(ns * self._spin_cycles_per_ns))


# hide_launch: the spin before a sample lasts SPIN_MARGIN times the host's launch time of the last timed
# call, at least SPIN_FLOOR_NS (the first kernel's launch latency) and at most SPIN_CEILING_NS (a host
# that takes longer than that to launch a sample is launch-bound: the samples say so).
SPIN_MARGIN = 1.5
SPIN_FLOOR_NS = 50_000
SPIN_CEILING_NS = 20_000_000


@dataclass
class SamplingPolicy:
    """How to sample (see the module docstring for what each guards against).

    After ``warmup`` calls, samples come in blocks of ``check_every`` until the precision rule holds
    (``precision_rule="ci"``: the median's 95% confidence interval is narrower than ``target_rel_ci`` of it;
    ``"iqr"``: the IQR is under ``target_rel_iqr`` of the median), or ``budget_s`` seconds of sampling have
    passed, or ``max_samples`` were taken; never fewer than ``min_samples``, and neither on precision nor on
    ``max_samples`` before ``min_time_s`` seconds of sampling (the budget is then at least that: the module
    docstring, "A second is one draw of the machine"). A forward sample is a block of calls lasting at least
    ``min_block_s``.
    """

    warmup: int = 3
    min_samples: int = 5
    max_samples: int = 1000
    budget_s: float = 1.0
    target_rel_ci: float = 0.02
    check_every: int = 5
    min_block_s: float = 0.0002
    precision_rule: str = "ci"
    target_rel_iqr: float = 0.05
    min_time_s: float = 0.0


# A sample at least this long is followed by a stopping check of its own: the check (sorting at most
# max_samples numbers) costs microseconds, so waiting for a block of check_every samples would only
# lengthen long ops' measurements.
CHECK_EACH_SAMPLE_NS = 1_000_000


def sample(
    timer: DeviceTimer,
    run: Callable[[], Any],
    policy: SamplingPolicy,
    prepare: Callable[[], Any] | None = None,
    flush: Callable[[], None] | None = None,
    agreement: RankAgreement | None = None,
) -> Measurement:
    """Warm up, then take timed samples of ``run`` (each after an untimed ``prepare`` and ``flush``)
    until the median is precise enough, the budget is spent, or ``max_samples`` are taken.

    A forward sample (no ``prepare``/``flush``) is a block of calls lasting ``min_block_s``; the first
    timed call sizes it, and is kept as the first sample when the block is one call (it ran after the
    warm-up exactly as a sample does; not under a barrier, where samples start after one). With several
    ranks, ``agreement`` makes every decision that changes how often the op is called a group decision
    (module docstring); every rank must then call ``sample`` with the same policy. The budget is counted
    on ``timer.clock_ns``.
    """
    agree = agreement or RankAgreement(torch.device("cpu"))

    def untimed() -> None:
        if prepare is not None:
            prepare()
        if flush is not None:
            flush()
        timer.synchronize()

    for _ in range(policy.warmup):
        untimed()
        timer.time_ns(run)  # discarded; through the timer, so hide_launch learns the launch time
    times: list[float] = []
    host_times: list[float] = []
    calls = 1
    if prepare is None and flush is None:
        probe_ns = max(timer.time_ns(run), 1)
        wanted = max(1, min(1000, math.ceil(policy.min_block_s / (probe_ns * 1e-9))))
        calls = int(agree.max(wanted)[0])
        if calls == 1 and not timer.barrier:
            times.append(probe_ns)
            if timer.last_launch_ns is not None:
                host_times.append(timer.last_launch_ns)
    measurement = Measurement(
        times_ns=times,
        host_times_ns=host_times,
        calls_per_sample=calls,
        warmup=policy.warmup,
        target_rel_ci=policy.target_rel_ci,
        precision_rule=policy.precision_rule,
        target_rel_iqr=policy.target_rel_iqr,
    )
    check_each: bool | None = None  # long samples are checked one by one: decided on the first sample
    # whether the samples span min_time_s: agreed by the ranks at each check, as the stops are
    spanned = policy.min_time_s <= 0
    started = timer.clock_ns()
    while True:
        if measurement.samples < policy.max_samples or not spanned:
            untimed()
            block_ns = timer.time_ns(run, calls)
            measurement.times_ns.append(block_ns / calls)
            if timer.last_launch_ns is not None:
                measurement.host_times_ns.append(timer.last_launch_ns / calls)
            if check_each is None:
                check_each = agree.max(block_ns)[0] >= CHECK_EACH_SAMPLE_NS
        n = measurement.samples
        if not (check_each or n % policy.check_every == 0 or n == policy.max_samples):
            continue
        if n >= policy.min_samples:
            local_s = (timer.clock_ns() - started) * 1e-9
            precise = False
            if local_s >= policy.min_time_s:  # before it no stop on precision: spare the sort of the times
                precision, target = measurement.precision, measurement.target
                precise = precision is not None and target is not None and precision <= target
            not_precise, elapsed = agree.max(0.0 if precise else 1.0, local_s)
            spanned = elapsed >= policy.min_time_s
            if not_precise == 0.0 and spanned:
                measurement.stop_reason = "precision"
                break
            if elapsed >= max(policy.budget_s, policy.min_time_s):
                measurement.stop_reason = "budget"
                break
        if n >= policy.max_samples and spanned:
            measurement.stop_reason = "max_samples"
            break
    measurement.sampled_s = (timer.clock_ns() - started) * 1e-9
    return measurement
