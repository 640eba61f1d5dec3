"""The predictor (``python -m autotuner.predict``): each rule checked against a figure computed by hand from
synthetic rows, provenance, missing measurements, bad input, and one real tiny run end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from autotuner.errors import UserError
from autotuner.ops.naming import PHASES
from autotuner.predict.__main__ import main
from autotuner.predict.layout import Layout
from autotuner.predict.prediction import load_runs, predict, render
from autotuner.predict.schedule import simulate
from autotuner.results import ResultsWriter, load_rows
from autotuner.results.units import human_bytes

# A small Llama-shaped model: 4 layers, h=64, 4 heads, 2 query groups of 16, SwiGLU 176, RMSNorm.
TC = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "ffn_hidden_size": 176,
    "gated_linear_unit": True,
    "normalization": "RMSNorm",
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "num_moe_experts": None,
}
VOCAB, H = 1024, 64
# One layer's parameters by hand: qkv 64*(4+2*2)*16, proj 64*64, fc1 64*2*176, fc2 176*64, two norms.
LAYER_PARAMS = 64 * 8 * 16 + 64 * 64 + 64 * 352 + 176 * 64 + 2 * 64
CAL = {"peak_flops": {"fp32": 1e11, "bf16": 1e11}, "memory_bandwidth": 1e10, "device_type": "cpu"}
US = 1e-6


def row(op: str, phase: str, us: float, s: int = 32, b: int = 1, tp: int = 1, **extra) -> dict:
    return {
        "case": "synthetic",
        "op": op,
        "phase": phase,
        "point": f"s{s}_b{b}",
        "seq_len": s,
        "micro_batch_size": b,
        "dtype": "fp32",
        "device": "cpu",
        "launcher": "get_data",
        "rank": "max" if tp > 1 else 0,
        "tensor_parallel": tp,
        "status": "ok",
        "median_us": us,
        **extra,
    }


def make_run(tmp_path: Path, rows: list[dict], name: str = "run", calibration: dict | None = CAL) -> Path:
    run_dir = tmp_path / name
    ResultsWriter(run_dir).extend(rows)
    env = {
        "case": "synthetic",
        "dtype": "fp32",
        "transformer_config": TC,
        "model_args": {"vocab_size": VOCAB, "tie_word_embeddings": False},
    }
    (run_dir / "environment.json").write_text(json.dumps(env))
    if calibration is not None:
        (run_dir / "calibration.json").write_text(json.dumps(calibration))
    return run_dir


def base_rows(s: int = 32) -> list[dict]:
    return [
        row("transformer_layer", "forward", 1000, s, activation_bytes=5000, weight_bytes=LAYER_PARAMS * 4),
        row("transformer_layer", "backward", 2000, s),
        row("embedding", "forward", 100, s),
        row("embedding", "backward", 100, s),
        row("final_layernorm", "forward", 10, s),
        row("final_layernorm", "backward", 20, s),
        row("output_layer", "forward", 300, s),
        row("output_layer", "backward", 600, s),
    ]


def adam_seconds(params: float) -> float:
    return params * 28 / CAL["memory_bandwidth"]  # fp32 Adam: 16 B read + 12 B written per parameter


def accumulation(params: float) -> float:
    """Adding a micro-batch's fp32 weight gradients into the kept ones: read 4 + 4 B, write 4 B."""
    return params * 12 / CAL["memory_bandwidth"]


# A pipeline stage's transfer per micro-batch and phase: s*b*h fp32 at the assumed 1 GB/s of a calibration
# without links (autotuner.predict.links).
P2P = 32 * 64 * 4 / 1e9
STAGE0_PARAMS = 2 * LAYER_PARAMS + VOCAB * H
STAGE1_PARAMS = 2 * LAYER_PARAMS + H + VOCAB * H  # final RMSNorm + untied output layer


def test_1f1b_step_bubble_and_sources(tmp_path):
    runs = load_runs([make_run(tmp_path, base_rows())])
    pred = predict(runs, Layout(seq_len=32, pp=2, global_batch_size=8, dtype="fp32"), CAL)
    f0, b0 = (2 * 1000 + 100) * US, (2 * 2000 + 100) * US + accumulation(STAGE0_PARAMS)
    f1, b1 = (2 * 1000 + 10 + 300) * US, (2 * 2000 + 20 + 600) * US + accumulation(STAGE1_PARAMS)
    assert pred.stages[0].forward == pytest.approx(f0) and pred.stages[0].backward == pytest.approx(b0)
    assert pred.stages[1].forward == pytest.approx(f1) and pred.stages[1].backward == pytest.approx(b1)
    m, p = 8, 2
    # the schedule simulated (tests/test_schedule.py derives it): stage 0's first forward, stage 1's m
    # forward-backward pairs, stage 0's last backward, and m + 1 exchanges on that path
    pipeline = f0 + m * (f1 + b1) + b0 + (m + 1) * P2P
    assert pred.step.exchange is not None and pred.step.exchange.seconds == pytest.approx(P2P)
    assert pred.step.exchange.source.kind == "modelled"
    assert pred.step.pipeline == pytest.approx(pipeline)
    assert pred.step.closed_form == pytest.approx((m + p - 1) * (f1 + b1))
    assert pred.step.bubble_fraction == pytest.approx(pipeline / (m * (f1 + b1)) - 1)
    assert pred.step.dp_reduction == 0
    assert pred.step.optimizer == pytest.approx(adam_seconds(STAGE1_PARAMS))
    assert pred.step.total == pytest.approx(pipeline + adam_seconds(STAGE1_PARAMS))
    kinds = {name: t.source.kind for st in pred.stages for name, _, t, _ in st.items}
    assert kinds.pop("grad_accumulation") == "modelled"
    assert set(kinds.values()) == {"measured"}
    # every figure measured at the point, but warm, where a calibration naming no cache wants them flushed
    # (the warning says so): the one run to measure is the flushed one
    (flushed,) = pred.missing
    assert "timing.flush_cache=true" in flushed["command"] and len(flushed["figures"]) == 8
    assert pred.tokens_per_s_per_gpu.value == pytest.approx(8 * 32 / pred.step.total / 2)
    per_token = 3 * (4 * (2 * LAYER_PARAMS + 4 * 32 * 64) + 2 * H * VOCAB)
    assert pred.mfu is not None and pred.mfu.value == pytest.approx(
        per_token * 8 * 32 / (pred.step.total * 1e11 * 2)
    )


def test_a_visit_adds_its_rows_fenced_mean_else_its_median(tmp_path):
    """A step adds its visits up, so a row stands for its fenced mean (autotuner.measure.stats); a row
    written before that column, for its median; the source says which."""
    rows = base_rows()
    rows[0] = {**rows[0], "fenced_mean_us": 1200.0}  # the layer's forward: median 1000, skewed
    runs = load_runs([make_run(tmp_path, rows)])
    pred = predict(runs, Layout(seq_len=32, global_batch_size=1, dtype="fp32"), CAL)
    items = {(name, phase): t for name, phase, t, _ in pred.stages[0].items}
    layer, embedding = items[("transformer_layer", "forward")], items[("embedding", "forward")]
    assert layer.seconds == pytest.approx(1200 * US) and "1200us fenced mean" in layer.source.detail
    assert embedding.seconds == pytest.approx(100 * US) and "100us median" in embedding.source.detail
    # a neighbouring point scales the same statistic: the layer at s64 from its s32 row
    at_s64 = predict(runs, Layout(seq_len=64, global_batch_size=1, dtype="fp32"), CAL)
    scaled = {(name, phase): t for name, phase, t, _ in at_s64.stages[0].items}[
        ("transformer_layer", "forward")
    ]
    assert "1200us fenced mean" in scaled.source.detail and scaled.seconds > 1200 * US


def test_a_seq_len_above_the_models_positions_is_said(tmp_path):
    """The profiler refuses such a shape; a plan may mean to extend the context, so predict says it."""
    run_dir = make_run(tmp_path, base_rows())
    env = json.loads((run_dir / "environment.json").read_text())
    env["model_args"]["max_sequence_length"] = 48
    (run_dir / "environment.json").write_text(json.dumps(env))
    runs = load_runs([run_dir])

    def said(seq_len: int) -> list[str]:
        notes = predict(runs, Layout(seq_len=seq_len, global_batch_size=1, dtype="fp32"), CAL).notes
        return [n for n in notes if "max_position_embeddings" in n]

    assert said(32) == []
    assert said(64) == [
        "seq_len=64 is above the model's max_position_embeddings=48: a longer context than it was made for "
        "(its times scaled from the rows as any length's)"
    ]


def test_cpu_rows_profiled_in_fewer_processes_than_the_layout_runs_are_named(tmp_path):
    """A CPU layout's processes share one host: rows profiled in fewer processes than it runs (a pipeline's
    stages profiled alone) read fast, and the prediction says so with the command that profiles them
    beside each other; rows profiled in as many, or on a GPU, say nothing. Given both, the rows profiled
    beside as many processes as the layout runs are the ones it takes, whichever run came last; the
    profiling plan's command for a missing point starts that many processes."""
    pp2 = Layout(seq_len=32, pp=2, global_batch_size=8, dtype="fp32")
    alone = make_run(tmp_path, base_rows(), "alone")
    said = [w for w in predict(load_runs([alone]), pp2, CAL).warnings if "process" in w]
    assert said == [
        "the CPU rows were profiled in 1 process, and this layout runs 2 on one host, which share its memory "
        "and caches: its ops run slower than those rows (torchrun --standalone --nproc-per-node=2 -m "
        "autotuner.main ... profiles them beside each other)"
    ]
    one = Layout(seq_len=32, global_batch_size=8, dtype="fp32")
    assert not any("process" in w for w in predict(load_runs([alone]), one, CAL).warnings)
    slower = [{**r, "median_us": r["median_us"] * 1.2} for r in base_rows()]  # beside another process
    beside = make_run(tmp_path, slower, "beside")
    env = json.loads((beside / "environment.json").read_text())
    (beside / "environment.json").write_text(json.dumps({**env, "world_size": 2}))
    assert not any("process" in w for w in predict(load_runs([beside]), pp2, CAL).warnings)
    assert [w for w in predict(load_runs([beside]), one, CAL).warnings if "process" in w] == [
        "the CPU rows were profiled in 2 processes, and this layout runs 1 on one host, which share its "
        "memory and caches: its ops run faster than those rows (python -m autotuner.main ... profiles them "
        "alone)"
    ]
    # one run of each, in either order: each layout takes the rows profiled beside its own processes
    for order in ([beside, alone], [alone, beside]):
        runs = load_runs(order)
        for layout, factor in ((pp2, 1.2), (one, 1.0)):
            pred = predict(runs, layout, CAL)
            layer = pred.stages[0].items[0][2]
            assert layer.seconds == pytest.approx(1000 * US * factor)
            assert not any("process" in w for w in pred.warnings)
    gpu = make_run(tmp_path, [{**r, "device": "cuda"} for r in base_rows()], "gpu")
    assert not any("process" in w for w in predict(load_runs([gpu]), pp2, CAL).warnings)
    # rows of another point profiled alone say nothing of the layout's point, profiled beside
    other = make_run(tmp_path, base_rows(s=64), "other_point")
    assert not any("process" in w for w in predict(load_runs([other, beside]), pp2, CAL).warnings)
    # a point nobody measured: on a CPU the command profiles it beside the layout's 2 processes, though
    # tp=1 alone would fit one; on a GPU, one process
    at_s64 = Layout(seq_len=64, pp=2, global_batch_size=8, dtype="fp32")
    command = predict(load_runs([alone]), at_s64, CAL).missing[0]["command"]
    assert command.startswith("torchrun --standalone --nproc-per-node=2 -m autotuner.main case=synthetic")
    assert "tensor_model_parallel_size" not in command and "shapes.seq_len=[64]" in command
    assert predict(load_runs([gpu]), at_s64, CAL).missing[0]["command"].startswith("python -m autotuner.main")


def two_process_run(tmp_path: Path, rows: list[dict], name: str) -> Path:
    """A run profiled under torchrun in 2 processes (its environment.json's ``world_size``)."""
    run_dir = make_run(tmp_path, rows, name)
    env = json.loads((run_dir / "environment.json").read_text())
    (run_dir / "environment.json").write_text(json.dumps({**env, "world_size": 2}))
    return run_dir


def test_ranks_that_timed_an_op_on_their_own_are_repeats_and_a_tp_op_takes_its_slowest_rank(tmp_path):
    """Under torchrun every rank writes its rows, then one per op with the slowest rank's (rank "max"). An
    op whose ranks waited for each other inside it (tensor-parallel) is as slow as its slowest rank: that
    row stands. Any other op ran in each rank on its own (a pipeline's or data-parallel layout's ops,
    profiled beside each other): its ranks' rows are repeats, the visit takes their mean (of more, their
    median) and its source names each rank; a file of the merged rows alone still gives the slowest's."""

    def per_rank(rows: list[dict], tp: int = 1) -> list[dict]:
        """Rank 0's rows as given, rank 1's 1.5 times slower, then the merged rows (rank 1's)."""
        slow = [{**r, "median_us": r["median_us"] * 1.5, "tensor_parallel": tp} for r in rows]
        return [
            *({**r, "rank": 0, "tensor_parallel": tp} for r in rows),
            *({**r, "rank": 1} for r in slow),
            *({**r, "rank": "max"} for r in slow),
        ]

    def layer_forward(pred) -> Any:
        return next(
            t for name, ph, t, _ in pred.stages[0].items if (name, ph) == ("transformer_layer", "forward")
        )

    pp2 = Layout(seq_len=32, pp=2, global_batch_size=8, dtype="fp32")
    beside = two_process_run(tmp_path, per_rank(base_rows()), "beside")
    layer = layer_forward(predict(load_runs([beside]), pp2, CAL))
    assert layer.seconds == pytest.approx(1250 * US)  # the ranks' 1000 and 1500
    said = "tp=1 1250us median (the mean of 2 repeats: beside rank 0 1000, beside rank 1 1500us)"
    assert said in layer.source.detail
    # with a second run of the same ops, four repeats: their median, the middle two's mean
    again = two_process_run(
        tmp_path, per_rank([{**r, "median_us": r["median_us"] * 1.2} for r in base_rows()]), "again"
    )
    layer = layer_forward(predict(load_runs([beside, again]), pp2, CAL))
    assert layer.seconds == pytest.approx((1200 + 1500) / 2 * US)  # of 1000, 1200, 1500 and 1800
    # the merged rows alone: the op takes the slowest rank's, as no rank's row is there to stand for it
    merged = two_process_run(tmp_path, [r for r in per_rank(base_rows()) if r["rank"] == "max"], "merged")
    assert layer_forward(predict(load_runs([merged]), pp2, CAL)).seconds == pytest.approx(1500 * US)
    # tensor-parallel rows: every op's ranks waited for each other, so the slowest rank's row stands
    tp2 = Layout(seq_len=32, tp=2, global_batch_size=8, dtype="fp32")
    sharded = two_process_run(tmp_path, per_rank(base_rows(), tp=2), "tp2")
    layer = layer_forward(predict(load_runs([sharded]), tp2, CAL))
    assert layer.seconds == pytest.approx(1500 * US) and "repeats" not in layer.source.detail


