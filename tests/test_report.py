"""The run report: written by a real tiny get_data run, remade and compared by python -m autotuner.report.

Two real runs (module scope, about half a minute together on a CPU): run A sweeps two sequence lengths
with the layer and all its sub-ops; run B measures the layer and its direct sub-ops at one of A's shape
points, with report=false. Checks: the page parses, names every op, embeds every figure; each PNG beside
it is a real PNG of its fixed size; compare mode; failed rows; bad input.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from autotuner.main import run
from autotuner.report.__main__ import main as report_main
from autotuner.results import load_rows
from tests.conftest import FAST

REPO = Path(__file__).resolve().parents[1]
DIRECT = ["input_layernorm", "self_attention", "self_attn_bda", "pre_mlp_layernorm", "mlp", "mlp_bda"]
# Pixel sizes the page is laid out for (autotuner/report/style.py SIZES).
SIZES = {
    "layer_breakdown": (1200, 600),
    "sublayer_breakdown": (1200, 700),
    "scaling_time": (1200, 800),
    "scaling_memory": (1200, 900),
    "roofline": (1200, 700),
}
VOID = {"meta", "img", "br", "hr", "link", "input"}


class Page(HTMLParser):
    """Text, image sources and h2 headings of a page; fails on a closing tag that does not match."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.open: list[str] = []
        self.images: list[str] = []
        self.text: list[str] = []
        self.headings: list[str] = []
        self.feed(text)
        self.close()
        assert self.open == [], f"unclosed tags: {self.open}"

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open[-1:]}"
        self.open.pop()

    def handle_data(self, data):
        self.text.append(data)
        if self.open and self.open[-1] == "h2":
            self.headings.append(data)

    @property
    def all_text(self) -> str:
        return " ".join(self.text)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def check_report(out_dir: Path, ops: set[str]) -> Page:
    page = Page((out_dir / "report.html").read_text(encoding="utf-8"))
    words = set(page.all_text.replace(",", " ").split())
    assert ops <= words, f"ops missing from the page: {ops - words}"
    pngs = sorted(out_dir.glob("*.png"))
    assert {p.stem for p in pngs} == set(SIZES)
    embedded = {src.split(",", 1)[1] for src in page.images if src.startswith("data:image/png;base64,")}
    assert len(embedded) == len(page.images) == len(pngs)  # self-contained: no image by URL
    for png in pngs:
        data = png.read_bytes()
        assert png_size(data) == SIZES[png.stem], png.name
        assert base64.b64encode(data).decode("ascii") in embedded, f"{png.name} not embedded"
    html = (out_dir / "report.html").read_text()
    assert "<script src" not in html and "<link" not in html  # nothing fetched when it opens
    return page


@pytest.fixture(scope="module")
def run_a(tiny_every_op_run: Path) -> Path:
    """case=tiny, every op (the layer, its direct parts and theirs among them), with its report."""
    return tiny_every_op_run


