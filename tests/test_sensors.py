"""Each sensor on ops whose true figures are known by construction, and the timer's sampling."""

from __future__ import annotations

import dataclasses
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


def _sleep(seconds: float):
    return lambda: time.sleep(seconds)


def test_sampler_stops_on_precision_for_a_steady_op():
    policy = SamplingPolicy(warmup=1, min_samples=5, budget_s=10, target_rel_ci=0.05)
    measurement = sample(DeviceTimer(CPU), _sleep(0.002), policy)
    assert measurement.stop_reason == "precision"
    assert measurement.rel_ci <= 0.05 and measurement.samples >= 6
    assert 2.0e6 <= measurement.median_ns < 2.0e6 * 3  # a sleep never returns early
    assert "ci_target_missed" not in measurement.warnings


def test_sampler_stops_on_budget_when_the_target_is_out_of_reach():
    policy = SamplingPolicy(warmup=0, min_samples=5, budget_s=0.05, target_rel_ci=0.0)
    measurement = sample(DeviceTimer(CPU), _sleep(0.004), policy)
    assert measurement.stop_reason == "budget" and 5 <= measurement.samples < 40
    assert "ci_target_missed" in measurement.warnings


def test_sampler_stops_at_max_samples_and_honours_min_samples():
    capped = sample(
        DeviceTimer(CPU),
        _sleep(0.0005),
        SamplingPolicy(warmup=0, max_samples=7, budget_s=60, target_rel_ci=0),
    )
    assert capped.stop_reason == "max_samples" and capped.samples == 7
    floor = sample(
        DeviceTimer(CPU), _sleep(0.0005), SamplingPolicy(warmup=0, min_samples=12, target_rel_ci=10)
    )
    assert floor.stop_reason == "precision" and floor.samples >= 12


def test_iqr_rule_stops_on_four_agreeing_samples_and_reports_a_miss():
    """The iqr rule (adaptive_autorange's) may stop at 4 samples, where the CI rule needs 6 at least."""
    policy = SamplingPolicy(warmup=1, min_samples=4, budget_s=10, precision_rule="iqr", target_rel_iqr=0.5)
    quick = sample(DeviceTimer(CPU), _sleep(0.002), policy)
    assert quick.stop_reason == "precision" and quick.samples == 4 and quick.rel_iqr <= 0.5
    assert quick.rel_ci is None and "few_samples(4)" in quick.warnings
    assert not any(w.endswith("_target_missed") for w in quick.warnings)
    assert quick.columns()["precision_rule"] == "iqr"
    strict = dataclasses.replace(policy, target_rel_iqr=0.0, budget_s=0.05)
    missed = sample(DeviceTimer(CPU), _sleep(0.004), strict)
    assert missed.stop_reason == "budget" and "iqr_target_missed" in missed.warnings
    assert "ci_target_missed" not in missed.warnings


def test_short_forward_calls_are_timed_in_blocks_and_prepare_is_excluded():
    x = torch.randn(16)
    blocked = sample(
        DeviceTimer(CPU), lambda: x + 1, SamplingPolicy(warmup=1, max_samples=10, min_block_s=0.001)
    )
    assert blocked.calls_per_sample > 1 and blocked.median_ns < 1e6
    prepared = sample(
        DeviceTimer(CPU),
        lambda: None,
        SamplingPolicy(warmup=0, max_samples=3, budget_s=60),
        prepare=_sleep(0.01),
    )
    assert prepared.calls_per_sample == 1 and prepared.median_ns < 5e6  # the 10 ms prepare is not timed


def test_warnings_flag_a_noisy_op_and_a_drifting_op():
    calls = []

    def noisy():
        calls.append(1)
        time.sleep(0.001 if len(calls) % 2 else 0.004)

    policy = SamplingPolicy(warmup=0, min_samples=20, max_samples=20, budget_s=60, target_rel_ci=0)
    noisy_warnings = sample(DeviceTimer(CPU), noisy, policy).warnings
    assert any(w.startswith("noisy") for w in noisy_warnings)

    delay = [0.001]

    def drifting():
        delay[0] *= 1.06  # 20 calls: the last third is about 2.5x slower than the first
        time.sleep(delay[0])

    drift_warnings = sample(DeviceTimer(CPU), drifting, policy).warnings
    assert any(w.startswith("drift(+") for w in drift_warnings)
    steady = Measurement(times_ns=[100.0] * 30, stop_reason="precision", target_rel_ci=0.02)
    assert steady.warnings == [] and Measurement(times_ns=[1.0] * 4).warnings[0] == "few_samples(4)"


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
