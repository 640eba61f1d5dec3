"""The metric registry: every column a launcher computes beyond its times is one decorated function.

::

    @register_metric("gbps", needs=("bytes_moved", "median_us"))
    def gbps(row, seen):
        return row["bytes_moved"] / (row["median_us"] * 1e-6) / 1e9 if row["median_us"] else None

A metric names its column (a field of :class:`autotuner.results.Row`, which holds the column's meaning and
unit, and fixes its place in the files), what it needs, the launchers that can supply it and, if not
both, the phases it applies to. A need is a column of the row so far (``median_us``, or another metric's
column: that metric then runs first) or something the launcher observed (:class:`Observed`: the
``phase`` it can run again, the ``device``, the ``calibration``, an nsys report's ``kernels``). An
observer fills its row with :func:`fill`: every metric of its launcher whose needs have a value, in
dependency order and otherwise in the order registered; a metric that returns None leaves its column
out. So the same function serves get_data, torch_profiler and nsys, each where it applies (``tflops``
needs ``flops``, which nsys's rows do not have, so nsys rows have no ``tflops``).

Sensors are metrics that run the phase once more, each under its own meter: activation bytes (one forward
under autograd's saved-tensor hooks), peak bytes (the device's memory sensor; a backward as a training step
runs it: its forward's saved activations freed as it consumes them, the weight gradients added into buffers
that exist before it: autotuner.measure.memory), FLOPs (torch's FLOP counter). The observer calls
:func:`fill` after its timing pass, so no sensor's pass is timed, and each sensor has a run of its own, so
none disturbs another's figure. They are registered in that order before the metrics computed from their
columns.

Metrics of one launcher alone live with it (the nsys kernel columns in autotuner.launchers.nsys_rows);
the shared ones are here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from autotuner.measure.flops import count_flops
from autotuner.measure.memory import gradient_buffers, peak_bytes, saved_bytes, weight_bytes
from autotuner.ops.naming import PHASES
from autotuner.results import SCHEMA
from autotuner.results.calibration import roofline

if TYPE_CHECKING:
    import torch

    from autotuner.runner import Phase


@dataclass
class Observed:
    """What a launcher observed besides the row, for the metrics that need it (None: not observed)."""

    launcher: str
    phase: Phase | None = None  # the phase, runnable again (None where it did not run here: nsys's report)
    device: torch.device | None = None
    # Model parameters that are not the op's activations (activation bytes leave them out).
    model_parameters: Sequence[torch.Tensor] = ()
    calibration: Mapping[str, Any] | None = None  # the device's ceilings (autotuner.calibrate)
    dtype: str | None = None
    kernels: Sequence[Any] | None = None  # nsys on a GPU: per iteration, its KernelStats

    def once(self, meter: Callable[[Callable[[], Any]], Any]) -> Any:
        """``meter(run)`` over one run of the phase, after its untimed ``prepare`` (a backward's forward)."""
        assert self.phase is not None
        if self.phase.prepare is not None:
            self.phase.prepare()
        return meter(self.phase.run)


_OBSERVED = frozenset(f.name for f in fields(Observed)) - {"launcher"}


@dataclass(frozen=True)
class Metric:
    """One registered metric (see :func:`register_metric`)."""

    column: str
    compute: Callable[[dict[str, Any], Observed], Any]
    needs: tuple[str, ...] = ()
    launchers: tuple[str, ...] | None = None  # None: every launcher
    phases: tuple[str, ...] = PHASES
    unit: str | None = None

    def ready(self, row: Mapping[str, Any], seen: Observed) -> bool:
        """Whether it applies to this row: its phase (where known), and a value for every need."""
        phase = seen.phase.name if seen.phase is not None else row.get("phase")
        if phase is not None and phase not in self.phases:
            return False
        return all(
            (getattr(seen, need) if need in _OBSERVED else row.get(need)) is not None for need in self.needs
        )


REGISTRY: dict[str, Metric] = {}


def register_metric(
    column: str,
    needs: Sequence[str] = (),
    launchers: Sequence[str] | None = None,
    phases: Sequence[str] = PHASES,
    unit: str | None = None,
) -> Callable[[Callable[[dict[str, Any], Observed], Any]], Callable[[dict[str, Any], Observed], Any]]:
    """Register ``compute(row, seen) -> value or None`` as the metric that fills ``column``.

    ``column`` must be a field of autotuner.results.Row (its meaning and unit live there; ``unit``, if
    given, must be the same). ``needs``: columns of the row or fields of :class:`Observed` that must have
    a value. ``launchers``: the launchers (autotuner.launchers.LAUNCHERS) whose rows may have it, None
    for all. ``phases``: the phases it applies to. Raises ValueError for a column that is not in Row,
    one registered twice, or an unknown need or phase, so a slip fails at import, not in a run.
    """
    if column not in SCHEMA:
        raise ValueError(f"metric {column!r}: add the column to autotuner.results.Row first")
    if column in REGISTRY:
        raise ValueError(f"metric {column!r} is registered twice")
    if unit is not None and unit != SCHEMA[column].unit:
        raise ValueError(f"metric {column!r}: unit {unit!r}, but Row says {SCHEMA[column].unit!r}")
    unknown = [n for n in needs if n not in SCHEMA and n not in _OBSERVED]
    unknown += [phase for phase in phases if phase not in PHASES]
    if unknown:
        raise ValueError(f"metric {column!r}: unknown needs or phases: {', '.join(unknown)}")

    def register(compute: Callable[[dict[str, Any], Observed], Any]) -> Callable[..., Any]:
        chosen = None if launchers is None else tuple(launchers)
        REGISTRY[column] = Metric(column, compute, tuple(needs), chosen, tuple(phases), SCHEMA[column].unit)
        return compute

    return register


def metrics_for(launcher: str, leave_out: Sequence[str] = ()) -> list[Metric]:
    """The launcher's metrics in the order they run: each after the metrics whose columns it needs,
    otherwise in the order registered (sensors first, each its own pass)."""
    chosen = [
        m
        for m in REGISTRY.values()
        if (m.launchers is None or launcher in m.launchers) and m.column not in leave_out
    ]
    made = {m.column for m in chosen}
    ordered: list[Metric] = []
    placed: set[str] = set()
    while len(ordered) < len(chosen):
        ready = next(
            (
                m
                for m in chosen
                if m.column not in placed and all(n in placed for n in m.needs if n in made and n != m.column)
            ),
            None,
        )
        if ready is None:
            left = [m.column for m in chosen if m.column not in placed]
            raise ValueError(f"metrics need each other's columns in a cycle: {', '.join(left)}")
        ordered.append(ready)
        placed.add(ready.column)
    return ordered


def fill(row: dict[str, Any], seen: Observed, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    """Add to ``row`` (in place; returned too) every metric of ``seen.launcher`` that applies to it,
    except those in ``leave_out`` (a launcher's own choice, such as torch_profiler's peak bytes on a CPU)."""
    for metric in metrics_for(seen.launcher, leave_out):
        if metric.ready(row, seen):
            value = metric.compute(row, seen)
            if value is not None:
                row[metric.column] = value
    return row


def _seconds(row: Mapping[str, Any]) -> float:
    return row["median_us"] * 1e-6


# --- sensors: each runs the phase once more, under its own meter ----------------------------------


@register_metric("weight_bytes", needs=("phase",))
def _weight_bytes(row: dict[str, Any], seen: Observed) -> int:
    assert seen.phase is not None
    return weight_bytes(seen.phase.parameters)


@register_metric(
    "activation_bytes",
    needs=("phase",),
    launchers=("get_data", "torch_profiler", "nsys"),
    phases=("forward",),
)
def _activation_bytes(row: dict[str, Any], seen: Observed) -> int:
    assert seen.phase is not None
    # Also the op's own weights: a model too large to build whole gives each op its own parts, built
    # after model_parameters was listed (autotuner.runner.spec._PartsPerOp).
    return saved_bytes(seen.phase.run, [*seen.model_parameters, *seen.phase.parameters])


@register_metric("peak_bytes", needs=("phase", "device"), launchers=("get_data", "torch_profiler", "nsys"))
def _peak_bytes(row: dict[str, Any], seen: Observed) -> int:
    assert seen.device is not None
    phase = seen.phase
    assert phase is not None

    def prepare() -> None:
        if phase.prepare is not None:
            phase.prepare()
        if phase.name == "backward":
            gradient_buffers(phase.parameters)

    return peak_bytes(phase.run, seen.device, prepare)


@register_metric("flops", needs=("phase",), launchers=("get_data", "torch_profiler", "nsys"))
def _flops(row: dict[str, Any], seen: Observed) -> int:
    return seen.once(count_flops)


# --- computed from the row ------------------------------------------------------------------------


@register_metric("tflops", needs=("flops", "median_us"), unit="TFLOP/s")
def _tflops(row: dict[str, Any], seen: Observed) -> float | None:
    return row["flops"] / _seconds(row) / 1e12 if row["median_us"] else None


@register_metric("bytes_moved", needs=("phase",), launchers=("get_data",))
def _bytes_moved(row: dict[str, Any], seen: Observed) -> int:
    assert seen.phase is not None
    return seen.phase.bytes_moved()


@register_metric("gbps", needs=("bytes_moved", "median_us"), unit="GB/s")
def _gbps(row: dict[str, Any], seen: Observed) -> float | None:
    return row["bytes_moved"] / _seconds(row) / 1e9 if row["median_us"] else None


@register_metric("arithmetic_intensity", needs=("flops", "bytes_moved"), unit="FLOP/B")
def _arithmetic_intensity(row: dict[str, Any], seen: Observed) -> float | None:
    return row["flops"] / row["bytes_moved"] if row["bytes_moved"] else None


def _roofline(row: Mapping[str, Any], seen: Observed) -> dict[str, Any]:
    ceiling = seen.phase.call.ceiling if seen.phase is not None else None
    return roofline(row["flops"], row["bytes_moved"], _seconds(row), seen.calibration, seen.dtype, ceiling)


_ROOFLINE_NEEDS = ("flops", "bytes_moved", "median_us", "calibration")


@register_metric("bound", needs=_ROOFLINE_NEEDS)
def _bound(row: dict[str, Any], seen: Observed) -> str | None:
    return _roofline(row, seen).get("bound")


@register_metric("ceiling_fraction", needs=_ROOFLINE_NEEDS)
def _ceiling_fraction(row: dict[str, Any], seen: Observed) -> float | None:
    return _roofline(row, seen).get("ceiling_fraction")
