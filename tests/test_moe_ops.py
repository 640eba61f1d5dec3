"""The Mixture-of-Experts ops (autotuner.ops_test.moe_ops) on real Megatron-Core MoE layers, on CPU.

The sub-ops fed from each other reproduce the MoE layer's own output, with the learned routing and with a
forced one (which the layer's router then hands on); the experts' FLOPs are those of the tokens each
expert gets; inside the layer each sub-op's range nests in ``moe_layer``'s; the three launchers write
forward and backward rows with the routing columns; ``dry_run=true`` costs every MoE op.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from autotuner.config import compose_config
from autotuner.main import run
from autotuner.measure.flops import count_flops
from autotuner.model.routing import Routing
from autotuner.ops.annotate import RecordingAnnotator, annotating, set_range_context
from autotuner.ops.naming import parse_range
from autotuner.ops_test import moe_ops
from autotuner.ops_test.base import REGISTRY, OpContext, OpNotApplicable, ShapePoint
from autotuner.results import load_rows
from autotuner.runner import Phase
from autotuner.runner.dry_run import preview, render
from autotuner.runner.spec import open_session, resolve_spec

MOE_OPS = ["moe_layer", "shared_experts", "router", "token_dispatch", "experts", "token_combine"]
ROUTED_OPS = [op for op in MOE_OPS if op != "shared_experts"]  # the ops whose rows record the routing
POINT = ShapePoint(16, 2)
_FEW_SAMPLES = ["timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3"]
FAST = [
    f"ops=[{','.join(MOE_OPS)}]",
    "shapes.seq_len=[16]",
    "shapes.micro_batch_size=[2]",
    "progress=false",
    "report=false",
]


def _spec(*overrides: str):
    return resolve_spec(compose_config([*overrides, "device=cpu"]))


@pytest.fixture(scope="module")
def sessions():
    """(model, OpContext) of tiny_moe (every layer MoE, no shared experts) and tiny_mla (first layer dense,
    then MoE with shared experts), with the learned routing, built once."""
    return {case: open_session(_spec(f"case={case}")) for case in ("tiny_moe", "tiny_mla")}


def _context(session, routing: Routing | None = None) -> OpContext:
    model, ctx = session
    return OpContext(model, ctx.device, ctx.dtype, ctx.seed, routing=routing or Routing())


def _chain(ctx: OpContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(the MoE layer's own output, the output of its sub-ops fed from each other) on the ops' input."""
    calls = {name: REGISTRY[name].build(ctx, POINT) for name in ROUTED_OPS}
    (hidden,) = calls["moe_layer"].inputs
    expected, bias = calls["moe_layer"].fn(hidden)
    assert bias is None
    probs, routing_map = calls["router"].fn(hidden)
    permuted, tokens_per_expert, permuted_probs = calls["token_dispatch"].fn(hidden, probs, routing_map)
    expert_output, _ = calls["experts"].fn(permuted, tokens_per_expert, permuted_probs)
    chained = calls["token_combine"].fn(expert_output)
    try:
        chained = chained + REGISTRY["shared_experts"].build(ctx, POINT).fn(hidden)
    except OpNotApplicable:
        assert ctx.layer.mlp.shared_experts is None
    return expected, chained


@pytest.mark.parametrize("case", ["tiny_moe", "tiny_mla"])
def test_chained_sub_ops_reproduce_the_moe_layer(sessions, case):
    """router -> token_dispatch -> experts -> token_combine (+ shared_experts) is the layer's output."""
    ctx = _context(sessions[case])
    expected, chained = _chain(ctx)
    assert chained.shape == expected.shape == (POINT.seq_len, POINT.micro_batch_size, ctx.config.hidden_size)
    torch.testing.assert_close(chained, expected, rtol=0, atol=1e-5)
    assert (ctx.layer.mlp.shared_experts is not None) == (case == "tiny_mla")


