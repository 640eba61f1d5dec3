"""The ops: each sees the inputs it sees inside the model (the chaining test), the registry resolves
names and aliases, and the model built holds exactly the parameters the mapping predicts."""

from __future__ import annotations

import pytest
import torch

from autotuner.errors import UserError
from autotuner.op_mapping import OP_ORDER, model_parts, needs_model, resolve_ops
from autotuner.ops_test.base import REGISTRY, OpNotApplicable, ShapePoint
from autotuner.ops_test.places import op_tree
from autotuner.predict.inputs import ModelShape


def test_chained_sub_ops_reproduce_the_layer(tiny_session):
    """Feed each sub-op of one TransformerLayer what the previous returned; the result must be the layer's."""
    from megatron.core.transformer.enums import AttnMaskType

    from autotuner.ops_test import layer_ops

    model, ctx = tiny_session
    layer, point = ctx.layer, ShapePoint(24, 3)
    x = ctx.hidden(point)
    mask, rotary = ctx.causal_mask(point), ctx.rotary(point)
    expected, _ = layer(x, attention_mask=mask, rotary_pos_emb=rotary)

    attention, mlp = layer.self_attention, layer.mlp
    normed = layer.input_layernorm(x)
    mixed, _ = attention.linear_qkv(normed)
    q, k, v = layer_ops.split_mixed_qkv(attention, mixed)
    q, k = layer_ops.rope_call(ctx, point)(q, k)
    context = attention.core_attention(
        q, k, v, mask, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=None
    )
    projected, proj_bias = attention.linear_proj(context)
    hidden = layer_ops.bda_call(layer, "self_attn_bda", proj_bias)(projected, x)
    fc1, _ = mlp.linear_fc1(layer.pre_mlp_layernorm(hidden))
    fc2, fc2_bias = mlp.linear_fc2(layer_ops.activation_call(ctx)(fc1))
    chained = layer_ops.bda_call(layer, "mlp_bda", fc2_bias)(fc2, hidden)

    assert chained.shape == expected.shape
    torch.testing.assert_close(chained, expected, rtol=0, atol=1e-5)


def test_every_op_builds_and_runs_forward_and_backward(tiny_session, tiny_spec):
    from autotuner.runner import Phase

    _, ctx = tiny_session
    point = ShapePoint(16, 2)
    # ops=[all] is the ops this model has: every op of OP_ORDER but the MLA and MoE ones
    absent = [name for name in OP_ORDER if REGISTRY[name].absent_reason(tiny_spec.tf_config)]
    assert [t.name for t in tiny_spec.ops] == [name for name in OP_ORDER if name not in absent]
    assert set(absent) == (
        set(op_tree().children("self_attention")) - {"linear_qkv", "rope", "core_attention", "linear_proj"}
    ) | set(op_tree().children("moe_layer")) | {"moe_layer", "post_mlp_layernorm"}
    skipped = set()
    for test in tiny_spec.ops:
        try:
            call = test.build(ctx, point)
        except OpNotApplicable:
            skipped.add(test.name)
            continue
        Phase("forward", call, 0).run()
        backward = Phase("backward", call, 0)
        backward.prepare()
        backward.run()
        grads = [t.grad for t in call.inputs if t.requires_grad]
        assert grads and all(g is not None for g in grads) or test.name == "embedding", test.name
    assert not skipped  # every op the model has builds and runs


def test_built_model_parameters_match_the_counts(tiny_session, tiny_spec):
    """The counts autotuner.model.counts reads off the model built on meta (which the dry run and the
    predictor use) are those of the model a run builds: parameters and parameter tensors, the layer's
    and the whole model's (the tensors torch's Adam loops over)."""
    from autotuner.model.counts import count_parameters

    model, _ = tiny_session
    counts = count_parameters(tiny_spec.model_args, tiny_spec.tf_config)
    assert counts.total == sum(p.numel() for p in model.parameters())
    layer = model.decoder.layers[0]
    assert counts.layer(False).parameters == sum(p.numel() for p in layer.parameters())
    shape = ModelShape.from_args("tiny", tiny_spec.model_args)
    assert shape.layer_tensors == len(list(layer.parameters()))
    assert shape.stage_tensors(ep=1, layers=shape.num_layers, first=True, last=True) == len(
        list(model.parameters())
    )


def test_names_aliases_and_selection():
    names = [t.name for t in resolve_ops(["fc1_op", "TEDotProductAttention", "pre_layernorm", "self_attn"])]
    assert names == ["input_layernorm", "self_attention", "core_attention", "linear_fc1"]  # model order
    assert [t.name for t in resolve_ops(None)] == list(OP_ORDER)
    with pytest.raises(UserError, match="unknown op 'fc3'"):
        resolve_ops(["fc3"])


def test_the_functional_group_is_asked_for_by_name():
    functional = ["matmul", "copy", "h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned"]
    assert [t.name for t in resolve_ops(["functional"])] == functional
    assert not {t.name for t in resolve_ops(["all"])} & set(functional)  # "all" is the model's ops
    assert [t.name for t in resolve_ops(["all", "functional"])] == [*OP_ORDER, *functional]
    assert [t.name for t in resolve_ops(["gemm", "linear_fc1"])] == ["linear_fc1", "matmul"]
    assert all(t.phases == ("forward",) for t in resolve_ops(["functional"]))
    assert not needs_model(resolve_ops(["functional"])) and needs_model(resolve_ops(["copy", "mlp"]))


def test_only_the_needed_parts_are_built():
    layer_only = model_parts(resolve_ops(["linear_qkv", "mlp"]), block_layers=2, tied_embeddings=False)
    assert (layer_only.num_layers, layer_only.pre_process, layer_only.post_process) == (1, False, False)
    head = model_parts(resolve_ops(["output_layer"]), block_layers=2, tied_embeddings=True)
    assert head.post_process and head.pre_process  # a tied output layer reads the embedding's weight
    block = model_parts(resolve_ops(["transformer_block"]), block_layers=3, tied_embeddings=False)
    assert block.num_layers == 3


def test_the_embedding_moves_the_rows_it_gathers_not_its_table(tiny_session):
    from autotuner.runner import Phase

    _, ctx = tiny_session
    point = ShapePoint(16, 2)
    call = REGISTRY["embedding"].build(ctx, point)
    table = ctx.model.embedding.word_embeddings.weight
    rows = 16 * 2 * table.shape[1] * 4  # fp32
    ids = 16 * 2 * 8  # int64 token ids
    assert Phase("forward", call, 0).bytes_moved() == ids + 2 * rows  # gathered rows read, output written
    assert Phase("backward", call, 0).bytes_moved() == ids + rows + table.numel() * 4  # dense table gradient
