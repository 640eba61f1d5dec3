"""Numbers as people read them: the one set of formatters for the run summary, ``compare``, the report's
tables and its figures. Rendering only; values stay raw numbers in the row files.

One rule per kind of number:

* **significant figures** (:func:`significant`): ``digits`` of them (3 unless asked), trailing zeros kept
  so a column's figures line up ("4.00"), never exponent notation -- ``torch.utils.benchmark.Compare``'s
  rule, which ``compare --digits`` has always followed;
* **times** are stored in microseconds (the ``*_us`` columns) and shown in ``us``, ``ms`` or ``s``:
  :func:`time_unit` picks the unit in which one value reads from 1 to under 1000,
  :func:`common_time_unit` one unit for a set of values (a table or an axis), picked by the smallest so
  that none reads below 1 (Compare's rule again). The symbol is ``us``, as in the column names: plain
  ASCII in every terminal, log and CSV viewer;
* **bytes** in binary units (KiB = 1024 B, as allocators and ``nvidia-smi`` count): one decimal, whole
  bytes below 1 KiB ("1.5 KiB", "512 B");
* **other quantities** (FLOPs, FLOP/s, B/s) with decimal SI prefixes: "12.8 MFLOP/s";
* a **missing value** (``None``, or the empty cell of a CSV) reads :data:`MISSING`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

MISSING = "-"
TIME_UNITS = (("s", 1e6), ("ms", 1e3), ("us", 1.0))  # name and microseconds per unit, largest first
BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
SI_PREFIXES = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def missing(value: Any) -> bool:
    """Whether ``value`` is absent: ``None`` in a JSONL row, ``""`` in a CSV one."""
    return value is None or value == ""


def _rounded(value: float, digits: int) -> float:
    """``value`` rounded to ``digits`` significant figures before a unit or a number of decimals is
    picked for it, so that 999.96 us reads "1.00 ms", never "1000 us", and 9.996 reads "10.0"."""
    return float(f"{value:.{digits}g}")


def significant(value: Any, digits: int = 3) -> str:
    """``value`` to ``digits`` significant figures in fixed-point notation: 12345.678 -> "12346",
    0.012345 -> "0.0123", 4 -> "4.00". Zero, infinities and NaN read as Python prints them."""
    if missing(value):
        return MISSING
    value = float(value)
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(_rounded(value, digits)))))
    return f"{value:.{decimals}f}"


def time_unit(us: float, digits: int = 3) -> tuple[str, float]:
    """(unit, microseconds per unit) in which ``us`` reads from 1 to under 1000 (``us`` below 1 us)."""
    magnitude = abs(_rounded(float(us), digits))
    for name, scale in TIME_UNITS:
        if magnitude >= scale:
            return name, scale
    return TIME_UNITS[-1]


def common_time_unit(values: Iterable[Any], digits: int = 3) -> tuple[str, float]:
    """One unit for a set of times in microseconds: the unit of the smallest non-zero one, so no value of
    the set reads below 1 and the largest keeps every significant figure. ``us`` for an empty set."""
    present = [abs(float(v)) for v in values if not missing(v) and float(v) != 0]
    return time_unit(min(present), digits) if present else TIME_UNITS[-1]


def human_time(us: Any, digits: int = 3) -> str:
    """A time in microseconds in its own unit: 262.048 -> "262 us", 1234.5 -> "1.23 ms"."""
    if missing(us):
        return MISSING
    name, scale = time_unit(us, digits)
    return f"{significant(float(us) / scale, digits)} {name}"


def human_bytes(value: Any) -> str:
    """1536 -> "1.5 KiB", 512 -> "512 B" (binary units)."""
    if missing(value):
        return MISSING
    value = float(value)
    for unit in BINARY_UNITS:
        if abs(value) < 1024 or unit == BINARY_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the last unit returns")


def human_si(value: Any, unit: str = "", digits: int = 3) -> str:
    """12800000 -> "12.8 M" (with ``unit="FLOP/s"``: "12.8 MFLOP/s"): FLOPs and rates span too many
    decades for one fixed unit."""
    if missing(value):
        return MISSING
    value = float(value)
    magnitude = abs(_rounded(value, digits))
    for prefix, scale in SI_PREFIXES:
        if magnitude >= scale:
            return f"{significant(value / scale, digits)} {prefix}{unit}"
    return f"{significant(value, digits)} {unit}".rstrip()
