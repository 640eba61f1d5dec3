"""How long the plan will take, said before its first row, and the progress line's time left.

A call of a phase is estimated from what the dry run counts for it on meta tensors (autotuner.runner.dry_run:
its FLOPs, its bytes moved, the aten operations it dispatches) and this machine's rates, measured at the
start in well under a second (:func:`measure_rates`): a GEMM's FLOP rate in the run's dtype, a copy's bytes
per second, the host's time per aten operation of a small module's forward and backward and the spread of
those times (how many samples a precision target takes), and the time of one memory-sensor session (a
profiler session on a CPU: about a tenth of a second here, the largest cost of a short row). A call takes
the longer of its FLOPs at the GEMM's rate and its bytes at the copy's, plus
its operations' host time. How many calls a row makes is the observer's rule (``expected_seconds`` of
each launcher's observer: get_data's sampling policy, nsys's and torch_profiler's fixed counts).

While the plan runs, the time left is the estimate of the rows left, scaled by how the rows so far compared
with their estimate (:class:`Forecast`), so one wrong rate corrects itself after a few rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Rates:
    """This machine's rates (see :func:`measure_rates`)."""

    flop_per_s: float
    byte_per_s: float
    operation_s: float  # the host's time per aten operation, module and autograd overhead included
    session_s: float  # one memory-sensor session around a trivial call
    relative_iqr: float  # the spread of a short op's times here now (IQR over median): how noisy samples are

    def samples_for(self, target_rel_ci: float) -> float:
        """How many samples the median's 95% CI needs to be narrower than ``target_rel_ci`` of it, at this
        machine's spread: about ``2 x 1.96 x 1.2533 x (IQR / 1.349) / sqrt(n)`` of the median (the
        median's standard error of a normal spread, whose sigma is IQR / 1.349), so
        ``n = (3.64 x relative IQR / target)^2``."""
        return (3.64 * self.relative_iqr / max(target_rel_ci, 1e-9)) ** 2

    def call_seconds(self, flops: float, bytes_moved: float, operations: int) -> float:
        """One call: the longer of its FLOPs and its bytes at the measured rates, plus its host time."""
        return max(flops / self.flop_per_s, bytes_moved / self.byte_per_s) + operations * self.operation_s


def _best_seconds(run: Callable[[], Any], device: torch.device, repeats: int, calls: int = 1) -> float:
    """The fastest of ``repeats`` blocks of ``calls`` calls, per call: the machine's rate, not a moment
    when another process held the cores."""
    run()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure_rates(device: torch.device, dtype: torch.dtype) -> Rates:
    """Measure :class:`Rates` on ``device`` (about 0.3 s on a CPU, and the first memory-sensor session of
    the process, which starts the profiler: 1-2 s)."""
    from autotuner.measure.memory import peak_bytes

    n = 2048 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    gemm = _best_seconds(lambda: a @ a, device, 5)
    # a copy of 16 MiB on a CPU: larger ones would raise the resident set the fit check estimates
    size = (256 if device.type == "cuda" else 16) * 2**20
    src = torch.empty(size // 4, device=device)
    dst = torch.empty_like(src)
    copy = _best_seconds(lambda: dst.copy_(src), device, 5)
    module = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.GELU()).to(device)
    x = torch.randn(1, 8, device=device, requires_grad=True)
    host = _best_seconds(lambda: module(x).sum().backward(), device, 5, calls=20)
    times = []  # the spread of a short op's samples, as the rows' samples are taken: one after another
    for _ in range(400):
        start = time.perf_counter()
        module(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    q1, median, q3 = statistics.quantiles(times, n=4)
    peak_bytes(lambda: None, device)  # the first session of a process starts the profiler: paid here
    session = _best_seconds(lambda: peak_bytes(lambda: None, device), device, 3)
    return Rates(
        flop_per_s=2 * n**3 / gemm,
        byte_per_s=2 * size / copy,
        operation_s=host / MODULE_OPERATIONS,
        session_s=session,
        relative_iqr=(q3 - q1) / median,
    )


# The aten operations of measure_rates's module's forward and backward (LayerNorm, Linear, GELU, the sum
# and its backward), counted with autotuner.runner.memory_estimate.LiveStorages.
MODULE_OPERATIONS = 22


PRIOR_SHARE = 0.1  # Forecast.left_s


def fill_seconds(launcher: str, device: torch.device, phase: str, leave_out: tuple[str, ...] = ()) -> float:
    """What a row's sensors and computed columns cost beside the op's own calls (a profiler session on a
    CPU, a garbage collection, the FLOP counter), measured on a trivial op: autotuner.measure.metrics.fill
    for ``launcher``, once warmed up (the profiler's start-up is a one-off)."""
    from autotuner.measure.metrics import Observed, fill
    from autotuner.ops_test.base import OpCall
    from autotuner.runner import Phase

    linear = torch.nn.Linear(8, 8).to(device)
    call = OpCall(linear, (torch.randn(1, 8, device=device, requires_grad=True),), linear)
    seen = Observed(launcher, phase=Phase(phase, call, 0), device=device)
    fill({}, seen, leave_out)
    start = time.perf_counter()
    fill({}, seen, leave_out)
    return time.perf_counter() - start


class Forecast:
    """The plan's estimated seconds per row, and the time left while it runs: the estimate of the rows
    left, times the ratio of the seconds taken to the seconds estimated for the rows done (1 before the
    first)."""

    def __init__(self, seconds: dict[Any, float]) -> None:
        self.seconds = seconds
        self.started = time.monotonic()
        self.done_estimate = 0.0
        self.left_estimate = sum(seconds.values())

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def finished(self, key: Any) -> None:
        spent = self.seconds.get(key, 0.0)
        self.done_estimate += spent
        self.left_estimate = max(0.0, self.left_estimate - spent)

    def left_s(self) -> float:
        """The rows left, at the pace of the rows done so far: the estimate's ratio of taken to estimated
        seconds, weighed against the estimate itself as if PRIOR_SHARE of the plan had gone as estimated
        (so rows estimated at nothing that take a second do not make the rest look endless)."""
        taken = time.monotonic() - self.started
        prior = max(PRIOR_SHARE * self.total_s, 1.0)
        return self.left_estimate * (taken + prior) / (self.done_estimate + prior)


def human_seconds(seconds: float) -> str:
    """``42 s``, ``3 min 12 s``, ``2 h 21 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {rest} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"
