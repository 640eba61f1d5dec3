"""Megatron-Core's pipeline schedules, simulated: where each stage's forwards and backwards fall in a step.

The predictor's pipeline time is the end of the last box this module places (:func:`simulate`), not a
closed form. Narayanan et al. 2021 (section 2.2) give one for equal stages, (m + p - 1) x (t_f + t_b),
or m (t_f + t_b)(1 + (p-1)/(v m)) interleaved; with no exchange cost and equal stages the simulation
ends exactly there (tested). Real stages are not equal: the first holds the embedding, the last the
final norm, the output layer and the loss; the closed form paces every slot, the warm-up and cool-down
too, at the slowest stage, and over-counts a pipeline whose other stages are faster (by one slowest
stage's lead per stage at the ends). Each stage's boxes here take its own forward and backward, and
each model chunk's its own (autotuner.predict.timing.chunk_times: the embedding in the model's first
chunk, the output layer in its last).

**The order** each rank runs (:func:`rank_order`), as Megatron-Core's schedules do:

* non-interleaved (v = 1, ``forward_backward_pipelining_without_interleaving``): stage i runs
  min(p-i-1, m) warm-up forwards, then pairs of one forward and one backward, then the remaining
  backwards (cool-down);
* interleaved (v > 1, ``forward_backward_pipelining_with_interleaving``): virtual micro-batch k is
  micro-batch (k // (p*v))*p + k % p of chunk (k // p) % v (forwards; the backwards visit the chunks in
  reverse), rank i runs min((p-i-1)*2 + (v-1)*p, m*v) warm-up forwards (``get_pp_rank_microbatches``
  and ``get_schedule_table``, groups of p micro-batches), then the same pairs and cool-down.

**The dependencies** (:func:`dependency`): a forward waits for the same micro-batch's forward on the
stage before (chunk c on the first rank for chunk c-1 on the last), a backward for the stage after
(chunk c on the last rank for chunk c+1 on the first; the last chunk's backward for its own forward).

**The exchanges.** Between two consecutive boxes of a rank, Megatron's schedule communicates when the
first sends (a forward's activation to the next stage, a backward's gradient to the one before) or the
second receives (:func:`exchanges`); it batches the two into one call (``send_forward_recv_backward``
and the like) and waits for both. So an exchange costs both ends: a rank's next box starts an
exchange's time after its previous one ends, and a box that receives starts an exchange's time after
its sender's box ends, whichever is later. One exchange's time is the predictor's ``pp_p2p`` (one s*b*h
transfer, the calibrated batched send and receive). The sending end is what the closed form leaves out:
in a tiny PP2 step measured on this project's VM the last stage started its next forward 0.69-0.74 ms
after its backward ended though that forward's input had arrived milliseconds before, while the stage
before waited in the same exchange for the gradient; and two processes in that exchange, one arriving
up to 5 ms after the other, left it together (``python -m benchmarks.pipeline_exchange``).

The interleaved schedule as Megatron-LM runs it by default (``overlap_p2p_comm``, as
autotuner.predict.steps runs it) posts each exchange without waiting and waits only for a receive, just
before the box that needs its data. On a GPU the exchange then runs beside the compute (NCCL's kernels
on their own stream) and costs the receiving box alone (``overlapped``, :func:`overlaps_exchanges`).
Between CPU processes its work shares the cores with the compute and hides behind nothing: a measured
llama-shaped VPP2 step (4 layers, s128, 4 micro-batches, on a 2-core CPU VM) replayed with its own boxes and
median hand-over came to 0.990 of its measured span charged to both ends, 0.955 overlapped.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

# A box's key: (stage, phase, micro-batch, chunk).
Key = tuple[int, str, int, int]
# A box as :func:`placement` orders it: its key, the position of its input's box (-1: none), whether that
# box is another rank's, whether its rank exchanges before it.
Placed = tuple[Key, int, bool, bool]
BOX_COLUMNS = ("stage", "phase", "microbatch", "chunk", "start_s", "end_s")


class Box(NamedTuple):
    """One forward or backward of one micro-batch (and virtual chunk) on one stage. A named tuple: a
    schedule of thousands of micro-batches holds one per box, and a frozen dataclass took several times
    as long to make."""

    stage: int
    phase: str
    microbatch: int
    chunk: int
    start: float
    end: float

    def row(self) -> list[Any]:
        """The box as plain data, in :data:`BOX_COLUMNS` order (``prediction.json``'s schedule)."""
        return list(self)


@dataclass(frozen=True)
class Schedule:
    """Every box of one step's pipeline, in the order they were placed; the step's pipeline time is
    :attr:`end`. Kept as the placement order and each box's start and end; the boxes are made when
    asked for (autotuner.tune ranks thousands of layouts, whose millions of boxes only the explained one
    shows)."""

    placed: tuple[Placed, ...]  # :func:`placement`'s entries, box by box
    starts: Sequence[float]
    ends: Sequence[float]
    exchange_s: float  # one exchange's time, as the simulation charged it
    end: float  # when the last box ends: the pipeline's time

    @functools.cached_property
    def boxes(self) -> tuple[Box, ...]:
        return tuple(
            Box(*entry[0], start, end)
            for entry, start, end in zip(self.placed, self.starts, self.ends, strict=True)
        )

    def without_boxes(self) -> Schedule:
        """The same schedule's end and exchange without its boxes: what a ranking of thousands of
        layouts keeps of each (autotuner.tune)."""
        return Schedule((), (), (), self.exchange_s, self.end)

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": list(BOX_COLUMNS),
            "boxes": [box.row() for box in self.boxes],
            "exchange_s": self.exchange_s,
        }