def test_interleaved_bubble_and_recompute(tmp_path):
    runs = load_runs([make_run(tmp_path, [*base_rows(), row("core_attention", "forward", 150)])])
    lay = Layout(seq_len=32, pp=2, vpp=2, global_batch_size=8, dtype="fp32", recompute="selective")
    pred = predict(runs, lay, CAL)
    t1 = (2 * 1000 + 10 + 300 + 2 * 2000 + 20 + 600 + 2 * 150) * US  # backward re-runs core attention
    t1 += accumulation(STAGE1_PARAMS)
    assert pred.stages[1].total == pytest.approx(t1)
    assert pred.step.closed_form == pytest.approx(8 * t1 * (1 + 1 / 16))
    # each model chunk's box is its own (one layer each): the embedding in the model's first chunk, the
    # final norm and the output layer in its last, each chunk's gradients accumulated by its parameters
    layer_b = (2000 + 150) * US + accumulation(LAYER_PARAMS)
    own = {
        (0, "forward", 0): 1100 * US,
        (0, "backward", 0): layer_b + 100 * US + accumulation(VOCAB * H),
        (0, "forward", 1): 1000 * US,
        (0, "backward", 1): layer_b,
        (1, "forward", 0): 1000 * US,
        (1, "backward", 0): layer_b,
        (1, "forward", 1): 1310 * US,
        (1, "backward", 1): layer_b + 620 * US + accumulation(H + VOCAB * H),
    }
    for st in pred.stages:
        by_hand = [own[(st.index, phase, c)] for c in (0, 1) for phase in ("forward", "backward")]
        assert [t for chunk in st.chunks for t in chunk] == pytest.approx(by_hand)
        assert sum(f for f, _ in st.chunks) == pytest.approx(st.forward)
        assert sum(b for _, b in st.chunks) == pytest.approx(st.backward)
    sched = simulate(lambda key: own[(key[0], key[1], key[3])], 2, 2, 8, P2P)
    assert pred.step.pipeline == pytest.approx(sched.end)
    assert "1F1B order simulated, each model chunk its own time" in pred.step.formula
    shown = next(line for line in render(pred).splitlines() if line.startswith("model chunks"))
    assert "stage 0: 1.10 ms / " in shown and "stage 1: 1.00 ms / 2.21 ms, 1.31 ms / 2.90 ms" in shown
    # the stage's time split evenly over its chunks ends elsewhere
    even = {(st.index, ph): getattr(st, ph) / 2 for st in pred.stages for ph in ("forward", "backward")}
    assert simulate(lambda key: even[key[:2]], 2, 2, 8, P2P).end != pytest.approx(sched.end, rel=1e-3)
    # which the accuracy benchmark rebuilds to print beside the new one (no host work calibrated here)
    from benchmarks.predict_accuracy import even_chunks_step_s

    rest = pred.step.dp_reduction + pred.step.optimizer
    assert even_chunks_step_s(pred, CAL) == pytest.approx(
        simulate(lambda key: even[key[:2]], 2, 2, 8, P2P).end + rest
    )
    assert (
        simulate(lambda key: own[(key[0], key[1], key[3])], 2, 2, 8).end < pred.step.pipeline
    )  # exchanges cost
    full = predict(runs, Layout(seq_len=32, pp=2, global_batch_size=8, dtype="fp32", recompute="full"), CAL)
    assert full.stages[0].backward == pytest.approx(
        (2 * 2000 + 100 + 2 * 1000) * US + accumulation(STAGE0_PARAMS)
    )


def test_optimizer_from_the_calibrated_adam_rate_else_modelled_with_a_warning(tmp_path):
    layout = Layout(seq_len=32, global_batch_size=2, dtype="fp32")
    params = 4 * LAYER_PARAMS + H + 2 * VOCAB * H
    cal = {**CAL, "adam_seconds_per_parameter": 2e-9, "adam_parameters": 1e7}
    timed = predict(load_runs([make_run(tmp_path, base_rows(), calibration=cal)]), layout, cal)
    zeroing = 4 * params / CAL["memory_bandwidth"]
    assert timed.step.optimizer == pytest.approx(params * 2e-9 + zeroing)
    assert timed.step.optimizer_source.kind == "scaled" and "timed by autotuner.calibrate" in (
        timed.step.optimizer_source.detail
    )
    assert not any("Adam" in w for w in timed.warnings)
    assert "cost per tensor not timed" in timed.step.optimizer_source.detail
    assert "at the copy bandwidth 10 GB/s (no zeroing_bandwidth" in timed.step.optimizer_source.detail
    # a calibration that timed zeroing: the gradients cleared at that rate (a CPU's is not half a copy's)
    zeroed_cal = {**cal, "zeroing_bandwidth": 4e9}
    runs = load_runs([make_run(tmp_path, base_rows(), "zeroed", calibration=zeroed_cal)])
    zeroed = predict(runs, layout, zeroed_cal)
    assert zeroed.step.optimizer == pytest.approx(params * 2e-9 + 4 * params / 4e9)
    assert "4 B per parameter at the calibrated zeroing 4 GB/s" in zeroed.step.optimizer_source.detail
    # with its cost per tensor: torch's Adam loops over the parameter tensors, here 6 per layer (two
    # RMSNorms, linear_qkv, linear_proj, fc1, fc2), the embedding, the final norm, the output layer
    looped_cal = {**cal, "adam_seconds_per_tensor": 5e-5}
    runs = load_runs([make_run(tmp_path, base_rows(), "looped", calibration=looped_cal)])
    looped = predict(runs, layout, looped_cal)
    assert looped.step.optimizer == pytest.approx(params * 2e-9 + (4 * 6 + 3) * 5e-5 + zeroing)
    assert "50 us per tensor x 27 parameter tensors" in looped.step.optimizer_source.detail
    # what a CPU calibration timed inside real steps beyond the back-to-back rates: once a step
    in_training = {**looped_cal, "adam_seconds_per_step_in_training": 4e-4}
    runs_in_training = load_runs([make_run(tmp_path, base_rows(), "in_training", calibration=in_training)])
    inside = predict(runs_in_training, layout, in_training)
    assert inside.step.optimizer == pytest.approx(looped.step.optimizer + 4e-4)
    assert "+ 400 us a step more inside training steps" in inside.step.optimizer_source.detail
    # the distributed optimizer steps one share of each flat buffer (autotuner.validate.steps)
    zero = Layout(seq_len=32, dp=2, global_batch_size=2, dtype="fp32", distributed_optimizer=True)
    sharded = predict(runs, zero, looped_cal)
    assert "x 1 flat buffer shares" in sharded.step.optimizer_source.detail
    bare = predict(load_runs([make_run(tmp_path, base_rows(), "bare")]), layout, CAL)
    assert bare.step.optimizer == pytest.approx(adam_seconds(params))
    assert bare.step.optimizer_source.kind == "modelled"
    assert any("did not time the Adam step" in w for w in bare.warnings)
    # bf16: Megatron's fp32 Adam, then the cast of the main parameters into the model's copy (6 B each)
    bf = [{**r, "dtype": "bf16"} for r in base_rows()]
    bf[0]["weight_bytes"] = LAYER_PARAMS * 2
    half = predict(
        load_runs([make_run(tmp_path, bf, "bf16")]),
        Layout(seq_len=32, global_batch_size=2, dtype="bf16"),
        cal,
    )
    assert half.step.optimizer == pytest.approx(params * 2e-9 + (4 + 6) * params / CAL["memory_bandwidth"])
    # two CPU processes (dp=2) share the memory: the rate timed with both at it, else the lone one, warned
    two = Layout(seq_len=32, dp=2, global_batch_size=2, dtype="fp32")
    together = {**cal, "adam_seconds_per_parameter_together": {"gloo:2": 3e-9}}
    shared = predict(load_runs([make_run(tmp_path, base_rows(), "dp2", together)]), two, together)
    assert shared.step.optimizer == pytest.approx(params * 3e-9 + zeroing)
    assert "every rank at once" in shared.step.optimizer_source.detail
    alone = predict(load_runs([make_run(tmp_path, base_rows(), "dp2_alone", cal)]), two, cal)
    assert alone.step.optimizer == pytest.approx(params * 2e-9 + zeroing)
    assert any("2 CPU processes at once" in w for w in alone.warnings)


def test_gradient_accumulation_per_micro_batch_unless_fused(tmp_path, monkeypatch):
    layout = Layout(seq_len=32, global_batch_size=3, dtype="fp32")
    params = 4 * LAYER_PARAMS + H + 2 * VOCAB * H
    pred = predict(load_runs([make_run(tmp_path, base_rows())]), layout, CAL)
    acc = {n: (t, c) for n, _, t, c in pred.stages[0].items}["grad_accumulation"]
    assert acc[0].seconds == pytest.approx(accumulation(params)) and acc[1] == 1
    assert pred.step.pipeline == pytest.approx(3 * pred.stages[0].total)
    assert acc[0].source.kind == "modelled" and "did not time it" in acc[0].source.detail
    # the calibration's timed add for the model's dtype, where it has one
    timed_cal = {**CAL, "grad_accumulation_seconds_per_parameter": {"fp32": 5e-12, "bf16": 7e-12}}
    timed = predict(load_runs([make_run(tmp_path, base_rows(), "timed", timed_cal)]), layout, timed_cal)
    acc = {n: t for n, _, t, c in timed.stages[0].items}["grad_accumulation"]
    assert acc.seconds == pytest.approx(5e-12 * params) and acc.source.kind == "scaled"
    assert "timed by autotuner.calibrate" in acc.source.detail
    monkeypatch.setitem(TC, "gradient_accumulation_fusion", True)
    fused = predict(load_runs([make_run(tmp_path, base_rows(), "fused")]), layout, CAL)
    assert "grad_accumulation" not in [n for n, *_ in fused.stages[0].items]
    assert fused.stages[0].backward == pytest.approx(pred.stages[0].backward - accumulation(params))


def test_host_work_outside_the_ops_per_micro_batch_on_a_cpu(tmp_path):
    """The calibration's host work per micro-batch (a stage's part + a part per layer) added to each CPU
    stage's forward and backward; without it a warning names the command; on a GPU it is not added."""
    layout = Layout(seq_len=32, pp=2, global_batch_size=8, dtype="fp32")
    work = {"forward": 1e-4, "forward_per_layer": 2e-5, "backward": 3e-4, "backward_per_layer": 4e-5}
    # a cache the stages' ops fit in: the host work as timed warm
    cal = {
        **CAL,
        "host_work_seconds_per_microbatch": work,
        "warm_cache_bytes": 2**20,
        "shared_cache_bytes": 2**30,
    }
    cal_without_work = {k: v for k, v in cal.items() if k != "host_work_seconds_per_microbatch"}
    bare = predict(load_runs([make_run(tmp_path, base_rows())]), layout, cal_without_work)
    assert "host_work" not in [n for st in bare.stages for n, *_ in st.items]
    assert any("host work outside its ops" in w and "autotuner.calibrate" in w for w in bare.warnings)
    pred = predict(load_runs([make_run(tmp_path, base_rows(), "timed", cal)]), layout, cal)
    for bare_stage, stage in zip(bare.stages, pred.stages, strict=True):
        assert stage.forward == pytest.approx(bare_stage.forward + 1e-4 + 2 * 2e-5)  # 2 layers a stage
        assert stage.backward == pytest.approx(bare_stage.backward + 3e-4 + 2 * 4e-5)
        work_items = [(phase, t) for n, phase, t, count in stage.items if n == "host_work" and count == 1]
        assert [phase for phase, _ in work_items] == ["forward", "backward"]
        assert all(
            t.source.kind == "scaled" and "autotuner.calibrate" in t.source.detail for _, t in work_items
        )
    assert not any("host work" in w for w in pred.warnings)
    # interleaved: each model chunk runs its own forward and backward step and GPTModel forward, so the
    # stage's part is paid per chunk (2 here, one layer each), the part per layer per layer
    inter = Layout(seq_len=32, pp=2, vpp=2, global_batch_size=8, dtype="fp32")
    bare_inter = predict(load_runs([make_run(tmp_path, base_rows(), "bare_inter")]), inter, cal_without_work)
    timed_inter = predict(load_runs([make_run(tmp_path, base_rows(), "timed_inter", cal)]), inter, cal)
    for bare_stage, stage in zip(bare_inter.stages, timed_inter.stages, strict=True):
        assert stage.forward == pytest.approx(bare_stage.forward + 2 * 1e-4 + 2 * 2e-5)
        assert stage.backward == pytest.approx(bare_stage.backward + 2 * 3e-4 + 2 * 4e-5)
        for (f0, b0), (f1, b1) in zip(bare_stage.chunks, stage.chunks, strict=True):
            assert (f1 - f0, b1 - b0) == pytest.approx((1e-4 + 2e-5, 3e-4 + 4e-5))
    gpu_rows = [{**r, "device": "cuda"} for r in base_rows()]
    on_gpu = predict(load_runs([make_run(tmp_path, gpu_rows, "gpu", cal)]), layout, cal)
    assert "host_work" not in [n for st in on_gpu.stages for n, *_ in st.items]
    assert not any("host work" in w for w in on_gpu.warnings)


