"""The torch_profiler launcher: the same plan, observed by ``torch.profiler``.

For each (op, shape point) the observer runs profiling sessions of training-like steps, each the op's
forward then its backward, under ``record_function`` ranges named as the NVTX ranges are
(``linear_qkv.forward [s256_b1] #3``, see autotuner.ops.naming)::

    for step in range(wait + warmup + active):      # torch.profiler.schedule(wait, warmup, active)
        set_range_context(point, i, warmup=step < wait + warmup)
        forward (the backward phase's untimed prepare: zero grads, forward with autograd)
        backward (seeded output gradients)
        prof.step()

and leaves a trace, stacks and operator tables per (op, point) (autotuner.launchers.profiler_files), plus
the usual results rows.

How it settles each measurement pitfall, and how to open its files: docs/launchers.md, "torch_profiler:
the pitfalls it settles".
"""

from __future__ import annotations

import bisect
import gc
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from autotuner.errors import UserError
from autotuner.launchers import profiler_files
from autotuner.measure.memory import _kineto_quiet
from autotuner.measure.metrics import Observed, fill
from autotuner.measure.timer import Measurement
from autotuner.ops.annotate import RecordFunctionAnnotator, annotating, set_range_context
from autotuner.ops.naming import PHASES, parse_range
from autotuner.ops_test.base import OpCall, OpTest, ShapePoint
from autotuner.runner import Phase
from autotuner.runner.eta import Rates, fill_seconds

# The detailed session's time over the op's own on a CPU (stacks, memory and shapes recorded: the module
# docstring's 2-2.5x)
DETAILED_COST = 2.5
# CUDA allocator events kept for a memory snapshot: enough for a layer's forward and backward steps.
_SNAPSHOT_ENTRIES = 200_000


@dataclass(frozen=True)
class ProfilerOptions:
    """The validated launcher config: schedule, recording switches and where the files go."""

    wait: int
    warmup: int
    active: int
    record_shapes: bool
    profile_memory: bool
    with_stack: bool
    with_flops: bool
    memory_snapshot: bool
    compress_over_bytes: int
    output_dir: Path
    lean_timing: bool = True

    @property
    def steps(self) -> int:
        return self.wait + self.warmup + self.active

    def range_context(self, step: int) -> tuple[int, bool]:
        """(iteration, warm-up?) of a step: ``#w<step>`` before the active steps, then ``#0..#active-1``."""
        skipped = self.wait + self.warmup
        return (step, True) if step < skipped else (step - skipped, False)


