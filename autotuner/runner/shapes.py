"""Shape generators: the shape points of a run, from explicit lists or a generator.

A shape point is one (seq_len, micro_batch_size). Each generator is configured per dimension, and a
dimension it does not configure keeps its explicit list (the case's ``seq_len``/``micro_batch_size``):

* ``explicit``: the cartesian product of the two lists.
* ``pow2``: ``2**p`` for ``p`` from ``min_power`` to ``max_power`` (per dimension), crossed.
* ``sweep``: ``values`` or ``range(start, stop + 1, step)``, keeping multiples of ``multiple_of``
  (``seq_len`` also of the TP size when sequence parallelism splits the sequence), crossed.
* ``fuzz``: ``n`` points drawn log-uniformly between ``min`` and ``max`` per dimension and rounded
  to ``multiple_of``, from Python's ``random.Random(seed)``: the same points for the same seed on every
  machine and Python version (the Mersenne Twister and its ``random()`` stream are fixed by Python).
  Repeated draws are dropped, so a narrow range can give fewer than ``n`` points.

The case's ``shapes:`` block and the command line's ``shapes.*`` overrides use the same keys; overrides
win, key by key.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

from autotuner.errors import UserError
from autotuner.ops_test.base import ShapePoint

DIMS = ("seq_len", "micro_batch_size")
GENERATORS = ("explicit", "pow2", "sweep", "fuzz")
# More values of one dimension than any plan could measure (each point is every op, forward and
# backward): a range past it is a typo, refused before its list is built (a sweep to 10**8 would take
# minutes and gigabytes to make, then be refused for its lengths).
MAX_VALUES = 10_000


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` onto ``base``, ignoring None values (unset override keys)."""
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        elif isinstance(value, dict):
            merged[key] = merge({}, value)
        else:
            merged[key] = value
    return merged


def _positive(values: list[Any], name: str) -> list[int]:
    if not values:
        raise UserError(f"{name} is empty: give at least one value, e.g. {name}=[256]")
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"{name} must hold positive integers, got {value!r}: fix {name}")
    return list(values)


def _pow2(dim: dict[str, Any], name: str) -> list[int]:
    low, high = dim.get("min_power"), dim.get("max_power")
    if low is None or high is None or low < 0 or high < low or high > 62:
        raise UserError(
            f"shapes.pow2.{name} needs 0 <= min_power <= max_power <= 62: fix shapes.pow2.{name}.*"
        )
    return [2**p for p in range(low, high + 1)]


def _sweep(dim: dict[str, Any], name: str, multiple: int) -> list[int]:
    if dim.get("values") is not None:
        values = _positive(list(dim["values"]), f"shapes.sweep.{name}.values")
    else:
        start, stop, step = dim.get("start"), dim.get("stop"), dim.get("step")
        step = 1 if step is None else step  # unset: every value; 0 is refused, not taken as unset
        if start is None or stop is None or start <= 0 or stop < start or step <= 0:
            raise UserError(f"shapes.sweep.{name} needs values, or 0 < start <= stop and step > 0")
        if (stop - start) // step + 1 > MAX_VALUES:
            raise UserError(
                f"shapes.sweep.{name} from {start} to {stop} by {step} is "
                f"{(stop - start) // step + 1} values, over {MAX_VALUES}: raise step or narrow the range"
            )
        values = list(range(start, stop + 1, step))
    multiple = math.lcm(multiple, dim.get("multiple_of") or 1)
    kept = [v for v in values if v % multiple == 0]
    if not kept:
        raise UserError(f"shapes.sweep.{name}: no value is a multiple of {multiple}: widen the range")
    return kept


def _fuzz(
    spec: dict[str, Any], explicit: dict[str, list[int]], multiples: dict[str, int]
) -> list[ShapePoint]:
    n, seed = spec.get("n"), spec.get("seed") or 0
    n = 8 if n is None else n  # unset: 8; 0 or less is refused, not taken as unset
    if not 0 < n <= MAX_VALUES:
        raise UserError(f"shapes.fuzz.n={n} must be between 1 and {MAX_VALUES}: fix shapes.fuzz.n")
    rng = random.Random(seed)
    bounds = {}
    for name in DIMS:
        dim = spec.get(name) or {}
        if dim.get("min") is None and dim.get("max") is None:
            bounds[name] = None  # not fuzzed: drawn from the explicit list
            continue
        low, high = dim.get("min"), dim.get("max")
        if low is None or high is None or low <= 0 or high < low:
            raise UserError(f"shapes.fuzz.{name} needs 0 < min <= max: fix shapes.fuzz.{name}.*")
        multiple = math.lcm(multiples[name], dim.get("multiple_of") or 1)
        lowest, highest = math.ceil(low / multiple) * multiple, high // multiple * multiple
        if lowest > highest:
            raise UserError(
                f"shapes.fuzz.{name}: no multiple of {multiple} lies in [{low}, {high}]: widen the range"
            )
        bounds[name] = (low, high, multiple, lowest, highest)
    points: list[ShapePoint] = []
    for _ in range(n):
        values = {}
        for name in DIMS:
            if bounds[name] is None:
                values[name] = rng.choice(explicit[name])
                continue
            low, high, multiple, lowest, highest = bounds[name]
            drawn = math.exp(rng.uniform(math.log(low), math.log(high)))
            # the nearest multiple that lies in [min, max]: rounding alone could step out of the range
            values[name] = min(highest, max(lowest, round(drawn / multiple) * multiple))
        point = ShapePoint(**values)
        if point not in points:
            points.append(point)
    return points


def generate_points(shapes: dict[str, Any], sequence_multiple: int = 1) -> list[ShapePoint]:
    """The shape points for a merged ``shapes`` block (case, then overrides)."""
    generator = shapes.get("generator") or "explicit"
    if generator not in GENERATORS:
        raise UserError(f"unknown shapes.generator {generator!r}: use one of {', '.join(GENERATORS)}")
    multiples = {"seq_len": sequence_multiple, "micro_batch_size": 1}
    explicit = {}
    for name in DIMS:
        values = shapes.get(name)
        explicit[name] = _positive(list(values), f"shapes.{name}") if values is not None else []
    if generator == "fuzz":
        for name in DIMS:
            if not (shapes.get("fuzz") or {}).get(name) and not explicit[name]:
                raise UserError(f"shapes.fuzz.{name} is not set and there is no shapes.{name} list")
        return _fuzz(shapes.get("fuzz") or {}, explicit, multiples)
    per_dim = {}
    for name in DIMS:
        dim = ((shapes.get(generator) or {}) if generator != "explicit" else {}).get(name) or {}
        if generator == "pow2" and dim:
            per_dim[name] = _pow2(dim, name)
        elif generator == "sweep" and dim:
            per_dim[name] = _sweep(dim, name, multiples[name])
        elif explicit[name]:
            per_dim[name] = explicit[name]
        else:
            raise UserError(
                f"shapes.{name} is empty: give shapes.{name}=[...] or configure the generator for it"
            )
    # each point once, however often a list names it: a dry run listed [32, 32]'s rows twice
    points = (ShapePoint(s, b) for s, b in itertools.product(per_dim["seq_len"], per_dim["micro_batch_size"]))
    return list(dict.fromkeys(points))
