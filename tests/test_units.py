"""The one units module and the one terminal-table printer, on numbers whose text is known."""

from __future__ import annotations

import pytest

from autotuner.results.table import render, text_table
from autotuner.results.units import (
    MISSING,
    common_time_unit,
    human_bytes,
    human_si,
    human_time,
    significant,
    time_unit,
)


@pytest.mark.parametrize(
    "value, digits, text",
    [
        (12345.678, 3, "12346"),  # never exponent notation, even past the figures asked for
        (12.345678, 3, "12.3"),
        (0.012345, 3, "0.0123"),
        (4, 3, "4.00"),  # trailing zeros kept: a column's figures line up
        (9.996, 3, "10.0"),  # rounded before the decimals are chosen, not "10.00"
        (6172.8 / 1e3, 3, "6.17"),
        (262.048, 4, "262.0"),
        (0, 3, "0"),
        (float("inf"), 3, "inf"),
        (None, 3, MISSING),
        ("", 3, MISSING),  # a CSV's empty cell
    ],
)
def test_significant(value, digits, text):
    assert significant(value, digits) == text


@pytest.mark.parametrize(
    "us, text",
    [
        (0.256, "0.256 us"),
        (262.048, "262 us"),
        (999.96, "1.00 ms"),  # rounds up into the next unit, never "1000 us"
        (1234.5, "1.23 ms"),
        (3_004_600.0, "3.00 s"),
        (None, MISSING),
    ],
)
def test_human_time_picks_the_unit_where_the_value_reads_1_to_1000(us, text):
    assert human_time(us) == text


def test_one_unit_for_a_set_is_the_smallest_values():
    # Compare's rule: no value of the table reads below 1; zeros and missing cells do not count.
    assert common_time_unit([12345.678, 4000.0, 6172.8]) == ("ms", 1e3)
    assert common_time_unit([2_000_000.0, 900.0]) == ("us", 1.0)
    assert common_time_unit([0.0, None, 3e6]) == ("s", 1e6)
    assert common_time_unit([]) == ("us", 1.0)
    assert time_unit(5e6) == ("s", 1e6)


@pytest.mark.parametrize(
    "value, text",
    [(512, "512 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"), (80 * 2**30, "80.0 GiB"), (None, MISSING)],
)
def test_human_bytes_in_binary_units(value, text):
    assert human_bytes(value) == text


@pytest.mark.parametrize(
    "value, unit, text",
    [
        (12_800_000, "", "12.8 M"),
        (989e12, "FLOP/s", "989 TFLOP/s"),
        (3.35e12, "B/s", "3.35 TB/s"),
        (1e6, "", "1.00 M"),
        (12.0, "FLOP", "12.0 FLOP"),
        (999_960.0, "", "1.00 M"),
    ],
)
def test_human_si_with_decimal_prefixes(value, unit, text):
    assert human_si(value, unit) == text


def test_text_table_aligns_columns_as_asked_and_keeps_cells_as_given():
    lines = text_table(
        ["name", "time"], [["a", "6.17 (2.00x)"], ["longer", "12.3"]], [False, True]
    ).splitlines()
    assert lines[0].split() == ["name", "time"] and set(lines[1]) == {"-", " "}
    # right-aligned cells end in one column; the cells are not parsed as numbers ("12.30" stays "12.3")
    assert lines[2].endswith("6.17 (2.00x)") and lines[3].endswith("12.3")
    assert len(lines[2]) == len(lines[3]) and lines[3].startswith("longer")
    assert all(line == line.rstrip() for line in lines)
    assert len(text_table(["a"], [["1"]], [True], rule=False).splitlines()) == 2  # no rule line


def test_run_summary_formats_each_kind_of_number_by_the_units_module():
    rows = [
        {
            "point": "s8_b1",
            "op": "linear_qkv",
            "phase": "forward",
            "status": "ok",
            "median_us": 1234.5,
            "iqr_us": 0.256,
            "samples": 30,
            "tflops": 0.012345,
            "gbps": 12.5,
            "weight_bytes": 1536,
            "peak_bytes": 3 * 2**20,
        },
        {
            "point": "s8_b1",
            "op": "mlp",
            "phase": "forward",
            "status": "failed",
            "error": "boom",
            "median_us": 9.0,
        },
    ]
    header, rule, ok, failed = render(rows).splitlines()
    assert header.split()[:5] == ["point", "op", "phase", "median", "IQR"]
    assert ok.split()[3:] == [
        "1.23",
        "ms",
        "0.256",
        "us",
        "30",
        "0.0123",
        "12.5",
        "1.5",
        "KiB",
        "-",
        "3.0",
        "MiB",
        "ok",
    ]
    # a failed row's measurements read "-" whatever it holds; its status carries the error
    assert failed.split()[3:] == ["-"] * 8 + ["failed:", "boom"]
    assert len(rule) >= len(header.rstrip())


def test_the_summary_lists_each_kind_of_warning_once_with_what_to_do():
    from autotuner.results.table import WARNING_FIXES

    rows = [
        {
            "op": op,
            "phase": "forward",
            "point": "s8_b1",
            "status": "ok",
            "median_us": 5.0,
            "rel_ci": 0.3,
            "precision_rule": "ci",
            "warnings": "imprecise(ci=30%)",
        }
        for op in ("mlp", "rope", "linear_qkv")
    ]
    rows.append({**rows[0], "op": "mlp_bda", "warnings": "imprecise(ci=12%);drift(+40%)"})
    rows.append(
        {**rows[0], "op": "embedding", "warnings": "", "rel_ci": None, "precision_rule": None, "samples": 5}
    )
    text = render(rows)
    said = [line for line in text.splitlines() if line.startswith("  imprecise:")]
    assert len(said) == 1 and said[0].startswith("  imprecise: 4 row(s) (mlp.forward, rope.forward")
    assert WARNING_FIXES["imprecise"] in said[0] and "timing.budget_s" in said[0]
    assert sum(line.startswith("  drift: 1 row(s) (mlp_bda.forward)") for line in text.splitlines()) == 1
    # the profiler row of a fixed count: one note naming the setting, not a warning of its own
    assert "note: 1 row(s) of a profiler's fixed count" in text and "launcher.active" in text
