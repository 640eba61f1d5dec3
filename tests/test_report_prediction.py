"""The prediction's page (autotuner.report.prediction): the 1F1B timeline, the memory stack and the
validation bars, each read back from the drawn figure, and prediction.html as python -m autotuner.predict
writes it. The predictions come from the real predictor on test_predict's synthetic rows."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest

from autotuner.errors import UserError
from autotuner.predict.__main__ import main
from autotuner.predict.layout import Layout
from autotuner.predict.prediction import load_runs, predict
from autotuner.report.prediction import load_prediction, write_prediction_page
from autotuner.report.prediction_figures import (
    MEMORY_TERMS,
    measured_timeline_figure,
    memory_figure,
    timeline_figure,
    validation_figure,
)
from tests.test_predict import CAL, base_rows, make_run

REL = 1e-9
Key = tuple[str, int, int, int]  # phase, stage, micro-batch, chunk


def prediction(tmp_path: Path, **layout) -> dict:
    runs = load_runs([make_run(tmp_path, base_rows())])
    return predict(runs, Layout(seq_len=32, dtype="fp32", **layout), CAL).to_json()


def drawn(figure) -> dict[str, object]:
    """The figure's artists that carry an id (rectangles, lines), by id."""
    return {a.get_gid(): a for ax in figure.axes for a in [*ax.patches, *ax.lines] if a.get_gid() is not None}


def spans(figure) -> dict[Key, tuple[float, float]]:
    """Timeline boxes as (start, end) by (phase, stage, mb, chunk)."""
    out = {}
    for gid, rect in drawn(figure).items():
        phase, stage, mb, chunk = gid.split(":")
        out[(phase, int(stage), int(mb), int(chunk))] = (rect.get_x(), rect.get_x() + rect.get_width())
    return out


@pytest.mark.parametrize(
    "layout",
    [
        {"pp": 2, "global_batch_size": 8},
        {"pp": 4, "global_batch_size": 6},
        {"pp": 2, "vpp": 2, "global_batch_size": 8},
        {"pp": 1, "global_batch_size": 3},
    ],
    ids=["pp2_m8", "pp4_m6", "pp2_vpp2_m8", "pp1_m3"],
)
def test_timeline_is_the_1f1b_schedule_of_the_predicted_pipeline_time(tmp_path, layout):
    rec = prediction(tmp_path, **layout)
    p, v, m = rec["layout"]["pp"], rec["layout"]["vpp"], rec["layout"]["microbatches"]
    figure = timeline_figure(rec)
    boxes = spans(figure)
    assert len(boxes) == 2 * p * m * v
    for s in range(p):
        for phase in ("forward", "backward"):
            mine = {(mb, c) for (ph, st, mb, c) in boxes if (ph, st) == (phase, s)}
            assert mine == {(mb, c) for mb in range(m) for c in range(v)}, (s, phase)
        row = sorted((span, key[0]) for key, span in boxes.items() if key[1] == s)
        for (a, _), (b, _) in zip(row, row[1:], strict=False):
            assert b[0] >= a[1] * (1 - REL), f"stage {s}: {a} overlaps {b}"
        # 1F1B: the forwards a stage has run when its first backward starts are the micro-batches whose
        # activations it holds at its peak, which the memory prediction counts (Megatron's warm-up + 1).
        first_backward = next(i for i, (_, phase) in enumerate(row) if phase == "backward")
        assert first_backward == rec["memory"][s]["held_microbatches"]
        if s:
            assert boxes[("forward", s, 0, 0)][0] >= boxes[("forward", s - 1, 0, 0)][1] * (1 - REL)
    assert max(end for _, end in boxes.values()) == pytest.approx(rec["step"]["pipeline_s"], rel=REL)
    # each box is its own model chunk's time, as the predictor placed it
    for (phase, stage, _, chunk), (start, end) in boxes.items():
        assert end - start == pytest.approx(rec["stages"][stage]["chunks"][chunk][f"{phase}_s"], rel=1e-6)


