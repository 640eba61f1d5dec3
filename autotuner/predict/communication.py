"""The step's communication beside its compute: each of Megatron's overlaps (autotuner.predict.overlap) placed
in the stages and the schedule of autotuner.predict.timing, each term's total and exposed part kept for
the step's breakdown (:class:`~autotuner.predict.overlap.Exposed`).

* tensor parallelism (per layer and micro-batch, a stage item): exposed whole in Megatron's local spec;
  with ``tp_comm_overlap`` the layer's collectives split evenly over its four GEMM pairs (the all-gathers
  before linear_qkv and linear_fc1, the reduce-scatters after linear_proj and linear_fc2) and each pair's
  exposed part by :func:`~autotuner.predict.overlap.tp_overlap_exposed`, the GEMM its row's time (a
  backward's data-gradient GEMM half its row: the weight-gradient GEMM is the other half); a pair
  without its GEMM's row stays exposed whole (said);
* context parallelism (per layer and micro-batch, stage items): the attention's other cp-1 steps
  (``cp_attention``: each a causal attention over s/cp tokens, the FLOPs of one of the load-balanced
  ring's steps) and the key-value exchange they do not hide (``cp_kv_exchange``): each step sends the
  rank's K and V, 2 * s/cp * b * groups * head_dim elements / tp, forward, and with their gradients twice
  that backward, to the next rank of the cp group;
* the data-parallel reduction with ``overlap_grad_reduce``: each stage's buckets in the last backward of
  each model chunk (the schedule's box), their collectives on one stream (:func:`grad_reduce_end`); the
  step waits for the last stage's stream to end;
* the parameter all-gather with ``overlap_param_gather``: each model chunk's first forward on each stage
  waits as :func:`~autotuner.predict.overlap.param_gather_delay` says (a longer box in the schedule);
* the pipeline's exchanges: the schedule with them less the schedule without.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from autotuner.predict.layout import Source
from autotuner.predict.op_time import OpTime, TimeModel
from autotuner.predict.overlap import (
    Part,
    bucket_size,
    buckets,
    context_attention,
    param_gather_delay,
    serial_stream,
    tp_overlap_exposed,
)
from autotuner.predict.schedule import Key, Schedule
from autotuner.results.units import human_time

# The GEMM each of a layer's tensor-parallel collectives is pipelined with under tp_comm_overlap.
TP_PAIRS = (
    ("linear_qkv", "all-gather"),
    ("linear_proj", "reduce-scatter"),
    ("linear_fc1", "all-gather"),
    ("linear_fc2", "reduce-scatter"),
)


def _t(seconds: float) -> str:
    return human_time(seconds * 1e6)


def tp_overlap_item(tm: TimeModel, phase: str, comm: OpTime) -> OpTime:
    """A layer's TP collectives of one phase (``comm``, exposed whole) as Transformer-Engine's
    tp_comm_overlap leaves them (module docstring); *modelled*."""
    tp, per = tm.layout.tp, comm.seconds / len(TP_PAIRS)
    exposed, said = 0.0, []
    for op, what in TP_PAIRS:
        gemm = tm.op(op, phase) if not tm._absent(op) else None
        if gemm is None or gemm.rows_tp == 0:  # no row of the GEMM: nothing known to hide it behind
            exposed += per
            said.append(f"{what} before/after {op}: {_t(per)} exposed whole (no row of {op})")
            continue
        hidden_behind = gemm.seconds / (2 if phase == "backward" else 1)
        part = tp_overlap_exposed(hidden_behind, per, tp)
        exposed += part
        said.append(
            f"{what} {_t(per)} beside {op}'s {'data-gradient GEMM' if phase == 'backward' else 'GEMM'} "
            f"{_t(hidden_behind)}: {_t(part)}"
        )
    detail = (
        f"tp_comm_overlap (Transformer-Engine, modelled): of {_t(comm.seconds)} of collectives "
        f"({comm.source.detail}), exposed max(0, comm - gemm) + min(gemm, comm)/tp a pair: " + "; ".join(said)
    )
    return OpTime(exposed, Source("modelled", detail), {"tp_collectives": exposed})


def kv_exchange_bytes(tm: TimeModel, phase: str) -> float:
    """Bytes one ring step of context parallelism sends (module docstring)."""
    lay, model = tm.layout, tm.model
    kv = 2 * lay.seq_len * lay.micro_batch_size * model.query_groups * model.kv_channels / lay.tp
    return kv * lay.bytes_per_element * (2 if phase == "backward" else 1)


def context_parallel_items(tm: TimeModel, phase: str, layers: int) -> list[tuple[str, str, OpTime, int]]:
    """The stage items context parallelism adds to each of ``layers`` layers in ``phase`` (module
    docstring); none at cp=1."""
    cp = tm.cp
    if cp == 1:
        return []
    step = tm.op("core_attention", phase)
    nbytes = kv_exchange_bytes(tm, phase)
    exchange, src = tm.collective("send_recv", nbytes, 2, "cp")
    compute, exposed = context_attention(step.seconds, exchange, cp)
    steps = OpTime(
        compute - step.seconds,
        Source(
            "modelled",
            f"context parallelism cp={cp} (modelled; Megatron runs it in Transformer-Engine): {cp - 1} more "
            f"steps of the rank's s/cp queries against another rank's keys, each {_t(step.seconds)} as its "
            f"core_attention over s/cp ({step.source.detail})",
        ),
        {"core_attention": compute - step.seconds},
        step.missing,
        step.rows_tp,
    )
    kv = OpTime(
        exposed,
        Source(
            "modelled",
            f"the key-value exchange of {cp - 1} ring steps, each {nbytes:.4g} B ({_t(exchange)}: "
            f"{src.detail}) beside a {_t(step.seconds)} step: (cp-1) x max(0, exchange - step)",
        ),
        {"cp_kv_exchange": exposed},
    )
    return [("cp_attention", phase, steps, layers), ("cp_kv_exchange", phase, kv, layers)]


class Stage(Protocol):
    """What of a stage's time the overlaps read (autotuner.predict.timing.StageTime)."""

    index: int
    items: Sequence[tuple[str, str, OpTime, int]]
    chunks: Sequence[tuple[float, float]]


