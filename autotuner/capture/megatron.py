"""Megatron-Core calls in a capture, as our op names and shape points.

A module is recognised by the nearest Megatron-Core class in its class hierarchy (the capture's
``base``), so subclasses, ours included, count. Every ``TransformerLayer`` and ``GPTModel`` found anchors
the module paths below it: a module at ``<layer path>.<suffix>`` is the op that
``autotuner.op_mapping.LAYER_MODULE_OPS`` gives ``suffix`` (``self_attention.linear_qkv`` -> ``linear_qkv``),
one at ``<model path>.<suffix>`` the op of ``MODEL_MODULE_OPS``. Both tables are the ones the profiler
instruments, so a captured call and a profiled op are the same module by construction.

The shape point of a call is read from its first tensor input: ``[s, b, ...]`` everywhere in Megatron-Core,
except the embedding's token ids, ``[b, s]``. Besides the point, the inputs show the model's sizes per
tensor-parallel rank (hidden size, attention heads, KV groups, head size, FFN size), which replay checks
against the case. With sequence parallelism the sub-modules see ``s / TP``: the points are then per rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from autotuner.capture.schema import CallRecord, Capture
from autotuner.op_mapping import LAYER_MODULE_OPS, MODEL_MODULE_OPS
from autotuner.ops_test.base import ShapePoint

LAYER_CLASS, MODEL_CLASS = "TransformerLayer", "GPTModel"


@dataclass
class MegatronCall:
    """All captured calls of one op at one shape point."""

    op: str
    point: ShapePoint
    count: int
    paths: list[str] = field(default_factory=list)
    dims: dict[str, int] = field(default_factory=dict)


def _is_megatron(record: CallRecord, class_name: str) -> bool:
    return (record.base or "").startswith("megatron.core.") and record.base_name == class_name


def _tensors(values: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [v["tensor"] for v in values if isinstance(v, dict) and isinstance(v.get("tensor"), dict)]


def _inputs(record: CallRecord) -> list[dict[str, Any]]:
    """Tensor inputs, the named first input (hidden_states, input_ids) ahead of the rest."""
    named = [record.kwargs[k] for k in ("hidden_states", "input_ids", "input_") if k in record.kwargs]
    return _tensors([*named, *record.args, *record.kwargs.values()])


def _point(op: str, record: CallRecord) -> ShapePoint | None:
    tensors = _inputs(record)
    if not tensors or len(tensors[0]["shape"]) < 2:
        return None
    first, second = tensors[0]["shape"][:2]
    return (
        ShapePoint(seq_len=second, micro_batch_size=first) if op == "embedding" else ShapePoint(first, second)
    )


def _dims(op: str, record: CallRecord) -> dict[str, int]:
    """Model sizes (per tensor-parallel rank) that this op's inputs show."""
    tensors = _inputs(record)
    if op == "transformer_layer" and tensors:
        return {"hidden_size": tensors[0]["shape"][-1]}
    if op == "core_attention" and len(tensors) >= 2 and len(tensors[0]["shape"]) == 4:
        query, key = tensors[0]["shape"], tensors[1]["shape"]
        return {"attention_heads": query[2], "kv_channels": query[3], "query_groups": key[2]}
    if op == "linear_fc2" and tensors:
        return {"ffn_hidden_size": tensors[0]["shape"][-1]}
    return {}


def _anchored_op(path: str, anchors: dict[str, str]) -> str | None:
    """The op of the module at ``path``, from the nearest enclosing layer or model path."""
    parts = path.split(".") if path else []
    for cut in range(len(parts), -1, -1):
        anchor = ".".join(parts[:cut])
        kind = anchors.get(anchor)
        if kind is None:
            continue
        suffix = ".".join(parts[cut:])
        op = (LAYER_MODULE_OPS if kind == LAYER_CLASS else MODEL_MODULE_OPS).get(suffix)
        if op is not None or kind == LAYER_CLASS:
            return op  # inside a layer, a module the table does not name is no op of ours
    return None


def megatron_calls(capture: Capture) -> list[MegatronCall]:
    """The Megatron-Core ops in a capture, one entry per (op, shape point), counts summed over layers."""
    anchors = {r.path: MODEL_CLASS for r in capture.calls if _is_megatron(r, MODEL_CLASS)}
    anchors.update({r.path: LAYER_CLASS for r in capture.calls if _is_megatron(r, LAYER_CLASS)})
    found: dict[tuple[str, ShapePoint], MegatronCall] = {}
    for record in capture.calls:
        if record.kind != "module" or not anchors:
            continue
        op = _anchored_op(record.path, anchors)
        point = _point(op, record) if op else None
        if op is None or point is None:
            continue
        call = found.setdefault((op, point), MegatronCall(op, point, 0))
        call.count += record.count
        call.paths.append(record.path)
        call.dims.update(_dims(op, record))
    return list(found.values())


def captured_points(calls: list[MegatronCall]) -> list[ShapePoint]:
    """The shape points the layers ran at (any mapped op's, if no whole layer was captured), sorted."""
    layer = [c.point for c in calls if c.op == "transformer_layer"]
    points = set(layer or [c.point for c in calls])
    return sorted(points, key=lambda p: (p.seq_len, p.micro_batch_size))


def call_counts(calls: list[MegatronCall], layer_function_ops: Iterable[str]) -> dict[tuple[str, str], int]:
    """(op, point label) -> captured calls. Ops that are functions inside the layer (RoPE, bias-dropout-
    add, the activation) are not modules and leave no record: each runs once per layer call, so they get
    the layer's count."""
    counts = {(c.op, c.point.label): c.count for c in calls}
    for call in calls:
        if call.op == "transformer_layer":
            for op in layer_function_ops:
                counts.setdefault((op, call.point.label), call.count)
    return counts


def merged_dims(calls: list[MegatronCall]) -> dict[str, set[int]]:
    dims: dict[str, set[int]] = {}
    for call in calls:
        for name, value in call.dims.items():
            dims.setdefault(name, set()).add(value)
    return dims
