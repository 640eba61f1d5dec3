"""The Multi-Latent Attention ops on case=tiny_mla (DeepSeek-V2-shaped, CPU, fp32): chained, they reproduce
the MLA attention's own output; each is instrumented in forward order, runs forward and backward, has rows
from the get_data and torch_profiler launchers and FLOPs in the dry run; the ops of the other attention
kind are skipped with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autotuner.main import run
from autotuner.ops_test.base import REGISTRY, OpNotApplicable, ShapePoint
from autotuner.ops_test.places import op_tree

Q_LORA_RANK = 16
# The attention's sub-ops each variant has, in the order its forward runs them (rope: q and k, twice).
PRESENT = {
    "mla": (
        "kv_down_proj",
        "kv_layernorm",
        "mla_q_proj",
        "kv_up_proj",
        "rope",
        "core_attention",
        "linear_proj",
    ),
    "q_lora": (
        "q_down_proj",
        "kv_down_proj",
        "q_layernorm",
        "kv_layernorm",
        "q_up_proj",
        "kv_up_proj",
        "rope",
        "core_attention",
        "linear_proj",
    ),
}
ATTENTION_OPS = ("self_attention", *op_tree().children("self_attention"))
MLA_ONLY = ("q_down_proj", "kv_down_proj", "kv_layernorm", "mla_q_proj", "q_up_proj", "kv_up_proj")
FAST = ["shapes.seq_len=[16]", "shapes.micro_batch_size=[1]", "progress=false", "report=false"]


def _overrides(variant: str) -> list[str]:
    return ["case=tiny_mla", *([f"hf.q_lora_rank={Q_LORA_RANK}"] if variant == "q_lora" else [])]


@pytest.fixture(scope="module", params=sorted(PRESENT))
def mla(request):
    """(variant, model, OpContext) of case=tiny_mla, without q LoRA ("mla") and with it ("q_lora")."""
    from autotuner.config import compose_config
    from autotuner.runner.spec import open_session, resolve_spec

    model, ctx = open_session(resolve_spec(compose_config([*_overrides(request.param), "device=cpu"])))
    return request.param, model, ctx


def test_chained_mla_sub_ops_reproduce_the_attention(mla):
    """q projection(s), kv down, split, kv_layernorm, kv up, split, RoPE on the RoPE parts, concat, core
    attention, linear_proj: fed from each other, they give MLASelfAttention's own output; and each op's
    builder makes inputs of the shapes fed here."""
    from megatron.core.transformer.enums import AttnMaskType

    from autotuner.ops_test import layer_ops

    variant, _, ctx = mla
    config, attention, point = ctx.config, ctx.layer.self_attention, ShapePoint(24, 3)
    assert type(attention).__name__.endswith("MLASelfAttention")
    s, b, heads = point.seq_len, point.micro_batch_size, attention.num_attention_heads_per_partition
    qk, pos, v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    h, mask = ctx.hidden(point), ctx.causal_mask(point)
    expected, _ = attention(h, attention_mask=mask, rotary_pos_emb=ctx.rotary(point))

    fed: dict[str, tuple[torch.Tensor, ...]] = {"kv_down_proj": (h,)}
    if variant == "q_lora":
        fed["q_down_proj"] = (h,)
        q_latent, _ = attention.linear_q_down_proj(h)
        fed["q_layernorm"] = (q_latent,)
        q_latent = attention.q_layernorm(q_latent)
        fed["q_up_proj"] = (q_latent,)
        q, _ = attention.linear_q_up_proj(q_latent)
    else:
        fed["mla_q_proj"] = (h,)
        q, _ = attention.linear_q_proj(h)
    kv_combined, _ = attention.linear_kv_down_proj(h)
    kv_latent, k_pos = torch.split(kv_combined, [config.kv_lora_rank, pos], dim=-1)
    fed["kv_layernorm"] = (kv_latent,)
    kv_latent = attention.kv_layernorm(kv_latent)
    fed["kv_up_proj"] = (kv_latent,)
    kv, _ = attention.linear_kv_up_proj(kv_latent)
    q_nope, q_pos = q.view(s, b, heads, qk + pos).split([qk, pos], dim=-1)
    k_nope, value = kv.view(s, b, heads, qk + v_dim).split([qk, v_dim], dim=-1)
    fed["rope"] = (q_pos, k_pos.unsqueeze(-2))
    q_pos, k_pos = layer_ops.rope_call(ctx, point)(*fed["rope"])
    query = torch.cat([q_nope, q_pos], dim=-1).contiguous()
    key = torch.cat([k_nope, k_pos.expand(-1, -1, heads, -1)], dim=-1).contiguous()
    fed["core_attention"] = (query, key, value.contiguous())
    context = attention.core_attention(
        *fed["core_attention"],
        mask,
        attn_mask_type=AttnMaskType.causal,
        attention_bias=None,
        packed_seq_params=None,
    )
    fed["linear_proj"] = (context,)
    chained, _ = attention.linear_proj(context)

    assert set(fed) == set(PRESENT[variant])
    assert chained.shape == expected.shape == (s, b, config.hidden_size)
    torch.testing.assert_close(chained, expected, rtol=0, atol=1e-5)
    for op, tensors in fed.items():
        call = REGISTRY[op].build(ctx, point)
        assert [t.shape for t in call.inputs] == [t.shape for t in tensors], op


def test_attention_ops_run_forward_and_backward_or_skip_with_a_reason(mla):
    from autotuner.runner import Phase

    variant, _, ctx = mla
    point, skipped = ShapePoint(16, 2), {}
    for name in ("transformer_layer", *ATTENTION_OPS):
        try:
            call = REGISTRY[name].build(ctx, point)
        except OpNotApplicable as exc:
            skipped[name] = str(exc)
            continue
        Phase("forward", call, 0).run()
        backward = Phase("backward", call, 0)
        backward.prepare()
        backward.run()
        grads = [t.grad for t in call.inputs if t.requires_grad]
        assert grads and all(g is not None for g in grads), name
        if name in MLA_ONLY:
            assert all(p.grad is not None for p in call.module.parameters()), name
    assert set(skipped) == set(ATTENTION_OPS) - {"self_attention", *PRESENT[variant]}
    assert "linear_qkv" in skipped and all(reason and "\n" not in reason for reason in skipped.values())


def test_mla_sub_ops_are_ranged_inside_the_attention_in_model_order(mla):
    """Registration order is MLA's forward order, and every sub-op (RoPE too) has its range there."""
    from autotuner.ops.annotate import RecordingAnnotator, annotating, set_range_context
    from autotuner.ops.naming import parse_range
    from autotuner.runner import Phase

    variant, _, ctx = mla
    present = PRESENT[variant]
    assert [op for op in ATTENTION_OPS if op in present] == list(present)
    point = ShapePoint(8, 1)
    call = REGISTRY["self_attention"].build(ctx, point)
    annotator = RecordingAnnotator()
    set_range_context(point.label, 0, warmup=False)
    with annotating(annotator):
        phase = Phase("backward", call, 0)
        phase.prepare()
        phase.run()
    pushed = [parse_range(name) for kind, name, _ in annotator.events if kind == "push"]
    forward = [r.op for r in pushed if r.phase == "forward"]
    rope = present.index("rope")
    assert forward == ["self_attention", *present[:rope], "rope", *present[rope:]]
    assert {r.op for r in pushed if r.phase == "backward"} == {"self_attention", *present}


