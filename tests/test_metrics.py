"""The row schema (autotuner.results.Row) and the metric registry (autotuner.measure.metrics)."""

from __future__ import annotations

import csv
import dataclasses
import json
from html import escape
from pathlib import Path

import pytest
import torch

import autotuner.launchers.nsys_rows  # noqa: F401 - registers the nsys kernel metrics
from autotuner.launchers import LAUNCHERS
from autotuner.launchers.get_data import GetDataObserver
from autotuner.main import run
from autotuner.measure.metrics import REGISTRY, Observed, fill, metrics_for, register_metric
from autotuner.measure.timer import SamplingPolicy
from autotuner.ops_test.base import OpCall, ShapePoint
from autotuner.report.data import Run
from autotuner.report.tables import rows_section
from autotuner.results import (
    COLUMNS,
    SCHEMA,
    ResultsWriter,
    Row,
    UnknownColumnError,
    describe_columns,
    load_rows,
)
from autotuner.results.calibration import roofline
from autotuner.runner import Phase

CPU = torch.device("cpu")
N, IN, OUT, FP32 = 64, 96, 160, 4
QUICK = SamplingPolicy(warmup=1, min_samples=3, max_samples=3)


def test_row_is_the_one_list_of_columns_with_their_meaning(tmp_path: Path):
    assert COLUMNS == [f.name for f in dataclasses.fields(Row)]
    assert all(SCHEMA[name].doc and SCHEMA[name].label for name in COLUMNS)
    assert all(name in describe_columns() for name in COLUMNS)
    page = (Path(__file__).resolve().parents[1] / "docs" / "columns.md").read_text()
    assert describe_columns() in page, "docs/columns.md is out of date: paste describe_columns() into it"
    # Every time, size and FLOP column states its unit.
    for name in COLUMNS:
        if name.endswith(("_us", "_bytes")) or name in ("flops", "tflops", "gbps", "bytes_moved"):
            assert SCHEMA[name].unit, name
    writer = ResultsWriter(tmp_path)
    writer.write({"case": "tiny", "op": "mlp", "phase": "forward", "point": "s8_b1", "rank": 0})
    with open(tmp_path / "results.csv", newline="") as handle:
        assert next(csv.reader(handle)) == COLUMNS
    assert list(json.loads((tmp_path / "results.jsonl").read_text())) == COLUMNS


def test_writer_refuses_a_key_that_is_not_a_column(tmp_path: Path):
    writer = ResultsWriter(tmp_path)
    good = {"case": "tiny", "op": "mlp", "phase": "forward", "point": "s8_b1", "rank": 0}
    writer.write(good)
    before = (tmp_path / "results.jsonl").read_text()
    with pytest.raises(UnknownColumnError, match="median_ms"):
        writer.write({**good, "point": "s16_b1", "median_ms": 1.0})
    with pytest.raises(UnknownColumnError, match="median_ms"):
        writer.extend([{**good, "median_ms": 1.0}])
    assert (tmp_path / "results.jsonl").read_text() == before and len(writer.rows) == 1


def test_every_metric_fills_a_row_column_for_real_launchers():
    assert REGISTRY, "no metric registered"
    for metric in REGISTRY.values():
        assert metric.column in SCHEMA and metric.unit == SCHEMA[metric.column].unit
        assert metric.launchers is None or set(metric.launchers) <= set(LAUNCHERS), metric.column
    for launcher in LAUNCHERS:
        order = [m.column for m in metrics_for(launcher)]
        for index, metric in enumerate(metrics_for(launcher)):
            # dependency order: a metric runs after every metric whose column it needs
            assert all(order.index(n) < index for n in metric.needs if n in order), (launcher, order)
    assert {"activation_bytes", "peak_bytes", "flops"} <= {m.column for m in metrics_for("get_data")}
    assert "bytes_moved" not in {m.column for m in metrics_for("torch_profiler")}  # get_data's alone


def test_registration_slips_fail_at_once():
    with pytest.raises(ValueError, match="add the column to autotuner.results.Row"):
        register_metric("median_ms")
    with pytest.raises(ValueError, match="registered twice"):
        register_metric("tflops", needs=("flops", "median_us"))
    with pytest.raises(ValueError, match="unit 'us', but Row says None"):
        register_metric("call_count", unit="us")
    with pytest.raises(ValueError, match="unknown needs"):
        register_metric("call_count", needs=("flopz",))
    assert "call_count" not in REGISTRY


