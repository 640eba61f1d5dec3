"""The summary table printed at the end of a run (rendering only; nothing is measured here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

from autotuner.results import label
from autotuner.results.units import MISSING, human_bytes, human_time, significant


def text_table(
    headers: Sequence[str], lines: Sequence[Sequence[str]], right: Sequence[bool], rule: bool = True
) -> str:
    """The one fixed-width printer of the terminal tables (this run summary, ``autotuner.compare``,
    ``autotuner.launcher_agreement``): columns two spaces apart, each left- or right-aligned as ``right``
    says, a dashed rule under the headers when ``rule``. Cells arrive formatted (autotuner.results.units):
    tabulate must not parse them as numbers, which would realign "6.17 (2.00x)" apart from "12.3" or drop
    a trailing zero."""
    return tabulate(
        lines,
        headers=list(headers),
        tablefmt="simple" if rule else "plain",
        colalign=["right" if flag else "left" for flag in right],
        disable_numparse=True,
    )


def _status(row: dict[str, Any]) -> str:
    return "ok" if row.get("status") == "ok" else f"{row.get('status')}: {row.get('error') or ''}"[:60]


def has_host_time(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether the rows' times are GPU times with a separate host time beside them (nsys on a GPU: the
    GPU's time leads, the NVTX range's is ``host_median_us``). Rows written before that column
    existed (``median_us`` was the range then) do not count, so their table keeps its plain labels."""
    return any(
        row.get("kernel_time_us") not in (None, "") and row.get("host_median_us") not in (None, "")
        for row in rows
    )


def render(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table: one line per row, grouped by shape point, in the order measured.

    Rows of nsys on a GPU lead with the GPU time (``gpu median``, ``gpu IQR``), then its kernels' part
    (``kernel time``: the rest is memsets and copies) and the host time of the op's NVTX range (``host
    median``); other rows have one time, ``median``.
    """
    host = has_host_time(rows)
    gpu = "gpu " if host else ""

    def host_time(row: dict[str, Any]) -> str:
        return human_time(row.get("host_median_us"))

    ok_only = True  # the cell reads "-" unless the row is ok
    # (header: the column's label in autotuner.results.Row, cell, ok_only, right-aligned)
    columns: list[tuple[str, Any, bool, bool]] = [
        (label("point"), lambda r: str(r.get("point", "")), False, False),
        (label("op"), lambda r: str(r.get("op", "")), False, False),
        (label("phase"), lambda r: str(r.get("phase", "")), False, False),
        (
            gpu + label("median_us"),
            lambda r: human_time(r.get("median_us")) + (" !" if r.get("warnings") else ""),
            ok_only,
            True,
        ),
        (gpu + label("iqr_us"), lambda r: human_time(r.get("iqr_us")), ok_only, True),
        *(
            [
                (label("kernel_time_us"), lambda r: human_time(r.get("kernel_time_us")), ok_only, True),
                (label("host_median_us"), host_time, ok_only, True),
            ]
            if host
            else []
        ),
        (label("samples"), lambda r: str(r.get("samples") or MISSING), False, True),
        (label("tflops"), lambda r: significant(r.get("tflops")), ok_only, True),
        (label("gbps"), lambda r: significant(r.get("gbps")), ok_only, True),
        (label("weight_bytes"), lambda r: human_bytes(r.get("weight_bytes")), False, True),
        (label("activation_bytes"), lambda r: human_bytes(r.get("activation_bytes")), False, True),
        (label("peak_bytes"), lambda r: human_bytes(r.get("peak_bytes")), False, True),
        (label("status"), _status, False, False),
    ]
    lines = [
        [MISSING if only_ok and row.get("status") != "ok" else cell(row) for _, cell, only_ok, _ in columns]
        for row in rows
    ]
    out = [text_table([header for header, *_ in columns], lines, [right for *_, right in columns])]
    if host:
        out.append(
            "gpu median, gpu IQR: each iteration's GPU time, its kernels, memsets and copies (results.csv: "
            "median_us, iqr_us; the kernels alone: kernel_time_us); host median: the op's NVTX range on the "
            "CPU (host_median_us)"
        )
    out += warnings_summary(rows)
    return "\n".join(out)


# What each kind of warning says, and what to do about it (docs/measurement.md, "Warnings").
WARNING_FIXES = {
    "few_samples": "too few samples for a confidence interval (under 6): raise timing.budget_s",
    "imprecise": "the median's 95% confidence interval is over 10% of it: raise timing.budget_s or "
    "timing.min_time_s, or quiet the machine (no other jobs; timing.threads=1)",
    "drift": "the samples' median moved over 25% during the measurement (clocks, another job): measure "
    "those ops again (ops=[...])",
    "launch_bound": "the host took longer to issue the op than the GPU to run it: read host_median_us, or "
    "replay it as a CUDA graph (timing.cuda_graph=true)",
    "cuda_graph_failed": "timed eagerly although timing.cuda_graph asked for a replay",
    "cuda_graph_off": "timed eagerly after an earlier capture failed: run the op alone with ops=[...]",
    "cuda_graph_empty": "the replayed phase launches no kernel: nothing to do",
    "no_kernels": "no kernel ran inside the op's ranges: check that the op ran on the GPU",
    "ranges_lost": "the report holds fewer of the op's ranges than were run: run it again",
}


def warnings_summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The rows' warnings grouped by kind, each kind once: how many rows, what it means, what to do."""
    kinds: dict[str, list[str]] = {}
    for row in rows:
        for warning in filter(None, str(row.get("warnings") or "").split(";")):
            kinds.setdefault(warning.split("(")[0], []).append(f"{row.get('op')}.{row.get('phase')}")
    fixed = [  # no precision target, and too few samples for a CI: a profiler's fixed count
        r
        for r in rows
        if r.get("status") == "ok" and isinstance(r.get("samples"), int) and r["samples"] < 6
        if not r.get("precision_rule")
    ]
    count = (
        [
            f"note: {len(fixed)} row(s) of a profiler's fixed count of samples, too few for a confidence "
            "interval (under 6): raise launcher.iterations (nsys) or launcher.active (torch_profiler)"
        ]
        if fixed
        else []
    )
    if not kinds:
        return count
    lines = [*count, "! rows with warnings (the warnings column of results.csv):"]
    for kind, where in kinds.items():
        shown = ", ".join(dict.fromkeys(where))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        lines.append(
            f"  {kind}: {len(where)} row(s) ({shown}): {WARNING_FIXES.get(kind, 'see docs/measurement.md')}"
        )
    return lines
