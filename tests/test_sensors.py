"""Each sensor on ops whose true figures are known by construction, and the timer's sampling."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from itertools import count, cycle, repeat
from typing import Any

import pytest
import torch

from autotuner.launchers.get_data import GetDataObserver
from autotuner.measure.flops import count_flops
from autotuner.measure.memory import (
    SavedTensorsMeter,
    frozen_heap,
    peak_and_held_bytes,
    peak_and_live,
    peak_bytes,
    weight_bytes,
)
from autotuner.measure.timer import DeviceTimer, Measurement, SamplingPolicy, sample
from autotuner.ops_test.base import OpCall, ShapePoint
from autotuner.runner import Phase

CPU = torch.device("cpu")
N, IN, OUT = 96, 128, 320
FP32 = 4


def _linear_phase(phase: str) -> tuple[Phase, torch.nn.Linear]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT, bias=False)
    x = torch.randn(N, IN, requires_grad=True)
    return Phase(phase, OpCall(linear, (x,), linear), seed=0), linear


def test_linear_figures_are_exact():
    observer = GetDataObserver(CPU, SamplingPolicy(warmup=1, min_samples=3, max_samples=3), [])
    forward, linear = _linear_phase("forward")
    observer.model_parameters = list(linear.parameters())
    row = observer.observe(None, ShapePoint(N, 1), forward)
    assert row["weight_bytes"] == IN * OUT * FP32
    assert row["activation_bytes"] == N * IN * FP32  # the saved input; the saved weight is not an activation
    assert row["peak_bytes"] == N * OUT * FP32  # the output
    assert row["flops"] == 2 * N * IN * OUT
    assert row["samples"] == 3 and row["median_us"] > 0

    backward, linear = _linear_phase("backward")
    observer.model_parameters = list(linear.parameters())
    row = observer.observe(None, ShapePoint(N, 1), backward)
    assert row["peak_bytes"] == N * IN * FP32 + IN * OUT * FP32  # grad of the input and of the weight
    assert row["flops"] == 4 * N * IN * OUT
    assert "activation_bytes" not in row


def test_peak_counts_temporaries_and_ignores_older_memory():
    x = torch.randn(1000, requires_grad=True)
    older = torch.randn(4096)

    def op():
        nonlocal older
        older = None  # frees a block that predates the phase: must not lower the peak
        doubled = x + x  # 4000 B
        exp = doubled.exp()  # 4000 B, saved for backward
        squared = exp * exp  # 4000 B
        return squared.sum()  # 4 B

    assert peak_bytes(op, CPU) == 3 * 4000 + 4


def test_a_backward_peak_is_net_of_the_saved_activations_it_frees():
    """As inside a training step: the forward's saved tensor (the exp's result, B bytes) is freed as the
    backward consumes it, before the input's gradient is made, so the peak is B, not B + the gradient."""
    rows, cols, copies = 64, 128, 8
    saved = rows * cols * copies * FP32

    class RepeatExp(torch.nn.Module):
        def forward(self, x):
            return x.repeat(1, copies).exp().sum(dim=1)  # exp saves its result; repeat and sum save sizes

    observer = GetDataObserver(CPU, SamplingPolicy(warmup=1, min_samples=3, max_samples=3), [])
    phase = Phase("backward", OpCall(RepeatExp(), (torch.randn(rows, cols, requires_grad=True),)), seed=0)
    row = observer.observe(None, ShapePoint(rows, 1), phase)
    assert row["peak_bytes"] == saved  # the exp's input gradient, while its saved result still lives
    phase.prepare()  # a forward made before the meter's session: its saved result's free is not seen
    assert peak_bytes(phase.run, CPU) == saved + rows * cols * FP32


def test_saved_tensor_meter_counts_each_storage_once():
    x = torch.randn(64, 64, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(64, 64))
    with SavedTensorsMeter(exclude=[weight]) as meter:
        y = x.exp()  # saves its result (16 KiB)
        z = y[:32] * y[32:]  # saves two views of y's storage: no new bytes
        w = z @ weight[:, :32]  # saves z (8 KiB) and a view of the weight (excluded)
    del w
    assert meter.bytes == 64 * 64 * 4 + 32 * 64 * 4


