"""Timing one phase of one op: device-correct timers, warm-up, repeated samples, plain-data results.

Gotchas this guards against:

* Asynchronous devices. On CUDA, ``time.perf_counter`` around a call measures how long the host took to
  *launch* the kernels, not how long they ran. We record CUDA events on the stream before and after the
  call and read the elapsed time between them after synchronising, so host launch time is never reported
  as op time. On CPU the op runs synchronously and ``perf_counter_ns`` brackets it.
* Work that belongs to the next sample. Each sample may have an untimed ``prepare`` step (the backward
  phase runs its forward there, then the timed call is the backward alone); we synchronise after
  ``prepare`` so none of its queued kernels leak into the timed window.
* Cold starts. Warm-up calls (first-call allocations, lazy initialisation, caches, the allocator growing
  its pool) run before any sample is kept.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Measurement:
    """Raw per-sample times of one (op, phase, point) plus derived statistics. Times in nanoseconds."""

    times_ns: list[int] = field(default_factory=list)
    warmup: int = 0
    stop_reason: str = ""

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
    def min_ns(self) -> float:
        return float(min(self.times_ns))

    @property
    def iqr_ns(self) -> float:
        if self.samples < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times_ns, n=4, method="inclusive")
        return float(q3 - q1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DeviceTimer:
    """Times a single call on the device it runs on (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_ns(self, run: Callable[[], Any]) -> int:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            return int(start.elapsed_time(end) * 1e6)
        begin = time.perf_counter_ns()
        run()
        return time.perf_counter_ns() - begin


@dataclass
class SamplingPolicy:
    """How many samples: warm-up calls, then at least ``min_samples`` and until ``budget_s`` of sampling
    has passed or ``max_samples`` are taken."""

    warmup: int = 2
    min_samples: int = 5
    max_samples: int = 100
    budget_s: float = 1.0


def sample(
    timer: DeviceTimer,
    run: Callable[[], Any],
    policy: SamplingPolicy,
    prepare: Callable[[], Any] | None = None,
) -> Measurement:
    """Warm up, then take timed samples of ``run`` (each after an untimed ``prepare``)."""
    for _ in range(policy.warmup):
        if prepare is not None:
            prepare()
        run()
    measurement = Measurement(warmup=policy.warmup)
    started = time.perf_counter()
    while True:
        if prepare is not None:
            prepare()
        timer.synchronize()
        measurement.times_ns.append(timer.time_ns(run))
        n = measurement.samples
        if n >= policy.max_samples:
            measurement.stop_reason = "max_samples"
            break
        if n >= policy.min_samples and time.perf_counter() - started >= policy.budget_s:
            measurement.stop_reason = "budget"
            break
    return measurement
