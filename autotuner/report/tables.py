"""The report's tables (rendering only): the runs, failed and skipped ops, the layer breakdown in numbers,
the speed-ups between runs, and every row. Cells of numbers carry their raw value in ``data-v`` so the
page's sort script orders 2 ms after 900 µs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

from autotuner.ops.naming import PHASES
from autotuner.report.data import (
    LAYER,
    LAYER_PARTS,
    Run,
    Speedup,
    breakdown,
    multi_rank,
    speedups,
)
from autotuner.results import column
from autotuner.results.table import has_host_time
from autotuner.results.units import human_bytes, human_si, human_time, significant


def cell(text: Any, sort: Any = None, cls: str = "") -> str:
    attrs = f' class="{cls}"' if cls else ""
    if sort is not None:
        attrs += f' data-v="{escape(str(sort))}"'
    return f"<td{attrs}>{escape('' if text is None else str(text))}</td>"


def table(
    headers: Sequence[str], body: Sequence[str], sortable: bool = False, titles: Sequence[str] = ()
) -> str:
    """An HTML table; ``titles``, if given, are the headers' tooltips (a column's meaning and unit)."""
    tips = list(titles) or [""] * len(headers)
    head = "".join(
        (f'<th title="{escape(tip)}">' if tip else "<th>") + f"{escape(h)}</th>"
        for h, tip in zip(headers, tips, strict=True)
    )
    cls = ' class="sortable"' if sortable else ""
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _warnings(row: dict[str, Any]) -> str:
    """The sampler's warnings, when the launcher wrote that column (a list or a string)."""
    value = row.get("warnings")
    if not value:
        return ""
    # get_data joins them with ";" (few_samples(3);drift(+30%)); a space lets the cell wrap.
    items = value if isinstance(value, (list, tuple)) else str(value).split(";")
    return "; ".join(str(item).strip() for item in items if str(item).strip())


def runs_section(runs: Sequence[Run]) -> str:
    body = []
    for index, run in enumerate(runs, 1):
        env = run.record.get("environment", {})
        statuses = [r.get("status") for r in run.rows]
        device = next((r["device"] for r in run.rows if r.get("device")), "")
        counts = ", ".join(f"{statuses.count(s)} {s}" for s in ("ok", "failed", "skipped", "refused"))
        launchers = ", ".join(sorted({str(r.get("launcher")) for r in run.rows if r.get("launcher")}))
        body.append(
            "<tr>"
            + cell(f"run {index}")
            + cell(run.label)
            + cell(", ".join(sorted({str(r["case"]) for r in run.rows if r.get("case")})))
            + cell(launchers)
            + cell(f"{env.get('device_name', '')} ({env.get('device_type', device)})")
            + cell(run.dtype)
            + cell(", ".join(run.points))
            + cell(counts)
            + "</tr>"
        )
    headers = ["", "run directory", "case", "launcher", "device", "dtype", "shape points", "rows"]
    return "<h2>Runs</h2>" + table(headers, body) + _time_note(runs)


def _time_note(runs: Sequence[Run]) -> str:
    """Which time the medians are, where a run has two (nsys on a GPU)."""
    gpu = [f"run {index}" for index, run in enumerate(runs, 1) if has_host_time(run.rows)]
    if not gpu:
        return ""
    which = "this run" if len(runs) == 1 else ", ".join(gpu)
    return (
        f"<p>Times of {escape(which)} (nsys on a GPU) are GPU times: every median in this report (figures, "
        "tables, speed-ups) is the summed duration of the op's kernels, memsets and copies per iteration "
        "(the kernels' part alone: <em>kernel time</em>). The host's time, the op's NVTX range (issuing "
        "the kernels), is the <em>host median</em> column of All rows.</p>"
    )