def test_a_dense_model_skips_the_mla_ops_with_a_reason(tiny_session):
    _, ctx = tiny_session
    for name in (*MLA_ONLY, "q_layernorm"):  # tiny has no qk_layernorm: no q norm either
        with pytest.raises(OpNotApplicable) as caught:
            REGISTRY[name].build(ctx, ShapePoint(8, 1))
        assert name in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "launcher", ["get_data", "torch_profiler", pytest.param("nsys", marks=pytest.mark.nsys)]
)
@pytest.mark.slow
def test_every_mla_op_has_rows_with_times_memory_and_flops(launcher, tmp_path: Path, request):
    settings = {
        "get_data": ["timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3"],
        "torch_profiler": ["launcher.warmup=1", "launcher.active=2"],
        "nsys": ["launcher.warmup=1", "launcher.iterations=2"],
    }[launcher]
    if launcher == "nsys":
        settings.append(f"launcher.nsys_bin={request.getfixturevalue('nsys_bin')}")
    argv = [*_overrides("mla"), f"launcher={launcher}", f"ops=[{','.join(ATTENTION_OPS)}]", *FAST, *settings]
    assert run([*argv, f"hydra.run.dir={tmp_path}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by_key = {(r["op"], r["phase"]): r for r in rows}
    assert len(rows) == len(by_key) == 2 * len(ATTENTION_OPS)
    for (op, phase), row in by_key.items():
        if op not in ("self_attention", *PRESENT["mla"]):
            assert row["status"] == "skipped" and row["error"], row
            continue
        assert row["status"] == "ok" and row["launcher"] == launcher, row
        assert 0 < row["min_us"] <= row["median_us"] and row["samples"] >= 2, row
        assert row["flops"] is not None and row["weight_bytes"] is not None, row
        if op not in ("rope", "kv_layernorm"):  # a norm's and RoPE's elementwise work counts no FLOPs
            assert row["flops"] > 0, row
        if launcher == "get_data":
            assert row["peak_bytes"] > 0, row
        elif phase == "forward":
            assert row["activation_bytes"] > 0, row


@pytest.mark.parametrize("variant", sorted(PRESENT))
def test_the_dry_run_costs_every_attention_op(variant):
    from autotuner.config import compose_config
    from autotuner.runner.dry_run import preview
    from autotuner.runner.spec import resolve_spec

    ops = f"ops=[{','.join(ATTENTION_OPS)}]"
    costs = preview(resolve_spec(compose_config([*_overrides(variant), ops, *FAST[:2]]))).costs
    assert {c.op for c in costs} == set(ATTENTION_OPS)
    for cost in costs:
        if cost.op in ("self_attention", *PRESENT[variant]):
            assert cost.flops is not None and cost.bytes_moved, cost
        else:
            assert cost.flops is None and cost.error.startswith("OpNotApplicable: "), cost
    matmuls = [c for c in costs if c.op.endswith("proj") and c.flops is not None]
    assert matmuls and all(c.flops > 0 for c in matmuls)


def test_the_predictors_tensor_count_is_the_built_mla_attentions(mla):
    """The parameter tensors autotuner.model.counts finds in MLA's attention (its projections and norms,
    with and without the q LoRA) built on meta are those the layer built on the CPU holds."""
    from autotuner.config import compose_config
    from autotuner.model.counts import count_parameters
    from autotuner.runner.spec import resolve_spec

    variant, _, ctx = mla
    spec = resolve_spec(compose_config([*_overrides(variant), "device=cpu"]))
    layer = ctx.layer
    counts = count_parameters(spec.model_args, spec.tf_config).layer(hasattr(layer.mlp, "router"))
    if hasattr(layer.mlp, "router"):  # the MoE layer's experts are counted in test_moe_ops
        assert counts.routed_expert_tensors == len(list(layer.mlp.experts.parameters()))
    assert counts.tensors == len(list(layer.parameters()))
    assert counts.parameters == sum(p.numel() for p in layer.parameters())
