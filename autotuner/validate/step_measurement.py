"""Measured training steps as plain data: each rank's raw times and memory (:class:`RankSteps`), the layout's
measurement of them (:class:`StepMeasurement`), statistics computed from them as properties, as
torch.utils.benchmark's ``Measurement`` keeps its raw times.

A step's time is the slowest rank's (the step ends when the last stage finishes); the reported step time
is the median over the timed steps of that maximum, with its interquartile range; the data-parallel
reduction and the optimizer step are read on the rank the others waited for (``_on_critical_rank``);
the peak memory is the largest over the ranks. What is measured and how:
autotuner.validate.steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autotuner.predict.layout import Layout
from autotuner.validate.in_step import Visit


@dataclass(frozen=True)
class RankSteps:
    """One rank's measurements. Times per step, in step order: ``warmup`` steps, the metered step (not
    timed: 0.0), then the timed steps."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    forward_backward_s: tuple[float, ...]  # the schedule (this rank's micro-batches)
    # the data-parallel communication: the gradients' reductions (sequence-parallel, data-parallel) and,
    # with the distributed optimizer, the parameters' all-gather after Adam
    reduce_s: tuple[float, ...]
    optimizer_s: tuple[float, ...]  # Adam's step and the zeroing of the gradients for the next one
    losses: tuple[float, ...]  # every step's mean loss over its micro-batches; empty off the last stage
    parameter_bytes: int  # this rank's parameters
    resident_bytes: int  # parameters, gradients, optimizer states when the metered step began
    step_peak_bytes: int  # the peak above that during the metered step
    # the ops' seconds per visit inside the timed steps, their fenced mean
    # (autotuner.validate.in_step.IN_STEP_KEYS, those this rank has); empty with activation recompute
    in_step_s: dict[str, float] = field(default_factory=dict)
    # one timed step's op visits (autotuner.validate.in_step.Visit), the step StepMeasurement.timeline_step
    # names, the same on every rank; empty with activation recompute
    timeline: tuple[Visit, ...] = ()
    # when this rank's timeline starts, from the earliest rank's start (the wall clock at each rank's
    # start mark: autotuner.validate.in_step); its visits are counted from that earliest start
    timeline_start_s: float = 0.0
    optimizer_tensors: int = 0  # the tensors this rank's Adam steps (0: a measurement from before it)

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.step_peak_bytes


@dataclass(frozen=True)
class StepMeasurement:
    """Measured training steps of one layout: raw per-rank data; statistics as properties."""

    case: str
    overrides: tuple[str, ...]
    layout: Layout
    command: tuple[str, ...]  # the command line that repeats this measurement
    warmup: int
    repeats: int
    device: str
    optimizer: str
    schedule: str  # the Megatron-Core schedule get_forward_backward_func chose
    ranks: tuple[RankSteps, ...]
    timeline_step: int = -1  # the step whose visits RankSteps.timeline holds (-1: none kept)

    @property
    def _timed_steps(self) -> range:
        """The indices of the timed steps (after the warm-up steps and the metered one)."""
        return range(self.warmup + 1, self.warmup + 1 + self.repeats)

    def _timed(self, per_rank: Callable[[RankSteps], tuple[float, ...]]) -> list[float]:
        """Per timed step, the slowest rank's time."""
        return [max(per_rank(r)[i] for r in self.ranks) for i in self._timed_steps]

    @property
    def step_times_s(self) -> list[float]:
        return self._timed(
            lambda r: tuple(
                f + g + o for f, g, o in zip(r.forward_backward_s, r.reduce_s, r.optimizer_s, strict=True)
            )
        )

    @property
    def step_s(self) -> float:
        """Median step time (slowest rank per step)."""
        return statistics.median(self.step_times_s)

    @property
    def step_iqr_s(self) -> float:
        times = self.step_times_s
        if len(times) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
        return q3 - q1

    def _on_critical_rank(self, per_rank: Callable[[RankSteps], tuple[float, ...]]) -> list[float]:
        """Per timed step, the phase's time on the rank whose forward-backward ended last: the rank the
        others waited for. A rank done earlier spends that wait inside its first collective (the DP
        reduction's clock starts at its own backward's end), so its reduction time holds the other's
        backward; the slowest rank's holds the collective alone."""
        return [
            per_rank(max(self.ranks, key=lambda r: r.forward_backward_s[i]))[i]  # noqa: B023 - used at once
            for i in self._timed_steps
        ]

    @property
    def forward_backward_s(self) -> float:
        return statistics.median(self._timed(lambda r: r.forward_backward_s))

    @property
    def reduce_s(self) -> float:
        return statistics.median(self._on_critical_rank(lambda r: r.reduce_s))

    @property
    def optimizer_s(self) -> float:
        return statistics.median(self._on_critical_rank(lambda r: r.optimizer_s))

    def in_step(self, stage: int) -> dict[str, float]:
        """The ops' seconds per visit (fenced means) inside the timed steps on stage ``stage``: per
        op, its slowest rank's (autotuner.validate.in_step); empty where nothing was timed."""
        found: dict[str, float] = {}
        for r in self.ranks:
            if r.pp_rank == stage:
                for key, seconds in r.in_step_s.items():
                    found[key] = max(found.get(key, 0.0), seconds)
        return found

    @property
    def peak_bytes(self) -> int:
        """The largest peak over the ranks (memory per GPU is what must fit)."""
        return max(r.peak_bytes for r in self.ranks)

    @property
    def losses(self) -> tuple[float, ...]:
        """Every step's loss over the global batch: the mean over the data-parallel ranks of the last
        pipeline stage (each the mean over its equal share of the micro-batches)."""
        last = [r.losses for r in self.ranks if r.losses and r.tp_rank == 0]
        return tuple(statistics.fmean(step) for step in zip(*last, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("layout", "ranks")},
            "layout": self.layout.to_json(),
            "ranks": [asdict(r) for r in self.ranks],
            "step_s": self.step_s,
            "step_iqr_s": self.step_iqr_s,
            "forward_backward_s": self.forward_backward_s,
            "reduce_s": self.reduce_s,
            "optimizer_s": self.optimizer_s,
            "peak_bytes": self.peak_bytes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepMeasurement:
        layout_fields = {f.name for f in fields(Layout)}
        layout = Layout(**{k: v for k, v in data["layout"].items() if k in layout_fields})
        ranks = tuple(
            RankSteps(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in r.items() if k != "timeline"},
                timeline=tuple(tuple(visit) for visit in r.get("timeline", ())),
            )
            for r in data["ranks"]
        )
        own = {f.name for f in fields(cls)} - {"layout", "ranks"}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in own}
        return cls(**values, layout=layout, ranks=ranks)