def test_a_forced_routing_is_the_one_the_layer_uses(sessions):
    """Under zipf the router hands on the forced map (the ops' inputs come from it, and the chain still
    reproduces the layer), and the router's backward still runs inside the layer's."""
    ctx = _context(sessions["tiny_mla"], Routing("zipf", 1.5))
    mlp = ctx.layer.mlp
    try:
        expected, chained = _chain(ctx)
        torch.testing.assert_close(chained, expected, rtol=0, atol=1e-5)
        probs, routing_map = REGISTRY["router"].build(ctx, POINT).fn(ctx.hidden(POINT))
        tokens, experts, topk = POINT.seq_len * POINT.micro_batch_size, ctx.config.num_moe_experts, 2
        forced = moe_ops.forced_map(ctx.routing, ctx.seed, tokens, experts, topk, routing_map.device)
        assert torch.equal(routing_map, forced) and forced.sum(dim=0).max() > tokens * topk / experts
        torch.testing.assert_close(probs.detach(), forced.to(probs.dtype) / topk)
        mlp.router.weight.grad = None
        expected.sum().backward()
        assert mlp.router.weight.grad is not None and mlp.router.weight.grad.abs().sum() > 0
    finally:
        moe_ops.force_routing(ctx.model, Routing(), ctx.seed)  # learned again, for the other tests
    assert "forward" not in mlp.router.__dict__


def test_experts_flops_count_the_tokens_each_expert_gets(sessions):
    ctx = _context(sessions["tiny_moe"], Routing("zipf", 1.2))
    try:
        call = REGISTRY["experts"].build(ctx, POINT)
    finally:
        moe_ops.force_routing(ctx.model, Routing(), ctx.seed)
    tokens = call.inputs[1].tolist()
    assert sum(tokens) == POINT.seq_len * POINT.micro_batch_size * 2 and len(set(tokens)) > 1
    assert call.row_fields["tokens_per_expert"] == tokens and call.row_fields["expert_imbalance"] > 1
    cfg = ctx.config
    h, ffn = cfg.hidden_size, cfg.moe_ffn_hidden_size
    per_token = h * ffn * (2 if cfg.gated_linear_unit else 1) + ffn * h
    assert count_flops(Phase("forward", call, 0).run) == 2 * sum(t * per_token for t in tokens)


def test_sub_op_ranges_nest_inside_the_moe_layer(sessions):
    """Inside the real layer each sub-op's forward and backward range is enclosed by moe_layer's, the
    forward ones in the order the layer runs them."""
    ctx = _context(sessions["tiny_mla"])
    mlp = ctx.layer.mlp
    for op, module in [
        ("moe_layer", mlp),
        *((op, getattr(mlp, op)) for op in ("shared_experts", "router", "experts")),
    ]:
        assert type(module).autotuner_op == op
    assert type(mlp.token_dispatcher).autotuner_base.__name__ == "MoEAllGatherTokenDispatcher"
    call = REGISTRY["moe_layer"].build(ctx, POINT)
    annotator = RecordingAnnotator()
    set_range_context(POINT.label, 0, warmup=False)
    with annotating(annotator):
        phase = Phase("backward", call, 0)
        phase.prepare()
        phase.run()
    enclosing: dict[tuple[str, str], set[str | None]] = {}
    forward_order, stack = [], []
    for kind, name, _ in annotator.events:
        if kind == "pop":
            stack.pop()
            continue
        parsed = parse_range(name)
        enclosing.setdefault((parsed.op, parsed.phase), set()).add(stack[-1] if stack else None)
        stack.append(parsed.op)
        if parsed.phase == "forward" and parsed.op != "moe_layer":
            forward_order.append(parsed.op)
    assert forward_order == MOE_OPS[1:]
    for phase_name in ("forward", "backward"):
        assert enclosing[("moe_layer", phase_name)] == {None}
        for op in MOE_OPS[1:]:
            assert enclosing[(op, phase_name)] == {"moe_layer"}, (op, phase_name)


# --- the launchers ---------------------------------------------------------------------------------