def test_host_work_timed_flushed_where_the_stage_sweeps_the_shared_cache(tmp_path):
    """A stage whose ops touch more bytes a micro-batch than the shared cache holds (in all the processes
    that share the host, on a CPU) takes the host work the calibration timed with the caches flushed
    inside each layer; one whose ops fit, the warm one; a calibration without the flushed figure keeps
    the warm one and says it under-counts; without cache sizes the stage is assumed to sweep them."""
    warm = {"forward": 1e-4, "forward_per_layer": 2e-5, "backward": 3e-4, "backward_per_layer": 4e-5}
    flushed = {k: 3 * v for k, v in warm.items()}
    one, dp2 = (Layout(seq_len=32, dp=dp, global_batch_size=dp, dtype="fp32") for dp in (1, 2))
    tokens = 32
    table = VOCAB * H
    swept = (  # the single stage's ops, their weights, fp32 gradients and saved bytes (stage_sweep)
        (table * 4 + table * 4 + tokens * H * 4)  # embedding
        + 4 * (LAYER_PARAMS * 8 + 5000)  # 4 layers, 5000 B saved each (base_rows)
        + (H * 8 + tokens * H * 4)  # final norm
        + (table * 8 + tokens * VOCAB * 4)  # output layer and its fp32 logits
    )

    def host_work_s(layout: Layout, cal: dict) -> tuple[float, str, list[str]]:
        pred = predict(
            load_runs([make_run(tmp_path, base_rows(), f"r{len(list(tmp_path.iterdir()))}", cal)]),
            layout,
            cal,
        )
        (forward,) = [t for n, phase, t, _ in pred.stages[0].items if n == "host_work" and phase == "forward"]
        return forward.seconds, forward.source.detail, pred.warnings

    base = {
        **CAL,
        "host_work_seconds_per_microbatch": warm,
        "host_work_seconds_per_microbatch_flushed": flushed,
    }
    between = {**base, "warm_cache_bytes": 2**20, "shared_cache_bytes": int(1.5 * swept)}
    seconds, detail, _ = host_work_s(one, between)
    assert seconds == pytest.approx(1e-4 + 4 * 2e-5) and "within" in detail  # one process: it fits
    seconds, detail, _ = host_work_s(dp2, between)  # two processes sweep one host's cache: half each, beyond
    assert seconds == pytest.approx(3 * (1e-4 + 4 * 2e-5))
    assert "flushed" in detail and "a share of 1/2: 2 processes on one host" in detail and "beyond" in detail
    small = {**base, "warm_cache_bytes": 2**10, "shared_cache_bytes": int(0.9 * swept)}
    assert host_work_s(one, small)[0] == pytest.approx(3 * (1e-4 + 4 * 2e-5))
    assert host_work_s(one, base)[0] == pytest.approx(3 * (1e-4 + 4 * 2e-5))  # no cache sizes: swept
    older = {k: v for k, v in small.items() if k != "host_work_seconds_per_microbatch_flushed"}
    seconds, _, said = host_work_s(one, older)
    assert seconds == pytest.approx(1e-4 + 4 * 2e-5)
    assert any("only with them warm" in w and "autotuner.calibrate" in w for w in said)
    # the accuracy benchmark's side-by-side line: the same rows with the warm host work everywhere
    from benchmarks.predict_accuracy import warm_host_work_step_s

    runs = load_runs([make_run(tmp_path, base_rows(), "side_by_side", small)])
    swept_step = predict(runs, one, small).step_seconds
    warm_step = warm_host_work_step_s(runs, one, small)
    assert warm_step == pytest.approx(predict(runs, one, older).step_seconds)
    # one micro-batch, its forward's and backward's host work 3x the warm one's: 2x more
    assert swept_step - warm_step == pytest.approx(2 * (1e-4 + 4 * 2e-5 + 3e-4 + 4 * 4e-5))
    assert warm_host_work_step_s(runs, one, older) is None


def test_warm_or_cold_rows_by_whether_the_gpu_memory_fits_the_cache(tmp_path):
    warm = base_rows()
    cold = [{**r, "cache_flush": True, "median_us": r["median_us"] * 1.5} for r in base_rows()]
    layout = Layout(seq_len=32, global_batch_size=1, dtype="fp32")
    both = load_runs([make_run(tmp_path, cold, "cold"), make_run(tmp_path, warm, "warm")])
    roomy = {**CAL, "warm_cache_bytes": 2**30}
    small = {**CAL, "warm_cache_bytes": 2**10}

    def layer_forward(pred) -> float:
        return pred.stages[0].items[0][2].seconds

    fits = predict(both, layout, roomy)  # a few MiB held: the step finds its data cached
    assert layer_forward(fits) == pytest.approx(1000 * US) and not any("cache" in w for w in fits.warnings)
    spills = predict(both, layout, small)
    assert layer_forward(spills) == pytest.approx(1500 * US) and not any(
        "cache" in w for w in spills.warnings
    )
    assert layer_forward(predict(both, layout, CAL)) == pytest.approx(1500 * US)  # no size: assumed cold
    # only warm rows where cold ones are wanted: used, with the warning and a flushing command to fix it
    warm_only = predict(
        load_runs([make_run(tmp_path, warm, "only")]), Layout(seq_len=64, dtype="fp32"), small
    )
    assert any("measured with warm caches" in w and "flush_cache=true" in w for w in warm_only.warnings)
    assert all("timing.flush_cache=true" in m["command"] for m in warm_only.missing)
    cold_only = predict(
        load_runs([make_run(tmp_path, cold, "conly")]), Layout(seq_len=64, dtype="fp32"), roomy
    )
    assert any("measured with a flushed cache" in w for w in cold_only.warnings)
    # the stage's first forward (the embedding's, after a backward) wants a flushed row, the rest warm
    # ones: the plan measures the missing point both ways, as the warning says
    commands = [m["command"] for m in cold_only.missing]
    assert sum("timing.flush_cache=false" in c for c in commands) == 1
    assert sum("timing.flush_cache=true" in c for c in commands) == 1
    # the warm run's forwards each after the op's backward, as the step runs them; the flushed one's not
    assert [("forward_after_backward=true" in c) for c in commands] == [
        "flush_cache=false" in c for c in commands
    ]
    assert len(cold_only.plan.missing) == 1  # one point, measured twice


def test_runs_that_measured_a_point_alike_are_repeats_and_the_op_takes_their_median(tmp_path):
    """Two runs' rows of an op at one point, measured alike, are two moments of the machine: the visit
    takes their mean and its source gives each; of three, their median (a disturbed run is out-voted);
    within one run the later row replaces the earlier; a row that fits the visit better (a forward timed
    after its backward) still wins over repeats of a worse fit."""
    layout = Layout(seq_len=32, global_batch_size=1, dtype="fp32")

    def visit(pred, op="transformer_layer", phase="forward"):
        return next(t for name, ph, t, _ in pred.stages[0].items if (name, ph) == (op, phase))

    slower = [
        {**r, "median_us": r["median_us"] * 1.4} if r["op"] == "transformer_layer" else r for r in base_rows()
    ]
    first, second = make_run(tmp_path, base_rows(), "first"), make_run(tmp_path, slower, "second")
    pred = predict(load_runs([first, second]), layout, CAL)
    for phase, us in (("forward", 1000), ("backward", 2000)):
        layer = visit(pred, phase=phase)
        assert layer.seconds == pytest.approx(1.2 * us * US)
        said = f"{1.2 * us:.4g}us median (the mean of 2 repeats: first {us}, second {1.4 * us:.4g}us)"
        assert said in layer.source.detail
    layer_share = (1.2 * 1000 + 1.2 * 2000) * 4 * US / pred.stages[0].total
    assert [n for n in pred.notes if "more than 5% apart" in n] == [
        "2 of the ops used were timed by repeats (runs, or ranks profiling beside each other) more than 5% "
        "apart (transformer_layer.backward (2000-2800us), transformer_layer.forward (1000-1400us)), "
        f"{layer_share:.0%} of stage 0's forward and backward: the machine ran at another speed in each, and "
        "each op takes their median (of two, their mean); runs at more moments narrow it"
    ]
    embedding = visit(pred, "embedding")  # the same in both runs: their mean is it
    assert embedding.seconds == pytest.approx(100 * US) and "the mean of 2 repeats" in embedding.source.detail
    # three runs: the median, so one run taken by another tenant's second is out-voted
    third = make_run(tmp_path, base_rows(), "third")
    pred = predict(load_runs([first, second, third]), layout, CAL)
    for phase, us in (("forward", 1000), ("backward", 2000)):
        layer = visit(pred, phase=phase)
        assert layer.seconds == pytest.approx(us * US)
        assert (
            f"{us}us median (the median of 3 repeats: first {us}, second {1.4 * us:.4g}, third {us}us)"
            in (layer.source.detail)
        )
    fenced = [{**r, "fenced_mean_us": r["median_us"] * 1.5} for r in base_rows()]
    mixed = predict(load_runs([first, make_run(tmp_path, fenced, "fenced")]), layout, CAL)
    assert visit(mixed).seconds == pytest.approx(1000 * US)  # the medians' mean where a run has no fence
    assert not [n for n in mixed.notes if "more than 5% apart" in n]  # the medians agree
    # one run's two rows at a point: the later stands alone
    again = make_run(tmp_path, [*base_rows(), *slower], "again")
    assert visit(predict(load_runs([again]), layout, CAL)).seconds == pytest.approx(1400 * US)
    # a forward timed after its backward fits a step's visit better than either repeat timed back to back
    after = [
        {**r, "forward_after_backward": True, "median_us": 900} if r["phase"] == "forward" else r
        for r in base_rows()
    ]
    better = make_run(tmp_path, after, "after")
    for runs in ([first, better, second], [better, first, second]):
        pred = predict(load_runs(runs), layout, CAL)
        assert visit(pred).seconds == pytest.approx(900 * US) and "the mean" not in visit(pred).source.detail


def test_warm_forwards_timed_after_their_backward_win_and_back_to_back_ones_are_named(tmp_path):
    """Inside a step every forward of an op follows its previous micro-batch's backward: given warm forward
    rows timed both ways (timing.forward_after_backward), a visit takes those timed after the backward,
    whichever run came last; a CPU prediction whose warm forward rows at its point were timed back to back
    says so and names the override; flushed rows, or rows on a GPU, say nothing."""
    layout = Layout(seq_len=32, global_batch_size=1, dtype="fp32")
    roomy = {**CAL, "warm_cache_bytes": 2**30, "shared_cache_bytes": 2**30}  # the layers' visits warm

    def layer_forward(pred):
        return next(
            t.seconds
            for name, phase, t, _ in pred.stages[0].items
            if (name, phase) == ("transformer_layer", "forward")
        )

    in_order = [
        {**r, "forward_after_backward": True, "median_us": r["median_us"] * 1.1}
        if r["phase"] == "forward"
        else r
        for r in base_rows()
    ]
    b2b, after = make_run(tmp_path, base_rows(), "b2b"), make_run(tmp_path, in_order, "after")
    for runs in ([b2b, after], [after, b2b]):
        pred = predict(load_runs(runs), layout, roomy)
        assert layer_forward(pred) == pytest.approx(1100 * US)
        assert not any("back to back" in w for w in pred.warnings)
    said = [w for w in predict(load_runs([b2b]), layout, roomy).warnings if "back to back" in w]
    assert said == [
        "the warm forward rows of embedding, final_layernorm, output_layer, transformer_layer were timed "
        "back to back; inside a step each forward follows the op's backward, which runs it slower on a "
        "CPU: profile them with timing.forward_after_backward=true"
    ]
    flushed = make_run(tmp_path, [{**r, "cache_flush": True} for r in base_rows()], "flushed")
    gpu = make_run(tmp_path, [{**r, "device": "cuda"} for r in base_rows()], "gpu")
    for runs in ([flushed], [gpu]):
        assert not any("back to back" in w for w in predict(load_runs(runs), layout, roomy).warnings)


def test_rows_timed_beside_held_activations_only_stand_in_for_rows_timed_without(tmp_path):
    """timing.held_activations_mib times another condition than the rows the predictor adds up (its steps
    read no nearer from them: autotuner.predict.caches, "Activations held"): a row timed without held
    activations wins over one timed beside them, whichever run came last; alone, the held row stands in."""
    layout = Layout(seq_len=32, global_batch_size=1, dtype="fp32")
    roomy = {**CAL, "warm_cache_bytes": 2**30, "shared_cache_bytes": 2**30}  # every visit warm
    in_order = [{**r, "forward_after_backward": r["phase"] == "forward"} for r in base_rows()]
    held = [{**r, "held_activation_bytes": 2**25, "median_us": r["median_us"] * 1.2} for r in in_order]
    plain, holding = make_run(tmp_path, in_order, "plain"), make_run(tmp_path, held, "held")

    def layer(pred) -> float:
        return next(
            t.seconds for op, ph, t, _ in pred.stages[0].items if (op, ph) == ("transformer_layer", "forward")
        )

    for runs in ([plain, holding], [holding, plain]):
        assert layer(predict(load_runs(runs), layout, roomy)) == pytest.approx(1000 * US)
    assert layer(predict(load_runs([holding]), layout, roomy)) == pytest.approx(1200 * US)


def test_a_stages_first_forward_op_takes_its_warm_row_only_where_that_row_followed_its_backward(tmp_path):
    """A stage's first forward op (the first stage's embedding, a later stage's first layer) follows the
    stage's backward, which ends with the op's own: a warm forward row timed after that backward
    (timing.forward_after_backward) times that visit, one timed back to back does not and the flushed row
    stands in. Caches that hold every op, so only that rule decides; the rows' own times tell which row
    each visit took."""
    layout = Layout(seq_len=32, global_batch_size=4, pp=2, dtype="fp32")
    roomy = {**CAL, "warm_cache_bytes": 2**30, "shared_cache_bytes": 2**30}
    cold = [{**r, "cache_flush": True, "median_us": r["median_us"] * 3} for r in base_rows()]
    in_order = [{**r, "forward_after_backward": r["phase"] == "forward"} for r in base_rows()]

    def forwards(warm_rows, name):
        runs = load_runs([make_run(tmp_path, cold, f"cold-{name}"), make_run(tmp_path, warm_rows, name)])
        pred = predict(runs, layout, roomy)
        per_stage = [
            {op: t.seconds for op, phase, t, _ in stage.items if phase == "forward"} for stage in pred.stages
        ]
        return pred, per_stage

    pred, after = forwards(in_order, "after")
    # stage 1's two layer visits a micro-batch: the first after the backward, the second after a layer
    assert after[1]["transformer_layer"] == pytest.approx(1000 * US)
    assert after[0]["embedding"] == pytest.approx(100 * US)
    assert "unless its warm forward row was timed after its backward" in pred.cache_note
    _, back_to_back = forwards(base_rows(), "b2b")
    assert back_to_back[1]["transformer_layer"] == pytest.approx((1000 + 3000) / 2 * US)
    assert back_to_back[0]["embedding"] == pytest.approx(300 * US)