def test_saved_tensor_meter_counts_only_what_the_forward_leaves_saved():
    """A graph the forward builds and drops (a router's auxiliary terms) frees what it saved; the allocator
    may give that address to a later save, which was then counted once for two storages."""
    x = torch.randn(64, 64, requires_grad=True)
    with SavedTensorsMeter() as meter:
        dropped = x.exp()  # saves its result, freed with it on the next line
        del dropped
        kept = x.sin().exp()  # sin saves x, exp its result
    assert meter.bytes == 2 * 64 * 64 * 4
    del kept


def test_weight_bytes_counts_tied_storage_once():
    shared = torch.nn.Parameter(torch.randn(10, 10))
    assert weight_bytes([shared, shared, torch.nn.Parameter(torch.randn(5))]) == 400 + 20


def test_flop_counter_on_a_matmul():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 4


class ScriptedClock:
    """A host clock that moves only when the op runs, by the next scripted duration (ns), so the sampler's
    stop rules, warnings and budget are checked on exact times instead of sleeps on a busy machine.
    ``prepare`` moves it too (an untimed step still spends the budget's time)."""

    def __init__(self, durations_ns: Iterable[int]) -> None:
        self.now_ns = 0
        self.durations_ns = iter(durations_ns)
        self.ran: list[int] = []  # every call's duration, warm-up and probe included

    def __call__(self) -> int:
        return self.now_ns

    def op(self) -> None:
        self.ran.append(next(self.durations_ns))
        self.now_ns += self.ran[-1]

    def wait(self, ns: int) -> Callable[[], None]:
        def untimed_step() -> None:
            self.now_ns += ns

        return untimed_step


def _scripted(durations_ns: Iterable[int], policy: SamplingPolicy) -> tuple[Measurement, ScriptedClock]:
    clock = ScriptedClock(durations_ns)
    return sample(DeviceTimer(CPU, clock_ns=clock), clock.op, policy), clock


MS = 1_000_000


