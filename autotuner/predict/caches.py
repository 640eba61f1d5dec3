"""Which visits of a step find their data in the cache: the warm row or the flushed one, per visit.

**Warm or cold caches.** A row measured with warm caches (``cache_flush`` false, the profiler's default) times
an op that finds its weights and inputs in the cache from its previous call; one measured with
``timing.flush_cache=true`` starts each call with the caches evicted. Inside a step an op finds its data again
only if what the stage touched since its previous visit left it there. A micro-batch sweeps the stage's ops
forward (embedding, layers, final norm, output layer), then backward in reverse, so a backward's previous
visit is its own forward, with every op after it in between, and a forward's is the last micro-batch's
backward, with every op before it in between (1F1B's steady state alternates a forward and a backward the same
way; the interleaved schedule's chunks put more between, which this undercounts). The distinct bytes of an op
are its weights, their fp32 main gradients and what its forward saves, from the model's sizes and the layer's
measured ``activation_bytes`` (:func:`stage_sweep`, :func:`warm_visits`). A visit takes the op's warm row when
those bytes fit the shared last-level cache (calibration ``shared_cache_bytes``: a GPU's L2; on a CPU the L3 a
core keeps data in, as measured: autotuner.measure.cache), or, whatever lies between, when the visit right
before it is the same op's in the same phase (a layer's forward after the previous layer's, its backward after
the next layer's); never for an op larger than that cache, nor for the first op of a stage's forward, which
follows a backward (the last micro-batch's, ending with this op's own: in 1F1B's steady state every forward
does), unless its warm forward row was timed after the op's backward (``timing.forward_after_backward``), as
the visit runs. A backward leaves cold what a flush does, the code and the memory the allocator recycles, so
a warm forward row timed back to back does not stand for that visit, and it takes the flushed row (a layer's
forward after its backward 1.11-1.20x its back-to-back time against 1.28-1.41x after a flush (tiny) and
1.06-1.09x against 1.11-1.13x (llama-shaped; ``python -m benchmarks.forward_after_backward``). Timed after the
backward, the warm row is nearer than the flushed one: on a 2-core CPU VM that visit took 1.098 ms inside tiny
PP2's steps, the layer's warm row 1.096 and its flushed row 1.352 (medians of six rounds), and from the warm
row it read 1.019 of its time inside the steps (``python -m benchmarks.predict_accuracy --cases tiny --layouts
pp2``, which prints the step both ways).

**Small ops between.** An op whose own bytes fit a core's private cache (calibration ``warm_cache_bytes``, a
CPU's L2) takes its warm row by the shared cache's rule too, even where what lies between its visits exceeds
the private cache, and so does the embedding's first forward (its backward only adds into the table's
gradient, so a warm row timed after it still finds what the last forward sample left). Neither row is what
such a visit pays: inside the steps the op before it has just run the code and used the allocator's memory,
which a flush evicts, and its own data come from the shared cache. How far the flushed row over-reads depends
on the machine. On a 2-core AMD VM (a 32 MiB L3), tiny's final norm forward took 0.06-0.16 ms inside the steps
against its warm row of 0.02 and flushed row of 0.14-0.25, the embedding's first forward 0.085 against 0.021
and 0.12-0.13 (warm: under by 1.6% of tiny's step; flushed: over by 1%). On a 2-core Intel VM, whose host
socket's L3 other tenants share, the flushed rows of the small ops read 5-12x their time inside the steps
(tiny TP1, one validation each: the final norm's forward 0.086 ms inside, warm 0.055, flushed 0.68; the
embedding's first forward 0.131 and 0.207 inside, warm 0.059, flushed 0.69 and 1.10; the embedding's backward
0.087 inside, warm 0.069, flushed 0.93; the output layer's forward 1.25 ms inside, warm 1.14, flushed 2.54),
and the step read 1.45 of its measured time from the same rows when these visits needed the private cache and
1.17 with this rule. The warm row errs by at most a few percent of a step on both machines, the flushed row by
up to 7% (the embedding's first forward alone, four visits a step), so these visits take the warm row. A third
kind of row, timed after a flush of the private cache alone, would time them as they run; it is not built.

**Processes of one host.** A CPU layout's processes share the host's cache, each sweeping its own stage (or
its own copy of it), and each keeps an even share of it (:class:`CacheSizes`, ``processes``); a GPU's L2 is
its own. The host work's rule (:func:`host_work_cached`) and the op visits both count so. With the whole cache
to one process, the llama-shaped PP2's last stage (two layers, the final norm, the output layer: about 20 MB a
micro-batch) would take its output layer's forward from the warm row, and that row read 0.797 and 0.809 of the
forward's time inside the steps (four rounds each), where the flushed row read 1.07-1.15 of it on one process
(TP1).

Other visits take an op's flushed row, and an op visited both ways the mean of the two by its visits
(:func:`blend`, said in its source). Without cache sizes every visit is assumed cold. The rule is LRU-like and
ignores that a cache keeps some of a larger working set; it is what the measurements showed on this project's
2-core CPU (1 MiB L2 per core, 32 MiB shared L3): the llama-shaped model's layers, timed by hooks inside its
real step, took 2.9-3.2 ms forward and 4.3-4.5 ms backward, their warm rows 2.82 and 4.30, their flushed rows
4.07 and 5.72; the tiny model's layers took 1.27-1.46 and 1.24 ms against warm rows of 1.18 and 1.24 and
flushed ones of 2.06 and 1.61. The stage-wide choice the rule replaced took the flushed rows for both (their
memory exceeds a core's L2) and over-predicted the llama-shaped forward-backward by 6-25%. A layer that
follows a layer: what makes a flushed row slow on a CPU is less the op's own weights leaving the cache than
what the flush evicts besides, the code and the memory the allocator recycles, which the layer before it has
just run and used (``python -m benchmarks.forward_after_backward``, one thread, a layer's forward
over its back-to-back time: after a flush 1.30-1.68x (tiny) and 1.09-1.16x (llama-shaped); after the flush and
then another layer's forward, this layer's weights still evicted, 1.01-1.09x and 1.03-1.06x; after another
layer alone 0.98-1.02x and 1.00-1.01x). Without this clause the llama-shaped TP1 stage took 1 of its 4 layer
visits a phase from the flushed row and read 11% (forward) and 8% (backward) over the layers' time inside the
steps, where its warm rows read 0.99-1.04 of it (``python -m benchmarks.row_in_step``); inside the steps no
visit of a layer ran slower than the rest. On a GPU a real model's layer exceeds the L2 and takes its flushed
row. Where the runs hold only one kind of row, it stands in for the other and the prediction warns. A warm
forward row timed after the op's backward (``timing.forward_after_backward``, as every forward of an op in a
step runs) wins over one timed back to back, which on a CPU reads under a step's forward; a CPU prediction
from back-to-back ones says so (autotuner.measure.timer, "A forward follows its backward").

**Activations held (not in the rule).** A step keeps each micro-batch's saved activations until
its backward, so an op's visit writes, or reads, memory whose previous use lies as many bytes back as the
stage touches between (:func:`reuse_distances`); a warm row timed after its own backward writes into the
blocks that backward has just freed. Rows timed beside earlier calls' held graphs
(``timing.held_activations_mib``, autotuner.measure.timer, "Activations a step holds") time the other
condition. In one process on a 2-core Intel VM they brought the llama-shaped layer's rows closer to its
visits inside the steps (``python -m benchmarks.row_in_step``), but the steps predicted from them, profiled
in their own processes, read 0.970-1.053 (the medians of four runs over two hours) against 0.922-0.977 from
the rows without in the same rounds, no nearer than those (``python -m benchmarks.predict_accuracy``), so the
rule takes the rows without held activations (autotuner.predict.inputs.Measurements) and
held rows only stand in for them.

The same sweep says whether a stage's host work outside its ops finds its own data cached
(:func:`host_work_cached`; autotuner.predict.timing, "Host work outside the ops").
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