def test_rows_that_spread_widely_are_named_with_their_share_of_the_stage(tmp_path):
    """A row the timer warned noisy (its IQR over a tenth of its median) moves between profiles: the
    prediction names each such row used, with its warning's figure, and the largest share of a stage's
    forward and backward they carry (here the layer's forward, 2 of the stage's visits); quiet rows, or a
    noisy row of an op the layout does not visit, or noisy rows of a small share of the stage (the final
    norm's), say nothing."""
    layout = Layout(seq_len=32, global_batch_size=1, dtype="fp32")
    noisy = [
        {**r, "warnings": "noisy(iqr=36%);few_samples(9)"}
        if (r["op"], r["phase"]) == ("transformer_layer", "forward")
        else r
        for r in base_rows()
    ]
    pred = predict(load_runs([make_run(tmp_path, noisy, "noisy")]), layout, CAL)
    said = [w for w in pred.warnings if "spread widely" in w]
    stage = pred.stages[0]
    layer = sum(
        t.seconds * n
        for name, phase, t, n in stage.items
        if (name, phase) == ("transformer_layer", "forward")
    )
    assert 0 < layer < stage.total
    assert said == [
        "1 of the rows used spread widely (transformer_layer.forward (iqr=36%)), "
        f"{layer / stage.total:.0%} of stage 0's forward and backward: their means move between profiles by "
        "more than one profile's samples show (two TP=2 profiles of the same ops on a CPU, back to back, "
        "differed by up to 30% an op); profile again and predict from both runs (each op then takes the mean "
        "of its two rows) before trusting a difference of that size"
    ]
    quiet = predict(load_runs([make_run(tmp_path, base_rows(), "quiet")]), layout, CAL)
    assert not any("spread widely" in w for w in quiet.warnings)
    every = [{**r, "warnings": "noisy(iqr=20%)"} for r in base_rows()]  # the four that carry the most named
    pred = predict(load_runs([make_run(tmp_path, every, "every")]), layout, CAL)
    stage = pred.stages[0]
    rows_held = sum(t.seconds * n for name, _, t, n in stage.items if name in {r["op"] for r in every})
    assert [w for w in pred.warnings if "widely" in w][0].startswith(
        "8 of the rows used spread widely (transformer_layer.backward (iqr=20%), transformer_layer.forward "
        "(iqr=20%), output_layer.backward (iqr=20%), output_layer.forward (iqr=20%), ...), "
        f"{rows_held / stage.total:.0%} of stage 0's"
    )
    small = [{**r, "warnings": "noisy(iqr=17%)"} if r["op"] == "final_layernorm" else r for r in base_rows()]
    assert not any(
        "spread widely" in w
        for w in predict(load_runs([make_run(tmp_path, small, "small")]), layout, CAL).warnings
    )
    unused = [*base_rows(), row("transformer_block", "forward", 5000, warnings="noisy(iqr=50%)")]
    assert not any(
        "spread widely" in w
        for w in predict(load_runs([make_run(tmp_path, unused, "unused")]), layout, CAL).warnings
    )


def test_warm_visits_follow_the_stage_sweep():
    """Which visits find their data where a warm row had it, computed by hand. Footprints (weights +
    grads + activations, MB): embedding 4+4+1, each layer 3+3+2, the final norm ~0, the output 4+4+2; a
    32 MB shared cache. A forward's previous visit was the last micro-batch's backward, so what lies
    between is every op before it; a backward's, its own forward: every op after it."""
    from autotuner.predict.caches import CacheSizes, SweepOp, warm_visits

    mb = 1e6
    sweep = [SweepOp("embedding", 4 * mb, 4 * mb, 1 * mb)]
    sweep += [SweepOp("transformer_layer", 3 * mb, 3 * mb, 2 * mb)] * 4
    sweep += [SweepOp("final_layernorm", 100, 100, 1000), SweepOp("output_layer", 4 * mb, 4 * mb, 2 * mb)]
    caches = CacheSizes(shared=32 * mb)
    # forward distances: embedding 0, layers 9/17/25/33, norm 41, output 41; backward: output 0, norm 10,
    # layers 10/18/26/34 (layer 3 first), embedding 42. The last layer's forward (33 MB) and the first
    # layer's backward (34) follow another layer's visit in the same phase: warm whatever lies between.
    # The final norm's forward and the output layer's follow 41 MB, the embedding's backward 42: flushed,
    # though the norm's own bytes are a few KB. The embedding's forward, 0 MB after its own backward, is
    # the first of the sweep's forwards: after a backward, flushed.
    assert warm_visits(sweep, caches) == {
        ("embedding", "forward"): 0,
        ("embedding", "backward"): 0,
        ("transformer_layer", "forward"): 4,
        ("transformer_layer", "backward"): 4,
        ("final_layernorm", "forward"): 0,
        ("final_layernorm", "backward"): 1,
        ("output_layer", "forward"): 0,
        ("output_layer", "backward"): 1,
    }
    # a small op whose data left a core's own cache but not the shared one takes its warm row (module
    # docstring, "Small ops between"): with 48 MB every visit but the embedding's first forward is warm
    roomy = warm_visits(sweep, CacheSizes(shared=48 * mb))
    assert [k for k, n in roomy.items() if n == 0] == [("embedding", "forward")]
    # an 8.5 MB shared cache holds a layer's own data (forward 5 MB, backward 8) but not what lies between
    # the first layer's forward and its last visit (the embedding's 9 MB), nor the last layer's backward
    # and its forward (the norm and the output layer, 10): those follow other ops and go cold; the other
    # three of each phase follow a layer
    smaller = warm_visits(sweep, CacheSizes(shared=8.5 * mb))
    assert smaller[("transformer_layer", "forward")] == smaller[("transformer_layer", "backward")] == 3
    assert smaller[("embedding", "forward")] == 0 and smaller[("output_layer", "backward")] == 0
    # a later pipeline stage's sweep starts with a layer: its first forward follows a backward and is
    # flushed, the other three follow a layer
    later = warm_visits(sweep[1:5], caches)
    assert later[("transformer_layer", "forward")] == 3 and later[("transformer_layer", "backward")] == 4
    # unless the warm forward row was timed after the op's own backward (timing.forward_after_backward):
    # then that row times the visit as it runs, the layer's on a later stage and the embedding's on the first
    after = frozenset({"embedding", "transformer_layer"})
    assert warm_visits(sweep[1:5], caches, after)[("transformer_layer", "forward")] == 4
    assert warm_visits(sweep, caches, after)[("embedding", "forward")] == 1
    assert warm_visits(sweep, caches, frozenset({"transformer_layer"}))[("embedding", "forward")] == 0
    # a GPU's L2: a layer larger than it finds nothing cached; without sizes, nothing is
    gpu = warm_visits(sweep, CacheSizes(shared=4.5 * mb))
    assert gpu[("transformer_layer", "forward")] == gpu[("transformer_layer", "backward")] == 0
    assert warm_visits(sweep[1:5], CacheSizes(4.5 * mb), after)[("transformer_layer", "forward")] == 0
    assert set(warm_visits(sweep, None).values()) == {0}
    # two processes of one host (a CPU layout's ranks), each sweeping its own stage: each keeps half, so a
    # 64 MB cache shared by two plans as the 32 MB one above, and 48 MB by two as the 24 MB one alone
    assert warm_visits(sweep, CacheSizes(shared=64 * mb, processes=2)) == warm_visits(sweep, caches)
    assert warm_visits(sweep, CacheSizes(48 * mb, 2)) == warm_visits(sweep, CacheSizes(24 * mb))
    assert warm_visits(sweep, CacheSizes(48 * mb, 2)) != roomy


def test_an_op_partly_cached_blends_its_warm_and_flushed_rows(tmp_path):
    from autotuner.predict.caches import CacheSizes, stage_sweep, warm_visits

    warm = base_rows()
    cold = [{**r, "cache_flush": True, "median_us": r["median_us"] * 1.5} for r in base_rows()]
    both = load_runs([make_run(tmp_path, cold, "cold"), make_run(tmp_path, warm, "warm")])
    layout = Layout(seq_len=32, global_batch_size=1, dtype="fp32")
    model = predict(both, layout, CAL).model
    sweep = stage_sweep(model, layout, 0, 5000)  # one layer's activation_bytes in the rows
    assert [op.name for op in sweep] == [
        "embedding",
        *["transformer_layer"] * 4,
        "final_layernorm",
        "output_layer",
    ]
    assert sweep[1].weights == sweep[1].grads == LAYER_PARAMS * 4 and sweep[1].activations == 5000
    # a shared cache that holds a layer's own data but not the embedding's: the first layer's forward,
    # after the embedding's, is cold; the other three follow a layer's forward and are warm
    room = sweep[1].own("backward")
    assert room < sweep[0].footprint
    cal = {**CAL, "warm_cache_bytes": 1024, "shared_cache_bytes": room}
    assert warm_visits(sweep, CacheSizes(room))[("transformer_layer", "forward")] == 3
    pred = predict(both, layout, cal)
    layer = pred.stages[0].items[0][2]
    assert layer.seconds == pytest.approx((3 * 1000 + 1 * 1500) / 4 * US)
    assert "3 of 4 visits per micro-batch with the data cached" in layer.source.detail
    assert "of 14 op visits per micro-batch find their data" in pred.cache_note  # 7 ops x 2 phases
    # on a CPU, DP2's two processes share the host's cache, each sweeping its own copy of the stage: twice
    # the room plans as one process's, the same room leaves each too little for a layer's own data
    dp2 = Layout(seq_len=32, dp=2, global_batch_size=2, dtype="fp32")
    shared = predict(both, dp2, {**cal, "shared_cache_bytes": 2 * room})
    assert shared.stages[0].items[0][2].seconds == pytest.approx(layer.seconds)
    assert "a share of 1/2: 2 processes on one host" in shared.cache_note
    halved = predict(both, dp2, cal).stages[0].items[0][2]
    assert halved.seconds == pytest.approx(1500 * US)
    older = predict(both, layout, {**CAL, "warm_cache_bytes": 1024})  # a calibration from before the L3
    assert "names no shared_cache_bytes" in older.cache_note and "0 of 14" in older.cache_note
    # a CPU calibration from before the shared cache was measured holds the size the CPU reports
    reported = predict(both, layout, {**cal, "device_type": "cpu"})
    assert "the size the CPU reports" in reported.cache_note and "measures it" in reported.cache_note
    measured = {**cal, "device_type": "cpu", "shared_cache_bytes_reported": 8 * room}
    assert "reports" not in predict(both, layout, measured).cache_note
    assert not any("cache" in w for w in pred.warnings)


def test_rows_timed_after_a_pause_never_stand_in_for_back_to_back_ones(tmp_path):
    """timing.idle_before_ms times another condition (an op after a wait), not more samples of the same:
    the predictor leaves such rows out, and a run of them alone does not hold its point for the plan."""
    from autotuner.predict.plan import Need, measured

    paused = [{**r, "idle_before_ms": 2.0, "median_us": r["median_us"] * 3} for r in base_rows()]
    layout = Layout(seq_len=32, dtype="fp32")
    both = load_runs([make_run(tmp_path, base_rows(), "plain"), make_run(tmp_path, paused, "paused")])
    assert predict(both, layout, CAL).stages[0].items[0][2].seconds == pytest.approx(1000 * US)
    alone = predict(load_runs([make_run(tmp_path, paused, "alone")]), layout, CAL)
    assert alone.stages[0].items[0][2].source.kind != "measured"
    assert any(
        m["command"] and "s32_b1" in f"s{m['seq_len']}_b{m['micro_batch_size']}" for m in alone.missing
    )
    assert measured([tmp_path / "plain"]) == {Need("synthetic", 32, 1, 1, 1, False, "fp32", processes=1)}
    assert measured([tmp_path / "alone"]) == set()


def test_an_uneven_split_puts_its_layers_where_megatron_does(tmp_path):
    """pp=2 with last_stage_layers=1 (Megatron's num_layers_in_last_pipeline_stage): stage 0 holds the
    embedding and 3 layers, stage 1 one layer and the head; each stage's time, parameters, optimizer and
    held activations follow its own count, and the schedule runs each stage at its own time."""
    runs = load_runs([make_run(tmp_path, base_rows())])
    lay = Layout(seq_len=32, pp=2, global_batch_size=8, dtype="fp32", last_stage_layers=1)
    pred = predict(runs, lay, CAL)
    params = [3 * LAYER_PARAMS + VOCAB * H, LAYER_PARAMS + H + VOCAB * H]
    assert [st.layers for st in pred.stages] == [3, 1]
    assert [m.params.value for m in pred.memory] == pytest.approx(params)
    f0, b0 = (3 * 1000 + 100) * US, (3 * 2000 + 100) * US + accumulation(params[0])
    f1, b1 = (1000 + 10 + 300) * US, (2000 + 20 + 600) * US + accumulation(params[1])
    assert pred.stages[0].forward == pytest.approx(f0) and pred.stages[0].backward == pytest.approx(b0)
    assert pred.stages[1].forward == pytest.approx(f1) and pred.stages[1].backward == pytest.approx(b1)
    own = {(0, "forward"): f0, (0, "backward"): b0, (1, "forward"): f1, (1, "backward"): b1}
    assert pred.step.pipeline == pytest.approx(simulate(lambda key: own[key[:2]], 2, 1, 8, P2P).end)
    assert pred.step.slowest_stage == 0  # the stage with the embedding and 3 layers
    # 1F1B: stage 0 holds 2 micro-batches of its 3 layers, stage 1 one of its 1
    assert [m.activations.value for m in pred.memory] == pytest.approx([5000 * 3 * 2, 5000 * 1 * 1])
    assert pred.step.optimizer == pytest.approx(adam_seconds(params[0]))  # the larger stage's
    assert "last=1" in lay.describe() and pred.to_json()["layout"]["last_stage_layers"] == 1


def test_megatron_report_is_what_megatron_lm_prints_for_the_first_stage(tmp_path):
    """Beside our terms, the figure Megatron-LM's report_theoretical_memory prints, worked by hand from its
    formulas: without sequence parallelism and selective recompute both, s*b*h*(10 + 24/t) a layer, x L,
    + the embedding's input 8*s*b*p and dropout s*b*h*p, x min(1, m/p) on a pipeline, + 5%; with both,
    s*b*h*(18 + 4*ffn/h) a layer, + the output layer's input and logits at p = 1, / t; weights and
    optimizer 18 B a parameter (6 + 12/dp with the distributed optimizer)."""
    runs = load_runs([make_run(tmp_path, base_rows())])
    s, b, layers = 32, 1, 4
    lay = Layout(seq_len=s, pp=2, dp=2, global_batch_size=16, dtype="fp32", distributed_optimizer=True)
    pred = predict(runs, lay, CAL)
    report = pred.megatron_report
    activations = (s * b * H * (10 + 24 / 1) * layers + 8 * s * b * 2 + s * b * H * 2) * min(1, 4 / 2) * 1.05
    assert report.activations.value == pytest.approx(activations)
    assert report.weights_and_optimizer.value == pytest.approx(STAGE0_PARAMS * (6 + 12 / 2))
    assert report.total == pytest.approx(activations + STAGE0_PARAMS * 12)
    # one micro-batch on a 2-stage pipeline: Megatron discounts the held micro-batches to m/p
    one = predict(runs, Layout(seq_len=s, pp=2, global_batch_size=1, dtype="fp32"), CAL).megatron_report
    assert one.activations.value == pytest.approx(activations / 2)
    # sequence parallelism with selective recompute, tp=2, no pipeline: the output layer's input and logits
    sp = Layout(
        seq_len=s, tp=2, global_batch_size=4, dtype="bf16", sequence_parallel=True, recompute="selective"
    )
    report = predict(runs, sp, CAL).megatron_report
    layer = s * b * H * (18 + 4 * 176 / H)
    head = s * b * H * 4 * (1 + VOCAB / H)
    assert report.activations.value == pytest.approx((layer * layers + 8 * s * b + s * b * H + head) / 2)
    assert "18 + 4*ffn/h" in report.activations.source.detail
    data = pred.to_json()
    assert data["derived"]["megatron_report_total_bytes"] == pytest.approx(pred.megatron_report.total)
    assert data["megatron_report"]["activations"]["value"] == pred.megatron_report.activations.value
    assert "Megatron-LM's theoretical-memory report, stage 0" in render(pred)


