"""The comparison table and the OSS benchmark JSON export, on runs with known numbers."""

from __future__ import annotations

import json

from autotuner.compare import main, within_noise
from autotuner.results import ResultsWriter


def _run(tmp_path, name, medians, iqr=1.0):
    writer = ResultsWriter(tmp_path / name)
    for (op, phase, point), median in medians.items():
        writer.write(
            {
                "case": "tiny",
                "op": op,
                "phase": phase,
                "point": point,
                "dtype": "fp32",
                "device": "cpu",
                "launcher": "get_data",
                "status": "ok",
                "median_us": median,
                "iqr_us": iqr,
                "tflops": 0.5,
                "peak_bytes": 1024,
            }
        )
    (tmp_path / name / "environment.json").write_text(
        json.dumps({"environment": {"device_name": "Test CPU", "hostname": "h", "torch": "2.13.0"}})
    )
    return str(tmp_path / name)


def test_table_speedups_noise_marks_and_significant_figures(tmp_path, capsys):
    base = _run(
        tmp_path, "base", {("mlp", "forward", "s8_b1"): 12345.678, ("mlp", "forward", "s16_b1"): 4000.0}
    )
    new = _run(tmp_path, "new", {("mlp", "forward", "s8_b1"): 6172.8, ("mlp", "forward", "s16_b1"): 4000.5})
    assert main([base, new, "labels=[main,branch]"]) == 0
    out = capsys.readouterr().out
    assert "[ mlp ]  (ms)" in out
    assert " 12.3 " in out  # 12345.678 us trimmed to 3 significant figures in ms
    assert "6.17 (2.00x)" in out  # twice as fast, well outside the IQR
    assert "4.00 (~1.00x)" in out  # 0.5 us apart with IQRs of 1 us: within noise


def test_within_noise():
    assert within_noise({"median_us": 10, "iqr_us": 2}, {"median_us": 11, "iqr_us": 2})
    assert not within_noise({"median_us": 10, "iqr_us": 0.1}, {"median_us": 11, "iqr_us": 0.1})


def test_oss_json_export(tmp_path):
    run = _run(tmp_path, "one", {("linear_qkv", "backward", "s8_b1"): 50.0})
    out = tmp_path / "oss.json"
    assert main([run, f"oss_json={out}"]) == 0
    records = json.loads(out.read_text())
    assert {r["metric"]["name"] for r in records} == {
        "backward_median_us",
        "backward_tflops",
        "backward_peak_bytes",
    }
    record = next(r for r in records if r["metric"]["name"] == "backward_median_us")
    assert record["metric"]["benchmark_values"] == [50.0]
    assert (
        record["model"]["name"] == "tiny.linear_qkv" and record["benchmark"]["extra_info"]["shape"] == "s8_b1"
    )
    assert (
        record["benchmark"]["extra_info"]["arch"] == "Test CPU"
        and record["dependencies"]["torch"] == "2.13.0"
    )


def test_missing_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_runs_measured_otherwise_are_said_to_differ_and_labels_must_differ(tmp_path, capsys):
    """bf16 against fp32 is a fair question for compare: the table answers it, and says first that the
    ratios compare the dtypes too. Two runs labelled alike would make the table ambiguous."""
    base = _run(tmp_path, "fp32", {("mlp", "forward", "s8_b1"): 100.0})
    other = tmp_path / "bf16"
    rows = (tmp_path / "fp32" / "results.jsonl").read_text().replace('"fp32"', '"bf16"')
    writer = ResultsWriter(other)
    for line in rows.splitlines():
        writer.write(json.loads(line))
    (other / "environment.json").write_text((tmp_path / "fp32" / "environment.json").read_text())
    assert main([base, str(other)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "the runs differ in dtype (fp32: fp32, bf16: bf16): each ratio compares that too"
    assert main([base, base]) == 0 and "differ" not in capsys.readouterr().out  # labels: the paths
    from autotuner.compare import default_labels

    assert default_labels(["runs/tiny/get_data/12", "runs/tiny/nsys/12", "x/a"]) == [
        "get_data/12",
        "nsys/12",
        "x/a",
    ]
    # one folder given twice: its name, numbered (it read "//tmp/.../run #1")
    assert default_labels(["/tmp/x/run", "/tmp/x/run/"]) == ["run #1", "run #2"]
    assert main([base, str(other), "labels=[a,a]"]) == 2
    assert "names two runs alike" in capsys.readouterr().err


def test_a_cell_without_a_time_says_why(tmp_path, capsys):
    """Every cell without a median read "-": a failed op, a skipped one, a row without its median and a
    point never measured looked alike, and an op without a time in any run had no table at all."""
    base = _run(tmp_path, "base", {("mlp", "forward", "s8_b1"): 10.0, ("mlp", "forward", "s16_b1"): 20.0})
    new = _run(tmp_path, "new", {("mlp", "forward", "s8_b1"): 10.0})
    writer = ResultsWriter(tmp_path / "new", resume=True)
    for op, status in (("mlp", "failed"), ("embedding", "skipped"), ("norm", "ok")):
        writer.write({"case": "tiny", "op": op, "phase": "forward", "point": "s16_b1", "status": status})
    assert main([base, new]) == 0
    out = capsys.readouterr().out
    cells = {
        (block.split("]")[0].strip("[ "), line[:13].strip()): line[13:].split()
        for block in out.split("\n\n")[:-1]
        for line in block.splitlines()[1:]
    }
    assert cells["mlp", "forward  new"] == ["10.0", "(~1.00x)", "failed"]
    assert cells["mlp", "forward  base"] == ["10.0", "20.0"]
    assert cells["embedding", "forward  new"] == ["-", "skipped"]
    assert cells["norm", "forward  new"] == ["-", "no", "median"]
    assert cells["norm", "backward new"] == ["-", "-"]
    assert "- = no row (not measured)" in out.splitlines()[-1]
