"""The summary table printed at the end of a run (rendering only; nothing is measured here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def human_bytes(value: Any) -> str:
    """1536 -> "1.5 KiB" (binary units); "-" for a missing value."""
    if value is None or value == "":
        return "-"
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"


def _time(us: Any) -> str:
    if us is None or us == "":
        return "-"
    us = float(us)
    if us >= 1e6:
        return f"{us / 1e6:.3f} s"
    if us >= 1e3:
        return f"{us / 1e3:.3f} ms"
    return f"{us:.1f} us"


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None or value == "" else format(float(value), fmt)


def render(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table: one line per row, grouped by shape point, in the order measured."""
    headers = [
        "point",
        "op",
        "phase",
        "median",
        "IQR",
        "n",
        "TFLOP/s",
        "GB/s",
        "weights",
        "activations",
        "peak",
        "status",
    ]
    lines = []
    for row in rows:
        ok = row.get("status") == "ok"
        lines.append(
            [
                str(row.get("point", "")),
                str(row.get("op", "")),
                str(row.get("phase", "")),
                (_time(row.get("median_us")) + (" !" if row.get("warnings") else "")) if ok else "-",
                _time(row.get("iqr_us")) if ok else "-",
                str(row.get("samples") or "-"),
                _num(row.get("tflops"), ".3f") if ok else "-",
                _num(row.get("gbps"), ".1f") if ok else "-",
                human_bytes(row.get("weight_bytes")),
                human_bytes(row.get("activation_bytes")),
                human_bytes(row.get("peak_bytes")),
                "ok" if ok else f"{row.get('status')}: {row.get('error') or ''}"[:60],
            ]
        )
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(headers)
    ]
    right = {3, 4, 5, 6, 7, 8, 9, 10}

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [fmt(headers), fmt(["-" * w for w in widths])]
    out.extend(fmt(line) for line in lines)
    if any(row.get("warnings") for row in rows):
        out.append("! the sampler raised warnings for this row (see the warnings column of results.csv)")
    return "\n".join(out)
