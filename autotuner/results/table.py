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


def _status(row: dict[str, Any]) -> str:
    return "ok" if row.get("status") == "ok" else f"{row.get('status')}: {row.get('error') or ''}"[:60]


def has_host_time(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether the rows' times are GPU times with a separate host time beside them (nsys on a GPU: the
    kernels' time leads, the NVTX range's is ``host_median_us``). Rows written before that column
    existed (``median_us`` was the range then) do not count, so their table keeps its plain labels."""
    return any(
        row.get("kernel_time_us") not in (None, "") and row.get("host_median_us") not in (None, "")
        for row in rows
    )


def render(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table: one line per row, grouped by shape point, in the order measured.

    Rows of nsys on a GPU lead with the GPU time (``gpu median``, ``gpu IQR``), then the host time of the
    op's NVTX range (``host median``); other rows have one time, ``median``.
    """
    host = has_host_time(rows)
    ok_only = True  # the cell reads "-" unless the row is ok
    # (header, cell, ok_only, right-aligned)
    columns: list[tuple[str, Any, bool, bool]] = [
        ("point", lambda r: str(r.get("point", "")), False, False),
        ("op", lambda r: str(r.get("op", "")), False, False),
        ("phase", lambda r: str(r.get("phase", "")), False, False),
        (
            "gpu median" if host else "median",
            lambda r: _time(r.get("median_us")) + (" !" if r.get("warnings") else ""),
            ok_only,
            True,
        ),
        ("gpu IQR" if host else "IQR", lambda r: _time(r.get("iqr_us")), ok_only, True),
        *([("host median", lambda r: _time(r.get("host_median_us")), ok_only, True)] if host else []),
        ("n", lambda r: str(r.get("samples") or "-"), False, True),
        ("TFLOP/s", lambda r: _num(r.get("tflops"), ".3f"), ok_only, True),
        ("GB/s", lambda r: _num(r.get("gbps"), ".1f"), ok_only, True),
        ("weights", lambda r: human_bytes(r.get("weight_bytes")), False, True),
        ("activations", lambda r: human_bytes(r.get("activation_bytes")), False, True),
        ("peak", lambda r: human_bytes(r.get("peak_bytes")), False, True),
        ("status", _status, False, False),
    ]
    headers = [header for header, *_ in columns]
    lines = [
        ["-" if only_ok and row.get("status") != "ok" else cell(row) for _, cell, only_ok, _ in columns]
        for row in rows
    ]
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(headers)
    ]
    right = [flag for *_, flag in columns]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if flag else c.ljust(w) for c, w, flag in zip(cells, widths, right, strict=True)
        ).rstrip()

    out = [fmt(headers), fmt(["-" * w for w in widths])]
    out.extend(fmt(line) for line in lines)
    if host:
        out.append(
            "gpu median, gpu IQR: each iteration's summed kernel time (results.csv: median_us, iqr_us); "
            "host median: the op's NVTX range on the CPU (host_median_us)"
        )
    if any(row.get("warnings") for row in rows):
        out.append("! the sampler raised warnings for this row (see the warnings column of results.csv)")
    return "\n".join(out)
