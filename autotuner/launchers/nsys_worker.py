"""The process that ``nsys profile`` runs: the plan of get_data, with NVTX ranges instead of timers.

Started by autotuner.launchers.nsys as ``python -m autotuner.launchers.nsys_worker <run_dir> <config>``,
where ``<config>`` is the config the parent validated (Hydra's ``<run_dir>/.hydra/config.yaml``). The
worker resolves it with the same :func:`autotuner.runner.spec.resolve_spec`, builds the same model and runs
the same :class:`autotuner.runner.Runner` with :class:`NsysObserver`. It measures nothing itself: the times
come from the report, read by the parent. The files it writes and the ranges it pushes are in
autotuner.launchers.nsys_protocol and docs/launchers.md ("Reading an Nsight Systems report").

A SIGTERM or SIGINT unwinds the worker (see :func:`_stop_on_signals`): the rows written so far stay, the
op being run gets no row, and the exit code is 128 + the signal's number, which nsys passes on. A worker
whose launcher is gone (killed outright) stops itself (see :func:`_watch_launcher`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from autotuner.errors import say_error
from autotuner.launchers.nsys_protocol import (
    FIT_FILE,
    LAUNCHER_ENV,
    MEASURING_FILE,
    STARTED_FILE,
    marker_name,
    process_identity,
    worker_dir,
)
from autotuner.measure.metrics import Observed, fill
from autotuner.ops.annotate import Annotator, NvtxAnnotator, annotating, set_range_context
from autotuner.ops_test.base import OpTest, ShapePoint
from autotuner.runner import Phase
from autotuner.runner.eta import Rates, fill_seconds
from autotuner.termination import check_stop, forget_stop, raise_stop, stopping_when_gone


class NsysObserver:
    """Runs each phase under NVTX ranges: ``warmup`` unmeasured iterations, then ``iterations`` measured
    ones inside a ``measure`` range (and, on CUDA, inside the profiler's capture range).

    With ``sub_op_ranges`` (the default) every instrumented op inside the observed one gets its ranges
    too, so the report shows a layer's sub-ops nested in it; each costs the enclosing range a push/pop
    and two autograd nodes (tens of microseconds on a CPU), which the enclosing op's time includes.
    Without, only the observed op is marked (see :func:`autotuner.ops.annotate.annotating`).

    Returns what the report cannot hold: the number of iterations, ``stop_reason`` "nsys", and the metric
    registry's sensor columns (autotuner.measure.metrics: weight and activation bytes, FLOPs, and on a GPU
    the allocator's peak), each from a run of its own after the measured iterations, outside every range
    and the capture, so the report's times hold none of it. Peak bytes on a CPU are left to get_data (they
    take a profiler session per row, as in torch_profiler).
    """

    name = "nsys"

    def __init__(
        self,
        device: torch.device,
        warmup: int,
        iterations: int,
        annotator: Annotator | None = None,
        measuring_file: Path | None = None,
        sub_op_ranges: bool = True,
        model_parameters: list[torch.Tensor] | None = None,
    ) -> None:
        self.model_parameters = model_parameters or []
        self.device = device
        self.warmup = warmup
        self.iterations = iterations
        self.sub_op_ranges = sub_op_ranges
        self.annotator = annotator if annotator is not None else NvtxAnnotator()
        self.measuring_file = measuring_file
        self._leave_out = ("peak_bytes",) if device.type != "cuda" else ()
        self._sensor_s: dict[str, float] = {}  # see expected_seconds

    def observe(self, op: OpTest, point: ShapePoint, phase: Phase) -> dict[str, Any]:
        if self.measuring_file is not None:
            self.measuring_file.write_text(f"{op.name}\t{phase.name}\t{point.label}\n")
        only_op = None if self.sub_op_ranges else op.name
        with annotating(self.annotator, only_op=only_op):
            for i in range(self.warmup):
                self._iteration(phase, point, i, warmup=True)
            self._capture(start=True)
            self.annotator.push(marker_name(op.name, phase.name, point.label))
            try:
                for i in range(self.iterations):
                    self._iteration(phase, point, i, warmup=False)
            finally:
                # Popped even when the op fails, so the ranges of the next ops do not nest inside it.
                self.annotator.pop()
                self._capture(start=False)
        fresh = Phase(phase.name, phase.call, phase.seed)  # its own outputs and gradients
        seen = Observed(self.name, phase=fresh, device=self.device, model_parameters=self.model_parameters)
        return fill({"samples": self.iterations, "stop_reason": "nsys"}, seen, leave_out=self._leave_out)

    def expected_seconds(self, phase: str, forward_s: float, backward_s: float, rates: Rates) -> float:
        """The row's expected seconds from one call's (autotuner.runner.eta): ``warmup + iterations``
        iterations (a backward's each its forward and itself), then the sensors' runs (activations of a
        forward, FLOPs; peak bytes on a GPU)."""
        once = forward_s if phase == "forward" else forward_s + backward_s
        sensors = (forward_s if phase == "forward" else 0.0) + once * (2 if self.device.type == "cuda" else 1)
        if phase not in self._sensor_s:  # their own cost, measured once (autotuner.runner.eta.fill_seconds)
            self._sensor_s[phase] = fill_seconds(self.name, self.device, phase, self._leave_out)
        return (self.warmup + self.iterations) * once + sensors + self._sensor_s[phase]

    def _iteration(self, phase: Phase, point: ShapePoint, iteration: int, warmup: bool) -> None:
        check_stop()  # a stop signal that a finalizer of the last iteration swallowed
        # Set before prepare(): the backward ranges are named when the forward builds the graph.
        set_range_context(point.label, iteration, warmup=warmup)
        if phase.prepare is not None:
            phase.prepare()
        out = phase.run()
        del out  # a forward's graph is freed here, not during the next iteration
        if self.device.type == "cuda":
            # Kernels run asynchronously: without this, one iteration's kernels would still be running
            # inside the next iteration's ranges. (An NVTX range itself is host time: see
            # nsys_rows.range_columns.)
            torch.cuda.synchronize(self.device)

    def _capture(self, start: bool) -> None:
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        if start:
            torch.cuda.profiler.start()
        else:
            torch.cuda.profiler.stop()


def _load_config(path: Path) -> Any:
    """The parent's config, checked against the structured schema (so types are the parent's)."""
    from omegaconf import OmegaConf

    from autotuner.config import AutotunerConfig, NsysLauncherConfig

    schema = OmegaConf.structured(AutotunerConfig(launcher=NsysLauncherConfig()))
    return OmegaConf.merge(schema, OmegaConf.load(path))


def run_worker(run_dir: Path, config_path: Path) -> int:
    """Run the plan in this process under NVTX ranges; 0 once the plan is done (failed ops included)."""
    import autotuner.capture.replay  # noqa: F401  (registers capture=<file>, as autotuner.main does)
    from autotuner.model.runtime import process_rank
    from autotuner.results import ResultsWriter
    from autotuner.results.atomic import atomic_write_text
    from autotuner.runner import Runner
    from autotuner.runner.fit import check_fit
    from autotuner.runner.spec import open_session, resolve_spec

    # From the environment: the started file comes first, before there is a spec (the parent passes the
    # same rank on, as torchrun's RANK and WORLD_SIZE are in the environment it gives us).
    out = worker_dir(Path(run_dir), *process_rank())
    # The next rank's parent may launch its nsys now (see nsys_process.wait_turn); our parent reads the pid
    # to pass a stop signal on (nsys_process.StopSignals), so the file must never be seen half-written.
    atomic_write_text(out / STARTED_FILE, f"{os.getpid()}\n")
    cfg = _load_config(config_path)
    spec = resolve_spec(cfg)
    writer = ResultsWriter(out)  # a fresh record each run: the parent reads it to know what completed
    fit = check_fit(cfg, spec)  # before the model is built: its runtime term is this process now
    # for the parent, should the kernel kill this process for memory (autotuner.launchers.nsys)
    atomic_write_text(out / FIT_FILE, json.dumps(fit.to_json()) + "\n")
    model, context = open_session(spec) if fit.builds or spec.world > 1 else (torch.nn.Module(), None)
    observer = NsysObserver(
        spec.device,
        int(cfg.launcher.warmup),
        int(cfg.launcher.iterations),
        measuring_file=out / MEASURING_FILE,
        sub_op_ranges=bool(cfg.launcher.sub_op_ranges),
        model_parameters=list(model.parameters()),
    )
    Runner(spec, observer, writer, progress=bool(cfg.progress), fit=fit).run(context)
    return 0


class Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGINT, raised where the worker is, so ``finally`` blocks run on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signals() -> None:
    """Turn the first SIGTERM or SIGINT into :class:`Stopped`, and ignore any after it.

    Python's default for SIGTERM ends the process at once, and nsys passes its own stop signal on to
    this process too. Raised instead, the signal unwinds the op being run: the observer pops its
    ``measure`` range (so the report's last window is closed), and a row being written is either on
    disk whole or not at all (the writer replaces files atomically). A second signal during that
    unwinding would stop it half-way, so it is ignored. Raised in a finalizer, the stop is lost; the
    observer's and the runner's loops raise it again (autotuner.termination.raise_stop).
    """

    def stop(signum: int, frame: object) -> None:
        for other in (signal.SIGTERM, signal.SIGINT):
            signal.signal(other, signal.SIG_IGN)
        raise_stop(lambda: Stopped(signum))

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


def _watch_launcher() -> None:
    """Stop this worker when the launcher that started its nsys is gone.

    The launcher passes its stop signals on (autotuner.launchers.nsys_process.StopSignals), but one killed
    outright (SIGKILL: torchrun's agent 30 s after its SIGTERM, SLURM after KillWait, ``kill -9``) passes
    nothing, and nsys and this worker, each in a session of its own, would run on: the plan to its end,
    or, under torchrun, a wait in a collective for a peer that is gone, holding a core until the process
    group's timeout. A watch (autotuner.termination.stopping_when_gone) looks for the launcher named by
    LAUNCHER_ENV; once it is gone it sends this process SIGTERM (the unwinding of :func:`_stop_on_signals`),
    then, if the main thread is held where no Python handler runs (inside a collective), SIGKILL. nsys
    then ends as after any end of its program."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if not launcher or threading.current_thread() is not threading.main_thread():
        return
    stopping_when_gone(lambda: process_identity(int(launcher.split()[0])) == launcher, "launcher-watch")


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 once the plan is done, 2 for bad input, 128 + N when stopped by signal N."""
    from autotuner.errors import UserError

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m autotuner.launchers.nsys_worker <run_dir> <config.yaml>", file=sys.stderr)
        return 2
    from autotuner.results.atomic import adopt_user_umask

    adopt_user_umask()  # nsys starts us with umask 0, which would make our files world-writable
    try:
        _stop_on_signals()
        _watch_launcher()
        return run_worker(Path(args[0]), Path(args[1]))
    except UserError as exc:
        say_error("autotuner nsys worker", exc)
        return exc.exit_code
    except Stopped as exc:
        forget_stop()
        print(f"autotuner nsys worker: stopped by {exc}", file=sys.stderr)
        return 128 + exc.signum


if __name__ == "__main__":
    raise SystemExit(main())
