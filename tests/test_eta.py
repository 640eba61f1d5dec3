"""The plan's time (autotuner.runner.eta): the rule that gives a row's seconds, and the time left while the
plan runs. How near the estimate comes to a run on a machine is benchmarks.plan_time's figure: a timing on
a shared machine is not a test's."""

from __future__ import annotations

import time

import pytest
import torch

from autotuner.launchers.get_data import GetDataObserver
from autotuner.measure.timer import SamplingPolicy
from autotuner.runner.eta import PRIOR_SHARE, Forecast, Rates


def test_a_row_s_estimated_samples_are_what_the_spread_needs_within_the_policy_s_bounds():
    """The plan's time rests on how many samples a row takes (its accuracy on a machine is
    benchmarks.plan_time's figure): as many as the spread needs for the target, at least the CI's
    six, at most the budget's time or max_samples."""
    policy = SamplingPolicy()
    observer = GetDataObserver(torch.device("cpu"), policy, [])
    forward_s, backward_s = 1e-3, 2e-3
    sample_s = forward_s + backward_s  # a backward sample: its forward, then itself

    def sampling_s(spread: float) -> tuple[float, Rates]:
        rates = Rates(1e12, 1e11, 1e-6, 0.0, relative_iqr=spread)
        return observer.expected_seconds("backward", forward_s, backward_s, rates), rates

    quiet, _ = sampling_s(1e-4)
    for spread in (0.05, 0.1):
        noisy, rates = sampling_s(spread)
        needed = rates.samples_for(policy.target_rel_ci)
        assert 6 < needed < policy.max_samples and needed * sample_s < policy.budget_s
        assert noisy - quiet == pytest.approx((needed - 6) * sample_s)
    loud, _ = sampling_s(1.0)
    assert loud - quiet == pytest.approx(policy.budget_s - 6 * sample_s)


def test_the_time_left_is_the_plan_s_estimate_until_rows_finish_then_their_pace():
    forecast = Forecast({"a": 10.0, "b": 30.0})
    assert forecast.left_s() == pytest.approx(40.0, rel=1e-3)  # before the first row: the plan's estimate
    forecast.started = time.monotonic() - 20.0  # row a took twice its estimate
    forecast.finished("a")
    prior = PRIOR_SHARE * 40.0  # the share of the plan weighed as if it had gone as estimated
    assert forecast.left_s() == pytest.approx(30.0 * (20.0 + prior) / (10.0 + prior), rel=1e-3)