def _jittered(ns: int) -> Iterator[int]:
    """``ns``, then ``ns`` + 1%, and so on: an op whose spread no precision target of 0 accepts."""
    return cycle([ns, ns + ns // 100])


def test_the_shared_cache_ends_where_a_core_rereads_at_memorys_rate():
    """autotuner.measure.cache.cached_extent on read rates (GB/s by MiB) of a 2-core Intel VM, whose sysfs
    reports a 480 MiB L3: 32 MiB read 2.3x faster than the largest size, 64 MiB 1.1x. A smaller size read
    slowly (a neighbour's burst) does not end the cache where a larger one still reads cached; where no
    size does, there is no shared cache to speak of."""
    from autotuner.measure.cache import cached_extent

    mib = 2**20
    vm = {4: 21.4, 8: 24.2, 16: 26.0, 32: 25.3, 64: 12.8, 128: 10.6, 256: 10.8, 512: 11.0, 1024: 11.1}
    assert cached_extent({k * mib: v for k, v in vm.items()}) == 32 * mib
    dip = {**vm, 8: 12.0}
    assert cached_extent({k * mib: v for k, v in dip.items()}) == 32 * mib
    quiet = {**vm, 64: 20.8}  # a quiet second: the cache keeps more
    assert cached_extent({k * mib: v for k, v in quiet.items()}) == 64 * mib
    assert cached_extent({4 * mib: 12.0, 8 * mib: 13.0, 16 * mib: 11.0}) is None


def test_the_measured_shared_cache_lies_between_a_cores_own_and_the_reported_one():
    """On this machine's CPU: at least the cache a core has to itself, at most what sysfs reports, else one
    of the doubling sizes probed; the flush writes four times it (twice the first size that does not stay)."""
    from autotuner.measure.cache import (
        CacheFlusher,
        last_level_cache_bytes,
        shared_cache_bytes,
        warm_cache_bytes,
    )

    shared, private = shared_cache_bytes(CPU), warm_cache_bytes(CPU)
    assert private <= shared <= last_level_cache_bytes(CPU)
    ratio = shared // private
    assert shared in (private, last_level_cache_bytes(CPU)) or (
        shared % private == 0 and ratio & (ratio - 1) == 0
    )
    assert CacheFlusher(CPU).buffer.numel() == 4 * shared
    assert shared_cache_bytes(CPU) == shared  # measured once a process


def test_the_default_clock_is_the_hosts_and_a_sleep_never_reads_short():
    assert DeviceTimer(CPU).clock_ns is time.perf_counter_ns
    assert DeviceTimer(CPU).time_ns(lambda: time.sleep(0.002), calls=2) >= 4 * MS


def test_sampler_stops_on_precision_for_a_steady_op():
    """A sample over a millisecond is checked at once; the CI needs 6 samples: the sixth stops it."""
    policy = SamplingPolicy(warmup=1, min_samples=5, budget_s=10, target_rel_ci=0.05)
    durations = [2 * MS, 2 * MS + 20_000, 2 * MS - 20_000] * 10
    measurement, clock = _scripted(durations, policy)
    assert measurement.stop_reason == "precision" and measurement.samples == 6
    assert measurement.times_ns == durations[1:7]  # the probe after the warm-up is the first sample
    assert measurement.median_ns == 2 * MS and measurement.rel_ci == pytest.approx(0.02)
    # six samples pin the median to 2%: nothing to distrust, however few they are
    assert len(clock.ran) == 7 and measurement.warnings == []


def test_min_time_keeps_a_precise_op_sampling_until_its_samples_span_it():
    """The steady op above stops at its sixth sample (12 ms) by default; with min_time_s=0.05 precision
    stops it only at the first check past 50 ms, and a budget shorter than that waits for it too. The row
    records the span either way (sampled_s: from the first sample after the probe to the stop). Neither
    does max_samples before it."""
    durations = [2 * MS, 2 * MS + 20_000, 2 * MS - 20_000] * 100
    quick, _ = _scripted(durations, SamplingPolicy(warmup=1, min_samples=5, budget_s=10, target_rel_ci=0.05))
    assert quick.samples == 6 and quick.columns()["sampled_s"] == pytest.approx(10e-3, rel=0.01)
    spanned, _ = _scripted(
        durations, SamplingPolicy(warmup=1, min_samples=5, budget_s=10, target_rel_ci=0.05, min_time_s=0.05)
    )
    # the probe, then 25 samples of 49.98 ms in all and a 26th past 50 ms: the first check past it stops
    assert spanned.stop_reason == "precision" and spanned.samples == 27
    assert spanned.sampled_s == pytest.approx(51.98e-3)
    # max_samples waits for it too: a short op's blocks of back-to-back calls go on past 1000 samples
    capped, _ = _scripted(_jittered(MS // 2), SamplingPolicy(warmup=0, max_samples=20, min_time_s=0.05))
    assert capped.stop_reason == "precision" and capped.samples > 20 and capped.sampled_s >= 0.05
    short_budget, _ = _scripted(
        _jittered(2 * MS),
        SamplingPolicy(warmup=0, min_samples=5, budget_s=0.01, target_rel_ci=0.0, min_time_s=0.05),
    )
    assert short_budget.stop_reason == "budget" and 0.05 <= short_budget.sampled_s < 0.05 + 2.1e-3


@pytest.mark.slow
def test_get_data_rows_record_the_span_timing_min_time_s_asks_for(tmp_path, capsys):
    """timing.min_time_s reaches get_data's sampler: each row of a precise-at-once op (target_rel_ci=1)
    spans at least it and says so in ``sampled_s``; a negative one is refused in one line, exit 2."""
    from autotuner.main import run
    from autotuner.results import load_rows

    args = ["case=tiny", "ops=[final_layernorm]", "shapes.seq_len=[16]", "shapes.micro_batch_size=[1]"]
    args += ["timing.target_rel_ci=1", "progress=false", "report=false"]
    assert run([*args, "timing.min_time_s=0.3", f"hydra.run.dir={tmp_path / 'spanned'}"]) == 0
    rows = load_rows(tmp_path / "spanned" / "results.jsonl")
    assert [r["phase"] for r in rows] == ["forward", "backward"]
    assert all(r["stop_reason"] == "precision" and 0.3 <= r["sampled_s"] < 1.0 for r in rows), rows
    assert run([*args, "timing.min_time_s=-1", f"hydra.run.dir={tmp_path / 'refused'}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "min_time_s" in line]
    assert len(errors) == 1 and "fix timing.*" in errors[0]


def test_samples_under_a_millisecond_are_checked_in_blocks():
    """Short samples are checked in blocks of CHECK_EVERY (5): at 5 samples the CI cannot exist yet, at 10
    it holds."""
    policy = SamplingPolicy(warmup=0, min_samples=5, budget_s=10, target_rel_ci=0.05)
    measurement, _ = _scripted([MS // 2] * 100, policy)
    assert measurement.stop_reason == "precision" and measurement.samples == 10


def test_sampler_stops_on_budget_when_the_target_is_out_of_reach():
    policy = SamplingPolicy(warmup=0, min_samples=5, budget_s=0.05, target_rel_ci=0.0)
    measurement, clock = _scripted(_jittered(4 * MS), policy)
    assert measurement.stop_reason == "budget" and measurement.samples == 14
    # The budget counts from the first sample after the probe, and the first check past it stops.
    spent = measurement.times_ns[1:]
    assert sum(spent[:-1]) < 0.05e9 <= sum(spent) and clock.ran == measurement.times_ns
    # a missed target is the row's stop_reason and rel_ci; its median, precise to under 10%, is trusted
    assert measurement.rel_ci < 0.10 and measurement.warnings == []


def test_the_budget_counts_the_untimed_steps():
    """prepare's time is not in any sample but is in the budget: what the user waits for."""
    policy = SamplingPolicy(warmup=0, min_samples=5, budget_s=0.05, target_rel_ci=0.0)
    clock = ScriptedClock(_jittered(MS))
    measurement = sample(DeviceTimer(CPU, clock_ns=clock), clock.op, policy, prepare=clock.wait(9 * MS))
    assert measurement.stop_reason == "budget" and measurement.samples == 5
    assert measurement.median_ns <= 1.01 * MS


def test_sampler_stops_at_max_samples_and_honours_min_samples():
    capped, _ = _scripted(
        _jittered(MS // 2), SamplingPolicy(warmup=0, max_samples=7, budget_s=60, target_rel_ci=0)
    )
    assert capped.stop_reason == "max_samples" and capped.samples == 7
    # min_samples=12 with checks every 5 samples: the first check that may stop is at 15
    floor, _ = _scripted([MS // 2] * 100, SamplingPolicy(warmup=0, min_samples=12, target_rel_ci=10))
    assert floor.stop_reason == "precision" and floor.samples == 15


def test_iqr_rule_stops_on_four_agreeing_samples_and_reports_a_miss():
    """The iqr rule (adaptive_autorange's) may stop at 4 samples, where the CI rule needs 6 at least."""
    policy = SamplingPolicy(warmup=1, min_samples=4, budget_s=10, precision_rule="iqr", target_rel_iqr=0.5)
    quick, _ = _scripted([2 * MS, 2 * MS, 2 * MS + 100_000, 2 * MS, 2 * MS, 2 * MS] * 2, policy)
    assert quick.stop_reason == "precision" and quick.samples == 4
    assert quick.rel_iqr == pytest.approx(0.0125) and quick.rel_ci is None
    assert quick.warnings == ["few_samples(4)"]
    assert quick.columns()["precision_rule"] == "iqr"
    strict = dataclasses.replace(policy, target_rel_iqr=0.0, budget_s=0.05)
    missed, _ = _scripted([4 * MS, 4 * MS, 5 * MS] * 10, strict)
    assert missed.stop_reason == "budget" and not any("target" in w for w in missed.warnings)


def test_short_forward_calls_are_timed_in_blocks_and_prepare_is_excluded():
    # A 10 us call and a 1 ms block: the probe asks for 100 calls a sample, and is not kept.
    blocked, clock = _scripted(
        repeat(10_000), SamplingPolicy(warmup=1, max_samples=10, min_block_s=0.001, target_rel_ci=0)
    )
    assert blocked.calls_per_sample == 100 and blocked.times_ns == [10_000.0] * blocked.samples
    assert len(clock.ran) == 1 + 1 + blocked.samples * 100  # warm-up, probe, the samples' calls
    # No block under a microsecond op's 1000-call ceiling.
    capped, _ = _scripted(repeat(1), SamplingPolicy(warmup=0, max_samples=5, min_block_s=1.0))
    assert capped.calls_per_sample == 1000
    clock = ScriptedClock(repeat(MS))
    prepared = sample(
        DeviceTimer(CPU, clock_ns=clock),
        clock.op,
        SamplingPolicy(warmup=0, max_samples=3, budget_s=60),
        prepare=clock.wait(10 * MS),
    )
    assert prepared.calls_per_sample == 1 and prepared.times_ns == [MS] * 3  # the 10 ms prepare is not timed


class _Output:
    """What a forward returns, whose freeing costs ``free_ns`` of the scripted clock (a graph's teardown)."""

    def __init__(self, clock: ScriptedClock, free_ns: int) -> None:
        weakref.finalize(self, clock.wait(free_ns))


def test_what_a_call_returns_is_freed_after_the_end_mark():
    """A forward's output (its graph, its saved activations) lives until the backward in training: freeing
    it is not the forward's time."""
    clock = ScriptedClock(repeat(2 * MS))

    def forward() -> _Output:
        clock.op()
        return _Output(clock, free_ns=MS)

    policy = SamplingPolicy(warmup=1, max_samples=6, budget_s=60, target_rel_ci=0)
    measurement = sample(DeviceTimer(CPU, clock_ns=clock), forward, policy)
    assert measurement.calls_per_sample == 1 and measurement.samples == 6
    assert measurement.times_ns == [2.0 * MS] * 6
    assert clock.now_ns == 7 * (2 * MS + MS)  # warm-up and six samples, each freed: after the window


def test_a_block_keeps_its_last_calls_result_past_the_end_mark():
    """In a block only the last call's result waits for the end mark; the others are freed as they return
    (keeping them all would make every call write memory no call had just freed)."""
    clock = ScriptedClock(repeat(10_000))

    def forward() -> _Output:
        clock.op()
        return _Output(clock, free_ns=1_000)

    # a 10 us call and a 1 ms block: 100 calls, 99 frees inside each sample
    policy = SamplingPolicy(warmup=1, max_samples=6, budget_s=60, min_block_s=0.001, target_rel_ci=0)
    measurement = sample(DeviceTimer(CPU, clock_ns=clock), forward, policy)
    assert measurement.calls_per_sample == 100
    assert measurement.times_ns == [(100 * 10_000 + 99 * 1_000) / 100] * measurement.samples


class _HoldsMarker(torch.autograd.Function):
    """An identity whose graph node keeps a Python object until the node itself is freed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, marker: object) -> torch.Tensor:
        ctx.marker = marker
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def test_a_backward_sample_leaves_its_spent_graph_to_be_freed_after_the_end_mark():
    """The backward frees the saved activations as it runs (timed, as in a step); the graph's nodes go
    when its outputs are dropped, which a step does after the layer's backward: after the end mark."""
    clock = ScriptedClock(repeat(MS))
    linear = torch.nn.Linear(4, 4)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return _HoldsMarker.apply(linear(x), _Output(clock, free_ns=MS))

    phase = Phase("backward", OpCall(forward, (torch.randn(2, 4, requires_grad=True),), linear), seed=0)
    phase.prepare()
    assert DeviceTimer(CPU, clock_ns=clock).time_ns(phase.run) == 0
    assert clock.now_ns == MS  # the node was freed, after the window


# A process that writes three 8 MiB blocks from the C heap and frees them together, as a step frees its
# temporaries (torch's CPU tensors come from the same malloc), in rounds; prints the page faults of 20
# rounds after 3, and what its host heap is.
HEAP_CHURN = """
import ctypes, resource, sys, torch
from autotuner.model.host_heap import host_heap, keep_freed_memory
if sys.argv[1] != "defaults":
    keep_freed_memory(torch.device(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def churn():
    blocks = [libc.malloc(8 << 20) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, 8 << 20)
    for block in blocks:
        libc.free(block)
for _ in range(3):
    churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, host_heap())
"""


@pytest.mark.slow
def test_a_cpu_process_keeps_freed_memory_so_no_sample_pays_page_faults():
    """With glibc's defaults the freed blocks go back to the system and every round faults their pages in
    again (24 MiB: 6,144 pages); kept (every process that times on a CPU), none. A CUDA device leaves the
    host heap alone."""
    seen = {}
    for mode in ("defaults", "cpu", "cuda"):
        done = subprocess.run(
            [sys.executable, "-c", HEAP_CHURN, mode], capture_output=True, text=True, check=True, timeout=120
        )
        faults, heap = done.stdout.split(maxsplit=1)
        seen[mode] = int(faults), heap.strip()
    assert seen["defaults"][0] > 20 * 6000 and seen["defaults"][1] == "allocator defaults"
    assert seen["cpu"] == (0, "glibc, freed memory kept: mmap from 32 MiB, never trimmed")
    assert seen["cuda"][0] > 20 * 6000 and seen["cuda"][1] == "allocator defaults"


def test_warnings_flag_an_imprecise_op_and_a_drifting_op_not_a_spread_one():
    policy = SamplingPolicy(warmup=0, min_samples=20, max_samples=20, budget_s=60, target_rel_ci=0)
    noisy, _ = _scripted(cycle([1 * MS, 4 * MS]), policy)
    assert noisy.warnings == [f"imprecise(ci={noisy.rel_ci:.0%})"] and noisy.rel_ci > 0.10
    # a wide spread around a median that many samples pin down: the IQR column says it, no warning
    many = dataclasses.replace(policy, min_samples=400, max_samples=400)
    spread, _ = _scripted(cycle([10 * MS, 11 * MS, 12 * MS, 13 * MS, 14 * MS]), many)
    assert spread.rel_iqr > 0.10 and spread.rel_ci <= 0.10 and spread.warnings == []
    # each call 6% slower than the last: over 20 calls the last third is about 2.5x the first
    drifting, _ = _scripted((int(MS * 1.06**k) for k in count()), policy)
    assert drifting.stop_reason == "max_samples"
    assert [w for w in drifting.warnings if w.startswith("drift(")] == [f"drift({drifting.drift:+.0%})"]
    assert drifting.drift > 0.5
    steady = Measurement(times_ns=[100.0] * 30, stop_reason="precision", target_rel_ci=0.02)
    assert steady.warnings == [] and Measurement(times_ns=[1.0] * 4, target_rel_ci=0.02).warnings[0] == (
        "few_samples(4)"
    )
    # a profiler's fixed count (no target) is the user's launcher setting: not a row's warning
    assert Measurement(times_ns=[1.0] * 4).warnings == []


def test_a_gpu_sample_the_host_issues_slower_than_the_gpu_runs_is_flagged_launch_bound():
    """GPU samples keep the host's time per call beside them (``host_median_us``); where it exceeds the
    GPU's, the op is launch-bound in a step that does not run ahead, and the row says so."""
    gpu = [100_000.0] * 12
    bound = Measurement(times_ns=gpu, host_times_ns=[150_000.0] * 12)
    assert bound.columns()["host_median_us"] == 150.0
    assert bound.warnings == ["launch_bound(host=1.5x)"]
    ahead = Measurement(times_ns=gpu, host_times_ns=[40_000.0] * 12)
    assert ahead.columns()["host_median_us"] == 40.0 and ahead.warnings == []
    assert "host_median_us" not in Measurement(times_ns=gpu).columns()  # a CPU sample is the host's time


def test_median_confidence_interval_from_order_statistics():
    from autotuner.measure.timer import median_ci

    assert median_ci([1, 2, 3, 4, 5]) is None
    values = list(range(1, 101))
    low, high = median_ci(values)
    assert low < 50.5 < high and (low, high) == (41, 60)


def test_measurement_statistics():
    m = Measurement(times_ns=[10, 20, 30, 40, 1000])
    assert (m.median_ns, m.min_ns, m.mean_ns, m.iqr_ns) == (30.0, 10.0, 220.0, 20.0)
    assert Measurement(times_ns=[5]).iqr_ns == 0.0


def test_the_fenced_mean_counts_a_skew_and_leaves_out_a_far_out_stall():
    from autotuner.measure.stats import fenced_mean

    times = [10, 10, 10, 10, 12, 14, 16, 100]
    # inclusive quartiles 10 and 14.5: Tukey's outer fences at -3.5 and 28 leave out the 100 alone
    m = Measurement(times_ns=times)
    assert (m.median_ns, m.mean_ns, m.fenced_mean_ns) == pytest.approx((11, 22.75, 82 / 7))
    assert m.median_ns < m.fenced_mean_ns < m.mean_ns  # the skew counted, the stall not
    assert m.columns()["fenced_mean_us"] == pytest.approx(82 / 7 / 1e3)
    assert fenced_mean([10, 10, 10, 10, 12, 14, 16, 28]) == pytest.approx(110 / 8)  # on the fence: kept
    assert fenced_mean([1, 2, 30]) == 11  # under 4 samples, quartiles mean nothing: the mean


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_backward_phase_times_the_backward_alone(phase):
    forward_calls = []

    class Counting(torch.nn.Module):
        def forward(self, x):
            forward_calls.append(1)
            return x * 2

    call = OpCall(Counting(), (torch.randn(4, requires_grad=True),))
    p = Phase(phase, call, 0)
    if phase == "backward":
        p.prepare()
        before = len(forward_calls)
        p.run()
        assert len(forward_calls) == before  # run() is the backward only
        assert call.inputs[0].grad is not None
    else:
        p.run()
        assert len(forward_calls) == 1


def test_a_forward_after_its_backward_follows_the_backward_of_the_previous_sample():
    """Phase.training_order (timing.forward_after_backward): each prepare runs the backward of what the
    previous run returned, from the backward phase's seeded gradients; the first has none to run; on
    exit the kept graph and the gradients are gone and the phase is back to back again."""
    phase, linear = _linear_phase("forward")
    plain_run = phase.run
    backward = Phase("backward", phase.call, seed=0)
    backward.prepare()
    backward.run()
    expected = linear.weight.grad.clone()  # the same seed: the same output gradients
    linear.weight.grad = None
    with phase.training_order() as order:
        phase.prepare()  # nothing run yet: nothing to run backward
        assert not order.followed and linear.weight.grad is None
        output = phase.run()
        del output  # the timer's reference goes at its end mark; the phase keeps the graph
        phase.prepare()
        assert order.followed
        torch.testing.assert_close(linear.weight.grad, expected, rtol=0, atol=0)
        phase.run()
        phase.prepare()  # the gradients cleared before each backward: not accumulated
        torch.testing.assert_close(linear.weight.grad, expected, rtol=0, atol=0)
        phase.run()
    assert phase._outputs == [] and phase.prepare is None and phase.run == plain_run
    assert linear.weight.grad is None
    with pytest.raises(ValueError, match="graphs=0"), phase.training_order(0):
        pass
    no_grad = Phase("forward", OpCall(lambda x: x * 2, (torch.randn(4),)), 0)
    with no_grad.training_order() as order:
        for _ in range(2):
            no_grad.prepare()
            no_grad.run()
    assert not order.followed  # an output without a gradient: its samples ran back to back


def _graphs_alive(outputs: list[torch.Tensor]) -> int:
    """How many of ``outputs`` (weak references' targets) still hold their graph."""
    return sum(1 for ref in outputs if ref() is not None and ref().grad_fn is not None)


def test_held_graphs_run_backward_oldest_first_and_are_freed_on_exit():
    """Phase.training_order(graphs) (timing.held_activations_mib): a forward holds ``graphs`` graphs from
    the start (as many forwards on entry), and each prepare runs the oldest one's backward; a backward's
    prepare runs forwards until ``graphs`` are held and its run is the oldest one's backward. Counted by
    calls of the op and by weak references to the outputs; with one graph the backward phase is as without
    the block."""
    calls = []
    linear = torch.nn.Linear(8, 8)
    call = OpCall(lambda x: calls.append(1) or linear(x), (torch.randn(4, 8, requires_grad=True),), linear)
    forward, backward = Phase("forward", call, seed=0), Phase("backward", call, seed=0)
    outputs = []
    with forward.training_order(3) as order:
        assert len(calls) == 3 and not order.followed  # held from the start
        for _ in range(5):
            forward.prepare()
            assert order.followed
            outputs.append(weakref.ref(forward.run()))
            # held: this sample's graph and those of the two before it, no more
            assert _graphs_alive(outputs) == min(len(outputs), 3)
    gc.collect()
    assert _graphs_alive(outputs) == 0  # freed on exit
    assert len(calls) == 3 + 5  # then one forward a sample: the held graphs' backwards call no forward

    calls.clear()
    with backward.training_order(3):
        backward.prepare()
        assert len(calls) == 3  # the first prepare fills the queue
        oldest = backward._outputs
        spent = backward.run()
        assert spent is oldest and linear.weight.grad is not None
        backward.prepare()
        assert len(calls) == 4  # then one forward a sample
    assert backward._outputs == [] and linear.weight.grad is None
    calls.clear()
    plain_prepare = backward.prepare
    with backward.training_order(1):
        assert backward.prepare is plain_prepare


def test_static_work_repeats_the_phase_on_fixed_tensors():
    """What a CUDA graph captures (Phase.static_work) computes what the eager phase computes, call after
    call: the backward reuses one forward's activations (retain_graph) and returns the same gradients."""
    eager, linear = _linear_phase("backward")
    eager.prepare()
    eager.run()
    expected = (eager.call.inputs[0].grad.clone(), linear.weight.grad.clone())
    work = eager.static_work()
    for _ in range(2):
        grad_input, grad_weight = work()
        torch.testing.assert_close(grad_input, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(grad_weight, expected[1], rtol=0, atol=0)
    forward, linear = _linear_phase("forward")
    assert torch.equal(forward.static_work()(), linear(forward.call.inputs[0]))


def test_static_work_runs_on_fresh_leaves_and_leaves_the_module_as_it_was():
    """The captured backward's forward runs on twins of the weights (new leaves sharing their storage,
    so no AccumulateGrad node from an earlier forward is reused); the module keeps its own parameters,
    and a tied weight has one twin whose gradient sums both uses, as the eager backward's does."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
    second.weight = first.weight
    model, weight = torch.nn.Sequential(first, second), first.weight
    x = torch.randn(4, 8, requires_grad=True)
    phase = Phase("backward", OpCall(model, (x,), model), seed=0)
    grad_input, grad_weight = phase.static_work()()
    assert first.weight is weight and second.weight is weight
    assert weight.grad is None and x.grad is None  # gradients returned, not accumulated
    phase.prepare()
    phase.run()
    torch.testing.assert_close(grad_input, x.grad, rtol=0, atol=0)
    torch.testing.assert_close(grad_weight, weight.grad, rtol=0, atol=0)


def test_peak_retires_a_block_whose_free_the_profiler_missed_when_its_address_comes_back():
    # (address, bytes): a block of 64 at address 1, then a block of 64 at address 1 again with no free
    # between (a gloo worker thread freed the first), then a block of 32 elsewhere, freed; one older
    # block (address 9) freed during the phase, which must not lower the peak
    events = [(1, 64), (9, -100), (1, 64), (2, 32), (2, -32)]
    assert peak_and_live(events) == (96, 64)
    # a free the events missed and whose address never comes back stays counted (said in the docstring)
    assert peak_and_live([(1, 64), (3, 64)]) == (128, 128)
    # what prepare() left (blocks 1 and 2, 150 B) is the phase's baseline, and its frees are seen
    assert peak_and_live([(1, 100), (2, 50), (3, 40), (1, -100), (4, 80)], metered_from=2) == (40, 20)


def test_peak_and_held_bytes_returns_what_the_phase_left_in_use():
    kept = []

    def phase():
        kept.append(torch.empty(1024))  # 4096 B still in use at the end
        torch.empty(2048).fill_(1.0)  # 8192 B, freed at once

    peak, held = peak_and_held_bytes(phase, CPU)
    assert (peak, held) == (4096 + 8192, 4096)


def test_a_frozen_heap_still_collects_what_is_dropped_in_it_and_thaws_at_its_end():
    class Node:
        pass

    before = Node()
    before.me = before  # a cycle made before the block
    made_before = weakref.ref(before)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        inside = Node()
        inside.me = inside
        made_inside = weakref.ref(inside)
        del inside, before
        gc.collect()
        assert made_inside() is None  # what the rows make and drop is collected
        assert made_before() is not None  # what was alive at the start is not walked
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert made_before() is None


def test_a_run_s_memory_sessions_walk_only_the_objects_it_made(tmp_path, monkeypatch):
    """Each CPU memory session starts with gc.collect(): with the imports and the model frozen it walks only
    what the run made since (a full collection of a Megatron process took about half a second a row)."""
    from autotuner.main import run
    from autotuner.measure import memory

    frozen = []

    class RecordingGc:
        def __getattr__(self, name: str) -> Any:
            return getattr(gc, name)

        def collect(self, *args: Any) -> int:
            frozen.append(gc.get_freeze_count())
            return gc.collect(*args)

    monkeypatch.setattr(memory, "gc", RecordingGc())
    fast = [
        "timing.warmup=1",
        "timing.min_samples=2",
        "timing.max_samples=3",
        "progress=false",
        "report=false",
    ]
    assert run(["case=tiny", "ops=[mlp]", "shapes.seq_len=[32]", f"hydra.run.dir={tmp_path}", *fast]) == 0
    assert frozen[0] == 0  # frozen_heap's own collection, before it freezes
    assert len(frozen) >= 3 and min(frozen[1:]) > len(gc.get_objects()) / 2
    assert gc.get_freeze_count() == 0
