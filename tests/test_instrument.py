"""The instrumentation: ranges nest in model order, forward and backward, on every op kind."""

from __future__ import annotations

import gc

import torch

from autotuner.op_mapping import LAYER_SUB_OPS
from autotuner.ops.annotate import RecordingAnnotator, annotating, set_range_context
from autotuner.ops.naming import parse_range
from autotuner.ops_test.base import ShapePoint
from autotuner.runner import Phase
from tests.conftest import dense_model_ops

# The sub-ops of tiny's dense layer: not the MLA ones, nor the MoE ones (tests/test_mla_ops.py and
# tests/test_moe_ops.py nest those in their layers), nor the q norm tiny has not (no qk_layernorm).
LAYER_FORWARD_ORDER = [op for op in LAYER_SUB_OPS if op in dense_model_ops()]


def _ranges(events, phase):
    """(name, depth) of each push of the given phase, in order."""
    out, depth = [], 0
    for kind, name, _ in events:
        if kind == "push":
            if parse_range(name).phase == phase:
                out.append((parse_range(name).op, depth))
            depth += 1
        else:
            depth -= 1
    assert depth == 0, "every push is popped"
    return out


POINT = ShapePoint(8, 1)


def _run(op_name, tiny_session, tiny_spec, point=POINT):
    _, ctx = tiny_session
    test = next(t for t in tiny_spec.ops if t.name == op_name)
    call = test.build(ctx, point)
    annotator = RecordingAnnotator()
    set_range_context(point.label, 3, warmup=False)
    with annotating(annotator):
        phase = Phase("backward", call, 0)
        phase.prepare()
        phase.run()
    return annotator.events


def test_layer_sub_ops_nest_in_model_order_forward_and_reverse_backward(tiny_session, tiny_spec):
    events = _run("transformer_layer", tiny_session, tiny_spec)
    forward = _ranges(events, "forward")
    assert forward[0] == ("transformer_layer", 0)
    inner = [op for op, depth in forward[1:]]
    # rope runs twice (q and k) inside self_attention; every other sub-op once, in model order
    assert [op for op in inner if op != "rope"] == [op for op in LAYER_FORWARD_ORDER if op != "rope"]
    assert inner.count("rope") == 2 and all(depth >= 1 for _, depth in forward[1:])
    depth_of = dict(forward[1:])
    assert depth_of["linear_qkv"] == depth_of["self_attention"] + 1 == depth_of["linear_fc1"] == 2

    backward = _ranges(events, "backward")
    assert backward[0] == ("transformer_layer", 0)
    ops = [op for op, _ in backward[1:]]
    assert (
        ops.index("mlp_bda")
        < ops.index("linear_fc2")
        < ops.index("linear_fc1")
        < ops.index("pre_mlp_layernorm")
    )
    assert (
        ops.index("pre_mlp_layernorm")
        < ops.index("linear_proj")
        < ops.index("core_attention")
        < ops.index("linear_qkv")
    )
    assert ops.index("linear_qkv") < ops.index("input_layernorm")
    assert set(ops) >= set(LAYER_FORWARD_ORDER) - {"rope"}
    names = [name for kind, name, _ in events if kind == "push"]
    assert all(parse_range(n).point == "s8_b1" and parse_range(n).iteration == 3 for n in names)


def test_an_op_whose_inputs_need_no_gradient_closes_its_backward_range(tiny_session, tiny_spec):
    events = _run("embedding", tiny_session, tiny_spec)
    assert [(k, parse_range(n).op, parse_range(n).phase) for k, n, _ in events] == [
        ("push", "embedding", "forward"),
        ("pop", "embedding", "forward"),
        ("push", "embedding", "backward"),
        ("pop", "embedding", "backward"),
    ]


def test_a_forward_without_backward_leaves_no_hook_behind(tiny_session, tiny_spec):
    _, ctx = tiny_session
    embedding_test = next(t for t in tiny_spec.ops if t.name == "embedding")
    call = embedding_test.build(ctx, ShapePoint(8, 1))
    annotator = RecordingAnnotator()
    with annotating(annotator):
        Phase("forward", call, 0).run()  # graph dropped at once
    gc.collect()
    events_before = len(annotator.events)
    with annotating(annotator):
        out = ctx.model.embedding.word_embeddings.weight.sum()
    out.backward()  # accumulates into the embedding weight: a stale hook would pop here
    assert len(annotator.events) == events_before


def test_no_annotator_calls_straight_through(tiny_session):
    _, ctx = tiny_session
    norm = ctx.layer.input_layernorm
    x = torch.randn(4, 1, ctx.config.hidden_size, requires_grad=True)
    y = norm(x)
    assert y.grad_fn is not None and "PushOnBackward" not in type(y.grad_fn).__name__
