"""The report page: one self-contained HTML file (figures embedded as base64 PNG, inline CSS, a few lines
of plain JavaScript to sort the tables), readable offline and without any framework. Rendering only: the
tables are built in autotuner.report.tables, the figures in autotuner.report.figures."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from html import escape

from autotuner.report.data import Run
from autotuner.report.figures import FigureFile
from autotuner.report.tables import (
    breakdown_table,
    cell,
    problems_section,
    rows_section,
    runs_section,
    speedup_section,
    table,
)

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1240px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.sortable th { cursor: pointer; } table.sortable th:hover { background: #e8e8e8; }
tr.failed td { background: #fde8e8; } tr.skipped td, tr.refused td { color: #888; }
td.faster { background: #e3f4e3; } td.slower { background: #fde8e8; }
img { max-width: 100%; border: 1px solid #eee; } .caption { color: #444; max-width: 1200px; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 12px; }
.warn { color: #a15c00; min-width: 200px; } td.error { min-width: 200px; }
code { background: #f4f4f4; padding: 0 3px; } .scroll { overflow-x: auto; }
.wide { width: calc(100vw - 48px); position: relative; left: 50%; transform: translateX(-50%);
        overflow-x: auto; }
"""

# Click a header to sort by it; numbers sort by the raw value in data-v, not by the formatted text.
SORT_JS = """
document.querySelectorAll("table.sortable th").forEach((th, col) => th.addEventListener("click", () => {
  const body = th.closest("table").tBodies[0], rows = Array.from(body.rows);
  const key = r => { const c = r.cells[col], v = c.dataset.v ?? c.textContent; const n = parseFloat(v);
                     return isNaN(n) ? v : n; };
  const dir = th.dataset.dir === "asc" ? -1 : 1; th.dataset.dir = dir === 1 ? "asc" : "desc";
  rows.sort((a, b) => { const x = key(a), y = key(b);
    return (typeof x === typeof y ? (x < y ? -1 : x > y ? 1 : 0) : typeof x === "number" ? -1 : 1) * dir; });
  rows.forEach(r => body.appendChild(r));
}));
"""


def _figures_section(figures: Sequence[FigureFile], after: dict[str, str]) -> str:
    """Each figure under its heading, embedded as a data URI, its caption, then ``after[name]`` if any."""
    out = []
    for item in figures:
        out.append(f'<h2 id="{item.name}">{escape(item.title)}</h2>')
        if item.path is not None:
            data = base64.b64encode(item.path.read_bytes()).decode("ascii")
            out.append(f'<img src="data:image/png;base64,{data}" alt="{escape(item.title)}">')
        out.append(f'<p class="caption">{escape(item.caption)}</p>')
        out.append(after.get(item.name, ""))
    return "".join(out)


def _environment_section(runs: Sequence[Run]) -> str:
    out = ["<h2>Configuration and environment</h2>"]
    for index, run in enumerate(runs, 1):
        env = dict(run.record.get("environment", {}))
        command = env.pop("command", None)
        out.append(f"<h3>run {index}: {escape(str(run.path))}</h3>")
        if command:
            out.append(f"<p>Command line:</p><pre>{escape(' '.join(map(str, command)))}</pre>")
        if run.overrides:
            out.append(f"<p>Overrides:</p><pre>{escape(' '.join(run.overrides))}</pre>")
        if env:
            out.append(table(["field", "value"], [f"<tr>{cell(k)}{cell(v)}</tr>" for k, v in env.items()]))
        else:
            out.append("<p>No environment.json in this run directory.</p>")
        for key, title in (("transformer_config", "Derived TransformerConfig"), ("model_args", "Model args")):
            if run.record.get(key):
                text = json.dumps(run.record[key], indent=1, default=repr)
                out.append(f"<details><summary>{title}</summary><pre>{escape(text)}</pre></details>")
        if run.config_yaml:
            out.append(
                f"<details><summary>Composed config</summary><pre>{escape(run.config_yaml)}</pre></details>"
            )
        if run.calibration:
            text = json.dumps(run.calibration, indent=1)
            out.append(f"<details><summary>Calibration</summary><pre>{escape(text)}</pre></details>")
    return "".join(out)


def render_page(runs: Sequence[Run], figures: Sequence[FigureFile]) -> str:
    # A table read from an nsys report alone (python -m autotuner.nsys_read) may not know its case.
    cases = ", ".join(dict.fromkeys(str(r["case"]) for run in runs for r in run.rows if r.get("case")))
    title = (
        "autotuner report"
        + (f": {cases}" if cases else "")
        + (f" ({len(runs)} runs compared)" if len(runs) > 1 else "")
    )
    contents = " · ".join(f'<a href="#{f.name}">{escape(f.title)}</a>' for f in figures)
    parts = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>',
        f"<style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>{contents} · <a href='#rows'>all rows</a> · <a href='#env'>configuration</a></p>",
        runs_section(runs),
        problems_section(runs),
        _figures_section(figures, {"layer_breakdown": breakdown_table(runs)}),
        speedup_section(runs),
        '<div id="rows">' + rows_section(runs) + "</div>",
        '<div id="env">' + _environment_section(runs) + "</div>",
        f"<script>{SORT_JS}</script></body></html>",
    ]
    return "\n".join(parts) + "\n"