def rank_order(stage: int, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """The (phase, micro-batch, chunk) sequence rank ``stage`` runs (module docstring)."""
    total = m * v
    if v == 1:
        warmup = min(p - stage - 1, m)
    else:
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)

    def which(k: int, phase: str) -> tuple[str, int, int]:
        group = (k // p) % v
        return phase, (k // (p * v)) * p + k % p, group if phase == "forward" else v - 1 - group

    order = [which(k, "forward") for k in range(warmup)]
    for k in range(total - warmup):
        order += [which(warmup + k, "forward"), which(k, "backward")]
    order += [which(k, "backward") for k in range(total - warmup, total)]
    return order


def dependency(key: Key, p: int, v: int) -> Key | None:
    """The box whose output ``key`` needs (module docstring); None for the first stage's first chunk's
    forward, which reads the data."""
    stage, phase, mb, chunk = key
    if phase == "forward":
        if stage > 0:
            return stage - 1, phase, mb, chunk
        return (p - 1, phase, mb, chunk - 1) if chunk > 0 else None
    if stage < p - 1:
        return stage + 1, phase, mb, chunk
    return (0, phase, mb, chunk + 1) if chunk < v - 1 else (stage, "forward", mb, chunk)


def _sends(stage: int, phase: str, chunk: int, p: int, v: int) -> bool:
    if phase == "forward":
        return not (stage == p - 1 and chunk == v - 1)  # the model's last chunk ends in the loss
    return not (stage == 0 and chunk == 0)  # the first chunk's input gradient goes nowhere


def _receives(stage: int, phase: str, chunk: int, p: int, v: int) -> bool:
    if phase == "forward":
        return not (stage == 0 and chunk == 0)
    return not (stage == p - 1 and chunk == v - 1)


def exchanges(stage: int, before: tuple[str, int, int], after: tuple[str, int, int], p: int, v: int) -> bool:
    """Whether the schedule communicates between two consecutive boxes (phase, micro-batch, chunk) of a
    rank: the first sends its output or the second receives its input (one batched call)."""
    if p == 1:
        return False
    return _sends(stage, before[0], before[2], p, v) or _receives(stage, after[0], after[2], p, v)


def overlaps_exchanges(vpp: int, device_type: str) -> bool:
    """Whether a schedule's exchanges cost the receiving box alone (module docstring): the interleaved
    schedule, as Megatron-LM runs it, on a GPU."""
    return vpp > 1 and device_type != "cpu"


@functools.lru_cache(maxsize=256)
def placement(p: int, v: int, m: int) -> tuple[Placed, ...]:
    """Every box of the schedule in an order that comes after its input's box and its rank's previous
    box: a topological order of the dependencies, the same whatever the boxes' durations, so it is
    worked out once per (p, v, m) (autotuner.tune simulates thousands of layouts); each entry a
    :data:`Placed` (its rank's exchange before it: :func:`exchanges`). RuntimeError if the order
    deadlocks (a bug of :func:`rank_order`)."""
    orders = [rank_order(s, p, v, m) for s in range(p)]
    at: dict[Key, int] = {}
    out: list[Placed] = []
    position = [0] * p
    # Each rank places its boxes in its order until one's input is not placed yet; it then waits on that
    # box and resumes when that box is placed: each box is looked at once or twice.
    waiting: dict[Key, int] = {}
    ready = list(range(p))
    while ready:
        s = ready.pop()
        order = orders[s]
        while position[s] < len(order):
            step = order[position[s]]
            key = (s, *step)
            needs = dependency(key, p, v)
            if needs is not None and needs not in at:
                waiting[needs] = s
                break
            before = position[s] > 0 and exchanges(s, order[position[s] - 1], step, p, v)
            source = -1 if needs is None else at[needs]
            at[key] = len(out)
            out.append((key, source, needs is not None and needs[0] != s, before))
            position[s] += 1
            if key in waiting:
                ready.append(waiting.pop(key))
    if any(position[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError(f"the 1F1B order deadlocks at p={p} v={v} m={m}")
    return tuple(out)


def simulate(
    duration: Callable[[Key], float],
    p: int,
    v: int,
    m: int,
    exchange_s: float = 0.0,
    overlapped: bool = False,
) -> Schedule:
    """Place every box of the schedule (module docstring): each as early as its rank's previous box and
    its input allow; ``duration(key)`` is the box's own time, ``exchange_s`` one exchange's, charged to
    both ends, or with ``overlapped`` to the receiving box alone."""
    free = [0.0] * p
    order = placement(p, v, m)
    starts, ends = array("d"), array("d")
    sending = 0.0 if overlapped else exchange_s
    for key, source, cross, before in order:
        stage = key[0]
        start = free[stage] + (sending if before else 0.0)
        if source >= 0:
            start = max(start, ends[source] + (exchange_s if cross else 0.0))
        end = start + duration(key)
        starts.append(start)
        ends.append(end)
        free[stage] = end
    return Schedule(order, starts, ends, exchange_s, max(free))


def closed_form_s(slowest: float, p: int, v: int, m: int) -> float:
    """Narayanan et al.'s pipeline time, m t (1 + (p-1)/(v m)) with t the slowest stage's forward +
    backward per micro-batch: what :func:`simulate` gives for equal stages and free exchanges."""
    return m * slowest * (1 + (p - 1) / (v * m))
