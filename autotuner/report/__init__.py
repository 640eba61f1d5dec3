"""The run report: ``report.html`` (self-contained) and its figures as PNG, made from ``results.jsonl``.

``write_report(run_dir)`` is what a run calls at its end (``report=true``, the default);
``python -m autotuner.report RUN_DIR [RUN_DIR ...]`` remakes one or compares several (see __main__).
Modules: data (read a run, the views), style (sizes, colours), breakdown / scaling / roofline (one kind
of figure each), figures (draw them all, with captions), page (the HTML).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

REPORT_NAME = "report.html"


def build_report(
    run_dirs: Sequence[Path], out_dir: Path | None = None, calibration_file: Path | None = None
) -> Path:
    """Write ``report.html`` and the figures for one run (into its directory unless ``out_dir``) or for
    several overlaid (into ``out_dir``, required then). Returns the page's path. Raises UserError for a
    directory without results or an unreadable calibration."""
    from autotuner.errors import UserError
    from autotuner.report.data import load_calibration, load_run, unique_labels

    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise UserError("no run directory given")
    if out_dir is None:
        if len(run_dirs) > 1:
            raise UserError("comparing several runs needs an output directory (--out DIR)")
        out_dir = run_dirs[0]
    calibration = load_calibration(calibration_file) if calibration_file else None
    labels = unique_labels(run_dirs)
    runs = [load_run(d, label, calibration) for d, label in zip(run_dirs, labels, strict=True)]
    # Imported only now: matplotlib takes about a second, which bad input should not wait for.
    from autotuner.report.figures import make_figures
    from autotuner.report.page import render_page

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = make_figures(runs, out_dir)
    page = out_dir / REPORT_NAME
    tmp = out_dir / f".{REPORT_NAME}.tmp"
    tmp.write_text(render_page(runs, figures), encoding="utf-8")
    os.replace(tmp, page)  # a reader never sees half a page
    return page


def write_report(run_dir: Path) -> Path:
    """The report of one finished run, written into its directory."""
    return build_report([Path(run_dir)])
