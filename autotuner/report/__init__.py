"""The run report: ``report.html`` (self-contained) and its figures as PNG, made from ``results.jsonl``.

``write_report(run_dir)`` is what a run calls at its end (``report=true``, the default);
``python -m autotuner.report RUN_DIR [RUN_DIR ...]`` remakes one or compares several (see __main__).
Modules: data (read a run, the views), style (sizes, colours), breakdown / scaling / roofline / experts
(one kind of figure each), figures (draw them all, with captions), tables, page (the HTML); a
prediction's page (``prediction.html`` of autotuner.predict): prediction_figures, prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from autotuner.results.atomic import atomic_write_text, check_writable

REPORT_NAME = "report.html"


def build_report(
    run_dirs: Sequence[Path], out_dir: Path | None = None, calibration_file: Path | None = None
) -> Path:
    """Write ``report.html`` and the figures for one run (into its directory unless ``out_dir``) or for
    several overlaid (into ``out_dir``, required then). Returns the page's path. Raises UserError, before
    anything is written, for a directory without usable results (autotuner.results.read_rows), an unreadable
    calibration or an output folder that cannot be made."""
    from autotuner.errors import UserError
    from autotuner.report.data import load_calibration, load_run, unique_labels

    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise UserError("no run directory given")
    named = f"out={out_dir}"
    if out_dir is None:
        if len(run_dirs) > 1:
            raise UserError("comparing several runs needs an output directory (out=DIR)")
        out_dir = run_dirs[0]
        named = f"the run directory {out_dir} (out=DIR writes the report elsewhere)"
    elif Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise UserError(
            f"out={out_dir} is a file: give a folder (the report writes {REPORT_NAME} and its figures "
            "into it)"
        )
    out_dir = Path(out_dir)
    calibration = load_calibration(calibration_file) if calibration_file else None
    labels = unique_labels(run_dirs)
    runs = [load_run(d, label, calibration) for d, label in zip(run_dirs, labels, strict=True)]
    # Imported only now: matplotlib takes about a second, which bad input should not wait for.
    from autotuner.report.figures import make_figures
    from autotuner.report.page import render_page

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, a file among its parents, no permission
        raise UserError(
            f"cannot make the report folder {out_dir}: {exc.strerror or exc}: give out= a folder that is "
            "not a file and can be written"
        ) from exc
    check_writable(out_dir, named, folder=True)  # a read-only run directory: one line, before drawing
    try:
        figures = make_figures(runs, out_dir)
        # Atomic: a reader never sees half a page, and two reports into one folder never share a temporary.
        return atomic_write_text(out_dir / REPORT_NAME, render_page(runs, figures))
    except OSError as exc:  # a disk that filled while drawing: each file is whole or absent
        raise UserError(
            f"cannot write the report into {out_dir} ({exc.strerror or exc}): free space there, or give "
            "out= a folder that can take it"
        ) from exc


def write_report(run_dir: Path) -> Path:
    """The report of one finished run, written into its directory."""
    return build_report([Path(run_dir)])