def _check_writable(folder: Path, what: str, fix: str) -> None:
    """Create ``folder`` and a file in it. A real write is the only reliable test: root passes every
    permission check (``os.access`` says yes) yet still fails on a read-only mount or a path through a
    regular file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"{what} {folder} is not writable ({reason}): {fix}") from exc


def check_settings(cfg: Any, spec: Any) -> None:
    """``cfg.launcher`` checked before anything runs (autotuner.launchers.check_settings: in a sweep, every
    job's before the first one measures). Raises UserError (one line, exit code 2)."""
    _check_launcher(cfg.launcher, spec.device)


def _check_launcher(launcher: Any, device: torch.device) -> None:
    from autotuner.launchers.common import RUN_FILES, check_profiled_calls

    wait, warmup, active = int(launcher.wait), int(launcher.warmup), int(launcher.active)
    if wait < 0 or warmup < 0:
        raise UserError(f"launcher.wait={wait} and launcher.warmup={warmup} must be >= 0")
    if active < 1:
        raise UserError(
            f"launcher.active={active}: the profiler records only active steps, so at least one is needed: "
            "set launcher.active=5"
        )
    check_profiled_calls({"launcher.wait": wait, "launcher.warmup": warmup, "launcher.active": active})
    if int(launcher.compress_over_bytes) < 0:
        raise UserError("launcher.compress_over_bytes must be >= 0 (0 compresses every trace)")
    if launcher.memory_snapshot and device.type != "cuda":
        raise UserError(
            f"launcher.memory_snapshot=true records the CUDA allocator, but this run is on {device.type}: "
            "drop it or run on a GPU"
        )
    given = Path(str(launcher.output_dir)).expanduser()
    if not given.is_absolute() and len(given.parts) == 1 and RUN_FILES.fullmatch(given.name):
        _refuse_run_file(launcher.output_dir, given.name)


def _refuse_run_file(given: Any, name: str) -> None:
    raise UserError(
        f"launcher.output_dir={given} is where the run writes its own {name}: "
        "give the traces a folder of their own, e.g. launcher.output_dir=profiles"
    )


def resolve_options(launcher: Any, device: torch.device, run_dir: Path) -> ProfilerOptions:
    """Validate ``cfg.launcher`` before any work. Raises UserError (one line, exit code 2)."""
    from autotuner.launchers.common import RUN_FILES

    _check_launcher(launcher, device)
    wait, warmup, active = int(launcher.wait), int(launcher.warmup), int(launcher.active)
    output_dir = Path(str(launcher.output_dir)).expanduser()
    output_dir = output_dir if output_dir.is_absolute() else Path(run_dir) / output_dir
    if output_dir.resolve().parent == Path(run_dir).resolve() and RUN_FILES.fullmatch(output_dir.name):
        _refuse_run_file(launcher.output_dir, output_dir.name)  # an absolute path into the run directory
    _check_writable(Path(run_dir), "the run directory", "choose another with hydra.run.dir=...")
    _check_writable(output_dir, "launcher.output_dir", "choose another with launcher.output_dir=...")
    return ProfilerOptions(
        wait=wait,
        warmup=warmup,
        active=active,
        record_shapes=bool(launcher.record_shapes),
        profile_memory=bool(launcher.profile_memory),
        with_stack=bool(launcher.with_stack),
        with_flops=bool(launcher.with_flops),
        memory_snapshot=bool(launcher.memory_snapshot),
        compress_over_bytes=int(launcher.compress_over_bytes),
        output_dir=output_dir,
        lean_timing=bool(launcher.lean_timing),
    )


def range_times_ns(events: Any, op: str, point: str, cuda: bool) -> dict[str, dict[int, int]]:
    """Per phase, per active iteration: the op's time in its own range, in nanoseconds.

    On CPU the host range's duration. On a GPU the time the device was busy inside the range's
    device-side span (several spans for one (phase, iteration), one per stream, count as one, from the
    earliest start to the latest end): the summed durations of the kernels, memsets and copies in it,
    as nsys's GPU time. Not the span itself: the profiler's own cost on the host slows the launches
    enough to leave the GPU idle inside a long forward (the Llama-2-7B layer at s2048_b1 on an H100:
    a span of 3816 us around 3314 us of kernels, where get_data and nsys read 3335 and 3314).
    """
    spans: dict[tuple[str, int], tuple[float, float]] = {}
    work: list[tuple[float, float]] = []  # the GPU's kernels, memsets and copies: (start, end)
    for event in events:
        on_gpu = event.device_type != DeviceType.CPU
        if cuda and on_gpu and not event.is_user_annotation:
            work.append((event.time_range.start, event.time_range.end))
            continue
        if not event.is_user_annotation or on_gpu != cuda:
            continue
        name = parse_range(event.name)
        if name is None or name.op != op or name.point != point or name.warmup:
            continue
        key = (name.phase, name.iteration)
        start, end = event.time_range.start, event.time_range.end
        if key in spans:
            start, end = min(start, spans[key][0]), max(end, spans[key][1])
        spans[key] = (start, end)
    work.sort()
    starts = [start for start, _ in work]
    times: dict[str, dict[int, int]] = {}
    for (phase, iteration), (start, end) in sorted(spans.items()):
        if cuda:
            inside = work[bisect.bisect_left(starts, start) : bisect.bisect_right(starts, end)]
            elapsed = sum(e - s for s, e in inside if e <= end)
        else:
            elapsed = end - start
        times.setdefault(phase, {})[iteration] = round(elapsed * 1e3)  # events are in microseconds
    return times


class TorchProfilerObserver:
    """Profiles (op, point) sessions and answers the runner's per-phase calls from them."""

    name = "torch_profiler"

    def __init__(
        self,
        options: ProfilerOptions,
        device: torch.device,
        phases: tuple[str, ...],
        model_parameters: list[torch.Tensor],
    ) -> None:
        self.options = options
        self.device = device
        self.cuda = device.type == "cuda"
        self.with_backward = "backward" in phases
        self.model_parameters = model_parameters
        # The measurement of the phase the runner will ask for next: (op, point, phase) -> times.
        self._pending: tuple[tuple[str, str, str], Measurement] | None = None

    def observe(self, op: OpTest, point: ShapePoint, phase: Phase) -> dict[str, Any]:
        key = (op.name, point.label, phase.name)
        if self._pending is not None and self._pending[0] == key:
            measurement = self._pending[1]
        else:
            measured = self.profile(op, point, phase.call, phase.seed)
            measurement = measured[phase.name]
            later = [p for p in measured if p != phase.name]
            self._pending = ((op.name, point.label, later[0]), measured[later[0]]) if later else None
        return self._sensors(phase, self._columns(measurement))

    def expected_seconds(self, phase: str, forward_s: float, backward_s: float, rates: Rates) -> float:
        """The row's expected seconds from one call's (autotuner.runner.eta). The forward row profiles the
        op's steps (forward then backward) in the lean session and the detailed one, whose recording
        takes about DETAILED_COST times the op's time on a CPU (module docstring); the backward row reuses
        them. Both run the sensors (activations of a forward, FLOPs; peak bytes on a GPU)."""
        step = forward_s + (backward_s if self.with_backward else 0.0)
        once = forward_s if phase == "forward" else forward_s + backward_s
        sensors = (forward_s if phase == "forward" else 0.0) + once * (2 if self.cuda else 1)
        leave_out = () if self.cuda else ("peak_bytes",)
        sensors += fill_seconds(self.name, self.device, phase, leave_out)  # their own cost (a few ms)
        if phase != PHASES[0]:
            return sensors
        detailed = 1.0 if self.cuda else DETAILED_COST
        sessions = (1.0 if self.options.lean_timing else 0.0) + detailed
        return self.options.steps * step * sessions + 2 * rates.session_s + sensors

    def _profiler(self, detailed: bool) -> torch.profiler.profile:
        o = self.options
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        stack = detailed and o.with_stack
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=o.wait, warmup=o.warmup, active=o.active, repeat=1),
            record_shapes=detailed and o.record_shapes,
            profile_memory=detailed and o.profile_memory,
            with_stack=stack,
            with_flops=detailed and o.with_flops,
            # verbose=True is what makes export_stacks write frames (without it the file is empty)
            experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True) if stack else None,
        )

    def _session(self, op: str, point: ShapePoint, phase: Phase, detailed: bool) -> torch.profiler.profile:
        """Run ``wait + warmup + active`` steps of ``phase`` (prepare then run) under one profiler.

        Detailed: every op's ranges (a layer's trace shows its sub-ops). Lean: ``op``'s alone.
        """
        gc.collect()  # a collection of the previous session's garbage would land inside a range
        marks = annotating(RecordFunctionAnnotator(), only_op=None if detailed else op)
        try:
            with _kineto_quiet(), self._profiler(detailed) as prof, marks:
                for step in range(self.options.steps):
                    iteration, warmup = self.options.range_context(step)
                    set_range_context(point.label, iteration, warmup)
                    if phase.prepare is not None:
                        phase.prepare()
                    out = phase.run()
                    del out
                    if self.cuda:
                        torch.cuda.synchronize()  # the step's kernels end inside the step
                    prof.step()
        finally:
            set_range_context("-", 0, False)
        return prof

    def profile(self, op: OpTest, point: ShapePoint, call: OpCall, seed: int) -> dict[str, Measurement]:
        """Profile (op, point): write its files, return a Measurement per phase."""
        # The backward Phase's prepare() is the training forward; forward-only plans (and ops without a
        # backward: the functional group) run the forward alone.
        with_backward = self.with_backward and "backward" in op.phases
        step_phase = Phase("backward" if with_backward else "forward", call, seed)
        timing = (
            self._session(op.name, point, step_phase, detailed=False) if self.options.lean_timing else None
        )
        folder = self.options.output_dir / point.label / op.name
        folder.mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        # Under torchrun each rank writes its own trace into the same folder: HTA's layout for several
        # ranks (one trace per rank per folder), and TensorBoard shows them side by side.
        stem = f"{op.name}.{point.label}" + (f".rank{rank}" if world > 1 else "")
        snapshot = self.options.memory_snapshot and self.cuda
        if snapshot:
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_ENTRIES, clear_history=True)
        try:
            detailed = self._session(op.name, point, step_phase, detailed=True)
            if snapshot:
                profiler_files.write_memory_snapshot(folder, stem)
        finally:
            if snapshot:
                torch.cuda.memory._record_memory_history(enabled=None)
        # Files before times: when the op's ranges are missing, the trace is there to show why.
        profiler_files.write_trace(detailed, folder, stem, rank, self.options.compress_over_bytes)
        if self.options.with_stack:
            profiler_files.write_stacks(detailed, folder, stem, self.cuda)
        profiler_files.write_tables(detailed, folder, stem, self.cuda)
        return self._measurements((timing or detailed).events(), op.name, point.label, with_backward)

    def _measurements(self, events: Any, op: str, point: str, with_backward: bool) -> dict[str, Measurement]:
        times = range_times_ns(events, op, point, self.cuda)
        out = {}
        for phase in PHASES if with_backward else PHASES[:1]:
            found = times.get(phase, {})
            if sorted(found) != list(range(self.options.active)):
                side = "GPU-side spans of " if self.cuda else ""
                raise RuntimeError(
                    f"found {len(found)} of {self.options.active} {side}'{op}.{phase} [{point}] #i' ranges "
                    "in the profile: is the op instrumented (autotuner.ops.instrument)?"
                )
            out[phase] = Measurement(
                times_ns=[found[i] for i in sorted(found)], warmup=self.options.warmup, stop_reason=self.name
            )
        return out

    def _columns(self, m: Measurement) -> dict[str, Any]:
        return m.columns()

    def _sensors(self, phase: Phase, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` with the metric registry's columns for this launcher (autotuner.measure.metrics):
        weight/activation bytes and FLOPs as get_data measures them (outside the profiler), FLOP/s from
        the profiler's median, and peak bytes on a GPU (the allocator's statistics). Peak bytes on CPU
        are left empty: there they take a profiler session of their own per row, as long as this
        launcher's own; get_data measures them."""
        fresh = Phase(phase.name, phase.call, phase.seed)  # its own outputs and gradients
        seen = Observed(self.name, phase=fresh, device=self.device, model_parameters=self.model_parameters)
        return fill(row, seen, leave_out=() if self.cuda else ("peak_bytes",))


def launch(cfg: Any, spec: Any, run: Any) -> int:
    """Validate the launcher config, run the plan under the profiler, print the summary table."""
    run_dir = run.path
    from autotuner.launchers.common import finish, start_writer
    from autotuner.runner import Runner
    from autotuner.runner.fit import check_fit
    from autotuner.runner.spec import open_session

    # Before any work: bad input ends with one line and exit code 2 (autotuner.main).
    options = resolve_options(cfg.launcher, spec.device, Path(run_dir))
    writer = start_writer(cfg, spec, run)
    fit = check_fit(cfg, spec)  # before the model is built: its runtime term is this process now
    model, context = open_session(spec) if fit.builds or spec.world > 1 else (torch.nn.Module(), None)
    observer = TorchProfilerObserver(options, spec.device, tuple(spec.phases), list(model.parameters()))
    Runner(spec, observer, writer, progress=cfg.progress, fit=fit).run(context)
    code = finish(writer, spec)
    print(f"traces, stacks and operator tables in {options.output_dir}/<point>/<op>/")
    return code
