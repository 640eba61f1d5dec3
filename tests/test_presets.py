"""The calibration presets (autotuner/results/presets/, docs/predict_presets.md) and the refusal of a GPU
prediction that has nothing measured of its GPU: each preset holds the figures recorded where it was
measured, is selected by name wherever a calibration file is, and a prediction names it and its rows."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from autotuner.errors import UserError
from autotuner.predict.__main__ import main as predict_main
from autotuner.predict.layout import Layout
from autotuner.predict.prediction import load_calibration_for, load_runs, predict, render
from autotuner.results import calibration

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "tests" / "fixtures" / "h200_llama7b" / "profile"
LAYOUT = ["seq_len=2048", "micro_batch_size=1", "global_batch_size=8", "report=false"]


def _figures(data: dict) -> dict[str, float]:
    """A calibration's figures by the names a preset's sources give them (``peak_flops.bf16``)."""
    out = {}
    for key, value in data.items():
        if key in ("preset", "device_type", "environment"):
            continue
        if isinstance(value, dict):
            out.update({f"{key}.{sub}": figure for sub, figure in value.items()})
        else:
            out[key] = value
    return out


def _sources(name: str) -> dict[str, str]:
    """Each figure of a preset and the record its own metadata cites for it; every figure is cited once."""
    data = calibration.load(name)
    cited = [
        (figure, source["record"]) for source in data["preset"]["sources"] for figure in source["figures"]
    ]
    assert sorted(figure for figure, _ in cited) == sorted(_figures(data)), name
    return dict(cited)


def test_the_presets_hold_the_figures_measured_on_their_gpus_with_where_and_when():
    assert calibration.presets() == ("h100", "h200")
    # the H200's: the whole calibration the H200 profile of the predictor's validation kept, the file it cites
    h200 = calibration.load("h200")
    kept = json.loads((H200 / "calibration.json").read_text())
    (record,) = set(_sources("h200").values())
    assert record.startswith("tests/fixtures/h200_llama7b/profile/calibration.json, copied whole")
    assert _figures(h200) == _figures(kept) and h200["environment"] == kept["environment"]
    assert h200["preset"]["measured"] == "2026-12-04" and "NVIDIA H200" in h200["preset"]["device"]
    # the H100's: the rows of docs/gpu_validation.md's calibration table, each from the run its source names
    doc = (REPO / "docs" / "gpu_validation.md").read_text()
    table = doc[doc.index("## H100: calibration") :].split("\n\n")[1]
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in table.splitlines()[2:]}
    recorded = {
        "peak_flops.bf16": ("matmul bf16, 8192^3", 0, 1e12),
        "peak_flops.fp16": ("matmul fp16", 0, 1e12),
        "peak_flops.fp32": ("matmul fp32", 0, 1e12),
        "memory_bandwidth": ("device copy (read + write)", 0, 1e9),
        "h2d_pinned": ("host to device, pinned / pageable", 0, 1e9),
        "h2d_pageable": ("host to device, pinned / pageable", 1, 1e9),
        "d2h_pinned": ("device to host, pinned / pageable", 0, 1e9),
        "d2h_pageable": ("device to host, pinned / pageable", 1, 1e9),
    }
    h100, cited = calibration.load("h100"), _sources("h100")
    figures = _figures(h100)
    assert set(figures) == {
        *recorded,
        "warm_cache_bytes",
        "shared_cache_bytes",
        "shared_cache_bytes_reported",
    }
    for figure, (label, part, unit) in recorded.items():
        run = int(re.search(r", run (\d)", cited[figure]).group(1))
        text = rows[label][run - 1].split("/")[part]
        assert figures[figure] == pytest.approx(float(text.split()[0]) * unit, rel=1e-12), figure
    # the L2 the GPU reports, as the calibration records it on a GPU: the H200's "60 MB" is its 62914560 B
    machine = {name: int(re.search(rf"{name} [^\n]*?(\d+) MB L2", doc).group(1)) for name in ("H100", "H200")}
    assert h200["shared_cache_bytes"] == machine["H200"] * 2**20
    assert h100["warm_cache_bytes"] == h100["shared_cache_bytes"] == machine["H100"] * 2**20
    assert h100["preset"]["measured"] == "2026-11-26" and h100["environment"]["torch"] == "2.11.0+cu130"
    for name in ("h100", "h200"):  # what the device reports names the preset for runs profiled on it
        assert calibration.preset_for(calibration.load(name)["environment"]["device_name"]) == name


def test_a_preset_is_selected_by_name_and_a_file_path_still_works(tmp_path, monkeypatch, capsys):
    """``calibration=h200`` predicts the recorded H200 profile exactly as the calibration file it kept does;
    the prediction names the preset, its device, its date and the figures it took, and the rows."""
    runs = load_runs([H200])
    layout = Layout(seq_len=2048, global_batch_size=8, dtype="bf16")
    kept = predict(runs, layout, load_calibration_for(runs, None))
    preset = predict(runs, layout, load_calibration_for(runs, "h200"), calibration_from="h200")
    assert preset.step_seconds == kept.step_seconds and preset.memory == kept.memory
    text = render(preset).splitlines()
    assert text[1].startswith("calibration: preset h200: NVIDIA H200 (143771 MiB")
    assert "measured 2026-12-04 by python -m autotuner.calibrate device=cuda" in text[1]
    taken = text[1].split("; figures taken: ")[1].split(", ")
    assert {"peak_flops[bf16]", "memory_bandwidth", "adam_seconds_per_parameter"} <= set(taken)
    assert "grad_accumulation_seconds_per_parameter[bf16]" in taken and "h2d_pinned" not in taken
    assert (
        text[2]
        == f"rows: 8 op rows in bf16 of {H200} (profiled on cuda, NVIDIA H200); each is named under sources"
    )
    assert (
        render(kept)
        .splitlines()[1]
        .startswith(f"calibration: {H200 / 'calibration.json'} (cuda NVIDIA H200;")
    )
    # a file of one's own, by path, as before; the JSON records which
    mine = tmp_path / "mine.json"
    shutil.copy(H200 / "calibration.json", mine)
    out = tmp_path / "p.json"
    assert predict_main([str(H200), *LAYOUT, f"calibration={mine}", f"json={out}"]) == 0
    record = json.loads(out.read_text())
    assert (
        record["calibration"].startswith(f"{mine} (cuda NVIDIA H200;") and record["rows"] == preset.rows_note
    )
    # a name that is a preset and a file here is one line, as is a name that is neither
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h100").write_text("{}")
    with pytest.raises(UserError, match=r"names both the preset h100 and the file \./h100: give \./h100"):
        calibration.load("h100")
    capsys.readouterr()
    assert predict_main([str(H200), *LAYOUT, "calibration=h300", f"json={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot read h300" in err
    assert "name a preset: h100, h200" in err


def test_the_h100_preset_prices_what_it_measured_and_says_what_it_did_not(capsys, tmp_path):
    """The H100's calibration predates the timed Adam step: modelled from its copy bandwidth, said so; and
    the rows of another GPU beside it are said."""
    out = tmp_path / "p.json"
    assert predict_main([str(H200), *LAYOUT, "calibration=h100", f"json={out}"]) == 0
    printed = capsys.readouterr().out
    assert "calibration: preset h100: NVIDIA H100 80GB HBM3" in printed and "measured 2026-11-26" in printed
    assert "the calibration did not time the Adam step: it is modelled from the memory bandwidth" in printed
    assert (
        "the calibration is of an NVIDIA H100 80GB HBM3, the rows were profiled on an NVIDIA H200" in printed
    )
    record = json.loads(out.read_text())
    assert "calibrated memory_bandwidth 2933 GB/s" in record["step"]["optimizer"]["source"]["detail"]


def test_a_gpu_prediction_without_a_calibration_is_refused_naming_what_measures_one(tmp_path, capsys):
    """Rows profiled on a GPU, no calibration kept: one line naming the preset of that GPU and the command
    that calibrates it, exit 2, nothing written (before, its Adam step was priced at an assumed 10 GB/s)."""
    bare = tmp_path / "profile"
    shutil.copytree(H200, bare)
    (bare / "calibration.json").unlink()
    out = tmp_path / "p.json"
    assert predict_main([str(bare), *LAYOUT, f"json={out}"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1 and not out.exists()
    assert "the runs were profiled on NVIDIA H200 and keep no calibration.json" in err
    assert "give calibration=h200 (the preset measured on an NVIDIA H200)" in err
    assert "python -m autotuner.calibrate device=cuda" in err
    # refused before num_layers=fit prints the depth it chose
    assert predict_main([str(bare), *LAYOUT, "num_layers=fit", "gpu_memory_gb=150.8", f"json={out}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == err
    assert predict_main([str(bare), *LAYOUT, "calibration=h200", f"json={out}"]) == 0


def test_a_calibration_without_the_dtype_predicted_is_refused(tmp_path, capsys):
    """Another dtype's matmul peak is an order of magnitude off (the H200's fp32 51 TFLOP/s, bf16 803): a
    calibration without the one predicted is one line naming both fixes, not a silent stand-in."""
    partial = json.loads((H200 / "calibration.json").read_text())
    partial["peak_flops"] = {"fp32": partial["peak_flops"]["fp32"]}
    path = tmp_path / "fp32_only.json"
    path.write_text(json.dumps(partial))
    out = tmp_path / "p.json"
    assert predict_main([str(H200), *LAYOUT, f"calibration={path}", f"json={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    assert f"the calibration {path} has no peak_flops for bf16, the dtype predicted (it has fp32)" in err
    assert "python -m autotuner.calibrate device=cuda" in err and "dtype=fp32" in err