@pytest.fixture(scope="module")
def run_b(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("report_b")
    ops = ",".join(["transformer_layer", *DIRECT])
    argv = ["case=tiny", f"hydra.run.dir={run_dir}", f"ops=[{ops}]", "shapes.seq_len=[64]", "report=false"]
    assert run([*argv, *FAST]) == 0
    return run_dir


@pytest.mark.slow
def test_run_writes_a_self_contained_report(run_a: Path):
    rows = load_rows(run_a / "results.jsonl")
    page = check_report(run_a, {r["op"] for r in rows})
    assert {"Layer breakdown", "Inside attention and MLP", "Roofline", "All rows"} <= set(page.headings)
    assert "Configuration and environment" in page.headings and "torch" in page.all_text


@pytest.mark.slow
def test_report_false_writes_no_report(run_b: Path):
    assert (run_b / "results.jsonl").exists()
    assert not (run_b / "report.html").exists() and not list(run_b.glob("*.png"))


@pytest.mark.slow
def test_cli_remakes_a_report_in_place(run_a: Path, capsys):
    (run_a / "report.html").unlink()
    assert report_main([str(run_a)]) == 0
    assert f"report: {run_a / 'report.html'}" in capsys.readouterr().out
    check_report(run_a, {r["op"] for r in load_rows(run_a / "results.jsonl")})


@pytest.mark.slow
def test_compare_two_runs(run_a: Path, run_b: Path, tmp_path: Path):
    out = tmp_path / "compare"
    assert report_main([str(run_a), str(run_b), f"out={out}"]) == 0
    page = check_report(out, {r["op"] for r in load_rows(run_a / "results.jsonl")})
    assert "Speed-up" in page.headings and "2 runs compared" in page.all_text
    text = page.all_text
    assert str(run_a) in text and str(run_b) in text
    # B measured the layer at s64_b2 only, so the speed-up table holds the layer there and nothing at s32_b2.
    html = (out / "report.html").read_text()
    speedup = html.split("<h2>Speed-up</h2>", 1)[1].split("<h2>", 1)[0]
    assert "<td>transformer_layer</td><td>forward</td><td>s64_b2</td>" in speedup
    assert "s32_b2" not in speedup and "linear_qkv" not in speedup


@pytest.mark.slow
def test_failed_rows_are_listed_and_calibration_draws_the_roof(run_a: Path, tmp_path: Path):
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(run_a / "environment.json", copy)
    rows = load_rows(run_a / "results.jsonl")
    for row in rows:
        if (row["op"], row["phase"], row["point"]) == ("mlp", "forward", "s32_b2"):
            row.update(status="failed", error="RuntimeError: out of memory (made up)", median_us=None)
    (copy / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calibration = tmp_path / "ceilings.json"
    calibration.write_text(json.dumps({"peak_flops": {"fp32": 5e10}, "memory_bandwidth": 1e10}))
    assert report_main([str(copy), f"calibration={calibration}"]) == 0
    page = check_report(copy, {r["op"] for r in rows})
    assert "Failed ops (1)" in page.headings
    assert "RuntimeError: out of memory (made up)" in page.all_text
    assert "calibrated ceiling" in page.all_text and "not measured" in page.all_text


@pytest.mark.slow
def test_rows_the_schema_allows_but_no_sweep_holds_never_crash_the_report(run_a: Path, tmp_path: Path):
    """Rows at no shape point (a captured call's, or a foreign range's read by nsys-read: seq_len null
    beside a swept micro-batch size) made the scaling figure raise TypeError on float(None); so could an op
    this tool does not have, a status it does not write, an ok row without its median."""
    copy = tmp_path / "odd"
    copy.mkdir()
    shutil.copy(run_a / "environment.json", copy)
    rows = load_rows(run_a / "results.jsonl")
    base = {k: v for k, v in rows[0].items() if v is not None and k in ("case", "dtype", "device", "rank")}
    odd = [
        {"op": "mlp", "point": "bf16[2,64]", "seq_len": None, "micro_batch_size": 2, "median_us": 5.0},
        {"op": "not_an_op", "point": "s32_b2", "seq_len": 32, "micro_batch_size": 2, "median_us": 5.0},
        {"op": "mlp", "point": "x", "median_us": 5.0},
        {"op": "mlp", "point": "s48_b2", "seq_len": 48, "micro_batch_size": 2},
    ]
    rows += [{**base, "phase": "forward", "status": "ok", "launcher": "nsys", **row} for row in odd]
    rows.append({**base, "op": "mlp", "phase": "forward", "point": "s8_b2", "status": "refused"})
    (copy / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report_main([str(copy)]) == 0
    check_report(copy, {"not_an_op", "mlp"})


def test_cli_without_results_is_one_line_and_exit_2(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "autotuner.report", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no results.jsonl" in proc.stderr


def test_a_report_error_never_fails_the_run(tmp_path: Path, capsys):
    from autotuner.main import _report

    _report(tmp_path)  # no results.jsonl: the report raises, the run must not
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "report not written" in err
