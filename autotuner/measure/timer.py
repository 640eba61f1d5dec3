"""Timing one phase of one op: device-correct timers, adaptive sampling, plain-data results.

Several ranks (tensor or expert parallelism under torchrun) call the op together: its collectives pair
one rank's n-th call with every other rank's n-th call. So every decision that changes how often a rank
calls the op is taken by the group, never by one rank (:class:`RankAgreement`): the calls per sample
(the largest any rank's probe asks for), whether samples are checked one by one (any rank's first
sample over a millisecond), and the stop (one small all-reduce per check: stop on precision only when
every rank's rule holds, on budget when the slowest rank's budget is spent). All ranks therefore take
the same samples and give the same ``stop_reason``. A rank that decided alone would leave the loop
while its peers still wait in the op's collectives: a deadlock.

Each timing pitfall is guarded where it is named below; why each guard, and the measurements behind
it, are in docs/measurement.md ("What the timer guards against, and why"); the sampling and its stop
rules (:func:`sample`) in docs/measurement.md ("Sampling and the stop rules").
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autotuner.cli import setting
from autotuner.measure.stats import fenced_mean

PRECISION_RULES = ("ci", "iqr")

# Warning thresholds (documented in docs/measurement.md's table of warnings). A row warns where its
# median cannot be trusted to about 5% either way, not where its samples merely spread: the spread is in
# its columns (iqr_us, rel_ci, stop_reason).
IMPRECISE_CI = 0.10  # the median's 95% CI wider than this share of it
DRIFT_FRACTION = 0.25  # the last third's median this far from the first third's: the machine changed


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
        rel_ci = self.rel_ci
        if rel_ci is None and self.target is not None:  # a fixed count (the profilers') is the user's choice
            found.append(f"few_samples({self.samples})")
        elif rel_ci is not None and rel_ci > IMPRECISE_CI:
            found.append(f"imprecise(ci={rel_ci:.0%})")
        drift = self.drift
        if drift is not None and abs(drift) > DRIFT_FRACTION:
            found.append(f"drift({drift:+.0%})")
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
        end mark, not inside the window (docs/measurement.md: "Freeing what a call returns")."""
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
    """How to sample (docs/measurement.md says when to change each setting).

    After ``warmup`` calls, samples come in blocks of :data:`CHECK_EVERY` until the precision rule holds
    (``precision_rule="ci"``: the median's 95% confidence interval is narrower than ``target_rel_ci`` of it;
    ``"iqr"``: the IQR is under ``target_rel_iqr`` of the median), or ``budget_s`` seconds of sampling have
    passed, or ``max_samples`` were taken; never fewer than ``min_samples``, and neither on precision nor on
    ``max_samples`` before ``min_time_s`` seconds of sampling (the budget is then at least that:
    docs/measurement.md, "A second is one draw of the machine"). A forward sample is a block of calls
    lasting at least ``min_block_s``.
    """

    warmup: int = setting(3, "untimed calls before the first sample", "N")
    min_samples: int = setting(5, "the fewest samples a row keeps", "N")
    max_samples: int = setting(1000, "sampling stops after this many samples", "N")
    budget_s: float = setting(1.0, "sampling stops after this many seconds of it", "S")
    target_rel_ci: float = setting(
        0.02, "precision_rule=ci: stop once the median's 95% CI is narrower than this share of it", "X"
    )
    min_block_s: float = setting(0.0002, "a forward sample is a block of back-to-back calls this long", "S")
    precision_rule: str = setting("ci", "ci or iqr: which rule stops sampling on precision", "RULE")
    target_rel_iqr: float = setting(
        0.05, "precision_rule=iqr: stop once the IQR is under this share of the median", "X"
    )
    min_time_s: float = setting(
        0.0, "the samples span at least this many seconds (the budget is then at least that)", "S"
    )


# Short samples are checked for a stop in blocks of CHECK_EVERY: each check sorts the samples (and under
# torchrun is an all-reduce), which would otherwise cost a short op more than it runs. A sample at least
# CHECK_EACH_SAMPLE_NS long is followed by a check of its own: the check costs microseconds, so waiting
# for a block would only lengthen long ops' measurements.
CHECK_EVERY = 5
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
        if not (check_each or n % CHECK_EVERY == 0 or n == policy.max_samples):
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
