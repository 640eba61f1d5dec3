"""Which visits of a step find their data in the cache: the op's warm row or its flushed one, per visit.

A row timed with warm caches (the profiler's default) stands for an op that finds its weights and inputs
where its previous call left them; one timed with ``timing.flush_cache=true`` for one that does not.
Inside a step an op finds its data again only if what the stage touched since its previous visit left it
there. A micro-batch sweeps the stage's ops forward, then backward in reverse (:func:`stage_sweep`), and
a visit takes the warm row (:func:`warm_visits`) when the bytes touched since fit the calibration's
``shared_cache_bytes`` (a GPU's L2; a CPU's L3, shared evenly by the layout's processes:
:class:`CacheSizes`), when the visit just before is the same op's in the same phase (a layer after a
layer), or when the op's own bytes fit a core's private cache (``warm_cache_bytes``); a stage's first
forward op, which follows a backward, only where its warm row was timed after its backward
(``timing.forward_after_backward``). Other visits take the flushed row, an op visited both ways the mean
by its visits (:func:`blend`); without cache sizes every visit is cold. The same sweep says whether a
CPU stage's host work finds its data cached (:func:`host_work_cached`). The rule, what it was validated
against and why held-activation rows only stand in: docs/predict.md, "Which rows a visit takes".
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autotuner.ops.naming import PHASES
from autotuner.predict.inputs import (
    ModelShape,
)
from autotuner.predict.layout import Layout, Source, worst_kind
from autotuner.predict.memory import GRAD_BYTES
from autotuner.predict.op_time import OpTime


@dataclass(frozen=True)
class SweepOp:
    """One op of a stage's sweep (module docstring, "Warm or cold caches") and the distinct bytes it
    touches on one GPU per micro-batch: its weights, their fp32 main gradients (written in its
    backward), and what its forward saves (the output layer: the logits)."""

    name: str
    weights: float
    grads: float
    activations: float

    @property
    def footprint(self) -> float:
        return self.weights + self.grads + self.activations

    def own(self, phase: str) -> float:
        """The bytes one visit touches: its warm row's data."""
        return self.weights + self.activations + (self.grads if phase == "backward" else 0.0)


@dataclass(frozen=True)
class CacheSizes:
    """``shared``: the last-level cache a warm row's data stay in between its calls (calibration
    ``shared_cache_bytes``; from a calibration older than it, ``warm_cache_bytes``, a core's own);
    ``processes``: how many of a layout's processes share it, each sweeping its own stage (a CPU layout's
    ranks share one host's cache; a GPU's L2 is its own): each keeps an even share, :attr:`each`."""

    shared: float
    processes: int = 1

    @property
    def each(self) -> float:
        return self.shared / self.processes

    @classmethod
    def from_calibration(cls, calibration: Mapping[str, Any] | None, processes: int = 1) -> CacheSizes | None:
        calibration = calibration or {}
        size = calibration.get("shared_cache_bytes") or calibration.get("warm_cache_bytes")
        return cls(float(size), processes) if size else None

    def said(self) -> str:
        """The cache and this process's share of it, in words."""
        from autotuner.results.units import human_bytes

        beside = (
            f", a share of 1/{self.processes}: {self.processes} processes on one host"
            if self.processes > 1
            else ""
        )
        return f"the {human_bytes(self.shared)} shared cache{beside}"


def stage_sweep(model: ModelShape, layout: Layout, stage: int, layer_activations: float) -> list[SweepOp]:
    """The ops one micro-batch visits on ``stage``'s GPU, in forward order, with their bytes (from the
    model's sizes and one layer's saved activations per micro-batch, autotuner.predict.memory)."""
    tp, per = layout.tp, layout.bytes_per_element
    tokens = layout.seq_len * layout.micro_batch_size
    table = model.vocab * model.hidden / tp
    layer = model.layer_params_on_rank(tp, layout.ep)
    ops = (
        [SweepOp("embedding", table * per, table * GRAD_BYTES, tokens * model.hidden * per)]
        if stage == 0
        else []
    )
    per_stage = layout.stage_layers(model.num_layers)[stage]
    ops += [SweepOp("transformer_layer", layer * per, layer * GRAD_BYTES, layer_activations)] * per_stage
    if stage == layout.pp - 1:
        norm = model.final_norm_params
        ops.append(SweepOp("final_layernorm", norm * per, norm * GRAD_BYTES, tokens * model.hidden * per))
        logits = tokens * model.vocab / tp * GRAD_BYTES  # fp32 for the loss
        ops.append(SweepOp("output_layer", table * per, table * GRAD_BYTES, logits))
    return ops


def reuse_distances(sweep: list[SweepOp]) -> list[tuple[float, float]]:
    """Per op of ``sweep``, the bytes the stage touches between its (forward, backward) visit and the op's
    previous visit: for a forward, every op before it (the last micro-batch's backward of those, then this
    one's forward); for a backward, every op after it (its forward, then their backward). Distinct bytes,
    each op's footprint once."""
    before = [0.0, *itertools.accumulate(op.footprint for op in sweep)]  # bytes of the ops before each
    return [(before[i], before[-1] - before[i + 1]) for i in range(len(sweep))]