def test_memory_terms(tmp_path):
    runs = load_runs([make_run(tmp_path, base_rows())])
    pred = predict(
        runs,
        Layout(seq_len=32, pp=2, dp=2, global_batch_size=16, dtype="fp32", distributed_optimizer=True),
        CAL,
    )
    m0, m1 = pred.memory
    assert m0.params.value == pytest.approx(STAGE0_PARAMS) and m0.params.source.kind == "measured"
    assert m0.weights.value == pytest.approx(STAGE0_PARAMS * 4)
    assert m0.gradients.value == pytest.approx(STAGE0_PARAMS * 4)
    assert m0.optimizer.value == pytest.approx(STAGE0_PARAMS * 8 / 2)  # fp32 Adam m, v, sharded over dp=2
    assert m0.activations.value == pytest.approx(5000 * 2 * 2)  # 2 layers x 2 micro-batches held (p - 0)
    assert m1.activations.value == pytest.approx(5000 * 2 * 1)
    assert m0.activations.source.kind == "measured"
    assert m0.logits.value == 0 and m1.logits.value == pytest.approx(32 * 1 * VOCAB * 4)
    korthikanti = 32 * 1 * 64 * (34 + 5 * 4 * 32 / 64) * 4 / 2  # fp32: twice the 2-byte formula
    assert m0.korthikanti_activations.value == pytest.approx(korthikanti * 4)
    # the peak: weights, gradients and Adam's states, + the larger of the forward-backward's own (the
    # activations and logits; nothing in flight without peak rows) and Adam's step's, which on the CPU
    # updates each flat buffer's share (dp=2) as one tensor: two fp32 temporaries of it
    assert m1.forward_backward == pytest.approx(10000 + 32 * VOCAB * 4)
    assert m1.optimizer_step.value == pytest.approx(8 * STAGE1_PARAMS / 2)
    assert m1.total == pytest.approx(STAGE1_PARAMS * (4 + 4 + 4) + 8 * STAGE1_PARAMS / 2)
    # selective recompute drops what core attention saves beyond its inputs q, k, v (s*b*(4+2*2)*16 fp32)
    ca = row("core_attention", "forward", 150, activation_bytes=20000)
    sel_runs = load_runs([make_run(tmp_path, [*base_rows(), ca], "sel")])
    sel = predict(
        sel_runs, Layout(seq_len=32, pp=2, global_batch_size=8, dtype="fp32", recompute="selective"), CAL
    )
    kept = 5000 - (20000 - 32 * 8 * 16 * 4)
    assert sel.memory[0].activations.value == pytest.approx(kept * 2 * 2)
    inter = predict(runs, Layout(seq_len=32, pp=2, vpp=2, global_batch_size=8, dtype="fp32"), CAL)
    # Megatron's interleaved warm-up: rank 0 holds (2-0-1)*2 + (2-1)*2 + 1 = 5 chunks of 1 layer
    assert [m.activations.value for m in inter.memory] == pytest.approx([5 * 5000, 3 * 5000])


def test_sub_ops_sum_when_the_layer_row_is_missing(tmp_path):
    parts = {
        "input_layernorm": 10,
        "self_attention": 500,
        "self_attn_bda": 5,
        "pre_mlp_layernorm": 10,
        "mlp": 400,
        "mlp_bda": 5,
    }
    rows = [r for r in base_rows() if r["op"] != "transformer_layer"]
    rows += [
        row(op, phase, us * (2 if phase == "backward" else 1))
        for op, us in parts.items()
        for phase in ("forward", "backward")
    ]
    pred = predict(
        load_runs([make_run(tmp_path, rows)]), Layout(seq_len=32, global_batch_size=1, dtype="fp32"), CAL
    )
    layer = pred.stages[0].items[0]
    assert layer[0] == "transformer_layer" and layer[2].seconds == pytest.approx(930 * US)
    assert layer[2].source.kind == "measured" and "sum of" in layer[2].source.detail
    assert pred.stages[0].dominant == "self_attention"
    # at another point each sub-op is scaled by its own rule: attention block by its analytic FLOPs
    far = predict(load_runs([make_run(tmp_path, rows, "far")]), Layout(seq_len=64, dtype="fp32"), CAL)

    def attention_flops(s: int) -> float:  # qkv and proj GEMMs 2*params per token, 4*s*h per token
        return 2 * (64 * 128 + 64 * 64) * s + 4 * s * 64 * s

    expected = (10 + 5 + 10 + 400 + 5) * 2 + 500 * attention_flops(64) / attention_flops(32)
    layer = far.stages[0].items[0][2]
    assert layer.seconds == pytest.approx(expected * US) and layer.source.kind == "scaled"


def test_a_missing_point_is_scaled_with_its_command_not_zero(tmp_path):
    runs = load_runs([make_run(tmp_path, base_rows(32))])
    pred = predict(runs, Layout(seq_len=64, global_batch_size=1, dtype="fp32"), CAL)
    layer = pred.stages[0].items[0][2]

    def flops(s: int) -> float:  # analytic layer FLOPs: GEMMs 2*params per token, attention 4*s*h per token
        return 2 * LAYER_PARAMS * s + 4 * s * 64 * s

    assert layer.seconds == pytest.approx(1000 * US * flops(64) / flops(32))
    assert layer.source.kind == "scaled" and "s32_b1" in layer.source.detail
    embedding = pred.stages[0].items[1][2]
    assert embedding.seconds == pytest.approx(200 * US) and "tokens" in embedding.source.detail
    commands = [m["command"] for m in pred.missing]
    assert commands and commands[0].startswith("python -m autotuner.main case=synthetic")
    assert "shapes.seq_len=[64]" in commands[0] and "shapes.micro_batch_size=[1]" in commands[0]
    assert "transformer_layer.forward" in pred.missing[0]["figures"]
    # nothing measured at all for this dtype: modelled from FLOPs and the calibrated peak, never zero
    bf = predict(
        runs, Layout(seq_len=32, global_batch_size=1, dtype="bf16"), {**CAL, "peak_flops": {"bf16": 1e12}}
    )
    modelled = bf.stages[0].items[0][2]
    assert modelled.source.kind == "modelled" and modelled.seconds == pytest.approx(flops(32) / 1e12)


