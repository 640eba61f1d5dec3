"""Megatron's overlaps of communication with compute, term by term: what each communication costs, and how
much of it the compute it runs beside cannot hide (the *exposed* part, which the step pays). Pure
functions of times and sizes; autotuner.predict.timing places them in the step.

* ``overlap_grad_reduce`` (Megatron's DDP): the gradients are kept in buckets of ``bucket_size``
  parameters (``max(4e7, 1e6 * dp)``, filled in the order the backward produces them); in the step's last
  micro-batch, a bucket's all-reduce (reduce-scatter with the distributed optimizer) starts as soon as its
  last gradient is made, one after another on one stream: ``c_j = max(c_{j-1}, r_j) + t_j`` with r_j the
  bucket's ready time in that backward and t_j its collective. Exposed: ``max(0, c_last - T)``, T the end
  of the rank's backward (:func:`grad_reduce_end`).
* ``overlap_param_gather`` (distributed optimizer): the next step's forward waits for each bucket's
  parameter all-gather before its first module; waiting for bucket j dispatches bucket j+1's, so gather
  j+1 runs beside bucket j's compute: ``f_j = max(e_{j-1}, g_j)``, ``g_{j+1} = f_j + t_{j+1}``, ``e_j = f_j +
  compute_j``, ``g_0 = t_0`` (the first gather hides behind nothing). Exposed: ``e_last - sum(compute)``,
  the delay of the rank's first forward (:func:`param_gather_delay`).
* pipeline exchanges (1F1B and interleaved): the schedule's simulation with the exchanges less the same
  without them (autotuner.predict.schedule: 1F1B waits for each batched send and receive at both ends;
  interleaved with ``overlap_p2p_comm`` on a GPU, only the receiver waits).
* tensor-parallel communication: in Megatron's local spec each all-reduce (or all-gather and
  reduce-scatter with sequence parallelism) sits between the GEMMs that need it: all exposed. With
  Transformer-Engine's ``tp_comm_overlap``, each all-gather is split into tp chunks pipelined with the GEMM
  that consumes it and each reduce-scatter with the GEMM that produces it (ring exchange): the pair takes
  ``max(gemm, comm) + min(gemm, comm)/tp``, one chunk not hidden at either end, so the exposed part is
  ``max(0, comm - gemm) + min(gemm, comm)/tp`` (:func:`tp_overlap_exposed`; *modelled*: the local spec
  cannot run it, so no row measures it).
* context parallelism's key-value exchange (:func:`context_attention`): each rank's attention over the
  whole sequence is cp steps, each the s/cp queries against one rank's s/cp keys, while the next rank's
  keys and values arrive: exposed ``(cp-1) * max(0, exchange - step)``.

Not modelled: the compute a communication slows by sharing the GPU's memory bandwidth and SMs with it
(NCCL's kernels take a few SMs), so a hidden collective is taken as free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Megatron's DDP bucket size when none is given: max(40M, 1M x dp) parameters
# (megatron/core/distributed/distributed_data_parallel.py).
BUCKET_PARAMS_MIN = 40_000_000
BUCKET_PARAMS_PER_DP = 1_000_000


def bucket_size(dp: int) -> int:
    """Megatron's default bucket size in parameters for a data-parallel group of ``dp`` ranks."""
    return max(BUCKET_PARAMS_MIN, BUCKET_PARAMS_PER_DP * dp)


@dataclass(frozen=True)
class Part:
    """A piece of a rank's forward or backward: its seconds and the parameters whose gradients it makes
    (backward) or whose values it needs (forward)."""

    name: str
    seconds: float
    params: float


@dataclass(frozen=True)
class Bucket:
    """Parameters communicated together; ``ready``: when its last part ends, from the start of the phase
    (a backward's bucket is then complete); ``first``: the index of its first part."""

    params: float
    ready: float
    first: int


def buckets(parts: Sequence[Part], size: float) -> list[Bucket]:
    """The buckets Megatron's DDP makes of ``parts``' parameters in this order: a bucket closes once it
    holds ``size`` parameters or more (a part whose parameters would overfill it is not split), the last
    holds the rest."""
    out: list[Bucket] = []
    held, clock, first = 0.0, 0.0, 0
    for index, part in enumerate(parts):
        clock += part.seconds
        if not held:
            first = index
        held += part.params
        if held >= size:
            out.append(Bucket(held, clock, first))
            held = 0.0
    if held:
        out.append(Bucket(held, clock, first))
    return out


def serial_stream(events: Sequence[tuple[float, float]]) -> float:
    """When the last of ``events`` (ready time, duration), run one after another on one stream in
    order, ends: ``c_j = max(c_{j-1}, r_j) + t_j``; 0 without events."""
    end = 0.0
    for ready, duration in events:
        end = max(end, ready) + duration
    return end


def grad_reduce_end(parts: Sequence[Part], size: float, collective: Callable[[float], float]) -> float:
    """When the bucketed gradient reduction of a backward made of ``parts`` (in backward order) ends,
    from the backward's start, each bucket's collective taking ``collective(params)`` seconds."""
    return serial_stream([(b.ready, collective(b.params)) for b in buckets(parts, size)])


def param_gather_delay(parts: Sequence[Part], size: float, gather: Callable[[float], float]) -> float:
    """How much later a forward made of ``parts`` (in forward order) ends when each bucket's parameters
    must be all-gathered first, the next bucket's gather dispatched when the previous one is waited
    for (module docstring)."""
    if not parts:
        return 0.0
    made = buckets(parts, size)
    firsts = [0, *(b.first for b in made[1:]), len(parts)]  # parts before any parameter: the first bucket's
    ends = 0.0
    gathered = gather(made[0].params)
    for j in range(len(made)):
        start = max(ends, gathered)
        compute = sum(p.seconds for p in parts[firsts[j] : firsts[j + 1]])
        if j + 1 < len(made):
            gathered = start + gather(made[j + 1].params)
        ends = start + compute
    return ends - sum(p.seconds for p in parts)


def tp_overlap_exposed(gemm: float, comm: float, tp: int) -> float:
    """The exposed part of a collective pipelined with its GEMM in tp chunks (module docstring)."""
    if comm <= 0:
        return 0.0
    return max(0.0, comm - gemm) + min(gemm, comm) / tp


def context_attention(step: float, exchange: float, cp: int) -> tuple[float, float]:
    """(compute, exposed exchange) of one rank's attention under context parallelism: ``cp`` steps of
    ``step`` seconds, each hiding the next key-value exchange of ``exchange`` seconds but the last."""
    return cp * step, (cp - 1) * max(0.0, exchange - step)


@dataclass(frozen=True)
class Exposed:
    """One communication term of the step: its seconds in all, what it adds to the step (``exposed``),
    what it overlaps with, and the rule with its figures."""

    name: str
    total: float
    exposed: float
    overlaps_with: str
    rule: str

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "total_s": self.total,
            "exposed_s": self.exposed,
            "overlaps_with": self.overlaps_with,
            "rule": self.rule,
            "source": {"kind": "modelled", "detail": self.rule},
        }