def mean_reuse_distance(sweeps: list[list[SweepOp]]) -> float:
    """The mean of :func:`reuse_distances` over the forward and backward visits of the stage that touches
    most a micro-batch."""
    fullest = max(sweeps, key=lambda sweep: sum(op.footprint for op in sweep))
    distances = [d for pair in reuse_distances(fullest) for d in pair]
    return sum(distances) / len(distances)


def warm_visits(
    sweep: list[SweepOp], caches: CacheSizes | None, timed_after_backward: frozenset[str] = frozenset()
) -> dict[tuple[str, str], int]:
    """{(op, phase): how many of its visits per micro-batch find their data where its warm row did}
    (module docstring): the bytes touched since the op's previous visit (its backward's previous
    visit is its forward; its forward's, the last micro-batch's backward) fit the shared cache, or the
    visit right before it in the step is the same op's, in the same phase (a layer after the layer before
    it). Never the sweep's first forward, which follows the stage's backward (ending with its own), unless
    the op is in ``timed_after_backward`` (its warm forward row was timed after its own backward, as that
    visit runs); nor without cache sizes (assumed exceeded), nor for an op larger than the shared cache."""
    found = {(op.name, phase): 0 for op in sweep for phase in PHASES}
    if caches is None:
        return found
    for i, (op, distances) in enumerate(zip(sweep, reuse_distances(sweep), strict=True)):
        for phase, distance in zip(PHASES, distances, strict=True):
            just_before = i - 1 if phase == "forward" else i + 1  # the backward sweeps in reverse
            follows_itself = 0 <= just_before < len(sweep) and sweep[just_before].name == op.name
            after_backward = phase == "forward" and i == 0 and op.name not in timed_after_backward
            warm = (
                op.own(phase) <= caches.each
                and not after_backward
                and (distance <= caches.each or follows_itself)
            )
            found[(op.name, phase)] += int(warm)
    return found


def cache_plan(
    sweeps: list[list[SweepOp]],
    caches: CacheSizes | None,
    calibration: Mapping[str, Any] | None,
    timed_after_backward: frozenset[str] = frozenset(),
) -> tuple[list[dict], bool, bool, str]:
    """Per stage the warm visits (:func:`warm_visits`) with ``caches`` (the ``calibration``'s, this
    process's share) and the ops whose warm forward rows were timed after their backward, whether any
    visit wants warm rows, any flushed ones, and why, in words."""
    plans = [warm_visits(sweep, caches, timed_after_backward) for sweep in sweeps]
    visits = sum(len(sweep) for sweep in sweeps) * len(PHASES)
    warm = sum(sum(plan.values()) for plan in plans)
    if caches is None:
        why = "no calibrated cache size (shared_cache_bytes): assumed every op's data leaves the cache"
    else:
        why = (
            f"{warm} of {visits} op visits per micro-batch find their data where a warm row had it (the "
            f"bytes touched since the op's last visit within {caches.said()}, "
            "or the visit before it the same op's; never a stage's first forward op, which follows a "
            "backward, unless its warm forward row was timed after its backward)"
        )
        calibration = calibration or {}
        if not calibration.get("shared_cache_bytes"):
            why += "; the calibration names no shared_cache_bytes (python -m autotuner.calibrate records it)"
        elif calibration.get("device_type") == "cpu" and "shared_cache_bytes_reported" not in calibration:
            why += (
                "; the calibration's shared_cache_bytes is the size the CPU reports, more than a VM's cores "
                "may keep (a calibration by python -m autotuner.calibrate now measures it)"
            )
    return plans, warm > 0, warm < visits, why


def blend(warm: OpTime, cold: OpTime, warm_count: int, count: int) -> OpTime:
    """An op visited ``count`` times per micro-batch, ``warm_count`` of them with its data cached: the
    mean time per visit, from its warm and its flushed rows."""
    share = warm_count / count
    parts = {
        k: share * warm.parts.get(k, 0.0) + (1 - share) * cold.parts.get(k, 0.0)
        for k in dict.fromkeys([*warm.parts, *cold.parts])
    }
    detail = (
        f"{warm_count} of {count} visits per micro-batch with the data cached: {warm.source.detail}; "
        f"the other {count - warm_count} flushed: {cold.source.detail}"
    )
    return OpTime(
        share * warm.seconds + (1 - share) * cold.seconds,
        Source(worst_kind([warm.source, cold.source]), detail),
        parts,
        tuple(dict.fromkeys([*warm.missing, *cold.missing])),
        cold.rows_tp,
    )


def host_work_cached(sweep: list[SweepOp], caches: CacheSizes | None) -> tuple[bool, str]:
    """Whether a stage's host work finds its own data in the shared cache (autotuner.predict.timing, "Host
    work outside the ops"): a micro-batch's ops on the stage touch no more bytes than this process's share
    of it holds; and why, in words. Without cache sizes, assumed not."""
    from autotuner.results.units import human_bytes

    if caches is None:
        return False, "no calibrated cache size: assumed swept out"
    touched = sum(op.footprint for op in sweep)
    cached = touched <= caches.each
    where = "within" if cached else "beyond"
    return cached, f"a micro-batch's ops touch {human_bytes(touched)}, {where} {caches.said()}"