def _chunk_parts(tm: TimeModel, stage: Stage, chunk: int, phase: str) -> list[Part]:
    """The pieces of one model chunk's ``phase`` on pipeline rank ``stage`` (its box's time in all), in
    the order the phase runs them, each with the parameters it holds: the embedding (the model's first
    chunk), its layers (equal shares of what is left), the final norm and the output layer (its last);
    a tied output layer at pp=1 shares the embedding's table, whose gradient is whole after both."""
    lay, model = tm.layout, tm.model
    seconds = stage.chunks[chunk][0 if phase == "forward" else 1]
    per_chunk = lay.stage_layers(model.num_layers)[stage.index] // lay.vpp
    first = stage.index == 0 and chunk == 0
    last = stage.index == lay.pp - 1 and chunk == lay.vpp - 1
    table = model.vocab * model.hidden / lay.tp
    outside = {name: 0.0 for name in ("embedding", "head")}
    for name, item_phase, t, count in stage.items:
        op = name.split(":", 1)[-1]
        if item_phase != phase:
            continue
        if first and op == "embedding":
            outside["embedding"] += t.seconds * count
        elif last and op in ("final_layernorm", "output_layer"):
            outside["head"] += t.seconds * count
    layer_s = max(0.0, seconds - sum(outside.values())) / max(1, per_chunk)
    head_params = model.final_norm_params + (table if not model.tie_embeddings or lay.pp > 1 else 0.0)
    parts = [Part("embedding", outside["embedding"], table)] if first else []
    parts += [Part("layer", layer_s, model.layer_params_on_rank(lay.tp, lay.ep))] * per_chunk
    parts += [Part("output_layer", outside["head"], head_params)] if last else []
    return parts if phase == "forward" else parts[::-1]


def chunk_boxes(schedule: Schedule, phase: str, last: bool) -> dict[tuple[int, int], tuple[float, float]]:
    """{(stage, chunk): (start, end)} of each chunk's last (``last``) or first box of ``phase``."""
    found: dict[tuple[int, int], tuple[float, float]] = {}
    for (key, *_), start, end in zip(schedule.placed, schedule.starts, schedule.ends, strict=True):
        if key[1] != phase:
            continue
        where = (key[0], key[3])
        if last or where not in found:
            found[where] = (start, end)
    return found


def bucket_seconds(tm: TimeModel, params: float, what: str) -> float:
    """One bucket's collective of the gradient reduction (fp32 gradients: all-reduce, or reduce-scatter
    with the distributed optimizer) or (``what="gather"``) of the distributed optimizer's parameter
    all-gather (the model's dtype), over the data-parallel (dp-cp) group."""
    lay = tm.layout
    if what == "gather":
        return tm.collective("all_gather", params * lay.bytes_per_element, lay.dp, "dp")[0]
    kind = "reduce_scatter" if lay.distributed_optimizer else "all_reduce"
    return tm.collective(kind, params * 4, lay.dp, "dp")[0]


def param_gather_delays(tm: TimeModel, stages: Sequence[Stage]) -> dict[Key, float]:
    """{box: the longer it takes} for each model chunk's first forward on each stage waiting for its
    buckets' parameter all-gathers (module docstring)."""
    size = bucket_size(tm.layout.dp)
    delays = {}
    for stage in stages:
        for chunk in range(len(stage.chunks)):
            parts = _chunk_parts(tm, stage, chunk, "forward")
            delay = param_gather_delay(parts, size, lambda p: bucket_seconds(tm, p, "gather"))
            if delay > 0:
                delays[(stage.index, "forward", 0, chunk)] = delay
    return delays


def gather_total(tm: TimeModel, params: float) -> float:
    """All of one rank's parameter all-gathers, bucket by bucket."""
    return sum(bucket_seconds(tm, b, "gather") for b in _sizes(params, bucket_size(tm.layout.dp)))


def _sizes(params: float, size: float) -> list[float]:
    whole, rest = divmod(params, size)
    return [size] * int(whole) + ([rest] if rest else [])


def grad_reduce_end(tm: TimeModel, schedule: Schedule, stages: Sequence[Stage]) -> tuple[float, float]:
    """(when the last stage's bucketed gradient reduction ends, the reduction's seconds on the busiest
    stage) with ``overlap_grad_reduce`` (module docstring)."""
    size = bucket_size(tm.layout.dp)
    boxes = chunk_boxes(schedule, "backward", last=True)
    end, busiest = 0.0, 0.0
    for stage in stages:
        events = []
        for chunk in range(len(stage.chunks)):
            start, _ = boxes[(stage.index, chunk)]
            parts = _chunk_parts(tm, stage, chunk, "backward")
            events += [
                (start + b.ready, bucket_seconds(tm, b.params, "reduce")) for b in buckets(parts, size)
            ]
        events.sort()
        busiest = max(busiest, sum(duration for _, duration in events))
        end = max(end, serial_stream(events))
    return end, busiest