def test_a_metric_without_its_needs_leaves_its_column_out():
    """nsys rows have no FLOPs, so no FLOP/s; with both columns the same function fills it."""
    row = {"median_us": 2.0}
    assert fill(dict(row), Observed("nsys")) == row
    filled = fill({**row, "flops": 4_000_000, "bytes_moved": 1000}, Observed("nsys"))
    assert filled["tflops"] == pytest.approx(4e6 / 2e-6 / 1e12)
    assert filled["gbps"] == pytest.approx(1000 / 2e-6 / 1e9)
    assert filled["arithmetic_intensity"] == 4000
    assert "bound" not in filled  # no calibration
    assert "tflops" not in fill({**row, "flops": 1}, Observed("nsys"), leave_out=("tflops",))


def test_roofline_bound_and_fraction_from_the_calibration():
    calibration = {"peak_flops": {"fp32": 1e12}, "memory_bandwidth": 1e10, "h2d_pinned": 1e9}
    # ridge point 100 FLOP/B: 1000 FLOP/B is compute-bound, 1 FLOP/B memory-bound
    assert roofline(1e9, 1e6, 1e-2, calibration, "fp32") == {"bound": "compute", "ceiling_fraction": 0.1}
    assert roofline(1e6, 1e6, 1e-3, calibration, "fp32") == {"bound": "memory", "ceiling_fraction": 0.1}
    assert roofline(0, 1e6, 1e-2, calibration, "fp32", "h2d_pinned")["bound"] == "h2d_pinned"
    assert roofline(1e9, 1e6, 1e-2, None, "fp32") == {}
    row = {"flops": 10**9, "bytes_moved": 10**6, "median_us": 1e4}
    filled = fill(row, Observed("get_data", calibration=calibration, dtype="fp32"))
    assert (filled["bound"], filled["ceiling_fraction"]) == ("compute", pytest.approx(0.1))


def test_get_data_row_has_arithmetic_intensity_from_its_flops_and_bytes():
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT, bias=False)
    x = torch.randn(N, IN, requires_grad=True)
    observer = GetDataObserver(CPU, QUICK, list(linear.parameters()))
    row = observer.observe(None, ShapePoint(N, 1), Phase("forward", OpCall(linear, (x,), linear), seed=0))
    assert row["flops"] == 2 * N * IN * OUT
    assert row["bytes_moved"] == (N * IN + IN * OUT + N * OUT) * FP32  # input, weight, output
    assert row["arithmetic_intensity"] == row["flops"] / row["bytes_moved"]
    assert row["tflops"] == pytest.approx(row["flops"] / (row["median_us"] * 1e-6) / 1e12)
    assert set(row) <= set(COLUMNS)


@pytest.mark.slow
def test_arithmetic_intensity_in_the_run_files_and_the_report(tmp_path: Path):
    args = ["case=tiny", "launcher=get_data", "ops=[linear_fc1]", f"hydra.run.dir={tmp_path}"]
    args += ["shapes.seq_len=[16]", "shapes.micro_batch_size=[1]", "progress=false", "report=false"]
    args += ["timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3"]
    assert run(args) == 0
    rows = {(r["op"], r["phase"]): r for r in load_rows(tmp_path / "results.jsonl")}
    fc1 = rows[("linear_fc1", "forward")]
    assert fc1["flops"] > 0 and fc1["arithmetic_intensity"] == fc1["flops"] / fc1["bytes_moved"]
    with open(tmp_path / "results.csv", newline="") as handle:
        header = next(csv.reader(handle))
    assert header == COLUMNS and "arithmetic_intensity" in header
    # The report's All rows table: headers are Row's labels, their tooltips Row's meaning and unit.
    html = rows_section([Run(tmp_path, "run", list(rows.values()))])
    assert f'<th title="{escape(SCHEMA["arithmetic_intensity"].describe())}">FLOP/B</th>' in html
    assert '<th title="median of the per-sample times' in html and ">median</th>" in html
