"""Ops declare their place (autotuner.ops_test.places): the tables once written by hand are derived, the
declared paths are the built model's, parents are the ranges that enclose each op, and a new op finds its
place with no other edit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from autotuner import op_mapping
from autotuner.model import build
from autotuner.ops.annotate import RecordingAnnotator, annotating, set_range_context
from autotuner.ops.naming import parse_range
from autotuner.ops_test.base import (
    ATTENTION,
    FACTORY,
    FUNCTION,
    LAYER,
    MLP,
    MODULE,
    REGISTRY,
    ShapePoint,
    register_op,
)
from autotuner.ops_test.places import LAYERS, op_for, op_tree
from autotuner.report import data
from tests.conftest import dense_model_ops

REPO = Path(__file__).resolve().parents[1]

# Multi-Latent Attention's sub-ops (and the q norm, which the dense attention has too), in its forward order.
MLA_OPS = (
    "q_down_proj",
    "kv_down_proj",
    "q_layernorm",
    "kv_layernorm",
    "mla_q_proj",
    "q_up_proj",
    "kv_up_proj",
)
MLA_PATHS = {
    "linear_q_down_proj": "q_down_proj",
    "linear_kv_down_proj": "kv_down_proj",
    "q_layernorm": "q_layernorm",
    "kv_layernorm": "kv_layernorm",
    "linear_q_proj": "mla_q_proj",
    "linear_q_up_proj": "q_up_proj",
    "linear_kv_up_proj": "kv_up_proj",
}
# The Mixture-of-Experts ops, in the order MoELayer.forward runs them (tests/test_moe_ops.py runs them).
MOE_OPS = ("moe_layer", "shared_experts", "router", "token_dispatch", "experts", "token_combine")
# The tables as they were written by hand before the ops declared their places: the regression check.
WRITTEN_OP_ORDER = (
    "embedding",
    "transformer_block",
    "transformer_layer",
    "input_layernorm",
    "self_attention",
    "linear_qkv",
    *MLA_OPS,
    "rope",
    "core_attention",
    "linear_proj",
    "post_attention_layernorm",
    "self_attn_bda",
    "pre_mlp_layernorm",
    "mlp",
    "linear_fc1",
    "activation",
    "linear_fc2",
    "post_mlp_layernorm",
    *MOE_OPS,
    "mlp_bda",
    "final_layernorm",
    "output_layer",
)
WRITTEN_FUNCTIONAL_OPS = ("matmul", "copy", "h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned")
WRITTEN_LAYER_MODULE_OPS = {
    "": "transformer_layer",
    "input_layernorm": "input_layernorm",
    "self_attention": "self_attention",
    "self_attention.linear_qkv": "linear_qkv",
    **{f"self_attention.{path}": op for path, op in MLA_PATHS.items()},
    "self_attention.core_attention": "core_attention",
    "self_attention.linear_proj": "linear_proj",
    "self_attention.post_layernorm": "post_attention_layernorm",
    "pre_mlp_layernorm": "pre_mlp_layernorm",
    "mlp": "mlp",
    "mlp.linear_fc1": "linear_fc1",
    "mlp.linear_fc2": "linear_fc2",
    "mlp.post_layernorm": "post_mlp_layernorm",
    "mlp.shared_experts": "shared_experts",
    "mlp.router": "router",
    "mlp.experts": "experts",
}
WRITTEN_LAYER_FACTORY_OPS = {"self_attn_bda": "self_attn_bda", "mlp_bda": "mlp_bda"}
WRITTEN_MODEL_MODULE_OPS = {
    "embedding": "embedding",
    "decoder": "transformer_block",
    "decoder.final_layernorm": "final_layernorm",
    "output_layer": "output_layer",
}
WRITTEN_LAYER_PARTS = (
    "input_layernorm",
    "self_attention",
    "self_attn_bda",
    "pre_mlp_layernorm",
    "mlp",
    "moe_layer",
    "mlp_bda",
)
WRITTEN_SUBLAYER_PARTS = {
    "self_attention": (
        "linear_qkv",
        *MLA_OPS,
        "rope",
        "core_attention",
        "linear_proj",
        "post_attention_layernorm",
    ),
    "mlp": ("linear_fc1", "activation", "linear_fc2", "post_mlp_layernorm"),
    "moe_layer": MOE_OPS[1:],
}


@pytest.fixture
def scratch_registry():
    """The registry, restored afterwards: an op registered in a test leaves no trace."""
    saved = dict(REGISTRY)
    try:
        yield REGISTRY
    finally:
        REGISTRY.clear()
        REGISTRY.update(saved)


def _build(ctx, point):
    raise AssertionError("never built here")


def test_the_derived_tables_are_the_ones_once_written():
    assert op_mapping.OP_ORDER == WRITTEN_OP_ORDER
    layer = WRITTEN_OP_ORDER[
        WRITTEN_OP_ORDER.index("input_layernorm") : WRITTEN_OP_ORDER.index("mlp_bda") + 1
    ]
    assert op_mapping.LAYER_SUB_OPS == layer
    assert op_mapping.ATTENTION_OPS == frozenset(layer[: layer.index("self_attn_bda") + 1])
    assert op_mapping.MLP_OPS == frozenset(layer[layer.index("pre_mlp_layernorm") :])
    # order matters to the instrumentation only in that every path is there; keep it anyway (model order)
    assert list(op_mapping.LAYER_MODULE_OPS.items()) == list(WRITTEN_LAYER_MODULE_OPS.items())
    assert list(op_mapping.LAYER_FACTORY_OPS.items()) == list(WRITTEN_LAYER_FACTORY_OPS.items())
    assert list(op_mapping.MODEL_MODULE_OPS.items()) == list(WRITTEN_MODEL_MODULE_OPS.items())
    assert data.LAYER_PARTS == WRITTEN_LAYER_PARTS
    assert list(data.SUBLAYER_PARTS.items()) == list(WRITTEN_SUBLAYER_PARTS.items())
    names = [t.name for t in op_mapping.ordered_tests()]
    assert names == [*WRITTEN_OP_ORDER, *WRITTEN_FUNCTIONAL_OPS]


def test_the_ops_table_in_the_docs_is_model_order_with_the_declared_places():
    text = (REPO / "docs" / "cases.md").read_text()
    start = text.index("## The ops")
    section = text[start : text.index("\n## ", start + 1)]
    rows = re.findall(r"^\| `(\w+)` \| `([\w.\[\]]*)` \|", section, flags=re.M)
    assert [op for op, _ in rows] == list(op_mapping.OP_ORDER)
    for op, where in rows:
        test = REGISTRY[op]
        shown = f"{LAYERS}[i]" if test.container == LAYER and not test.where else test.where
        assert where == shown, op


def test_reading_the_places_imports_no_torch():
    """The report (the results side) derives the layer's parts from the places: it must stay torch-free."""
    code = (
        "import sys; import autotuner.report.data, autotuner.ops_test.places; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))[:3])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_every_place_is_in_the_built_model_and_instrumented_there(tiny_session):
    model, ctx = tiny_session
    tree = op_tree()
    for name in tree.model_order:
        # the ops tiny's model has (the MLA and MoE ones are checked in tests/test_mla_ops.py and
        # tests/test_moe_ops.py, q_layernorm needs qk_layernorm)
        if name not in dense_model_ops():
            continue
        test = tree.tests[name]
        owner = ctx.layer if test.container == LAYER else model
        path = test.where if test.kind != FUNCTION else test.where.rpartition(".")[0]
        obj = owner
        for attr in filter(None, path.split(".")):
            assert hasattr(obj, attr), f"{name}: no {attr!r} on the way to {test.where!r}"
            obj = getattr(obj, attr)
        if test.kind == FUNCTION:  # its caller is its parent's module
            assert tree.tests[tree.parents[name]].where == path, name
        else:
            assert getattr(obj if test.kind == FACTORY else type(obj), "autotuner_op", None) == name, name


def test_each_op_runs_inside_the_range_of_its_parent(tiny_session, tiny_spec):
    """The parents derived from the paths are the ranges that enclose each op when the block runs."""
    from autotuner.runner import Phase

    _, ctx = tiny_session
    point = ShapePoint(8, 1)
    call = REGISTRY["transformer_block"].build(ctx, point)
    annotator = RecordingAnnotator()
    set_range_context(point.label, 0, warmup=False)
    with annotating(annotator):
        Phase("forward", call, 0).run()
    enclosing, stack = {}, []
    for kind, name, _ in annotator.events:
        if kind == "push":
            op = parse_range(name).op
            enclosing.setdefault(op, set()).add(stack[-1] if stack else None)
            stack.append(op)
        else:
            stack.pop()
    tree = op_tree()
    # tiny's ops but those around the block (tests/test_mla_ops.py and tests/test_moe_ops.py check the
    # MLA and MoE ops in their layers)
    inside_block = {n for n in dense_model_ops() if n not in ("embedding", "output_layer")}
    assert set(enclosing) == inside_block
    assert enclosing == {op: {tree.parents[op]} for op in inside_block}


def test_a_new_op_finds_its_place_with_no_other_edit(scratch_registry, tiny_session, tiny_spec):
    register_op("k_layernorm", where="self_attention.k_layernorm")(_build)
    tree = op_tree()
    order = [t.name for t in op_mapping.ordered_tests()]
    # after its parent and the siblings registered before it, before the next part of the layer
    assert order.index("post_attention_layernorm") + 1 == order.index("k_layernorm")
    assert order.index("k_layernorm") == order.index("self_attn_bda") - 1
    assert [t.name for t in op_mapping.resolve_ops(["all"])] == order[: len(WRITTEN_OP_ORDER) + 1]
    assert tree.parents["k_layernorm"] == "self_attention" and tree.half("k_layernorm") == ATTENTION
    assert "k_layernorm" in tree.in_half(ATTENTION) and "k_layernorm" in tree.layer_ops
    assert tree.children("self_attention")[-1] == "k_layernorm"
    parts = op_mapping.model_parts(op_mapping.resolve_ops(["k_layernorm"]), 2, False)
    assert (parts.attention, parts.mlp) == (True, False)
    # the instrumentation finds it too (a model of its own: the session's must stay as it is)
    spec = tiny_spec
    model = build.build_model(spec.model_args, spec.tf_config, build.ModelParts(), spec.device, False)
    op_mapping.instrument_gpt(model)
    assert type(model.decoder.layers[0].self_attention.k_layernorm).autotuner_op == "k_layernorm"


def test_alternatives_at_one_path_are_told_apart_by_class(scratch_registry):
    for name in MOE_OPS:  # registered here again, alone
        del scratch_registry[name]

    class MoELayer:  # stands for Megatron's: only the class name counts
        pass

    register_op("moe_layer", where="mlp", module_class="MoELayer", half=MLP)(_build)
    register_op("router", where="mlp.router", parent="moe_layer")(_build)
    tree = op_tree()
    order = tree.model_order
    # next to the dense MLP (after its parts), not after the last op registered in the layer
    assert order[order.index("post_mlp_layernorm") :][:4] == (
        "post_mlp_layernorm",
        "moe_layer",
        "router",
        "mlp_bda",
    )
    assert tree.parents["router"] == "moe_layer" and tree.half("router") == MLP
    at_mlp = tree.placed(LAYER, MODULE)["mlp"]
    assert op_for(at_mlp, MoELayer()).name == "moe_layer" and op_for(at_mlp, object()).name == "mlp"
    assert tree.paths(LAYER, MODULE)["mlp"] == "mlp"

    assert tree.parents["linear_fc1"] == "mlp"  # the dense MLP's parts need no edit
    register_op("experts", where="mlp.experts")(_build)  # forgot parent="moe_layer": the default's
    assert op_tree().parents["experts"] == "mlp"


def test_a_place_that_cannot_be_instrumented_is_refused(scratch_registry):
    with pytest.raises(ValueError, match="already sits at 'mlp'"):
        register_op("dense_again", where="mlp")(_build)
    with pytest.raises(ValueError, match="instrument hook"):
        register_op("unhooked", where="mlp.gate", kind=FUNCTION)(_build)
    with pytest.raises(ValueError, match="only an op inside the layer"):
        register_op("head_half", where="output_layer.x", needs="head", half=MLP)(_build)
    with pytest.raises(ValueError, match="parent 'mlp' is not an op above"):
        register_op("astray", where="self_attention.astray", parent="mlp")(_build)
        op_tree()
