"""Megatron's overlaps term by term, and context parallelism, in predict and tune: the pure rules on
hand-checkable times, then predictions from the H200 profile's real rows over the DGX H200 preset."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotuner.errors import UserError
from autotuner.predict.cluster import load
from autotuner.predict.layout import Layout
from autotuner.predict.overlap import (
    Part,
    bucket_size,
    buckets,
    context_attention,
    grad_reduce_end,
    param_gather_delay,
    tp_overlap_exposed,
)
from autotuner.predict.prediction import load_calibration_for, load_runs, predict, render

H200 = Path(__file__).parent / "fixtures" / "h200_llama7b" / "profile"


def test_buckets_and_the_reduction_stream():
    """Four parts of 1 s and 10 parameters each, buckets of 20: ready at 2 s and 4 s; collectives of 0.5
    s end at 2.5 and 4.5, the last 0.5 s after the backward; of 3 s, one after the other: 2 + 3 + 3."""
    parts = [Part("layer", 1.0, 10)] * 4
    assert [(b.params, b.ready) for b in buckets(parts, 20)] == [(20, 2.0), (20, 4.0)]
    assert grad_reduce_end(parts, 20, lambda params: 0.5) == 4.5
    assert grad_reduce_end(parts, 20, lambda params: 3.0) == 8.0
    assert bucket_size(8) == 40_000_000 and bucket_size(64) == 64_000_000  # Megatron's default


def test_the_parameter_gather_waits_for_the_first_bucket_and_hides_the_next_behind_its_compute():
    parts = [Part("layer", 1.0, 10)] * 4
    assert param_gather_delay(parts, 20, lambda params: 0.5) == 0.5  # the first gather alone
    assert param_gather_delay(parts, 20, lambda params: 3.0) == 3.0 + (3.0 - 2.0)  # the second outlasts 2 s
    assert param_gather_delay([], 20, lambda params: 1.0) == 0


def test_tp_overlap_and_the_context_parallel_ring():
    assert tp_overlap_exposed(4.0, 1.0, 4) == pytest.approx(0.25)  # one chunk of four not hidden
    assert tp_overlap_exposed(1.0, 4.0, 4) == pytest.approx(3.0 + 0.25)
    assert context_attention(2.0, 1.0, 4) == (8.0, 0.0)
    assert context_attention(1.0, 3.0, 4) == (4.0, 6.0)


@pytest.fixture(scope="module")
def h200():
    runs = load_runs([H200])
    return runs, load_calibration_for(runs, None), load("dgx_h200")


def _terms(pred):
    return {term.name: term for term in pred.step.terms}


def test_overlap_grad_reduce_hides_all_but_the_tail_and_says_so(h200):
    runs, cal, cluster = h200
    layout = Layout(seq_len=2048, dp=16, global_batch_size=64)
    without = predict(runs, layout, cal, cluster=cluster)
    with_overlap = predict(
        runs,
        Layout(seq_len=2048, dp=16, global_batch_size=64, overlap_grad_reduce=True),
        cal,
        cluster=cluster,
    )
    term = _terms(with_overlap)["dp_grad_reduce"]
    # the same bytes, bucketed: each bucket's collective pays its latency
    assert without.step.dp_reduction < term.total < 1.05 * without.step.dp_reduction
    assert 0 < term.exposed < term.total
    assert with_overlap.step.dp_reduction == pytest.approx(term.exposed)
    assert without.step.total - with_overlap.step.total == pytest.approx(
        without.step.dp_reduction - term.exposed
    )
    text = render(with_overlap)
    assert "dp_grad_reduce" in text and "overlap_grad_reduce" in text and "upper bound" not in text
    assert with_overlap.to_json()["step"]["terms"][0]["name"] == "dp_grad_reduce"


def test_overlap_param_gather_delays_the_first_forward_alone(h200):
    runs, cal, cluster = h200
    base = dict(
        seq_len=2048, dp=16, global_batch_size=64, distributed_optimizer=True, overlap_grad_reduce=True
    )
    reduced = predict(runs, Layout(**base), cal, cluster=cluster)
    gathered = predict(runs, Layout(**base, overlap_param_gather=True), cal, cluster=cluster)
    term = _terms(gathered)["param_gather"]
    assert 0 < term.exposed < term.total
    assert gathered.step.pipeline - reduced.step.pipeline == pytest.approx(term.exposed)
    # without it the gather follows the optimizer whole
    assert reduced.step.dp_reduction - gathered.step.dp_reduction == pytest.approx(term.total, rel=0.02)
    with pytest.raises(UserError, match="overlap_param_gather=true needs"):
        Layout(seq_len=2048, dp=16, global_batch_size=64, overlap_param_gather=True)


def test_pipeline_exchanges_are_the_schedule_with_them_less_without(h200):
    runs, cal, cluster = h200
    pred = predict(runs, Layout(seq_len=2048, pp=2, dp=8, global_batch_size=32), cal, cluster=cluster)
    term = _terms(pred)["pp_exchanges"]
    # the stages 8 ranks apart: on two nodes, over the network
    assert term.exposed > 0 and "1 a node over 2 nodes" in pred.step.exchange.source.detail
    assert pred.step.exchange.seconds > 0 and term.total == pytest.approx(term.exposed)  # 1F1B waits


def test_tp_comm_overlap_leaves_less_exposed_and_needs_sequence_parallelism(h200):
    runs, cal, cluster = h200
    base = dict(seq_len=2048, tp=2, dp=8, global_batch_size=32, sequence_parallel=True)
    local = predict(runs, Layout(**base), cal, cluster=cluster)
    te = predict(runs, Layout(**base, tp_comm_overlap=True), cal, cluster=cluster)
    spec, overlapped = _terms(local)["tp_collectives"], _terms(te)["tp_collectives"]
    assert spec.exposed == pytest.approx(spec.total) and overlapped.total == pytest.approx(spec.total)
    item = next(t for name, _, t, _ in te.stages[0].items if name == "tp_collectives:transformer_layer")
    # the profile has no GEMM rows: nothing known to hide behind, said, and exposed whole
    assert "no row of linear_qkv" in item.source.detail and overlapped.exposed == pytest.approx(spec.exposed)
    with pytest.raises(UserError, match="tp_comm_overlap=true needs sequence_parallel"):
        Layout(seq_len=2048, tp=2, dp=8, global_batch_size=32, tp_comm_overlap=True)


def test_context_parallel_ranks_compute_their_share_and_the_ring(h200):
    """cp=2 over s=4096: each rank's ops at s/cp = 2048 (the profile's point: measured), its attention
    the other step of core attention at 2048 added, the key-value exchange beside it; the tokens and
    the model FLOPs of the whole sequence."""
    runs, cal, cluster = h200
    layout = Layout(seq_len=4096, cp=2, dp=8, global_batch_size=32)
    pred = predict(runs, layout, cal, cluster=cluster)
    items = {(name, phase): (t, count) for name, phase, t, count in pred.stages[0].items}
    layer, _ = items[("transformer_layer", "forward")]
    assert layer.source.kind == "measured" and "s2048" in layer.source.detail
    step, layers = items[("cp_attention", "forward")]
    attention = next(
        r
        for r in runs.rows
        if r["op"] == "core_attention" and r["phase"] == "forward" and r["seq_len"] == 2048
    )
    assert (
        step.seconds == pytest.approx(attention["fenced_mean_us"] * 1e-6) and layers == pred.model.num_layers
    )
    assert ("cp_kv_exchange", "backward") in items and "cp_kv_exchange" in _terms(pred)
    assert pred.layout.gpus == 16 and pred.layout.seq_len == 4096
    assert pred.tokens_per_s_per_gpu.value == pytest.approx(32 * 4096 / pred.step.total / 16)
    assert "cp=2" in render(pred)
    with pytest.raises(UserError, match="multiple of 2\\*cp"):
        Layout(seq_len=4094, cp=2)


@pytest.mark.slow
def test_tune_ranks_context_parallel_and_overlapped_layouts_when_asked(h200, tmp_path):
    from autotuner.tune import rank

    settings = {
        "gpus": 16,
        "gpu_memory_gb": 141,
        "global_batch_size": 32,
        "seq_len": 4096,
        "cluster": "dgx_h200",
        "max_cp": 2,
        "overlap": True,
    }
    ranked, _ = rank([str(H200)], settings, keep=lambda lay: lay.pp == 1 and lay.recompute == "none")
    layouts = [r.prediction.layout for r in ranked]
    assert {lay.cp for lay in layouts} == {1, 2}
    assert all(
        lay.overlap_grad_reduce and lay.overlap_param_gather == lay.distributed_optimizer for lay in layouts
    )
    default, _ = rank([str(H200)], {k: v for k, v in settings.items() if k not in ("max_cp", "overlap")})
    assert {r.prediction.layout.cp for r in default} == {1}
    assert not any(r.prediction.layout.overlap_grad_reduce for r in default)


@pytest.mark.slow
def test_the_commands_take_the_cluster_the_overlaps_and_cp(tmp_path, capsys):
    import json

    from autotuner.predict.__main__ import main as predict_main
    from autotuner.tune import main as tune_main

    out = tmp_path / "prediction.json"
    layout = ["seq_len=4096", "cp=2", "dp=8", "global_batch_size=32", "overlap_grad_reduce=true"]
    assert predict_main([str(H200), *layout, "cluster=dgx_h200", "report=false", f"json={out}"]) == 0
    record = json.loads(out.read_text())
    assert record["layout"]["cp"] == 2 and "preset dgx_h200" in record["cluster"]
    assert {term["name"] for term in record["step"]["terms"]} >= {"dp_grad_reduce", "cp_kv_exchange"}
    assert "cp_kv_exchange" in capsys.readouterr().out
    assert predict_main([str(H200), *layout, "cluster=nowhere.json", "report=false", f"json={out}"]) == 2
    assert "cannot read the cluster file" in capsys.readouterr().err
    ranked = ["gpus=16", "gpu_memory_gb=141", "global_batch_size=32", "seq_len=4096", "top=3"]
    assert tune_main([str(H200), *ranked, "cluster=dgx_h200", "overlap=true", "max_cp=2"]) == 0
    assert "overlap=grad" in capsys.readouterr().out
    assert tune_main([str(H200), *ranked, "cluster=dgx_h200", "gpus_per_node=4"]) == 2
    assert "drop one" in capsys.readouterr().err
