"""Each sensor on ops whose true figures are known by construction, and the timer's sampling."""

from __future__ import annotations

import time

import pytest
import torch

from autotuner.launchers.get_data import GetDataObserver
from autotuner.measure.flops import count_flops
from autotuner.measure.memory import SavedTensorsMeter, peak_bytes, weight_bytes
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


def test_saved_tensor_meter_counts_each_storage_once():
    x = torch.randn(64, 64, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(64, 64))
    with SavedTensorsMeter(exclude=[weight]) as meter:
        y = x.exp()  # saves its result (16 KiB)
        z = y[:32] * y[32:]  # saves two views of y's storage: no new bytes
        w = z @ weight[:, :32]  # saves z (8 KiB) and a view of the weight (excluded)
    del w
    assert meter.bytes == 64 * 64 * 4 + 32 * 64 * 4


def test_weight_bytes_counts_tied_storage_once():
    shared = torch.nn.Parameter(torch.randn(10, 10))
    assert weight_bytes([shared, shared, torch.nn.Parameter(torch.randn(5))]) == 400 + 20


def test_flop_counter_on_a_matmul():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 4


def test_timer_measures_a_known_sleep_and_stops_on_budget():
    policy = SamplingPolicy(warmup=1, min_samples=4, max_samples=1000, budget_s=0.05)
    measurement = sample(DeviceTimer(CPU), lambda: time.sleep(0.004), policy)
    assert measurement.stop_reason == "budget"
    assert 4 <= measurement.samples < 40
    assert 4.0e6 <= measurement.median_ns < 4.0e6 * 3  # a sleep never returns early


def test_timer_excludes_the_prepare_step():
    policy = SamplingPolicy(warmup=0, min_samples=3, max_samples=3, budget_s=0)
    measurement = sample(DeviceTimer(CPU), lambda: None, policy, prepare=lambda: time.sleep(0.01))
    assert measurement.stop_reason == "max_samples" and measurement.median_ns < 5e6


def test_measurement_statistics():
    m = Measurement(times_ns=[10, 20, 30, 40, 1000])
    assert (m.median_ns, m.min_ns, m.mean_ns, m.iqr_ns) == (30.0, 10.0, 220.0, 20.0)
    assert Measurement(times_ns=[5]).iqr_ns == 0.0


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