def test_memory_stack_sums_to_each_stage_and_marks_korthikanti_and_the_gpu(tmp_path):
    rec = prediction(tmp_path, pp=2, global_batch_size=8)
    artists = drawn(memory_figure(rec, gpu_memory_gb=0.002))
    for stage in rec["memory"]:
        s = stage["stage"]
        bars = [artists[f"memory:{s}:{term}"] for term in MEMORY_TERMS]
        resident = sum(b.get_height() for b in bars[:3])
        forward_backward = sum(b.get_height() for b in bars[3:])
        peak = resident + max(forward_backward, stage["optimizer_step"]["value"])
        assert peak == pytest.approx(stage["total_bytes"], rel=REL)
        assert [b.get_height() for b in bars] == [stage[t]["value"] for t in MEMORY_TERMS]
        for lower, upper in zip(bars, bars[1:], strict=False):  # stacked, not overlaid
            assert upper.get_y() == pytest.approx(lower.get_y() + lower.get_height())
        korth, act = artists[f"korthikanti:{s}"], artists[f"memory:{s}:activations"]
        assert korth.get_height() == stage["korthikanti_activations"]["value"] > 0
        assert korth.get_y() == act.get_y() and korth.get_x() > act.get_x() + act.get_width()
        # Adam's step on the resident states, beside the forward-backward's terms (the peak is the larger)
        step, optimizer = artists[f"optimizer_step:{s}"], artists[f"memory:{s}:optimizer"]
        assert step.get_height() == stage["optimizer_step"]["value"] > 0
        assert step.get_y() == pytest.approx(optimizer.get_y() + optimizer.get_height())
        assert step.get_x() + step.get_width() < optimizer.get_x()
    assert list(artists["gpu_memory"].get_ydata()) == pytest.approx([2e6, 2e6])
    assert "gpu_memory" not in drawn(memory_figure(rec))


def test_a_prediction_made_before_the_adam_step_was_a_term_still_makes_its_page(tmp_path):
    rec = prediction(tmp_path, pp=2, global_batch_size=8)
    for stage in rec["memory"]:
        del stage["optimizer_step"]
    artists = drawn(memory_figure(rec))
    assert artists["optimizer_step:0"].get_height() == 0
    page = write_prediction_page(rec, tmp_path / "old.html")
    assert "Adam step" in page.read_text()
    # a new record's page lists the term's source with the others'
    new = write_prediction_page(
        prediction(tmp_path / "new", pp=2, global_batch_size=8), tmp_path / "new.html"
    )
    assert "stage 0 optimizer_step: [modelled] torch.optim.Adam" in new.read_text()


def test_validation_bars_hold_the_record(tmp_path):
    rec = prediction(tmp_path, pp=2, global_batch_size=8)
    assert validation_figure(rec) is None
    rec["validation"] = {
        "predicted_step_s": 0.05,
        "measured_step_s": 0.04,
        "measured_step_iqr_s": 0.002,
        "step_error": 0.25,
        "predicted_peak_bytes": 3e6,
        "measured_peak_bytes": 4e6,
        "memory_error": -0.25,
        "command": ["torchrun", "--nproc-per-node=2"],
    }
    figure = validation_figure(rec)
    bars = {gid: a.get_height() for gid, a in drawn(figure).items()}
    assert bars == {
        "step time:predicted": 0.05,
        "step time:measured": 0.04,
        "peak memory:predicted": 3e6,
        "peak memory:measured": 4e6,
    }
    assert [ax.get_title() for ax in figure.axes] == ["step time: error +25.0%", "peak memory: error -25.0%"]
    # with the step's phases (validate=true records them): a panel of them between, and rows in the table
    rec["validation"]["phases"] = {
        "forward-backward": {"predicted_s": 0.04, "measured_s": 0.032},
        "gradient reduction": {"predicted_s": 0.006, "measured_s": 0.005},
        "optimizer": {"predicted_s": 0.004, "measured_s": 0.003},
    }
    figure = validation_figure(rec)
    bars = {gid: a.get_height() for gid, a in drawn(figure).items()}
    assert bars["phase gradient reduction:predicted"] == 0.006 and bars["phase optimizer:measured"] == 0.003
    assert len(bars) == 10 and figure.axes[1].get_title() == "the step's phases"
    page = Page(write_prediction_page(rec, tmp_path / "phases.html").read_text())
    text = " ".join(page.text)
    assert "phase: forward-backward" in text and "+25.0%" in text and "+33.3%" in text  # the optimizer's
    # and each op inside the step (module hooks) beside its predicted time per visit
    rec["validation"]["in_step"] = [
        {
            "stage": 0,
            "what": "transformer_layer backward",
            "predicted_s": 0.0033,
            "measured_s": 0.004,
            "how": "x",
        }
    ]
    text = " ".join(Page(write_prediction_page(rec, tmp_path / "in_step.html").read_text()).text)
    assert "in the step, stage 0: transformer_layer backward (x)" in text and "-17.5%" in text


