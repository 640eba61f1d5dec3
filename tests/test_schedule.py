"""The pipeline schedule simulation (autotuner.predict.schedule): Megatron-Core's order, its dependencies,
the exchanges charged to both ends, and the closed form it reduces to for equal stages."""

from __future__ import annotations

import random

import pytest

from autotuner.predict.schedule import (
    closed_form_s,
    dependency,
    exchanges,
    placement,
    rank_order,
    simulate,
)

REL = 1e-9
GRID = [(1, 1, 3), (2, 1, 1), (2, 1, 8), (4, 1, 6), (4, 1, 2), (2, 2, 8), (4, 2, 8), (3, 3, 6), (4, 4, 4)]


def own_times(forward: list[float], backward: list[float], v: int = 1):
    return lambda key: (forward if key[1] == "forward" else backward)[key[0]] / v


@pytest.mark.parametrize(("p", "v", "m"), GRID, ids=[f"p{p}v{v}m{m}" for p, v, m in GRID])
def test_equal_stages_and_free_exchanges_give_narayanans_closed_form(p, v, m):
    sched = simulate(own_times([1.0] * p, [2.0] * p, v), p, v, m)
    assert sched.end == pytest.approx(closed_form_s(3.0, p, v, m), rel=REL)
    assert len(sched.boxes) == 2 * p * v * m


@pytest.mark.parametrize(("p", "v", "m"), GRID, ids=[f"p{p}v{v}m{m}" for p, v, m in GRID])
def test_every_box_follows_its_rank_and_its_input_with_the_exchanges(p, v, m):
    forward = [1.0 + 0.3 * s for s in range(p)]
    backward = [2.5 - 0.2 * s for s in range(p)]
    x = 0.25
    sched = simulate(own_times(forward, backward, v), p, v, m, exchange_s=x)
    at = {(b.stage, b.phase, b.microbatch, b.chunk): b for b in sched.boxes}
    for s in range(p):
        order = rank_order(s, p, v, m)
        assert sorted(order) == sorted(
            {(ph, mb, c) for ph in ("forward", "backward") for mb in range(m) for c in range(v)}
        )
        mine = [at[(s, *step)] for step in order]
        for box in mine:
            assert box.end - box.start == pytest.approx(own_times(forward, backward, v)((s, box.phase, 0, 0)))
        for i, (before, after) in enumerate(zip(mine, mine[1:], strict=False)):
            gap = x if exchanges(s, order[i], order[i + 1], p, v) else 0.0
            assert after.start >= before.end + gap - REL
        for box in mine:
            needs = dependency((s, box.phase, box.microbatch, box.chunk), p, v)
            if needs is not None:
                cost = x if needs[0] != s else 0.0
                assert box.start >= at[needs].end + cost - REL
                assert needs[1] == box.phase or (needs[1], box.phase) == ("forward", "backward")


def test_two_unequal_stages_by_hand():
    """p=2: stage 1 the slower. Stage 0's first forward, then stage 1 paces m forward-backward pairs, one
    exchange before each of its forwards (receiving; and sending the gradient back after each backward,
    the same batched call), then the last gradient reaches stage 0 (one more exchange) for its last
    backward: f0 + m (f1 + b1) + b0 + (m + 1) x."""
    f0, b0, f1, b1, x, m = 1.0, 2.0, 1.5, 3.0, 0.2, 8
    sched = simulate(own_times([f0, f1], [b0, b1]), 2, 1, m, exchange_s=x)
    assert sched.end == pytest.approx(f0 + m * (f1 + b1) + b0 + (m + 1) * x, rel=REL)
    # the closed form paces the warm-up and cool-down at stage 1 too: it over-counts by the difference
    assert closed_form_s(f1 + b1, 2, 1, m) - sched.end == pytest.approx((f1 + b1) - (f0 + b0) - (m + 1) * x)


def test_one_micro_batch_through_two_stages_pays_an_exchange_each_way():
    sched = simulate(own_times([1.0, 2.0], [3.0, 4.0]), 2, 1, 1, exchange_s=0.5)
    at = {(b.stage, b.phase): (b.start, b.end) for b in sched.boxes}
    assert at == {
        (0, "forward"): (0.0, 1.0),
        (1, "forward"): (1.5, 3.5),
        (1, "backward"): (3.5, 7.5),  # the last stage's forward ends in the loss: no exchange before
        (0, "backward"): (8.0, 11.0),
    }


def test_no_exchanges_without_a_pipeline():
    assert not exchanges(0, ("forward", 0, 0), ("backward", 0, 0), 1, 1)
    sched = simulate(own_times([1.0], [2.0]), 1, 1, 4, exchange_s=10.0)
    assert sched.end == pytest.approx(12.0)
    assert len(sched.boxes) == 2 * 4 and {box.phase for box in sched.boxes} == {"forward", "backward"}


