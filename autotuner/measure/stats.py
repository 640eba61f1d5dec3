"""What a sum of many calls adds per call: the fenced mean (autotuner.measure.timer, "A sum of calls is
not a sum of medians"). Torch-free, so that the predictor reads in-step times as the launchers read rows."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

# Tukey's "far out" fences: a sample past Q3 + 3 IQR (or below Q1 - 3 IQR) is a stall, not the op's spread
FAR_OUT_IQRS = 3.0


def fenced_mean(times: Sequence[float]) -> float:
    """The mean of ``times`` inside Tukey's outer fences (Q1 - 3 IQR, Q3 + 3 IQR): what a call adds to a
    sum of many calls, its spread's skew counted and a far-out stall left out. Under 4 samples, the mean."""
    if len(times) < 4:
        return float(statistics.fmean(times))
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    low, high = q1 - FAR_OUT_IQRS * (q3 - q1), q3 + FAR_OUT_IQRS * (q3 - q1)
    return float(statistics.fmean(t for t in times if low <= t <= high))