def test_the_measured_steps_op_visits_are_drawn_per_rank(tmp_path):
    """The validation's timeline (autotuner.predict.validate.RankTimeline, as validate=true records it):
    each rank's op visits as boxes at their times, rank 0 on top, the stage's own span (which holds the
    ops) not drawn, and the time between the ops in the caption."""
    from autotuner.predict.validate import RankTimeline

    rec = prediction(tmp_path, pp=2, global_batch_size=8)
    assert measured_timeline_figure(rec) is None
    first = RankTimeline(0, 0, 0, 0, 0.010, (
        ("stage.forward", 0, 0.0, 0.003),
        ("embedding.forward", 0, 0.0, 0.001),
        ("transformer_layer.forward", 1, 0.001, 0.003),
        ("transformer_layer.backward", 1, 0.006, 0.009),
    ))  # fmt: skip
    second = RankTimeline(1, 1, 0, 0, 0.009, (
        ("transformer_layer.forward", 2, 0.0035, 0.005),
        ("output_layer.forward", 0, 0.005, 0.006),
        ("output_layer.backward", 0, 0.0062, 0.0065),
        ("transformer_layer.backward", 2, 0.0065, 0.0075),
    ))  # fmt: skip
    assert first.between_ops_s == pytest.approx(0.010 - 0.006)
    assert second.between_ops_s == pytest.approx(0.009 - 0.0038)
    rec["validation"] = {
        "predicted_step_s": 0.05, "measured_step_s": 0.04, "measured_step_iqr_s": 0.002, "step_error": 0.25,
        "predicted_peak_bytes": 3e6, "measured_peak_bytes": 4e6, "memory_error": -0.25, "command": ["x"],
        "timeline": [first.to_json(), second.to_json()],
    }  # fmt: skip
    boxes = {
        gid: (a.get_x(), a.get_x() + a.get_width(), a.get_y())
        for gid, a in drawn(measured_timeline_figure(rec)).items()
        if gid.startswith("visit:")
    }
    assert len(boxes) == 7 and not any("stage." in gid for gid in boxes)
    layer = boxes["visit:0:transformer_layer.forward:1:0.001"]
    assert layer[:2] == pytest.approx((0.001, 0.003))
    assert layer[2] > boxes["visit:1:transformer_layer.forward:2:0.0035"][2]  # rank 0 above rank 1
    page = Page(write_prediction_page(rec, tmp_path / "measured.html").read_text())
    assert "The measured step, op by op" in page.headings and page.images == 4
    assert "Between the ops: rank 0 4.00 ms of 10.0 ms; rank 1 5.20 ms of 9.00 ms." in " ".join(page.text)
    assert "Hand-overs" not in " ".join(page.text)
    # a pipeline's hand-overs a stage waited for, beside the predicted transfer
    rec["validation"]["handovers"] = [
        {"phase": "forward", "seconds": 0.0005},
        {"phase": "backward", "seconds": 0.0007},
    ]
    rec["validation"]["predicted_transfer_s"] = 0.0001
    text = " ".join(Page(write_prediction_page(rec, tmp_path / "handed.html").read_text()).text)
    assert "median 600 us over 2, against a predicted transfer of 100 us." in text


