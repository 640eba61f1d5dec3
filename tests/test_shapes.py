"""Shape generators: explicit, pow2, sweep with divisibility, and the seeded fuzzer's determinism."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autotuner.errors import UserError
from autotuner.ops_test.base import ShapePoint
from autotuner.runner.shapes import generate_points, merge

CASE = {"seq_len": [128, 256], "micro_batch_size": [1]}


def labels(points):
    return [p.label for p in points]


def test_explicit_is_the_cartesian_product():
    assert labels(generate_points({"seq_len": [8, 16], "micro_batch_size": [1, 2]})) == [
        "s8_b1",
        "s8_b2",
        "s16_b1",
        "s16_b2",
    ]
    # each point once, as a run measures it (a dry run listed a repeated value's rows twice)
    assert labels(generate_points({"seq_len": [8, 8], "micro_batch_size": [1]})) == ["s8_b1"]


def test_pow2_per_dimension_keeps_the_other_dimension_explicit():
    shapes = merge(CASE, {"generator": "pow2", "pow2": {"seq_len": {"min_power": 9, "max_power": 11}}})
    assert labels(generate_points(shapes)) == ["s512_b1", "s1024_b1", "s2048_b1"]


def test_sweep_with_divisibility_and_the_tp_constraint():
    shapes = {
        "generator": "sweep",
        "sweep": {
            "seq_len": {"start": 100, "stop": 130, "step": 2, "multiple_of": 4},
            "micro_batch_size": {"values": [1, 2, 3, 4], "multiple_of": 2},
        },
    }
    points = generate_points(shapes)
    assert {p.seq_len for p in points} == {100, 104, 108, 112, 116, 120, 124, 128}
    assert {p.micro_batch_size for p in points} == {2, 4} and len(points) == 16
    tp_points = generate_points(shapes, sequence_multiple=8)  # sequence parallel over TP=8
    assert {p.seq_len for p in tp_points} == {104, 112, 120, 128}


def test_fuzzer_is_deterministic_bounded_and_seed_dependent():
    spec = {
        "generator": "fuzz",
        "fuzz": {
            "n": 12,
            "seed": 7,
            "seq_len": {"min": 64, "max": 8192, "multiple_of": 64},
            "micro_batch_size": {"min": 1, "max": 8},
        },
    }
    first, again = generate_points(spec), generate_points(spec)
    assert first == again and 1 < len(first) <= 12
    assert all(
        64 <= p.seq_len <= 8192 and p.seq_len % 64 == 0 and 1 <= p.micro_batch_size <= 8 for p in first
    )
    other = generate_points(merge(spec, {"fuzz": {"seed": 8}}))
    assert other != first
    # rounding to the multiple stays inside [min, max]: 33-100 rounds to 64 or 128, of which only 64 fits
    narrow = merge(spec, {"fuzz": {"seq_len": {"min": 33, "max": 100}}})
    assert {p.seq_len for p in generate_points(narrow)} == {64}


def test_fuzzer_gives_the_same_points_in_a_fresh_interpreter():
    """Same seed, same points, whatever else the process did before (no global RNG involved)."""
    code = (
        "from autotuner.runner.shapes import generate_points;"
        "print([p.label for p in generate_points({'generator': 'fuzz', 'fuzz': {'n': 5, 'seed': 3,"
        "'seq_len': {'min': 16, 'max': 4096}, 'micro_batch_size': {'min': 1, 'max': 4}}})])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    here = generate_points(
        {
            "generator": "fuzz",
            "fuzz": {
                "n": 5,
                "seed": 3,
                "seq_len": {"min": 16, "max": 4096},
                "micro_batch_size": {"min": 1, "max": 4},
            },
        }
    )
    assert out.strip() == str(labels(here))


def test_overrides_win_key_by_key():
    merged = merge(
        {"generator": "pow2", "pow2": {"seq_len": {"min_power": 4, "max_power": 6}}, **CASE},
        {
            "pow2": {"seq_len": {"max_power": 5, "min_power": None}},
            "micro_batch_size": [2],
        },
    )
    assert labels(generate_points(merged)) == ["s16_b2", "s32_b2"]


@pytest.mark.parametrize(
    "shapes, message",
    [
        ({"generator": "grid"}, "unknown shapes.generator"),
        ({"seq_len": [0], "micro_batch_size": [1]}, "positive integers"),
        ({"seq_len": [], "micro_batch_size": [1]}, "is empty"),
        (
            {
                "generator": "pow2",
                "pow2": {"seq_len": {"min_power": 5, "max_power": 2}},
                "micro_batch_size": [1],
            },
            "min_power",
        ),
        (
            {
                "generator": "sweep",
                "sweep": {"seq_len": {"values": [3, 5], "multiple_of": 2}},
                "micro_batch_size": [1],
            },
            "no value is a multiple",
        ),
        ({"generator": "fuzz", "fuzz": {"seq_len": {"min": 10}}, "micro_batch_size": [1]}, "0 < min <= max"),
        # a 0 is refused, not read as "unset" (a step of 1, 8 points)
        (
            {"generator": "sweep", "sweep": {"seq_len": {"start": 8, "stop": 32, "step": 0}}, **CASE},
            "step > 0",
        ),
        ({"generator": "fuzz", "fuzz": {"n": 0}, **CASE}, "shapes.fuzz.n=0 must be between 1"),
        ({"generator": "fuzz", "fuzz": {"n": -1}, **CASE}, "shapes.fuzz.n=-1 must be between 1"),
        # a range no plan could measure is refused before its list is made
        (
            {"generator": "sweep", "sweep": {"seq_len": {"start": 1, "stop": 10**8}}, **CASE},
            "100000000 values, over 10000",
        ),
        ({"generator": "fuzz", "fuzz": {"n": 10**9}, **CASE}, "must be between 1 and 10000"),
        (
            {"generator": "pow2", "pow2": {"seq_len": {"min_power": 0, "max_power": 10**9}}, **CASE},
            "max_power <= 62",
        ),
        (
            {
                "generator": "fuzz",
                "fuzz": {"seq_len": {"min": 33, "max": 35, "multiple_of": 64}},
                "micro_batch_size": [1],
            },
            "no multiple of 64 lies in",
        ),
    ],
)
def test_bad_generator_configs(shapes, message):
    with pytest.raises(UserError, match=message):
        generate_points(shapes)


def test_shape_point_label():
    assert ShapePoint(4096, 2).label == "s4096_b2"
