"""The get_data launcher: our own timers and memory sensors, tidy rows on disk.

Per phase, in this order, each pass separate so no sensor disturbs another's numbers:
1. timing: warm-up then timed samples (autotuner.measure.timer);
2. activation bytes (forward only): one forward under autograd's saved-tensor hooks;
3. peak bytes: one run under the device's memory sensor;
4. FLOPs: one run under torch's FLOP counter.
Steps 2-4 and the columns computed from the row are the metric registry's (autotuner.measure.metrics):
bytes moved (a counted minimum, see Phase.bytes_moved) give GB/s and the arithmetic intensity; with a
device calibration (python -m autotuner.calibrate) each row also gets its bound and the fraction of that
ceiling it reaches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from autotuner.measure.cache import CacheFlusher, last_level_cache_bytes, rotation_sets
from autotuner.measure.graphs import NotReplayable, capture_phase
from autotuner.measure.memory import graphs_to_hold, saved_bytes
from autotuner.measure.metrics import Observed, fill
from autotuner.measure.timer import DeviceTimer, RankAgreement, SamplingPolicy, sample
from autotuner.model.runtime import graph_rng_generators
from autotuner.ops_test.base import OpTest, ShapePoint
from autotuner.runner import Phase, TrainingOrder
from autotuner.runner.eta import Rates, fill_seconds


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


class IdlePause:
    """The untimed pause before a sample (``timing.idle_before_ms``): the device finishes its queue, then
    the process sleeps, as a pipeline stage sleeps in its receive while its neighbour computes
    (autotuner.measure.timer, "Back to back is not how every op runs")."""

    def __init__(self, timer: DeviceTimer, seconds: float) -> None:
        self.timer, self.seconds = timer, seconds

    def __call__(self) -> None:
        self.timer.synchronize()
        time.sleep(self.seconds)


def _in_turn(steps: list[Callable[[], None]]) -> Callable[[], None] | None:
    """One callable running ``steps`` in order (None when there are none)."""
    if not steps:
        return None
    if len(steps) == 1:
        return steps[0]

    def run() -> None:
        for step in steps:
            step()

    return run


def forward_saved_bytes(phase: Phase, exclude: list[torch.Tensor]) -> int:
    """What one untimed forward of ``phase``'s op saves, as the ``activation_bytes`` sensor counts it
    (``exclude``: the model's weights)."""
    return saved_bytes(lambda: phase.call.fn(*phase.call.inputs), [*exclude, *phase.parameters])


class GetDataObserver:
    name = "get_data"

    def __init__(
        self,
        device: torch.device,
        policy: SamplingPolicy,
        model_parameters: list[torch.Tensor],
        flush_cache: bool = False,
        rotate_inputs: bool = True,
        calibration: dict[str, Any] | None = None,
        dtype: str = "fp32",
        cuda_graph_below_us: float | None = None,
        hide_launch: bool = True,
        idle_before_ms: float = 0.0,
        forward_after_backward: bool = False,
        held_activations_mib: float = 0.0,
    ) -> None:
        self.cuda_graph_below_us = cuda_graph_below_us if device.type == "cuda" else None
        self.graphs_off = ""  # set after a failed capture: the reason later rows give
        self.calibration = calibration
        self.dtype = dtype
        self.device = device
        self.policy = policy
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self.timer = DeviceTimer(device, barrier=distributed, hide_launch=hide_launch)
        # Under torchrun every choice that changes how often a rank calls the op is the group's.
        self.agreement = RankAgreement(device)
        self.model_parameters = model_parameters
        self.flush_cache, self.idle_before_ms = flush_cache, idle_before_ms
        self.forward_after_backward, self.held_activations_mib = forward_after_backward, held_activations_mib
        steps = [CacheFlusher(device) if flush_cache else None]
        self.flush_bytes = steps[0].buffer.numel() if steps[0] is not None else 0
        steps += [IdlePause(self.timer, idle_before_ms * 1e-3) if idle_before_ms > 0 else None]
        self.before_sample = _in_turn([s for s in steps if s is not None])  # untimed, before each sample
        self.rotate_inputs = rotate_inputs and not flush_cache
        self.cache_bytes = last_level_cache_bytes(device)
        self._sensor_s: dict[str, float] = {}  # see sensor_seconds

    def expected_seconds(self, phase: str, forward_s: float, backward_s: float, rates: Rates) -> float:
        """The row's expected seconds from one call's (autotuner.runner.eta): the warm-up, the samples, then
        the sensors (activations, a forward's; peak bytes in a session of its own on a CPU; FLOPs; bytes
        moved). A forward sample is a block of calls lasting ``min_block_s``; a backward sample its forward
        and itself. Sampling stops at the precision target, after as many samples as the machine's
        measured spread needs (:meth:`Rates.samples_for`; the iqr rule: 4 where the spread is under its
        target, else never), or at the budget or ``max_samples`` if sooner, never before
        ``min_samples`` or ``min_time_s``."""
        policy = self.policy
        call_s, prepare_s = (forward_s, 0.0) if phase == "forward" else (backward_s, forward_s)
        before = 0.0 if self.before_sample is None else self.idle_before_ms * 1e-3 + self.flush_s(rates)
        sample_s = prepare_s + call_s + before
        if phase == "forward" and self.before_sample is None:  # a block of calls (autotuner.measure.timer)
            sample_s = min(1000, max(1, math.ceil(policy.min_block_s / max(call_s, 1e-9)))) * call_s
        if policy.precision_rule == "iqr":
            needed = 4 if rates.relative_iqr <= policy.target_rel_iqr else math.inf
        else:
            needed = max(6, rates.samples_for(policy.target_rel_ci))
        samples = min(max(needed, policy.min_samples), policy.max_samples)
        sampling = min(samples * sample_s, max(policy.budget_s, policy.min_samples * sample_s))
        sampling = max(sampling, policy.min_time_s)
        # activations (a forward's), peak bytes, FLOPs, bytes moved (a forward's call, a backward's forward)
        once = prepare_s + call_s
        sensors = 2 * once + (2 * call_s if phase == "forward" else prepare_s)
        return policy.warmup * once + sampling + sensors + self.sensor_seconds(phase)

    def sensor_seconds(self, phase: str) -> float:
        """What the sensors of a row cost beside the op's own calls (autotuner.runner.eta.fill_seconds),
        measured once per phase."""
        if phase not in self._sensor_s:
            self._sensor_s[phase] = fill_seconds(self.name, self.device, phase)
        return self._sensor_s[phase]

    def flush_s(self, rates: Rates) -> float:
        """One cache flush: a write over its buffer (half a copy's traffic)."""
        return self.flush_bytes / (rates.byte_per_s / 2)

    def _input_sets(self, phase: Phase) -> int:
        """Enough copies of inputs that fit in the cache that cycling through them overflows it."""
        return rotation_sets(phase.input_bytes, self.cache_bytes) if self.rotate_inputs else 1

    def _held_graphs(self, phase: Phase) -> tuple[int, int]:
        """(graphs, bytes each saves): :func:`graphs_to_hold`, the group's largest count under torchrun: it
        decides how many forwards a backward sample's prepare runs (autotuner.measure.timer.RankAgreement)."""
        saved = forward_saved_bytes(phase, self.model_parameters)
        graphs = graphs_to_hold(saved, self.held_activations_mib * 2**20)
        return int(self.agreement.max(graphs)[0]), saved

    def _graphed(self, phase: Phase, label: str) -> tuple[Callable[[], None] | None, str]:
        """A CUDA-graph replay of the phase when its eager call is short enough (autotuner.measure.graphs),
        else None; and a warning when the capture failed."""
        if self.cuda_graph_below_us is None or not phase.call.graphable:
            return None, ""
        if self.graphs_off:
            return None, f"cuda_graph_off({self.graphs_off})"
        probes = []
        for _ in range(3):  # the first call may initialise things; the fastest of three decides
            if phase.prepare is not None:
                phase.prepare()
            self.timer.synchronize()
            probes.append(self.timer.time_ns(phase.run) / 1e3)
        # Captured on every rank or on none: the slowest rank's fastest call decides.
        if self.agreement.max(min(probes))[0] >= self.cuda_graph_below_us:
            return None, ""
        replay, warning, error = None, "", None
        try:
            replay = capture_phase(phase, graph_rng_generators())
        except NotReplayable as exc:  # failed before capturing: nothing stranded, captures go on
            print(f"{label} cannot be replayed, timed eagerly: {_first_line(exc)}", file=sys.stderr)
            warning = "cuda_graph_failed(not_replayable)"
        except Exception as exc:  # noqa: BLE001 - timed eagerly instead; the row says why
            error = exc
        # A capture that failed on any rank is timed eagerly on every rank (the calls must pair up).
        if not self.agreement.all(error is None):
            # a failed capture may strand memory (autotuner.measure.graphs): no more captures this run
            self.graphs_off = "earlier_failure"
            why = _first_line(error) if error is not None else "it failed on another rank"
            print(
                f"CUDA-graph capture of {label} failed, timed eagerly (no more captures this run): {why}",
                file=sys.stderr,
            )
            name = type(error).__name__ if error is not None else "other_rank"
            return None, f"cuda_graph_failed({name})"
        if not self.agreement.all(replay is not None):
            return None, warning or "cuda_graph_failed(not_replayable)"
        return replay, ""

    def observe(self, op: OpTest | None, point: ShapePoint, phase: Phase) -> dict[str, Any]:
        label = f"{op.name if op is not None else 'an op'} {phase.name} at {point.label}"
        replay, graph_warning = self._graphed(phase, label)
        graphed = replay is not None
        order = TrainingOrder()  # a replay's samples run back to back
        graphs, saved_bytes = 1, 0
        if replay is not None:
            measurement = sample(self.timer, replay, self.policy, None, self.before_sample, self.agreement)
        else:
            phase.rotate(self._input_sets(phase))
            if self.held_activations_mib > 0:
                graphs, saved_bytes = self._held_graphs(phase)
            in_order = (self.forward_after_backward and phase.name == "forward") or graphs > 1
            with phase.training_order(graphs) if in_order else contextlib.nullcontext(order) as order:
                measurement = sample(
                    self.timer, phase.run, self.policy, phase.prepare, self.before_sample, self.agreement
                )
        replay_empty = replay is not None and replay.empty
        del replay  # frees the graph and its memory pool before the memory passes
        row: dict[str, Any] = {
            **measurement.columns(),
            "calls_per_sample": measurement.calls_per_sample,
            "input_sets": len(phase.input_sets),
            "cache_flush": self.flush_cache,
            "idle_before_ms": self.idle_before_ms,
            "forward_after_backward": order.followed,
            "held_activation_bytes": (graphs - 1) * saved_bytes if graphs > 1 else None,
            "cuda_graph": graphed,
            "launch_hidden": self.timer.hide_launch,
        }
        if graphed and replay_empty:
            graph_warning = "cuda_graph_empty"
        if graph_warning:
            row["warnings"] = ";".join(w for w in (row["warnings"], graph_warning) if w)
        phase.rotate(1)  # the memory and FLOP passes need one set only
        # The sensors (each its own pass, after the timing pass) and the columns computed from the row.
        seen = Observed(
            self.name,
            phase=phase,
            device=self.device,
            model_parameters=self.model_parameters,
            calibration=self.calibration,
            dtype=self.dtype,
        )
        return fill(row, seen)


def load_calibration(cfg: Any, spec: Any) -> dict[str, Any] | None:
    """The calibration named by ``calibration=`` or, if absent, this device's default file (if any).
    Reads and validates only (UserError for a bad file): :func:`launch` calls it before anything of the
    run is written, and keeps a copy in the run directory afterwards (:func:`keep_calibration`)."""
    from pathlib import Path

    from autotuner.model.runtime import device_name
    from autotuner.results import calibration

    path = cfg.calibration or calibration.default_path(spec.device.type, device_name(spec.device))
    if not cfg.calibration and not Path(path).is_file():
        return None
    return calibration.load(path)


def keep_calibration(data: dict[str, Any], run_dir: Any) -> None:
    """A copy of the calibration in the run directory, so the run's report can use it."""
    import json
    from pathlib import Path

    from autotuner.results.atomic import atomic_write_text

    atomic_write_text(Path(run_dir) / "calibration.json", json.dumps(data, indent=2) + "\n")


def launch(cfg: Any, spec: Any, run: Any) -> int:
    """Run the plan with this observer; print the summary table; exit code 1 if any op failed."""
    run_dir = run.path
    from autotuner.launchers.common import finish, start_writer
    from autotuner.runner import Runner
    from autotuner.runner.fit import check_fit
    from autotuner.runner.spec import open_session

    calibration = load_calibration(cfg, spec)  # validated before start_writer writes anything
    writer = start_writer(cfg, spec, run)
    if calibration is not None:
        keep_calibration(calibration, run_dir)
    fit = check_fit(cfg, spec)  # before the model is built: its runtime term is this process now
    model, context = open_session(spec) if fit.builds or spec.world > 1 else (torch.nn.Module(), None)
    timing = cfg.timing
    policy = SamplingPolicy(**{f.name: timing[f.name] for f in dataclasses.fields(SamplingPolicy)})
    observer = GetDataObserver(
        spec.device,
        policy,
        list(model.parameters()),
        flush_cache=timing.flush_cache,
        rotate_inputs=timing.rotate_inputs,
        calibration=calibration,
        dtype=spec.dtype,
        cuda_graph_below_us=timing.cuda_graph_below_us if timing.cuda_graph else None,
        hide_launch=timing.hide_launch,
        idle_before_ms=timing.idle_before_ms,
        forward_after_backward=timing.forward_after_backward,
        held_activations_mib=timing.held_activations_mib,
    )
    Runner(spec, observer, writer, progress=cfg.progress, fit=fit).run(context)
    return finish(writer, spec)