def test_tp_from_tp1_rows_adds_modelled_all_reduces(tmp_path):
    cal = {**CAL, "all_reduce_bandwidth": {"gloo:2": 1e9}}
    runs = load_runs([make_run(tmp_path, base_rows(), calibration=cal)])
    pred = predict(runs, Layout(seq_len=32, tp=2, global_batch_size=1, dtype="fp32"), cal)
    items = {(n, p): (t, c) for n, p, t, c in pred.stages[0].items}
    layer, count = items[("transformer_layer", "forward")]
    assert layer.seconds == pytest.approx(500 * US) and layer.source.kind == "scaled" and count == 4
    comm, _ = items[("tp_collectives:transformer_layer", "forward")]
    one = 2 * (2 - 1) / 2 * (32 * 64 * 4) / 1e9  # ring all-reduce of s*b*h fp32 over 2 ranks
    assert comm.seconds == pytest.approx(2 * one) and comm.source.kind == "modelled"
    assert pred.missing[0]["command"].startswith("torchrun --standalone --nproc-per-node=2 -m autotuner.main")
    assert "modelled" in pred.tp_note
    # rows measured under torchrun at tp=2: their collectives are inside, nothing is added
    tp_rows = [row("transformer_layer", ph, us, tp=2) for ph, us in (("forward", 700), ("backward", 1300))]
    runs2 = load_runs([make_run(tmp_path, base_rows() + tp_rows, "run2", calibration=cal)])
    pred2 = predict(runs2, Layout(seq_len=32, tp=2, global_batch_size=1, dtype="fp32"), cal)
    names = [n for n, *_ in pred2.stages[0].items]
    assert "tp_collectives:transformer_layer" not in names and "measured" in pred2.tp_note


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        (["tp=3"], "does not divide the 4 attention heads"),
        (["pp=3"], "does not divide the 4 layers"),
        (["pp=3", "first_stage_layers=1"], "leaves 3 of the 4 layers to the 2 other pipeline ranks"),
        (["pp=2", "first_stage_layers=2", "last_stage_layers=1"], "must add up to the 4 layers"),
        (["first_stage_layers=2"], "needs pipeline parallelism"),
        (["pp=2", "vpp=2", "global_batch_size=2", "last_stage_layers=1"], "each must be a multiple of 2"),
        (["global_batch_size=3", "dp=2"], "not a multiple"),
        (["bogus=1"], "unknown setting"),
        (["recompute=some"], "recompute"),
    ],
)
def test_bad_layout_is_one_line_and_exit_2(tmp_path, capsys, settings, words):
    run_dir = make_run(tmp_path, base_rows())
    assert main([str(run_dir), "seq_len=32", *settings]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autotuner-predict: error:") and words in err[0], err
    assert not (run_dir / "prediction.json").exists()


@pytest.mark.slow
def test_a_real_tiny_run_end_to_end(tmp_path, capsys):
    from autotuner.main import run

    run_dir = tmp_path / "tiny"
    ops = "ops=[transformer_layer,embedding,final_layernorm,output_layer]"
    fast = ["timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3"]
    args = [
        "case=tiny",
        "shapes.seq_len=[32]",
        "shapes.micro_batch_size=[1]",
        "progress=false",
        "report=false",
    ]
    assert run([*args, ops, *fast, f"hydra.run.dir={run_dir}"]) == 0
    out = tmp_path / "p.json"
    assert main([str(run_dir), "seq_len=32", "pp=2", "global_batch_size=4", f"json={out}"]) == 0
    text = capsys.readouterr().out
    assert "step time" in text and "memory per GPU" in text
    pred = json.loads(out.read_text())
    ((_, _, layer, count),) = [
        i for i in pred["stages"][0]["items"] if i[:2] == ["transformer_layer", "forward"]
    ]
    assert layer["source"]["kind"] == "measured" and layer["seconds"] > 0 and count == 1
    (measured,) = [
        r
        for r in load_rows(run_dir / "results.jsonl")
        if (r["op"], r["phase"]) == ("transformer_layer", "forward")
    ]
    assert layer["seconds"] == pytest.approx(measured["fenced_mean_us"] * US)  # what a step adds per visit
    assert pred["memory"][0]["activations"]["source"]["kind"] == "measured"
    assert pred["derived"]["step_s"] > pred["step"]["pipeline"] > 0
    # all measured at the point, warm (the profile's default) where the step wants them flushed (no cache
    # size calibrated): said, and what to run is the flushed profile alone
    assert any("measured with warm caches" in w for w in pred["derived"]["warnings"])
    assert pred["missing"] and all("timing.flush_cache=true" in m["command"] for m in pred["missing"])
    # the real stages differ (the output layer and loss on the last), so the simulated schedule ends
    # before the closed form that paces every stage at the slowest; the bubble (p-1)/m = 1/4 shrinks
    step, slowest = pred["step"], pred["stages"][pred["step"]["slowest_stage"]]
    compute = 4 * (slowest["forward"] + slowest["backward"])
    assert compute < step["pipeline"] < step["closed_form"] == pytest.approx(compute * (1 + 1 / 4))
    assert 0 < step["bubble_fraction"] < 1 / 4 and len(step["schedule"]["placed"]) == 2 * 2 * 4


def test_adam_pays_its_zero_state_rate_for_embedding_rows_no_token_touches(tmp_path):
    """An untied embedding's rows that no token of the global batch touches keep zero gradients and
    moments, which torch's CPU Adam steps slower (autotuner.calibrate.adam_zero_state_seconds): the first
    stage pays the calibrated rate for them, the step waits for the slowest stage's Adam."""
    import dataclasses

    import torch

    from autotuner.predict.inputs import ModelShape

    layout = Layout(seq_len=32, global_batch_size=2, dtype="fp32")  # 64 tokens a step
    cal = {**CAL, "adam_seconds_per_parameter": 2e-9, "adam_seconds_per_tensor": 5e-5}
    zero_cal = {**cal, "adam_seconds_per_zero_state_parameter": 3e-9}
    plain = predict(load_runs([make_run(tmp_path, base_rows(), "plain", cal)]), layout, cal)
    runs = load_runs([make_run(tmp_path, base_rows(), "zero", zero_cal)])
    zero = predict(runs, layout, zero_cal)
    # the expected untouched rows against the validation's own draws (autotuner.validate.stage_trainer:
    # torch.randint over the vocabulary), counted over many global batches
    generator = torch.Generator().manual_seed(0)
    counted = [VOCAB - len(torch.randint(VOCAB, (64,), generator=generator).unique()) for _ in range(4000)]
    model = ModelShape.from_environment(runs.env)
    untouched = model.untouched_embedding_params(1, 64)
    assert untouched == pytest.approx(sum(counted) / len(counted) * H, rel=0.01)
    assert 0.9 * VOCAB * H < untouched < VOCAB * H  # 64 tokens touch at most 64 of 1024 rows
    assert zero.step.optimizer == pytest.approx(plain.step.optimizer + untouched * 3e-9)
    assert "ns per parameter whose moments are zero" in zero.step.optimizer_source.detail
    # a table tied to the output layer gets a gradient in every row
    tied = dataclasses.replace(model, tie_embeddings=True)
    assert tied.untouched_embedding_params(1, 64) == 0.0
    # PP2: the first stage holds the table; at a rate this high its Adam is the step's
    pp = Layout(seq_len=32, pp=2, global_batch_size=2, dtype="fp32")
    slow_cal = {**cal, "adam_seconds_per_zero_state_parameter": 1e-6}
    slow = predict(load_runs([make_run(tmp_path, base_rows(), "slow", slow_cal)]), pp, slow_cal)
    stage0_tensors = 2 * 6 + 1  # two layers of six, the embedding
    zeroing = 4 * STAGE0_PARAMS / CAL["memory_bandwidth"]
    expected = STAGE0_PARAMS * 2e-9 + stage0_tensors * 5e-5 + untouched * 1e-6 + zeroing
    assert slow.step.optimizer == pytest.approx(expected)
    # the distributed optimizer over dp=2: the rank whose share holds the rows pays them, up to its share
    shares = Layout(seq_len=32, dp=2, global_batch_size=2, dtype="fp32", distributed_optimizer=True)
    sharded = predict(load_runs([make_run(tmp_path, base_rows(), "shares", slow_cal)]), shares, slow_cal)
    params = 4 * LAYER_PARAMS + H + 2 * VOCAB * H
    expected = params / 2 * 2e-9 + 5e-5 + min(untouched, params / 2) * 1e-6 + 4 * params / 1e10
    assert sharded.step.optimizer == pytest.approx(expected)


def test_adam_inside_training_steps_is_what_its_back_to_back_rates_leave_once_a_step():
    """autotuner.calibrate.adam_in_step, by hand: each timed step's optimizer phase less the rates' share
    (per tensor, per parameter, and the gradients' zeroing at the calibrated zeroing rate, else the copy
    bandwidth), median over the steps of every depth; the warm-up and metered steps left out."""
    from autotuner.calibrate import adam_in_step
    from autotuner.validate.step_measurement import RankSteps, StepMeasurement

    rates = {"adam_seconds_per_tensor": 2e-5, "adam_seconds_per_parameter": 2e-9, "memory_bandwidth": 4e9}

    def depth(tensors: int, params: int, timed: tuple[float, ...]) -> StepMeasurement:
        steps = (9.0, 0.0, *timed)  # a warm-up step and the metered one: never counted
        rank = RankSteps(0, 0, 0, 0, steps, steps, steps, (), 4 * params, 0, 0, optimizer_tensors=tensors)
        layout = Layout(seq_len=32, global_batch_size=4, dtype="fp32")
        return StepMeasurement("tiny", (), layout, (), 1, len(timed), "cpu", "", "", (rank,))

    # one layer: 9 tensors, 10,000 parameters, the rates give 180 + 20 + 10 us; four layers: 27 and
    # 40,000, 540 + 80 + 40 us
    shallow = depth(9, 10_000, (710e-6, 760e-6, 690e-6))  # 500, 550, 480 us beyond
    deep = depth(27, 40_000, (1160e-6, 1190e-6, 1500e-6))  # 500, 530, 840 us beyond
    assert adam_in_step([(1, shallow), (4, deep)], rates) == pytest.approx(515e-6)
    # zeroing timed at half the copy rate: 10 us more of it per 10,000 parameters, that much less beyond
    slower_zeroing = {**rates, "zeroing_bandwidth": 2e9}
    assert adam_in_step([(1, shallow), (4, deep)], slower_zeroing) == pytest.approx(515e-6 - 25e-6)
    # steps no slower than the rates: nothing added, never a negative time
    assert adam_in_step([(1, depth(9, 10_000, (100e-6, 150e-6)))], rates) == 0.0


@pytest.mark.slow  # times real Adam steps and the zeroing of a 64 MiB buffer
def test_calibration_times_adam_per_parameter_and_per_tensor_and_checks_the_new_entries(tmp_path):
    import torch

    from autotuner.calibrate import (
        ADAM_LAYERS,
        MATMUL_SIZE,
        adam_rates,
        adam_zero_state_seconds,
        grad_accumulation_seconds,
        zeroing_bandwidth,
    )
    from autotuner.errors import UserError
    from autotuner.measure.timer import SamplingPolicy
    from autotuner.results.calibration import HOST_WORK_PARTS, load

    policy = SamplingPolicy(warmup=1, min_samples=3, max_samples=5, budget_s=0.5, target_rel_ci=0.5)
    per_parameter, per_tensor, count = adam_rates(torch.device("cpu"), policy)
    # zeroing a buffer past the cache writes each byte once: slower than no memory, faster than a bus
    buffer = torch.ones(2**26, dtype=torch.uint8)
    zeroing = zeroing_bandwidth(buffer, torch.device("cpu"), policy)
    assert 1e8 < zeroing < 1e13 and not buffer.any()
    h, f, layers = ADAM_LAYERS["cpu"]
    assert count == layers * (3 * h * h + h * h + 2 * f * h + h * f)
    # an Adam step reads and writes at least 28 B per fp32 parameter: not faster than the copy ceiling
    assert 28 / 1e12 < per_parameter < 1e-6
    # torch's Adam on a CPU loops over the tensors, a dozen small ops each: under a millisecond. Solved
    # from two timed steps, it reads 0 where load slowed the large step more than the small one (never
    # below): its size on a quiet machine is benchmarks.adam_in_step's figure, not a test's.
    assert 0 <= per_tensor < 1e-3
    # zero gradients and moments: what a step takes more a parameter, a time like per_parameter's (never
    # negative, under the same ceiling). Its size beside the step's own varies with the machine's load:
    # that figure is benchmarks.adam_in_step's, not a test's.
    zero_state = adam_zero_state_seconds(torch.device("cpu"), policy, per_parameter, per_tensor)
    assert 0 <= zero_state < 1e-6
    seconds = per_parameter * count
    nbytes = 2**24
    added = grad_accumulation_seconds(torch.device("cpu"), policy, nbytes)
    assert set(added) == set(MATMUL_SIZE["cpu"])
    # reading the gradient and reading and writing the fp32 one: at least 10 B a parameter, not above 1 TB/s
    assert all(10 / 1e12 < rate < 1e-6 for rate in added.values()), added
    good = {
        **CAL,
        "adam_seconds_per_parameter": seconds / count,
        "warm_cache_bytes": 2**25,
        "grad_accumulation_seconds_per_parameter": added,
        "zeroing_bandwidth": zeroing,
    }
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert load(tmp_path / "good.json")["adam_seconds_per_parameter"] == pytest.approx(seconds / count)
    good["adam_seconds_per_tensor"] = per_tensor
    good["adam_seconds_per_zero_state_parameter"] = zero_state
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert load(tmp_path / "good.json")["adam_seconds_per_tensor"] == per_tensor
    assert load(tmp_path / "good.json")["adam_seconds_per_zero_state_parameter"] == zero_state
    for key, value in (
        ("adam_seconds_per_parameter", -1),
        ("adam_seconds_per_tensor", -1e-6),
        ("adam_seconds_per_tensor", "slow"),
        ("adam_seconds_per_zero_state_parameter", -1e-9),
        ("adam_seconds_per_zero_state_parameter", "slow"),
        ("adam_seconds_per_step_in_training", -1e-4),
        ("adam_seconds_per_step_in_training", True),
        ("warm_cache_bytes", "big"),
        ("zeroing_bandwidth", 0),
        ("zeroing_bandwidth", "fast"),
        ("grad_accumulation_seconds_per_parameter", {"bf16": 0}),
        ("grad_accumulation_seconds_per_parameter", 3e-12),
        ("host_work_seconds_per_microbatch", {"forward": 1e-4, "backward": 3e-4}),
        ("host_work_seconds_per_microbatch", dict.fromkeys(HOST_WORK_PARTS, -1e-4)),
        ("host_work_seconds_per_microbatch_flushed", {"forward": 1e-4}),
    ):
        (tmp_path / "bad.json").write_text(json.dumps({**good, key: value}))
        with pytest.raises(UserError, match=key):
            load(tmp_path / "bad.json")


def test_memory_in_flight_and_the_saved_bytes_beside_the_layers(tmp_path):
    sizes = {  # op: (activation_bytes, forward peak_bytes, backward peak_bytes)
        "embedding": (100, 150, 1000),
        "transformer_layer": (5000, 6000, 4000),
        "final_layernorm": (50, 60, 70),
        "output_layer": (2000, 2500, 900),
    }
    rows = []
    for r in base_rows():
        saved, forward, backward = sizes[r["op"]]
        extra = {"activation_bytes": saved, "peak_bytes": forward} if r["phase"] == "forward" else {}
        rows.append({**r, **extra, **({"peak_bytes": backward} if r["phase"] == "backward" else {})})
    pred = predict(load_runs([make_run(tmp_path, rows)]), Layout(seq_len=32, dtype="fp32"), CAL)
    (m,) = pred.memory
    assert m.activations.value == pytest.approx(4 * 5000 + 100 + 50)
    assert m.logits.value == 2000 and m.logits.source.kind == "measured"
    # a backward's peak is net of what it frees of its own (the meter sees those frees): the last layer's
    # 4000 B, while the final norm and output layer have freed their 2050 B, beats the output layer's
    # forward beyond what it saves (2500 - 2000) and its backward (900); the embedding's backward runs
    # with everything after it freed (1000 - 22050)
    assert m.in_flight.value == pytest.approx(4000 - 2050) and m.in_flight.source.kind == "measured"
    params = 4 * LAYER_PARAMS + H + 2 * VOCAB * H  # fp32: weights, gradients, Adam's two states, 4 B each
    assert m.resident == pytest.approx(params * 16) and m.forward_backward == pytest.approx(
        20150 + 2000 + 1950
    )
    # at a TP without rows, the TP=1 rows' share: each rank holds 1/tp of what the split ops allocate
    # (it read 0 B, "no rows ... add nothing", beside activations scaled from the same rows)
    at_tp2 = predict(load_runs([tmp_path / "run"]), Layout(seq_len=32, tp=2, dtype="fp32"), CAL).memory[0]
    assert at_tp2.in_flight.value == pytest.approx((4000 - 2050) / 2)
    assert (
        at_tp2.in_flight.source.kind == "scaled"
        and "from rows at a smaller TP, divided by the ratio to tp=2" in at_tp2.in_flight.source.detail
    )
    # an output layer whose backward outgrows that decides instead, with nothing freed behind it
    rows = [
        {**r, "peak_bytes": 9000} if (r["op"], r["phase"]) == ("output_layer", "backward") else r
        for r in rows
    ]
    pred = predict(load_runs([make_run(tmp_path, rows, "big")]), Layout(seq_len=32, dtype="fp32"), CAL)
    assert pred.memory[0].in_flight.value == pytest.approx(9000)


def test_a_run_without_its_environment_is_its_cases_model_only_if_its_layer_rows_are(tmp_path, capsys):
    """Without environment.json a run is predicted at the sizes of the case its rows name, as published;
    a run made at other sizes (hf.* overrides) was predicted as the stock model from rows of another."""
    rows = [{**r, "case": "tiny"} for r in base_rows()]  # the synthetic layer is tiny's (46208 parameters)
    same = make_run(tmp_path, rows, "same")
    (same / "environment.json").unlink()
    pred = predict(load_runs([same]), Layout(seq_len=32, global_batch_size=2, dtype="fp32"), CAL)
    assert pred.model.case == "tiny" and pred.model.layer_params == LAYER_PARAMS
    assert any("no environment.json: the model is case tiny's as published" in n for n in pred.warnings)
    wider = [{**r, "weight_bytes": 2 * r["weight_bytes"]} if r.get("weight_bytes") else r for r in rows]
    other = make_run(tmp_path, wider, "other")
    (other / "environment.json").unlink()
    assert main([str(other), "seq_len=32", "global_batch_size=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"holds {2 * LAYER_PARAMS} parameters, not the {LAYER_PARAMS}" in err[0], err
    assert "restore the run's environment.json" in err[0]
    # a TP rank's row holds half the layer (its norms whole): the same model at tp=2, another at twice that
    from autotuner.errors import UserError

    rank_bytes = ((LAYER_PARAMS - 128) / 2 + 128) * 4  # fp32; the layer's two RMSNorms hold 2 x 64

    def at_tp2(name: str, factor: int) -> Path:
        rows_tp2 = [
            {
                **r,
                "tensor_parallel": 2,
                **({"weight_bytes": factor * rank_bytes} if "weight_bytes" in r else {}),
            }
            for r in rows
        ]
        run_dir = make_run(tmp_path, rows_tp2, name)
        (run_dir / "environment.json").unlink()
        return run_dir

    assert load_runs([at_tp2("tp2", 1)]).rows
    with pytest.raises(UserError, match="not the 46208 of case tiny"):
        load_runs([at_tp2("tp2x2", 2)])


@pytest.mark.parametrize("name", ["results.jsonl", "environment.json", "results.csv", "calibration.json"])
def test_an_output_never_replaces_the_records_of_a_run_it_reads(tmp_path, capsys, name):
    """json= (predict), oss_json= (compare): a path naming a record of an input run was overwritten."""
    from autotuner.compare import main as compare_main

    run_dir = make_run(tmp_path, base_rows())
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    target = str(run_dir / ".." / run_dir.name / name)  # however it is spelled
    assert main([str(run_dir), "seq_len=32", "global_batch_size=2", f"json={target}"]) == 2
    assert compare_main([str(run_dir), str(run_dir), "labels=[a,b]", f"oss_json={target}"]) == 2
    for line in capsys.readouterr().err.strip().splitlines():
        assert f"is the run's own {name}" in line and "give another file name" in line, line
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    # nor the run's report, by the page beside a JSON named report.json
    assert main([str(run_dir), "seq_len=32", "global_batch_size=2", f"json={run_dir / 'report.json'}"]) == 2
    assert "is the run's own report.html" in capsys.readouterr().err
    # the page goes beside the JSON with .html: a JSON named so was replaced by its page
    assert main([str(run_dir), "seq_len=32", "global_batch_size=2", f"json={tmp_path / 'p.html'}"]) == 2
    assert "give a .json name" in capsys.readouterr().err and not (tmp_path / "p.html").exists()


@pytest.mark.slow
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    """``autotuner-predict ... | head -1``: a closed pipe ends it with SIGPIPE's status, no traceback."""
    import subprocess
    import sys

    run_dir = make_run(tmp_path, base_rows())
    command = [sys.executable, "-m", "autotuner.predict", str(run_dir), "seq_len=32", "global_batch_size=2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_the_adam_steps_own_memory_and_the_peak_of_the_two_phases(tmp_path):
    """Adam's step allocates after the forward-backward has freed its terms, so the peak is the resident
    states plus the larger of the two phases' own: torch.optim.Adam over CUDA tensors (foreach) makes an fp32
    copy of every exp_avg_sq at once, on the CPU it steps one tensor at a time with two temporaries of it."""
    params = 4 * LAYER_PARAMS + H + 2 * VOCAB * H
    layout = Layout(seq_len=32, dtype="fp32")
    cpu = predict(load_runs([make_run(tmp_path, base_rows())]), layout, CAL).memory[0]
    # the largest tensor here is a vocabulary table (VOCAB x H), not the gated fc1 (2 x 176 x H)
    assert cpu.optimizer_step.value == 8 * VOCAB * H > 8 * 2 * 176 * H
    cuda_rows = [{**r, "device": "cuda"} for r in base_rows()]
    gpu_pred = predict(load_runs([make_run(tmp_path, cuda_rows, "cuda")]), layout, CAL)
    gpu = gpu_pred.memory[0]
    # (the CPU's calibration beside GPU rows is said: what is modelled from it is another machine's)
    assert any(
        "the calibration is of a cpu device, the rows were profiled on cuda" in w for w in gpu_pred.warnings
    )
    assert gpu.optimizer_step.value == 4 * params and "_foreach_sqrt" in gpu.optimizer_step.source.detail
    for m in (cpu, gpu):
        assert m.resident == pytest.approx(params * 16)
        assert m.total == pytest.approx(m.resident + max(m.forward_backward, m.optimizer_step.value))
    assert gpu.optimizer_step.value > gpu.forward_backward and gpu.total == pytest.approx(params * 20)
    # the device is the runs', also where no row is of the layout's dtype (every time then modelled)
    other_dtype = predict(load_runs([tmp_path / "cuda"]), Layout(seq_len=32, dtype="bf16"), CAL).memory[0]
    assert "_foreach_sqrt" in other_dtype.optimizer_step.source.detail
    # a middle pipeline stage holds no vocabulary table: its largest tensor is the gated fc1
    runs = load_runs([make_run(tmp_path, base_rows(), "pp4")])
    middle = predict(runs, Layout(seq_len=32, pp=4, global_batch_size=4, dtype="fp32"), CAL).memory[1]
    assert middle.optimizer_step.value == 8 * 2 * 176 * H
    pred = predict(load_runs([make_run(tmp_path, base_rows(), "again")]), layout, CAL)
    assert pred.to_json()["memory"][0]["optimizer_step"]["value"] == cpu.optimizer_step.value
    assert "Adam step" in render(pred)


H200 = Path(__file__).parent / "fixtures" / "h200_llama7b"


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_predictions_from_an_h200_profile_meet_the_steps_measured_there(recompute):
    """Recorded on an H200 (tests/fixtures/h200_llama7b/steps.json, docs/gpu_validation.md): a 4-layer profile
    of a Llama-2-7B-shaped model and the real steps of the model as deep as num_layers=fit chose. With
    recompute the forward-backward holds little, and Adam's foreach step (a 4 B copy of every parameter's
    exp_avg_sq) is the peak: predicted without it, 32 layers were said to fit and the steps ran out of
    memory in torch._foreach_sqrt."""
    from autotuner.predict.inputs import ModelShape
    from autotuner.predict.prediction import deepest_that_fits, load_calibration_for

    record = json.loads((H200 / "steps.json").read_text())
    measured = record["steps"][recompute]
    runs = load_runs([H200 / "profile"])
    layout = Layout(**record["layout"], recompute=recompute)
    model = deepest_that_fits(runs, layout, ModelShape.from_environment(runs.env), record["gpu_memory_gb"])
    assert model.num_layers == measured["num_layers"]
    pred = predict(runs, layout, load_calibration_for(runs, None), model)
    (memory,) = pred.memory
    assert memory.total == pytest.approx(measured["peak_bytes"], rel=0.01)
    assert (memory.optimizer_step.value > memory.forward_backward) == (recompute != "none")
    assert pred.step.total == pytest.approx(measured["step_s"], rel=0.03)
    # what only the CPU validation host has is not in a GPU's prediction: no zero-moment Adam rows (a
    # GPU's Adam moves the same bytes whatever their values), no line of which visits found a warm cache
    # when none does (each row's source says it is a flushed one)
    assert "moments are zero" not in pred.step.optimizer_source.detail
    assert "adam_seconds_per_zero_state_parameter" not in pred.calibration_figures
    assert pred.cache_note == "" and "  cache " not in render(pred)


def test_prediction_json_round_trips_and_another_schema_version_is_refused(tmp_path):
    """prediction.json is the Prediction's fields (dataclasses.asdict) under a schema version: read back,
    it is the same Prediction, every nested record its own type again (the H200 fixture's, and a CPU
    pipeline's with its profiling plan, link gaps, Megatron's report and a GPU memory check)."""
    from autotuner.predict.prediction import Prediction, load_calibration_for
    from autotuner.results.prediction_record import SCHEMA_VERSION

    h200 = load_runs([H200 / "profile"])
    layout = Layout(seq_len=32, pp=2, dp=2, global_batch_size=8, dtype="fp32")
    cpu = predict(load_runs([make_run(tmp_path, base_rows())]), layout, CAL).against_gpu_memory(0.001)
    gpu = predict(
        h200,
        Layout(**json.loads((H200 / "steps.json").read_text())["layout"]),
        load_calibration_for(h200, None),
    )
    assert cpu.plan is not None and cpu.plan.runs and cpu.link_gaps and cpu.megatron_report
    for pred in (cpu, gpu):
        record = json.loads(json.dumps(pred.to_json()))
        assert record["schema_version"] == SCHEMA_VERSION and record["derived"]["step_s"] == pred.step.total
        assert Prediction.from_json(record) == pred
        assert Prediction.from_json({**record, "validation": {"step_error": 0.1}}) == pred
    for version in (None, SCHEMA_VERSION + 1):
        with pytest.raises(
            UserError, match=f"schema_version {version or 1}, this autotuner reads"
        ) as refused:
            Prediction.from_json({**record, "schema_version": version} if version else {"layout": {}})
        assert len(str(refused.value).splitlines()) == 1


def _moe_run(tmp_path: Path, rows: list[dict], name: str, ep: int, cal: dict) -> Path:
    """A run of a Mixtral-shaped variant of the synthetic model (8 experts of 32, top-2) at ``ep``."""
    run_dir = make_run(tmp_path, rows, name, calibration=cal)
    tc = {**TC, "num_moe_experts": 8, "moe_ffn_hidden_size": 32, "moe_router_topk": 2}
    tc["expert_model_parallel_size"] = ep
    env = {
        "case": "synthetic",
        "dtype": "fp32",
        "transformer_config": tc,
        "model_args": {"vocab_size": VOCAB},
    }
    (run_dir / "environment.json").write_text(json.dumps(env))
    return run_dir


def test_expert_parallel_layouts_from_ep1_rows_or_measured_at_their_ep(tmp_path):
    cal = {**CAL, "all_gather_bandwidth": {"gloo:2": 1e9}, "reduce_scatter_bandwidth": {"gloo:2": 5e8}}
    layer_ops = {"input_layernorm": 10, "self_attention": 500, "self_attn_bda": 5, "pre_mlp_layernorm": 10}
    layer_ops |= {"mlp_bda": 5, "router": 50, "token_dispatch": 100, "experts": 600, "token_combine": 80}
    moe = {"token_dispatcher": "alltoall"}
    rows = [{k: v for k, v in r.items() if k != "weight_bytes"} for r in base_rows()]
    rows += [row(op, ph, us, **moe) for op, us in layer_ops.items() for ph in ("forward", "backward")]
    rows += [row(op, ph, 0, status="skipped") for op in ("mlp", "shared_experts") for ph in ("forward",)]
    single = _moe_run(tmp_path, rows, "ep1", 1, cal)
    layout = Layout(seq_len=32, dp=2, ep=2, global_batch_size=2, dtype="fp32")
    pred = predict(load_runs([single]), layout, cal)
    # the ep=1 layer row does not stand for ep=2: the sum of the sub-ops, experts halved, each exchange
    # an all-to-all of s*b*top-k*h fp32 timed as an all-gather of it over 2 ranks; the forward dispatch
    # also gathers the 2 ranks' 8 tokens-per-expert counts (int64) and exchanges the s*b*top-k probabilities
    exchange = (2 - 1) / 2 * (32 * 1 * 2 * 64 * 4) / 1e9
    small = (2 - 1) / 2 * (2 * 8 * 8 + 32 * 2 * 4) / 1e9
    layer = pred.stages[0].items[0][2]
    expected = (10 + 500 + 5 + 10 + 5 + 50 + 100 + 600 / 2 + 80) * US + 2 * exchange + small
    assert layer.seconds == pytest.approx(expected) and layer.source.kind == "modelled"
    assert layer.parts["experts"] == pytest.approx(300 * US)
    assert pred.missing and "tf.expert_model_parallel_size=2" in pred.missing[0]["command"]
    # the routed experts' parameters are split over ep: 8 experts x (64*2*32 + 32*64), half on each rank
    same = predict(load_runs([single]), Layout(seq_len=32, dp=2, global_batch_size=2, dtype="fp32"), cal)
    assert same.memory[0].params.value - pred.memory[0].params.value == pytest.approx(4 * 8 * 6144 / 2)
    # DP reduction: the dense gradients over dp=2; at ep=2 the experts' group is tp*dp/ep = 1 rank (each
    # expert lives on one rank): not reduced, where at ep=1 every gradient is
    cal_ar = {**cal, "all_reduce_bandwidth": {"gloo:2": 1e9}}
    reduced = {
        ep: predict(
            load_runs([single]), Layout(seq_len=32, dp=2, ep=ep, global_batch_size=2, dtype="fp32"), cal_ar
        )
        for ep in (1, 2)
    }
    params = {ep: reduced[ep].memory[0].params.value for ep in (1, 2)}
    routed_at_ep2 = 4 * 8 * 6144 / 2  # 4 layers, 8 experts of 6144 parameters each, half on a rank
    for ep, grads in ((1, params[1]), (2, params[2] - routed_at_ep2)):
        assert reduced[ep].step.dp_reduction == pytest.approx(2 * (2 - 1) / 2 * grads * 4 / 1e9)
    assert "expert grads: 1 rank, nothing to reduce" in reduced[2].step.dp_source.detail
    # the distributed optimizer shards each kind of state over its own group: the dense ones over dp=2,
    # the experts' over their tp*dp/ep = 1 rank (not at all), as the measured steps hold them
    zero = predict(
        load_runs([single]),
        Layout(seq_len=32, dp=2, ep=2, global_batch_size=2, dtype="fp32", distributed_optimizer=True),
        cal_ar,
    )
    dense = params[2] - routed_at_ep2
    assert zero.memory[0].optimizer.value == pytest.approx(8 * (dense / 2 + routed_at_ep2))
    assert "/ dp=2, experts' / 1" in zero.memory[0].optimizer.source.detail
    assert f"x {dense / 2 + routed_at_ep2:.4g} params" in zero.step.optimizer_source.detail
    # the all-gather dispatcher instead: forward dispatch gathers all ranks' routing maps (bool),
    # probabilities (fp32) and s*b*h tokens, combine reduce-scatters
    gathered = [{**r, "token_dispatcher": "allgather"} if r["op"] in layer_ops else r for r in rows]
    allgather = predict(load_runs([_moe_run(tmp_path, gathered, "ag", 1, cal)]), layout, cal)
    gather, scatter = (0.5 * 2 * 32 * 64 * 4 / bw for bw in (1e9, 5e8))
    routing = 0.5 * 2 * 32 * 8 * (1 + 4) / 1e9
    expected = (10 + 500 + 5 + 10 + 5 + 50 + 100 + 600 / 2 + 80) * US + gather + scatter + routing
    assert allgather.stages[0].items[0][2].seconds == pytest.approx(expected)
    # its backward: dispatch reduce-scatters the tokens' and probabilities' gradients, combine all-gathers
    backward = next(
        t for n, p, t, _ in allgather.stages[0].items if (n, p) == ("transformer_layer", "backward")
    )
    probs_grad = 0.5 * 2 * 32 * 8 * 4 / 5e8
    assert backward.parts["token_combine_exchange"] == pytest.approx(gather)
    assert backward.parts["token_dispatch_exchange"] == pytest.approx(scatter + probs_grad)
    assert backward.seconds - (10 + 500 + 5 + 10 + 5 + 50 + 100 + 300 + 80) * US == pytest.approx(
        gather + scatter + probs_grad
    )
    # rows measured at ep=2 under torchrun stand for themselves, collectives inside
    at_ep = [row("transformer_layer", "forward", 700), row("transformer_layer", "backward", 1400)]
    measured = predict(load_runs([single, _moe_run(tmp_path, at_ep, "ep2", 2, cal)]), layout, cal)
    layer = measured.stages[0].items[0][2]
    assert layer.seconds == pytest.approx(700 * US) and layer.source.kind == "measured"


def test_the_accuracy_benchmark_judges_the_median_by_its_confidence_interval():
    """benchmarks.predict_accuracy's verdict: the median's 95% interval over the rounds inside the 5% band
    is met, wholly outside it missed, across an edge inconclusive; fewer than 6 rounds give no interval."""
    from benchmarks.predict_accuracy import verdict

    assert verdict([0.97, 0.98, 1.0, 1.01, 0.99, 1.02]) == ("met", (0.97, 1.02))
    assert verdict([0.80, 0.85, 0.90, 0.88, 0.86, 0.84]) == ("missed", (0.80, 0.90))
    assert verdict([1.06, 1.2, 1.1, 1.08, 1.3, 1.07]) == ("missed", (1.06, 1.3))
    # a median of 1.0 whose interval reaches 0.90: the rounds cannot tell a 5% error from none
    assert verdict([0.90, 1.0, 1.02, 0.97, 1.01, 0.99])[0] == "inconclusive"
    assert verdict([1.0, 1.0, 1.0]) == ("too few rounds", None)
    # more rounds narrow the interval to inner order statistics: one outlier each side no longer decides
    assert verdict([0.80, 0.97, 0.98, 0.99, 1.0, 1.01, 1.02, 1.20]) == ("met", (0.97, 1.02))


def test_the_accuracy_benchmark_spreads_its_step_draws_between_a_rounds_profiles():
    """benchmarks.predict_accuracy measures a round's steps ``--step-draws`` times: before every profile,
    after them all, and the rest between them, as evenly as whole profiles allow."""
    from benchmarks.predict_accuracy import STEP_DRAWS, draw_points

    assert draw_points(3, 2) == []  # before and after alone
    assert draw_points(3, 3) == [2]  # warm, flushed | draw | warm again: the middle of the warm pair
    assert draw_points(6, 3) == [3]  # with the other span's three profiles around the round's own
    assert draw_points(6, 5) == [2, 3, 4]
    # more draws than gaps: some gaps get two, the one before the first profile included
    assert draw_points(3, 8) == [0, 1, 1, 2, 2, 3]
    assert STEP_DRAWS > 2


def test_the_accuracy_benchmark_pools_the_rounds_of_saved_runs(tmp_path: Path, capsys):
    """``--pool``: the round lines two runs printed, read back and judged as one run of all their rounds
    (three rounds each give no interval; six together do); a run at real-time priority (``--realtime``,
    its log's first line says so) is judged apart from them, not pooled with runs of the default."""
    from benchmarks.predict_accuracy import REALTIME, SCHEDULING, Round, main, round_line, round_parts

    def one(step: float, drift: float) -> Round:
        empty = dict.fromkeys(Round._fields)
        return Round(
            **{
                **empty,
                "step_ratio": step,
                "memory_ratio": 1.01,
                "predicted_s": step,
                "measured_s": 1.0,
                "drift": drift,
                "phases": (("forward-backward", 0.2, 0.21), ("optimizer", 0.023, 0.026)),
                "in_step": (
                    (0, "embedding forward", 1e-4, 3e-4, ""),
                    (0, "transformer_layer forward", 0.004, 0.0045, ""),
                    (0, "transformer_layer backward", 0.006, 0.0063, ""),
                    (1, "transformer_layer forward", 0.003, 0.0031, ""),
                ),
            }
        )

    # each round's parts follow its line in a log, and are not read back as rounds
    assert round_parts(one(1.0, 1.0)) == (
        "  ms, predicted/measured: forward-backward 200/210, optimizer 23/26; "
        "stage 0's layer per visit: forward 4.000/4.500, backward 6.000/6.300"
    )

    logs = []
    for run, steps in enumerate(([0.97, 1.02, 0.99], [1.01, 0.98, 1.03], [0.5, 0.5, 0.5])):
        lines = (
            [f"{SCHEDULING}: {REALTIME}"] if run == 2 else []
        )  # an older benchmark's logs have no such line
        lines += ["intra-op threads per process (profiles, steps, calibration): 1"]
        for i, step in enumerate(steps):
            said = one(step, 1.2 if i == 0 else 1.0)
            lines += [round_line(i + 1, 3, "tiny", "tp1", said), round_parts(said)]
        logs.append(tmp_path / f"run{run}.log")
        logs[-1].write_text("\n".join(lines) + "\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", ["predict_accuracy", "--pool", *map(str, logs)])
        assert main() == 0
    out = capsys.readouterr().out.strip()
    assert out.splitlines() == [
        "tiny         tp1     6 rounds: step 1.000 met (95% CI [0.970, 1.030]); memory 1.010 met (95% CI "
        "[1.010, 1.010]); calm rounds' step 1.005 (4); scheduling the kernel's default",
        "tiny         tp1     3 rounds: step 0.500 too few rounds; memory 1.010 too few rounds; calm rounds' "
        f"step 0.500 (2); scheduling {REALTIME}",
    ]


def test_the_ranking_benchmark_judges_the_order_by_the_measured_interval():
    """benchmarks.layout_ranking's verdict: the measured ratio's 95% interval wholly on the predicted side
    of 1 is right, wholly on the other wrong, holding 1 unresolved; fewer than 6 rounds, no interval."""
    from benchmarks.layout_ranking import order_verdict

    faster = [0.88, 0.90, 0.91, 0.93, 0.94, 0.95]
    assert order_verdict(0.9, faster) == ("right", (0.88, 0.95))
    assert order_verdict(1.1, faster) == ("wrong", (0.88, 0.95))
    assert order_verdict(1.1, [1.02, 1.05, 1.04, 1.2, 1.1, 1.08])[0] == "right"
    assert order_verdict(0.9, [0.9, 0.95, 1.0, 1.02, 1.05, 0.97])[0] == "unresolved"
    assert order_verdict(0.9, [0.9, 0.9]) == ("too few rounds", None)


def test_the_accuracy_benchmark_refuses_realtime_it_may_not_set(monkeypatch, capsys):
    """``--realtime`` where the system refuses SCHED_FIFO (a user without root or a real-time limit): a
    one-line error naming the fix and exit 2, before anything runs."""
    from benchmarks.predict_accuracy import main

    def refuse(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("os.sched_setscheduler", refuse)
    monkeypatch.setattr("sys.argv", ["predict_accuracy", "--realtime", "--cases", "tiny", "--rounds", "1"])
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "predict_accuracy: error: --realtime: this user may not set SCHED_FIFO: run as root, or raise "
        "ulimit -r to 1"
    )


# --- damaged inputs: one line, from the tools' one reader of each file ---------------------------------


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda e: e.pop("model_args"), "model_args.vocab_size is null"),  # a size the predictor needs
        (
            lambda e: e["transformer_config"].update(num_layers="two"),
            'transformer_config.num_layers is "two"',
        ),
        (lambda e: e["transformer_config"].update(num_layers=-2), "transformer_config.num_layers is -2"),
        (
            lambda e: e["transformer_config"].update(hidden_size=None),
            "transformer_config.hidden_size is null",
        ),
        (lambda e: e.update(transformer_config="x"), 'transformer_config is "x", not an object'),
        (lambda e: e.update(world_size="x"), 'world_size is "x"'),
        (lambda e: e.update(environment="x"), 'environment is "x", not an object'),
        # the memory walk is quadratic in the layers: a million ran for minutes
        (lambda e: e["transformer_config"].update(num_layers=10**6), "num_layers is 1000000, above 10000"),
    ],
)
def test_a_damaged_environment_record_is_one_line_in_every_tool(tmp_path, edit, message):
    from autotuner.compare import load_run as compare_load
    from autotuner.errors import UserError
    from autotuner.report.data import load_run as report_load

    run_dir = make_run(tmp_path, base_rows())
    env = json.loads((run_dir / "environment.json").read_text())
    edit(env)
    (run_dir / "environment.json").write_text(json.dumps(env))
    for load in (load_runs, compare_load, report_load):
        with pytest.raises(UserError) as refused:
            load([run_dir] if load is load_runs else run_dir)
        assert message in str(refused.value) and "restore it from the run" in str(refused.value)


def test_rows_with_a_nan_or_negative_time_or_size_are_refused_and_captured_calls_are_no_point(tmp_path):
    from autotuner.errors import UserError

    for column, bad, said in (
        ("median_us", float("nan"), "is nan; expected a time >= 0"),
        ("median_us", -5.0, "is -5.0; expected a time >= 0"),
        # an op's bytes: -5 was predicted as negative parameters, 1e30 as PiB of memory and an MFU of 0%
        ("weight_bytes", -5, "is -5; expected a size from 0 to 2\\^60 bytes"),
        ("weight_bytes", 1e30, "is 1e\\+30; expected a size"),
        ("activation_bytes", -1, "is -1; expected a size"),
        ("peak_bytes", float("inf"), "is inf; expected a size"),
    ):
        rows = base_rows()
        rows[0] = {**rows[0], column: bad}
        with pytest.raises(UserError, match=said):
            load_runs([make_run(tmp_path, rows, name=f"bad{column}{bad}")])
    # a run made with capture=FILE holds calls at no shape point: they are left out, the ops' rows kept
    rows = [
        *base_rows(),
        {**base_rows()[0], "op": "captured_linear", "seq_len": None, "micro_batch_size": None},
    ]
    runs = load_runs([make_run(tmp_path, rows, name="captured")])
    assert len(runs.rows) == len(base_rows())
    assert predict(runs, Layout(seq_len=32, global_batch_size=1, dtype="fp32"), CAL).step.pipeline > 0


def test_sizes_no_one_means_are_refused_before_any_work():
    """A typo's extra zeros: 10^6 micro-batches a step took a minute and 5 GB (each is simulated through
    the schedule); a sequence of 10^24 tokens printed PiB. tune skips layouts past the bound."""
    from autotuner.errors import UserError
    from autotuner.predict.layout import MAX_MICROBATCHES

    with pytest.raises(UserError, match=f"is 1000000 micro-batches a step .* above {MAX_MICROBATCHES}"):
        Layout(seq_len=16, pp=2, global_batch_size=10**6)
    with pytest.raises(UserError, match="seq_len=1000000000000000000000000 is above 16777216 tokens"):
        Layout(seq_len=10**24)
    assert Layout(seq_len=16, global_batch_size=MAX_MICROBATCHES).microbatches == MAX_MICROBATCHES


def test_runs_of_two_models_of_one_case_name_the_sizes_that_differ(tmp_path):
    from autotuner.errors import UserError

    first, other = make_run(tmp_path, base_rows(), "a"), make_run(tmp_path, base_rows(), "b")
    env = json.loads((other / "environment.json").read_text())
    env["transformer_config"]["hidden_size"] *= 2
    (other / "environment.json").write_text(json.dumps(env))
    with pytest.raises(UserError) as refused:
        load_runs([first, other])
    hidden = TC["hidden_size"]
    assert f"profiled another model (synthetic, hidden_size {2 * hidden}) than {first} (synthetic, " in str(
        refused.value
    ) and f"hidden_size {hidden}): pass runs of one model" in str(refused.value)


def _stage_kinds(pred) -> set[str]:
    return {t.source.kind for st in pred.stages for *_, t, _ in st.items} | {pred.step.optimizer_source.kind}


def test_a_cpu_prediction_without_a_calibration_takes_its_rows_figures_and_assumes_none(tmp_path):
    """Without a calibration a CPU prediction's rows are the measurement: the bandwidth the Adam step and
    the gradients' accumulation are priced at is the fastest any row moved its counted bytes at, said so
    (before: an assumed 10 GB/s); with no row of the dtype to take a peak from, one line naming what
    measures it (before: an assumed 1 TFLOP/s). Nothing it says speaks of a calibration it does not have."""
    rows = base_rows()
    rows[2]["bytes_moved"] = 4_000_000  # embedding forward, 100 us: 40 GB/s, the fastest
    rows[4]["bytes_moved"] = 100_000  # final_layernorm forward, 10 us: 10 GB/s
    runs = load_runs([make_run(tmp_path, rows, calibration=None)])
    pred = predict(runs, Layout(seq_len=32, global_batch_size=2, dtype="fp32"))
    params = pred.memory[0].params.value
    assert pred.step.optimizer == pytest.approx(params * 28 / 40e9)
    detail = pred.step.optimizer_source.detail
    assert "no calibration: the rows' fastest bytes moved, 40 GB/s (results.jsonl embedding.forward" in detail
    accumulated = {n: t for n, _, t, _ in pred.stages[0].items}["grad_accumulation"]
    assert accumulated.seconds == pytest.approx(params * 12 / 40e9)
    said = [*pred.warnings, pred.mfu_note, pred.cache_note, detail, accumulated.source.detail]
    assert not any("ASSUMED" in w or "assumed a peak" in w for w in said)
    assert not any(re.search(r"the calibration (did not|has|names|timed)", w) for w in said), said
    assert render(pred).splitlines()[1].startswith("calibration: none (a CPU prediction from CPU rows")
    with pytest.raises(UserError) as refused:
        predict(runs, Layout(seq_len=32, global_batch_size=2, dtype="bf16"))
    message = str(refused.value)
    assert message.startswith("no calibration, and no bf16 GEMM row in the runs to take a peak from")
    assert "python -m autotuner.calibrate device=cpu" in message and "dtype=bf16" in message


def test_the_warnings_about_rows_count_the_rows_the_times_came_from(tmp_path):
    """The layer measured whole: its sub-ops' rows apportion its time to the dominant op but give none of
    it. The warnings that count "the rows used" (warm rows standing in for flushed ones, rows whose
    samples spread widely) counted those too: "12 of the rows used" beside the 8 the sources name."""
    noisy = {"warnings": "noisy(iqr=40%)"}
    rows = base_rows()
    rows[0].update(noisy)  # transformer_layer forward, 4 of the stage's 13 ms: worth saying
    sub_ops = [row(op, ph, 300, **noisy) for op in ("self_attention", "mlp") for ph in PHASES]
    layout = Layout(seq_len=32, global_batch_size=2, dtype="fp32")
    pred = predict(load_runs([make_run(tmp_path, rows + sub_ops)]), layout, CAL)
    taken = {f"{r['op']}.{r['phase']}" for r in rows}
    assert {f"{n}.{p}" for n, p, t, _ in pred.stages[0].items if t.source.kind == "measured"} == taken
    assert pred.stages[0].dominant in ("self_attention", "mlp")  # the sub-ops' rows were consulted
    (warm,) = [w for w in pred.warnings if "measured with warm caches" in w]
    assert warm.startswith(f"{len(taken)} of the rows used (")
    # and the commands it points to are printed: the run that measures them as the step runs them
    assert "the commands printed for what is missing do" in warm
    (planned,) = pred.missing
    assert set(planned["figures"]) == taken and "timing.flush_cache=true" in planned["command"]
    (spread,) = [w for w in pred.warnings if "spread widely" in w]
    assert spread.startswith("1 of the rows used spread widely (transformer_layer.forward (iqr=40%))")


def test_a_prediction_without_rows_of_its_dtype_says_what_its_figures_come_from(tmp_path):
    """The note said "every time is modelled" beside an optimizer scaled from the calibration's timed Adam
    rate, and the memory in flight, from no row at all, was labelled scaled."""
    cal = {**CAL, "adam_seconds_per_parameter": 2e-9}
    runs = load_runs([make_run(tmp_path, base_rows(), calibration=cal)])
    pred = predict(runs, Layout(seq_len=32, global_batch_size=2, dtype="bf16"), cal)
    assert pred.step.optimizer_source.kind == "scaled"
    claims = [w for w in pred.warnings if "every time is modelled" in w]
    assert not claims or _stage_kinds(pred) == {"modelled"}, claims
    (note,) = [w for w in pred.warnings if "no ok rows in bf16" in w]
    assert "no time comes from a row" in note
    assert not any("results.jsonl" in t.source.detail for st in pred.stages for *_, t, _ in st.items)
    assert pred.memory[0].in_flight.source.kind == "modelled" and pred.memory[0].in_flight.value == 0


def test_a_layout_that_does_not_fit_the_gpu_says_so_and_tune_drops_it(tmp_path, capsys):
    run = make_run(tmp_path, base_rows())
    out = tmp_path / "p.json"
    argv = [str(run), "seq_len=32", "global_batch_size=2", "dtype=fp32", "report=false", f"json={out}"]
    assert main([*argv, "gpu_memory_gb=0.001"]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    fit, derived = record["memory_fit"], record["derived"]
    assert not derived["fits"] and fit["fullest_bytes"] == max(derived["memory_total_bytes"])
    assert derived["memory_limit_bytes"] == pytest.approx(0.001e9 * 0.9)
    said = (
        f"does not fit: the fullest GPU (stage 0) needs {fit['fullest_bytes'] / 1e9:.4g} GB "
        f"({human_bytes(fit['fullest_bytes'])}), more than gpu_memory_gb=0.001 less a 10% margin (0.0009 GB)"
    )
    assert f"memory against the GPU: {said}" in printed and derived["warnings"][0].startswith(said)
    assert printed.count(said) == 1  # said once, in the memory section
    assert main([*argv, "gpu_memory_gb=80"]) == 0
    assert "memory against the GPU: fits: the fullest GPU (stage 0) needs" in capsys.readouterr().out
    assert json.loads(out.read_text())["derived"]["fits"]
    # tune keeps what fits by the same rule, and lists no other
    from autotuner.tune import rank, table

    settings = {"gpus": 2, "global_batch_size": 4, "seq_len": 32, "dtype": "fp32", "gpu_memory_gb": 80}
    needs = sorted(r.memory_bytes for r in rank([str(run)], settings)[0])
    settings["gpu_memory_gb"] = (needs[0] + needs[-1]) / 2 / 0.9 / 1e9
    ranked, _ = rank([str(run)], settings)
    assert {r.fits for r in ranked} == {True, False}
    assert all(r.fits == r.prediction.memory_fit.fits for r in ranked)
    shown = table(ranked, top=len(ranked))
    assert all((r.prediction.layout.describe() in shown) == r.fits for r in ranked)


def test_the_predictor_and_the_validation_state_each_module_in_at_most_30_lines():
    """A module docstring says the contract and the why (the long explanations are docs/predict.md's)."""
    import ast

    package = Path(__file__).resolve().parents[1] / "autotuner"
    long = {}
    for path in sorted([*(package / "predict").glob("*.py"), *(package / "validate").glob("*.py")]):
        first = ast.parse(path.read_text()).body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            if (lines := first.end_lineno - first.lineno + 1) > 30:
                long[path.name] = lines
    assert long == {}