def _run(run_dir: Path, *overrides: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = run([f"hydra.run.dir={run_dir}", *FAST, *overrides])
    return code, err.getvalue()


def _check_rows(run_dir: Path, routing: str, skipped: tuple[str, ...] = ()) -> dict[tuple[str, str], dict]:
    rows = {(r["op"], r["phase"]): r for r in load_rows(run_dir / "results.jsonl")}
    assert set(rows) == {(op, phase) for op in MOE_OPS for phase in ("forward", "backward")}
    for (op, _), row in rows.items():
        if op in skipped:
            assert row["status"] == "skipped" and "no shared experts" in row["error"], row
            continue
        assert row["status"] == "ok", row
        assert row["median_us"] > 0 and row["weight_bytes"] is not None
        if op == "shared_experts":
            continue
        assert row["routing"] == routing and row["experts_impl"] == "SequentialMLP"
        assert row["token_dispatcher"] == "allgather" and row["expert_parallel"] == 1
        tokens = row["tokens_per_expert"]
        assert len(tokens) == 8 and sum(tokens) == POINT.seq_len * POINT.micro_batch_size * 2
        assert (row["tokens_per_expert_min"], row["tokens_per_expert_max"]) == (min(tokens), max(tokens))
        assert row["expert_imbalance"] == pytest.approx(max(tokens) / (sum(tokens) / 8))
    header = (run_dir / "results.csv").read_text().splitlines()[0].split(",")
    assert {"routing", "tokens_per_expert", "expert_imbalance", "experts_impl"} <= set(header)
    return rows


@pytest.mark.slow
def test_get_data_rows_under_zipf_routing(tmp_path: Path):
    code, err = _run(tmp_path, "case=tiny_moe", "moe.routing=zipf", *_FEW_SAMPLES)
    assert code == 0, err
    rows = _check_rows(tmp_path, "zipf", skipped=("shared_experts",))
    assert rows[("experts", "forward")]["expert_imbalance"] > 1
    for op in ROUTED_OPS:
        for phase in ("forward", "backward"):
            assert rows[(op, phase)]["peak_bytes"] >= 0, (op, phase)
    for op in ("moe_layer", "router", "experts"):
        assert rows[(op, "forward")]["flops"] > 0 and rows[(op, "backward")]["flops"] > 0, op


@pytest.mark.slow
def test_get_data_rows_under_balanced_routing_with_shared_experts(tmp_path: Path):
    code, err = _run(tmp_path, "case=tiny_mla", "moe.routing=balanced", *_FEW_SAMPLES)
    assert code == 0, err
    rows = _check_rows(tmp_path, "balanced")
    assert {rows[(op, "forward")]["expert_imbalance"] for op in ROUTED_OPS} == {1.0}
    assert rows[("shared_experts", "forward")]["flops"] > 0


@pytest.mark.slow
def test_torch_profiler_rows(tmp_path: Path):
    code, err = _run(
        tmp_path, "case=tiny_mla", "launcher=torch_profiler", "launcher.warmup=1", "launcher.active=2"
    )
    assert code == 0, err
    rows = _check_rows(tmp_path, "learned")
    for op in ("moe_layer", "shared_experts", "router", "experts"):
        assert rows[(op, "forward")]["flops"] > 0 and rows[(op, "backward")]["flops"] > 0, op
        assert rows[(op, "forward")]["activation_bytes"] > 0, op


@pytest.mark.nsys
def test_nsys_rows(nsys_bin: str, tmp_path: Path):
    code, err = _run(
        tmp_path,
        "case=tiny_mla",
        "launcher=nsys",
        f"launcher.nsys_bin={nsys_bin}",
        "launcher.warmup=1",
        "launcher.iterations=2",
    )
    assert code == 0, err
    rows = _check_rows(tmp_path, "learned")
    assert all(row["samples"] == 2 and row["stop_reason"] == "nsys" for row in rows.values())
    # the sensors ran in the worker, outside the measured ranges: memory and FLOPs as the others have them
    for op in ("moe_layer", "shared_experts", "router", "experts"):
        assert rows[(op, "forward")]["flops"] > 0 and rows[(op, "backward")]["flops"] > 0, op
        assert rows[(op, "forward")]["activation_bytes"] > 0 and rows[(op, "forward")]["tflops"] > 0, op


# --- dry_run ---------------------------------------------------------------------------------------


def _expert_flops(spec, tokens: int) -> int:
    """Forward FLOPs of the routed experts when every token goes to top-k of them."""
    tf = spec.tf_config
    per_token = tf.hidden_size * tf.moe_ffn_hidden_size * (3 if tf.gated_linear_unit else 2)
    return 2 * tokens * tf.moe_router_topk * per_token


def _check_preview(spec, no_shared: bool) -> str:
    result = preview(spec)
    costs = {(c.op, c.phase, c.point): c for c in result.costs}
    for (op, _, _), cost in costs.items():
        if op not in MOE_OPS:
            continue
        if op == "shared_experts" and no_shared:
            assert cost.error.startswith("OpNotApplicable"), cost
            continue
        assert cost.error is None and cost.bytes_moved > 0, cost
        assert cost.flops is not None and (cost.flops > 0) == (op not in ("token_dispatch", "token_combine"))
    for point in spec.points:
        tokens = point.seq_len * point.micro_batch_size
        assert costs[("experts", "forward", point.label)].flops == _expert_flops(spec, tokens)
        assert costs[("experts", "backward", point.label)].flops == 2 * _expert_flops(spec, tokens)
    for layer_op in ("transformer_layer", "moe_layer"):
        if (layer_op, "forward", spec.points[0].label) in costs:
            assert costs[(layer_op, "forward", spec.points[0].label)].flops > 0
    return render(result)


@pytest.mark.slow
@pytest.mark.parametrize("case, no_shared", [("tiny_moe", True), ("tiny_mla", False)])
def test_dry_run_costs_every_moe_op(case: str, no_shared: bool, capsys):
    shapes = ["shapes.seq_len=[16,32]", "shapes.micro_batch_size=[1]"]
    assert run([f"case={case}", "dry_run=true", *shapes]) == 0
    out = capsys.readouterr().out
    assert "MoE ops routed balanced: moe.routing=learned depends on the router's weights" in out
    for op in ROUTED_OPS + ([] if no_shared else ["shared_experts"]):
        lines = [line for line in out.splitlines() if line.split()[:1] == [op]]
        assert len(lines) == 4 and all("FLOP" in line and "n/a" not in line for line in lines), lines
    _check_preview(_spec(f"case={case}", *shapes), no_shared)
    zipf = _spec(f"case={case}", "ops=[experts]", "moe.routing=zipf", "moe.zipf_s=2")
    assert "MoE ops routed as moe.routing=zipf (s=2" in _check_preview(zipf, no_shared)


@pytest.mark.parametrize(
    "case, no_shared",
    [
        ("mixtral_8x7b", True),
        pytest.param("deepseek_v2_lite", False, marks=pytest.mark.slow),
    ],
)
def test_dry_run_of_a_published_moe_model(case: str, no_shared: bool):
    """At the case's own shapes (s4096): the whole layer and every MoE op costed, the experts' FLOPs those
    of every token sent to top-k experts."""
    text = _check_preview(_spec(f"case={case}", f"ops=[transformer_layer,{','.join(MOE_OPS)}]"), no_shared)
    for op in ["transformer_layer", *ROUTED_OPS]:
        lines = [line for line in text.splitlines() if line.split()[:1] == [op]]
        assert len(lines) == 2 and not any("n/a" in line for line in lines), lines


@pytest.mark.parametrize("case", ["tiny_moe", "tiny_mla"])
def test_the_predictors_tensor_count_is_the_built_moe_layers(sessions, case):
    """The counts of an MoE layer the predictor stands on (autotuner.model.counts, from the model built on
    meta) are those of the MoE layer a run builds on the CPU: the router, every routed expert's linears
    and the shared experts' (with their gate)."""
    from autotuner.model.counts import count_parameters

    _, ctx = sessions[case]
    spec = _spec(f"case={case}")
    counts = count_parameters(spec.model_args, spec.tf_config).layer(moe=True)
    layer = ctx.layer
    assert counts.routed_expert_tensors == len(list(layer.mlp.experts.parameters()))
    assert counts.routed_expert_tensors == 2 * ctx.config.num_moe_experts
    assert counts.tensors == len(list(layer.parameters()))
    assert counts.parameters == sum(p.numel() for p in layer.parameters())
