"""Megatron-LM's published H100 runs: its formulas against the models' own counts, the benchmark's
machinery on a synthetic fixture made here, and the benchmark itself from the H100 fixture where one has
been made on a GPU (scripts/make_h100_fixture.sh; skipped, and reported as skipped, without it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autotuner.predict.inputs import ModelShape
from autotuner.predict.layout import Layout
from autotuner.predict.megatron_formulas import (
    megatron_flops_per_step,
    megatron_shard_parameters,
    padded_vocab,
)
from benchmarks import megatron_published as bench

REPO = Path(__file__).resolve().parents[1]
H100 = REPO / "autotuner" / "results" / "presets" / "h100.json"


@pytest.fixture(scope="module")
def models() -> dict[str, ModelShape]:
    return {p.case: ModelShape.from_case(p.case) for p in bench.PUBLISHED}


def test_the_cases_are_the_published_models(models):
    """Each case's sizes as the table states them, and its parameters (counted on transformers' model on
    the meta device) the size the table names it by, within 3%: 1.7B, 7.1B, 16B, 32B."""
    for published in bench.PUBLISHED:
        model = models[published.case]
        assert model.num_layers == published.layers and model.vocab == 131072
        assert (
            model.kv_channels == 128 and model.hidden == 128 * model.heads and model.ffn == 4 * model.hidden
        )
        assert not model.tie_embeddings and model.query_groups == model.heads
        size = float(published.name.rstrip("B")) * 1e9
        assert model.parameters() == pytest.approx(size, rel=0.03), published.name  # 1.745e9 is "1.7B"


def test_megatrons_flops_and_shard_count_agree_with_the_models_own(models):
    """Megatron-LM's FLOPs formula is three passes of every GEMM with the attention square whole: the
    same as 3x the analytic forward of the model counted on the meta device, but for the biases and norm
    weights Megatron leaves out (under 0.1%); its shard count likewise against ours."""
    for published in bench.PUBLISHED:
        model = models[published.case]
        layout = Layout(seq_len=4096, tp=published.tp, dp=48, global_batch_size=192)
        tokens = 192 * 4096
        ours = (
            3
            * (
                model.num_layers * model.forward_flops("transformer_layer", 4096, 1) / 4096
                + 2 * model.hidden * model.vocab
            )
            * tokens
        )
        assert megatron_flops_per_step(model, layout) == pytest.approx(ours, rel=1e-3)
        shard = (
            model.num_layers * model.layer_params_on_rank(published.tp, 1)
            + 2 * model.vocab * model.hidden / published.tp
        )
        assert megatron_shard_parameters(model, layout) == pytest.approx(shard, rel=1e-3)
    assert padded_vocab(50257, 8) == 51200 and padded_vocab(131072, 8) == 131072


OPS_FLOPS = {  # forward FLOPs a token of the layer's GEMMs, in units of h^2 (the 4h MLP, MHA)
    "linear_qkv": 6,
    "linear_proj": 2,
    "linear_fc1": 8,
    "linear_fc2": 8,
}


def synthetic_profile(folder: Path, published: bench.Published, model: ModelShape) -> None:
    """An emulated rank's one-layer profile of ``published``'s model as the fixture script makes it, its
    times made up from FLOPs at 70% of the H100 preset's bf16 peak (GEMMs), 50% (attention) and bytes at
    its copy bandwidth: the benchmark's machinery, not its accuracy, is what these rows test."""
    calibration = json.loads(H100.read_text())
    peak, copy = calibration["peak_flops"]["bf16"], calibration["memory_bandwidth"]
    h, tp, vocab = model.hidden, published.tp, model.vocab
    rows = []
    for b in (1, 2):
        tokens = 4096 * b
        activation = tokens * h * 2
        gemms = {op: factor * h * h * tokens / tp / (0.7 * peak) for op, factor in OPS_FLOPS.items()}
        attention = 4 * 4096 * tokens * h / tp / (0.5 * peak)
        elementwise = 12 * activation / copy
        forward = {
            **gemms,
            "core_attention": attention,
            "transformer_layer": sum(gemms.values()) + attention + elementwise,
            "embedding": 2 * activation / copy,
            "final_layernorm": 2 * activation / copy,
            "output_layer": 2 * h * vocab * tokens / tp / (0.7 * peak),
        }
        for op, seconds in forward.items():
            for phase, factor in (("forward", 1), ("backward", 2)):
                row = {
                    "case": published.case,
                    "op": op,
                    "phase": phase,
                    "point": f"s4096_b{b}",
                    "seq_len": 4096,
                    "micro_batch_size": b,
                    "dtype": "bf16",
                    "device": "cuda",
                    "launcher": "get_data",
                    "rank": 0,
                    "tensor_parallel": tp,
                    "status": "ok",
                    "median_us": seconds * factor * 1e6,
                    "fenced_mean_us": seconds * factor * 1e6,
                    "cache_flush": True,
                    "activation_bytes": 34 * activation / 2 / tp if op == "transformer_layer" else activation,
                    "peak_bytes": 4 * activation,
                }
                if op == "transformer_layer":
                    row["weight_bytes"] = model.layer_params_on_rank(tp, 1) * 2
                    if tp > 1:  # sequence parallelism's two all-gathers and two reduce-scatters a phase
                        row["collectives"] = [
                            {"kind": kind, "bytes": activation, "group": "tp"}
                            for kind in ("all_gather_into_tensor", "reduce_scatter_tensor") * 2
                        ]
                rows.append(row)
    run = folder / published.case
    run.mkdir()
    # written as lines, not through ResultsWriter: the emulated rank's ``collectives`` column is the
    # emulation's, which autotuner.results.Row does not hold yet
    (run / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    shutil.copy(H100, run / "calibration.json")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, models) -> Path:
    folder = tmp_path_factory.mktemp("h100_fixture")
    for published in bench.PUBLISHED:
        synthetic_profile(folder, published, models[published.case])
    return folder


