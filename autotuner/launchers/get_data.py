"""The get_data launcher: our own timers and memory sensors, tidy rows on disk.

Per phase, in this order, each pass separate so no sensor disturbs another's numbers:
1. timing: warm-up then timed samples (autotuner.measure.timer);
2. activation bytes (forward only): one forward under autograd's saved-tensor hooks;
3. peak bytes: one run under the device's memory sensor;
4. FLOPs: one run under torch's FLOP counter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from autotuner.measure.cache import CacheFlusher, last_level_cache_bytes
from autotuner.measure.flops import count_flops
from autotuner.measure.memory import SavedTensorsMeter, peak_bytes, weight_bytes
from autotuner.measure.timer import DeviceTimer, SamplingPolicy, sample
from autotuner.ops_test.base import OpTest, ShapePoint
from autotuner.runner import Phase


class GetDataObserver:
    name = "get_data"

    def __init__(
        self,
        device: torch.device,
        policy: SamplingPolicy,
        model_parameters: list[torch.Tensor],
        flush_cache: bool = False,
        rotate_inputs: bool = True,
    ) -> None:
        self.device = device
        self.policy = policy
        self.timer = DeviceTimer(device)
        self.model_parameters = model_parameters
        self.flush = CacheFlusher(device) if flush_cache else None
        self.rotate_inputs = rotate_inputs and not flush_cache
        self.cache_bytes = last_level_cache_bytes(device)

    def _once(self, phase: Phase, meter: Any) -> Any:
        if phase.prepare is not None:
            phase.prepare()
        return meter(phase.run)

    def _input_sets(self, phase: Phase) -> int:
        """Enough copies of inputs that fit in the cache that cycling through them overflows it."""
        size = phase.input_bytes
        if not self.rotate_inputs or size == 0 or size >= self.cache_bytes:
            return 1
        return min(8, math.ceil(2 * self.cache_bytes / size))

    def observe(self, op: OpTest | None, point: ShapePoint, phase: Phase) -> dict[str, Any]:
        phase.rotate(self._input_sets(phase))
        measurement = sample(self.timer, phase.run, self.policy, phase.prepare, self.flush)
        row: dict[str, Any] = {
            "samples": measurement.samples,
            "median_us": measurement.median_ns / 1e3,
            "iqr_us": measurement.iqr_ns / 1e3,
            "min_us": measurement.min_ns / 1e3,
            "mean_us": measurement.mean_ns / 1e3,
            "rel_ci": measurement.rel_ci,
            "stop_reason": measurement.stop_reason,
            "warnings": ";".join(measurement.warnings),
            "calls_per_sample": measurement.calls_per_sample,
            "input_sets": len(phase.input_sets),
            "cache_flush": self.flush is not None,
            "weight_bytes": weight_bytes(phase.parameters),
        }
        phase.rotate(1)  # the memory and FLOP passes need one set only
        if phase.name == "forward":
            with SavedTensorsMeter(exclude=self.model_parameters) as saved:
                out = phase.run()
            del out
            row["activation_bytes"] = saved.bytes
        row["peak_bytes"] = self._once(phase, lambda run: peak_bytes(run, self.device))
        row["flops"] = self._once(phase, count_flops)
        row["tflops"] = row["flops"] / (measurement.median_ns * 1e-9) / 1e12 if measurement.median_ns else None
        return row


def launch(cfg: Any, spec: Any, run_dir: Any) -> int:
    """Run the plan with this observer; print the summary table; exit code 1 if any op failed."""
    from autotuner.launchers.common import finish, start_writer
    from autotuner.runner import Runner
    from autotuner.spec import open_session

    writer = start_writer(cfg, spec, run_dir)
    model, context = open_session(spec)
    policy = SamplingPolicy(
        **{k: cfg.timing[k] for k in ("warmup", "min_samples", "max_samples", "budget_s")}
    )
    observer = GetDataObserver(spec.device, policy, list(model.parameters()))
    Runner(spec, observer, writer, progress=cfg.progress).run(context)
    return finish(writer, spec)