def test_overlapped_exchanges_cost_only_the_receiving_box():
    """Megatron-LM's interleaved schedule posts its exchanges and waits only before the box that needs the
    data: no rank pays between its own boxes, every box that receives pays one exchange after its input."""
    p, v, m, x = 2, 2, 4, 0.25
    sched = simulate(own_times([1.0, 1.5], [2.0, 2.5], v), p, v, m, exchange_s=x, overlapped=True)
    at = {(b.stage, b.phase, b.microbatch, b.chunk): b for b in sched.boxes}
    for s in range(p):
        mine = [at[(s, *step)] for step in rank_order(s, p, v, m)]
        for before, after in zip(mine, mine[1:], strict=False):
            assert after.start >= before.end - REL
        for box in mine:
            key = (s, box.phase, box.microbatch, box.chunk)
            needs = dependency(key, p, v)
            ready = 0.0 if needs is None else at[needs].end + (x if needs[0] != s else 0.0)
            previous = max((b.end for b in mine if b.end <= box.start + REL), default=0.0)
            assert box.start == pytest.approx(max(ready, previous))  # as early as rank and input allow
    both = simulate(own_times([1.0, 1.5], [2.0, 2.5], v), p, v, m, exchange_s=x)
    free = simulate(own_times([1.0, 1.5], [2.0, 2.5], v), p, v, m)
    assert free.end < sched.end < both.end


@pytest.mark.parametrize(("p", "v", "m"), GRID, ids=[f"p{p}v{v}m{m}" for p, v, m in GRID])
def test_the_placement_order_puts_every_box_after_its_input_and_its_ranks_previous_box(p, v, m):
    """simulate places the boxes in one order worked out per (p, v, m), whatever their durations: it must
    hold every box once, each after the box it needs and after its rank's box before it."""
    order = placement(p, v, m)
    keys = [key for key, *_ in order]
    assert len(set(keys)) == len(keys) == 2 * p * v * m
    at = {key: i for i, key in enumerate(keys)}
    for i, (key, source, cross, before) in enumerate(order):
        needs = dependency(key, p, v)
        assert source == (-1 if needs is None else at[needs]) and source < i
        assert cross == (needs is not None and needs[0] != key[0])
        mine = rank_order(key[0], p, v, m)
        k = mine.index(key[1:])
        assert before == (k > 0 and exchanges(key[0], mine[k - 1], key[1:], p, v))
        if k:
            assert at[(key[0], *mine[k - 1])] < i
    assert placement(p, v, m) is order  # worked out once


def sweep_simulation(duration, p, v, m, exchange_s, overlapped):
    """The simulation written the plain way, as it was before it was made fast: sweep every rank, placing
    each box whose input is placed, until nothing is left. Each box's (start, end) by key."""
    orders = [rank_order(s, p, v, m) for s in range(p)]
    done: dict = {}
    free, position = [0.0] * p, [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            while position[s] < len(orders[s]):
                step = orders[s][position[s]]
                key = (s, *step)
                needs = dependency(key, p, v)
                if needs is not None and needs not in done:
                    break
                start = free[s]
                if not overlapped and position[s] and exchanges(s, orders[s][position[s] - 1], step, p, v):
                    start += exchange_s
                if needs is not None:
                    start = max(start, done[needs][1] + (exchange_s if needs[0] != s else 0.0))
                done[key] = (start, start + duration(key))
                free[s] = done[key][1]
                position[s] += 1
    return done


@pytest.mark.parametrize(("p", "v", "m"), GRID, ids=[f"p{p}v{v}m{m}" for p, v, m in GRID])
@pytest.mark.parametrize("overlapped", [False, True])
def test_the_fast_simulation_places_every_box_where_the_plain_sweep_does(p, v, m, overlapped):
    """Random durations per box (not per stage: the replay of measured steps gives each box its own), a
    random exchange: every box's start and end as the plain sweep has them, exactly."""
    rng = random.Random(p * 100 + v * 10 + m)
    own = {
        (s, ph, mb, c): rng.uniform(0.1, 3.0)
        for s in range(p)
        for ph in ("forward", "backward")
        for mb in range(m)
        for c in range(v)
    }
    x = rng.uniform(0.0, 0.5)
    sched = simulate(own.__getitem__, p, v, m, exchange_s=x, overlapped=overlapped)
    plain = sweep_simulation(own.__getitem__, p, v, m, x, overlapped)
    got = {(b.stage, b.phase, b.microbatch, b.chunk): (b.start, b.end) for b in sched.boxes}
    assert got == plain
    assert sched.end == max(end for _, end in plain.values())