def test_the_benchmark_predicts_each_published_run_from_a_fixture(synthetic, models):
    rows = bench.run(synthetic, "dgx_h100")
    assert [row.published.name for row in rows] == ["1.7B", "7.1B", "16B", "32B"]
    for row in rows:
        pred, published = row.prediction, row.published
        lay = pred.layout
        assert (lay.tp, lay.pp, lay.dp, lay.gpus) == (published.tp, 1, 48, published.gpus)
        assert lay.distributed_optimizer and lay.overlap_grad_reduce and lay.overlap_param_gather
        assert lay.tp_comm_overlap == lay.sequence_parallel == (published.tp > 1)
        assert pred.model.num_layers == published.layers  # the one-layer profile at the case's depth
        flops = megatron_flops_per_step(models[published.case], lay)
        assert row.tflops == pytest.approx(flops / pred.step_seconds / lay.gpus / 1e12)
        assert row.error == pytest.approx(row.tflops / published.tflops - 1)
        terms = {term.name: term for term in pred.step.terms}
        assert {"dp_grad_reduce", "param_gather"} <= set(terms)
        if published.tp > 1:  # the emulated rank's recorded collectives, priced over the cluster's NVLink
            assert "emulated rank" in pred.tp_note and "dgx_h100" in pred.tp_note
            assert terms["tp_collectives"].exposed < terms["tp_collectives"].total  # behind the GEMMs
    text = bench.render(rows, synthetic, "dgx_h100")
    for row in rows:
        assert f"{row.published.tflops:.1f}" in text and f"{row.error:+.1%}" in text
    assert (
        "worst error" in text
        and sum(line.endswith(tuple("0123456789")) and " Megatron " in line for line in text.splitlines())
        == 4
    )


def test_without_the_fixture_the_benchmark_says_what_makes_it(tmp_path, capsys):
    assert bench.main(["--fixture", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "scripts/make_h100_fixture.sh" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(
    not (bench.FIXTURE / bench.PUBLISHED[0].case / "results.jsonl").is_file(),
    reason="no H100 fixture (tests/fixtures/h100_megatron_gpt): scripts/make_h100_fixture.sh on an H100 "
    "makes it",
)
def test_the_published_h100_runs_are_predicted_within_ten_percent():
    rows = bench.run(bench.FIXTURE, "dgx_h100")
    assert all(abs(row.error) <= bench.TARGET for row in rows), bench.render(rows, bench.FIXTURE, "dgx_h100")