class Page(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.headings, self.images, self.text, self._h2 = [], 0, [], False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self._h2 = tag == "h2"
        self.images += tag == "img" and dict(attrs)["src"].startswith("data:image/png;base64,")

    def handle_endtag(self, tag):
        self._h2 = False

    def handle_data(self, data):
        (self.headings if self._h2 else self.text).append(data)


def test_predict_writes_the_page_beside_the_json(tmp_path, capsys):
    run_dir = make_run(tmp_path, base_rows())
    out = tmp_path / "out" / "prediction.json"
    out.parent.mkdir()
    args = [str(run_dir), "seq_len=32", "pp=2", "global_batch_size=8", "gpu_memory_gb=80"]
    assert main([*args, f"json={out}"]) == 0
    page = Page((out.parent / "prediction.html").read_text())
    assert ["Step", "Stages (per micro-batch)", "Pipeline schedule", "Memory per stage"] == page.headings[:4]
    assert "Predicted against measured steps" in page.headings and page.images == 2  # no validation record
    text = " ".join(page.text)
    assert "No validation record" in text and "80 GB" in text and "pipeline bubble" in text
    assert "Source:" in text and "measured" in text
    assert "0: Megatron-LM report" in text and "weights and optimizer" in text  # the memory table's last row
    capsys.readouterr()
    # The page alone, from the JSON on disk (how a page is remade), now with a validation record.
    rec = load_prediction(out)
    rec["validation"] = {
        "predicted_step_s": 0.05, "measured_step_s": 0.04, "measured_step_iqr_s": 0.002, "step_error": 0.25,
        "predicted_peak_bytes": 3e6, "measured_peak_bytes": 4e6, "memory_error": -0.25, "command": ["x"],
    }  # fmt: skip
    again = Page(write_prediction_page(rec, tmp_path / "again.html").read_text())
    assert again.images == 3 and "+25.0%" in " ".join(again.text)
    # report=false: no page.
    (out.parent / "prediction.html").unlink()
    assert main([*args, "report=false", f"json={out}"]) == 0
    assert out.is_file() and not (out.parent / "prediction.html").exists()


def test_bad_input_is_one_line(tmp_path, capsys):
    run_dir = make_run(tmp_path, base_rows())
    assert main([str(run_dir), "seq_len=32", "gpu_memory_gb=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gpu_memory_gb" in err[0] and not (run_dir / "prediction.html").exists()
    (tmp_path / "not.json").write_text("{}")
    with pytest.raises(UserError, match="not a prediction"):
        load_prediction(tmp_path / "not.json")


@pytest.mark.parametrize(
    "layout",
    [
        Layout(seq_len=8, pp=2, last_stage_layers=1, global_batch_size=4),
        Layout(seq_len=8, pp=4, first_stage_layers=2, last_stage_layers=2, global_batch_size=4),
        Layout(
            seq_len=8, tp=2, dp=2, global_batch_size=4, sequence_parallel=True, distributed_optimizer=True
        ),
        Layout(seq_len=8),
    ],
)
def test_the_layout_line_names_every_setting(layout):
    """One line, written once (the page's ``describe_layout``, which reads prediction.json without the
    predictor; ``Layout.describe`` calls it): every setting that tells two layouts apart is on it, in the
    names the predictor's command line takes."""
    import json

    from autotuner.report.prediction import describe_layout

    line = layout.describe()
    assert describe_layout(json.loads(json.dumps(layout.to_json()))) == line
    for name, key in [("tp", "tp"), ("pp", "pp"), ("vpp", "vpp"), ("dp", "dp"), ("ep", "ep")]:
        assert f"{name}={getattr(layout, key)} " in line
    assert f"mbs={layout.micro_batch_size} gbs={layout.global_batch_size} s={layout.seq_len} " in line
    assert f"recompute={layout.recompute} sp={str(layout.sequence_parallel).lower()} " in line
    assert f"distopt={str(layout.distributed_optimizer).lower()} {layout.dtype}" in line
    for end in ("first", "last"):
        layers = getattr(layout, f"{end}_stage_layers")
        assert (f" {end}={layers}" in line) == (layers is not None)
    gpus, batches = layout.gpus, layout.microbatches
    assert line.endswith(f"({gpus} GPUs, {batches} micro-batches)") or (
        line.endswith("(1 GPU, 1 micro-batch)") and gpus == batches == 1
    )


def test_the_timeline_caption_says_where_the_interleaved_exchanges_are_charged(tmp_path):
    """Interleaved, each box is its model chunk's time; its exchanges cost both ends between CPU processes
    and the receiving box alone on GPUs (autotuner.predict.schedule.overlaps_exchanges), as simulated."""
    layout = Layout(seq_len=32, dtype="fp32", pp=2, vpp=2, global_batch_size=8)
    cpu = predict(load_runs([make_run(tmp_path, base_rows(), "cpu")]), layout, CAL).to_json()
    gpu_rows = [{**r, "device": "cuda"} for r in base_rows()]
    gpu = predict(load_runs([make_run(tmp_path, gpu_rows, "gpu")]), layout, CAL).to_json()
    said = {}
    for name, rec in (("cpu", cpu), ("gpu", gpu)):
        said[name] = " ".join(Page(write_prediction_page(rec, tmp_path / f"{name}.html").read_text()).text)
        assert "Each box takes its own model chunk's time" in said[name]
    assert cpu["step"]["exchange_overlapped"] is False and gpu["step"]["exchange_overlapped"] is True
    assert "stage costs both ends" in said["cpu"] and "receiving box" not in said["cpu"]
    assert "costs the receiving box (overlapped with compute)" in said["gpu"]