def problems_section(runs: Sequence[Run]) -> str:
    many = len(runs) > 1
    ranks = multi_rank([r for run in runs for r in run.rows])
    out = []
    for status, title in (("failed", "Failed ops"), ("skipped", "Skipped ops"), ("refused", "Refused ops")):
        body = []
        for index, run in enumerate(runs, 1):
            for row in run.rows:
                if row.get("status") == status:
                    cells = [f"run {index}"] if many else []
                    cells += [row.get("rank")] if ranks else []
                    cells += [row.get("op"), row.get("phase"), row.get("point"), row.get("error")]
                    body.append(f'<tr class="{status}">' + "".join(cell(c) for c in cells) + "</tr>")
        if body:
            headers = (
                (["run"] if many else [])
                + (["rank"] if ranks else [])
                + [
                    "op",
                    "phase",
                    "point",
                    "error" if status == "failed" else "reason",
                ]
            )
            out.append(f"<h2>{title} ({len(body)})</h2>" + table(headers, body))
    return "".join(out)


def speedup_section(runs: Sequence[Run]) -> str:
    if len(runs) < 2:
        return ""
    out = [
        "<h2>Speed-up</h2><p>Median time of run 1 divided by that of the other run, per op, phase and shape "
        "point measured <code>ok</code> in both: above 1 the other run is faster. Green and red mark changes "
        "over 5%.</p>"
    ]
    for index, other in enumerate(runs[1:], 2):
        found = speedups(runs[0], other)
        if not found:
            out.append(f"<p>Run 1 and run {index} share no measured (op, phase, shape point).</p>")
            continue
        body = []
        for item in found:
            cls = "faster" if item.factor > 1.05 else "slower" if item.factor < 0.95 else ""
            body.append(
                "<tr>"
                + cell(item.op)
                + cell(item.phase)
                + cell(item.point)
                + cell(human_time(item.base_us), item.base_us, "n")
                + cell(human_time(item.other_us), item.other_us, "n")
                + cell(f"{item.factor:.2f}x", item.factor, f"n {cls}".strip())
                + "</tr>"
            )
        headers = ["op", "phase", "point", "run 1 median", f"run {index} median", "speed-up"]
        out.append(f"<h3>run {index} against run 1</h3><p>{_geomeans(found)}</p>")
        out.append(table(headers, body, sortable=True))
    return "".join(out)


def _geomeans(found: Sequence[Speedup]) -> str:
    """One number per phase: the geometric mean of the speed-ups (the mean that treats 2x and 0.5x as
    opposites). Every op counts once per point, parents and their parts alike."""
    parts = []
    for phase in PHASES:
        factors = [item.factor for item in found if item.phase == phase]
        if factors:
            mean = math.exp(sum(map(math.log, factors)) / len(factors))
            parts.append(f"{phase} {mean:.2f}x over {len(factors)}")
    return escape("Geometric mean of the speed-ups: " + "; ".join(parts) + ".")


def breakdown_table(runs: Sequence[Run]) -> str:
    """The layer breakdown figure in numbers: each direct sub-op's median and its share of the layer."""
    columns = [
        (index, run, phase, point)
        for phase in PHASES
        for point in dict.fromkeys(p for run in runs for p in run.points)
        for index, run in enumerate(runs, 1)
    ]
    found = [(c, breakdown(c[1], LAYER, LAYER_PARTS, c[2], c[3])) for c in columns]
    found = [(c, b) for c, b in found if b is not None]
    if not found:
        return ""
    lines = {part: [] for part in (*LAYER_PARTS, "not covered", LAYER)}
    for _, item in found:
        values = dict(item.parts) | {"not covered": item.remainder, LAYER: item.total}
        for name, cells in lines.items():
            value = values.get(name)
            share = f" ({100 * value / item.total:.0f}%)" if value is not None and item.total else ""
            cells.append(cell(human_time(value) + share if value is not None else "not measured", cls="n"))
    many = len(runs) > 1
    headers = [""] + [f"{phase} {point}" + (f" run {i}" if many else "") for (i, _, phase, point), _ in found]
    body = [f"<tr>{cell(name)}{''.join(cells)}</tr>" for name, cells in lines.items()]
    return '<div class="scroll">' + table(headers, body) + "</div>"


