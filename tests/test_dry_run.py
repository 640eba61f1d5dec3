"""``dry_run=true``: parameter counts of the Megatron model built on meta, the plan with its costs, nothing
written (autotuner.runner.dry_run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotuner.calibrate import HOST_WORK_DEPTHS, HOST_WORK_MODEL
from autotuner.config import compose_config
from autotuner.main import run
from autotuner.results import load_rows
from autotuner.runner.dry_run import model_parameters, preview
from autotuner.runner.plan import plan
from autotuner.runner.spec import resolve_spec
from tests.test_cases import PUBLISHED_PARAMETERS

TINY = ["case=tiny", "shapes.seq_len=[16,32]", "shapes.micro_batch_size=[1]", "device=cpu"]


def _spec(*overrides: str):
    return resolve_spec(compose_config(list(overrides)))


@pytest.mark.slow
def test_llama70b_prints_its_published_total_and_writes_nothing(tmp_path: Path, capsys):
    run_dir = tmp_path / "run"
    assert run(["case=llama70b", "dry_run=true", "launcher=nsys", f"hydra.run.dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert "parameters: total 68976648192, active 68976648192" in out
    assert not run_dir.exists()
    spec = _spec("case=llama70b")
    lines = out.splitlines()
    for point, op, phase in plan(spec):
        assert any(line.split()[:3] == [op.name, phase, point.label] for line in lines), (op.name, phase)
    assert "fit check: " in out and ": peak " in out


def test_a_block_never_has_more_layers_than_the_model():
    """A model of fewer layers than transformer_block_layers (calibrate's one-layer steps, which run every
    op) measures all of its own, said in a note; the block of the model with enough keeps its setting."""
    one = _spec(*TINY, "hf.num_hidden_layers=1")
    assert one.block_layers == 1
    assert one.notes[-1] == (
        "transformer_block measures the model's 1 layer(s), not transformer_block_layers=2: "
        "the model has no more"
    )
    assert _spec(*TINY, "transformer_block_layers=5").block_layers == 2
    assert _spec(*TINY, "hf.num_hidden_layers=4", "transformer_block_layers=3").block_layers == 3
    assert not any(
        "transformer_block" in n for n in _spec(*TINY, "hf.num_hidden_layers=1", "ops=[mlp]").notes
    )
    # the models calibrate's host-work steps build (every op, as autotuner.validate.steps resolves them):
    # they resolve
    for depth in HOST_WORK_DEPTHS:
        assert _spec(
            "case=tiny", *HOST_WORK_MODEL, f"hf.num_hidden_layers={depth}", "device=cpu"
        ).block_layers


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_dense_totals_match_the_published_ones(name: str):
    total, active = model_parameters(_spec(f"case={name}"))
    assert total == active == PUBLISHED_PARAMETERS[name]


def test_tiny_op_parameters_and_costs_match_the_real_model():
    """Each op's parameters on meta are those of the same op built by a real run's session; its FLOPs
    and bytes are counted (positive where the op multiplies, moves bytes everywhere)."""
    from autotuner.runner.spec import open_session

    spec = _spec(*TINY)
    costs = preview(spec).costs
    assert [(c.point, c.op, c.phase) for c in costs] == [(p.label, o.name, ph) for p, o, ph in plan(spec)]
    assert all(c.error is None and c.bytes_moved > 0 for c in costs), [c for c in costs if c.error]
    _, context = open_session(_spec(*TINY))
    for op in spec.ops:
        point = spec.points[0]
        module = op.build(context, point).module
        real = sum(p.numel() for p in module.parameters()) if module is not None else 0
        assert {c.parameters for c in costs if c.op == op.name} == {real}, op.name
    flops = {(c.op, c.phase, c.point): c.flops for c in costs}
    assert flops[("linear_qkv", "backward", "s32_b1")] == 2 * flops[("linear_qkv", "forward", "s32_b1")] > 0
    assert flops[("linear_qkv", "forward", "s32_b1")] == 2 * flops[("linear_qkv", "forward", "s16_b1")]


@pytest.mark.slow
@pytest.mark.parametrize("case, op", [("tiny", "core_attention"), ("tiny_moe", "moe_layer")])
def test_a_real_run_after_a_dry_run_in_the_same_process(case: str, op: str, tmp_path: Path, monkeypatch):
    """The dry run's meta scratch buffer, RNG tracker and MoE auxiliary loss scale are not left to a later
    real run (core attention takes its scores buffer from Megatron's global one; a router's backward, the
    scale Megatron keeps for the process once a backward has made it)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # as in a fresh process: no backward through a router has made the scale yet (an earlier test's would
    # be on the host, and the dry run would leave it be)
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    fast = ["shapes.seq_len=[16]", "shapes.micro_batch_size=[1]", "progress=false", "report=false"]
    assert run([f"case={case}", "dry_run=true", *fast]) == 0
    run_dir = tmp_path / "real"
    real = [
        f"case={case}",
        f"ops=[{op}]",
        "timing.min_samples=2",
        "timing.max_samples=3",
        f"hydra.run.dir={run_dir}",
        *fast,
    ]
    assert run(real) == 0
    assert (run_dir / "results.jsonl").exists()
    rows = load_rows(run_dir / "results.jsonl")
    assert [r["status"] for r in rows] == ["ok", "ok"]


def test_a_sweep_of_dry_and_measured_jobs_is_refused(tmp_path: Path, capsys):
    """``-m dry_run=true,false`` would preview the job asked to measure: one line, exit 2, nothing made."""
    code = run(["-m", "case=tiny", "dry_run=true,false", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("autotuner: error: a sweep of dry_run=true and dry_run=false jobs")
    assert not (tmp_path / "sweep").exists()