def _number(fmt: str) -> Any:
    return lambda v: format(v, fmt) if isinstance(v, (int, float)) else v


# The rows table: (column, formatter). The header, its tooltip (meaning and unit) and whether the cell
# sorts as a number come from the column in autotuner.results.Row; Row's optional columns (written by some
# launchers or only with a calibration) appear when some row has them.
ROW_COLUMNS: list[tuple[str, Any]] = [
    ("rank", str),
    ("point", str),
    ("op", str),
    ("phase", str),
    ("status", str),
    ("median_us", human_time),
    ("iqr_us", human_time),
    ("host_median_us", human_time),
    ("samples", str),
    ("rel_ci", _number(".1%")),
    ("stop_reason", str),
    ("sampled_s", _number(".2g")),
    ("weight_bytes", human_bytes),
    ("activation_bytes", human_bytes),
    ("peak_bytes", human_bytes),
    ("flops", human_si),
    ("tflops", significant),
    ("bytes_moved", human_bytes),
    ("gbps", _number(".3g")),
    ("arithmetic_intensity", significant),
    ("bound", str),
    ("ceiling_fraction", _number(".1%")),
    ("kernel_time_us", human_time),
    ("kernel_count", str),
    ("top_kernels", str),
    ("call_count", str),
    ("routing", str),
    ("tokens_per_expert_min", str),
    ("tokens_per_expert_max", str),
    ("expert_imbalance", _number(".2f")),
    ("experts_impl", str),
    ("token_dispatcher", str),
    ("expert_parallel", str),
]


def rows_section(runs: Sequence[Run]) -> str:
    many = len(runs) > 1
    rows = [(index, row) for index, run in enumerate(runs, 1) for row in run.rows]
    host = has_host_time([row for _, row in rows])
    # nsys on a GPU: the median is the GPU's time (kernels, memsets, copies) and the kernel-time column
    # its kernels' part. Without a GPU the NVTX range is the median itself, so no host column.
    hidden = set() if host else {"host_median_us"}
    # Renamed only when every run's medians are GPU times (a CPU run beside it keeps "median").
    every = all(has_host_time(run.rows) for run in runs)
    gpu = {"median_us", "iqr_us"} if every else set()
    columns = [
        (("gpu " if key in gpu else "") + column(key).label, key, fmt, column(key).number)
        for key, fmt in ROW_COLUMNS
        if (not column(key).optional or any(row.get(key) is not None for _, row in rows))
        and (key != "rank" or multi_rank([row for _, row in rows]))
        and key not in hidden
    ]
    errors = any(row.get("error") for _, row in rows)  # the column only when some row has one
    body = []
    for index, row in rows:
        cells = [cell(index, index)] if many else []
        for _, key, fmt, numeric in columns:
            value = row.get(key)
            text = "" if value is None or value == "" else fmt(value)
            cells.append(cell(text, value if numeric else None, "n" if numeric else ""))
        cells.append(cell(_warnings(row), cls="warn"))
        cells += [cell(row.get("error"), cls="error")] if errors else []
        body.append(f'<tr class="{escape(str(row.get("status")))}">' + "".join(cells) + "</tr>")
    headers = (
        (["run"] if many else []) + [c[0] for c in columns] + ["warnings"] + (["error"] if errors else [])
    )
    titles = (
        ([""] if many else [])
        + [column(c[1]).describe() for c in columns]
        + [column("warnings").describe()]
        + ([column("error").describe()] if errors else [])
    )
    note = "<p>Every row of results.jsonl (results.csv has every column); click a column header to sort.</p>"
    rows_table = table(headers, body, sortable=True, titles=titles)
    # The widest table: it may use the whole window, not only the figures' column.
    return "<h2>All rows</h2>" + note + '<div class="wide">' + rows_table + "</div>"
