"""``capture=<file>``: profile what a training run actually called, through the usual launchers.

:func:`case_from_capture` turns a validated RunSpec (the case's model and settings) plus a capture into the
spec to run:

* **Megatron-Core plan** (the capture holds Megatron layers, autotuner.capture.megatron): the case's ops at
  exactly the captured shape points instead of the case's lists. The captured sizes (hidden size, heads,
  KV groups, head size, FFN size) must be the case's, so the profiled model is the one that trained.
* **Generic plan** (no Megatron layers, or ``ops=[captured]``): every distinct captured call is an op of its
  own (autotuner.capture.generic); no Megatron model is built (the spec's ``session`` is
  :func:`open_generic_session`, which autotuner.runner.spec.open_session calls instead).

Either way each row gets ``call_count``: how often the op ran at that point in the captured steps, so
median time x call_count ranks what matters in the real run.

Importing this module registers :func:`feed` for the ``capture`` config key
(autotuner.runner.spec.register_feed): the entry points that resolve specs (autotuner.main, the nsys
worker) import it, so autotuner.runner.spec never imports capture code.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from autotuner.capture import megatron
from autotuner.capture.generic import (
    CallPoint,
    GenericOp,
    covered_paths,
    distinct_calls,
    op_stem,
    signature_label,
)
from autotuner.capture.schema import Capture, load
from autotuner.capture.tensors import NotReplayable
from autotuner.errors import UserError
from autotuner.model.runtime import DTYPES
from autotuner.ops.naming import PHASES
from autotuner.ops_test.base import LAYER, REGISTRY, OpTest
from autotuner.runner import RunSpec
from autotuner.runner.spec import register_feed

CAPTURED = "captured"  # ops=[captured]: the capture's own calls, even from a Megatron model
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def feed(spec: RunSpec, cfg: DictConfig) -> RunSpec:
    """``capture=<file>``: the spec that profiles the capture (see :func:`case_from_capture`), with the
    ops and the explicit dtype of the command line."""
    return case_from_capture(spec, cfg.capture, list(cfg.ops), None if cfg.dtype == "auto" else spec.dtype)


def case_from_capture(spec: RunSpec, path: str, ops: list[str], dtype: str | None) -> RunSpec:
    """The spec that profiles ``path``'s capture. ``ops`` as given on the command line; ``dtype`` the
    explicit dtype (None for auto: a generic plan then keeps each recorded dtype)."""
    capture = load(path)
    if not capture.calls:
        raise UserError(
            f"capture file {path} holds no calls: check the step window and that the script trains"
        )
    if ops != [CAPTURED]:
        calls = megatron.megatron_calls(capture)
        if calls:
            return _megatron_spec(spec, capture, calls)
        if ops not in (["all"], []):
            raise UserError(
                f"capture file {path} holds no Megatron-Core layer calls for ops={ops}: "
                "leave ops unset (or ops=[captured]) to profile its own calls"
            )
    return _generic_spec(spec, capture, dtype)


def _steps_note(capture: Capture) -> str:
    return (
        f"{capture.total_calls} calls in {capture.steps_captured} optimizer step(s), status {capture.status}"
    )


def _megatron_spec(spec: RunSpec, capture: Capture, calls: list[megatron.MegatronCall]) -> RunSpec:
    _check_sizes(spec, megatron.merged_dims(calls), capture)
    points = megatron.captured_points(calls)
    limit = spec.model_args.max_sequence_length
    too_long = sorted({p.seq_len for p in points if p.seq_len > limit})
    if too_long:
        raise UserError(
            f"captured sequence lengths {too_long} exceed max_position_embeddings={limit} of case "
            f"{spec.case}: raise hf.max_position_embeddings"
        )
    layer_functions = sorted(
        name for name, test in REGISTRY.items() if LAYER in test.needs and name not in _module_ops()
    )
    note = f"shape points {[p.label for p in points]} from capture {capture.path} ({_steps_note(capture)})"
    return dataclasses.replace(
        spec,
        points=points,
        call_counts=megatron.call_counts(calls, layer_functions),
        notes=[*spec.notes, note],
    )


def _module_ops() -> set[str]:
    from autotuner.op_mapping import LAYER_MODULE_OPS

    return set(LAYER_MODULE_OPS.values())


def _check_sizes(spec: RunSpec, dims: dict[str, set[int]], capture: Capture) -> None:
    """The captured per-rank sizes must be the case's: otherwise the profile is of another model."""
    cfg = spec.tf_config
    tp = cfg.tensor_model_parallel_size
    expected = {
        "hidden_size": cfg.hidden_size,
        "attention_heads": cfg.num_attention_heads // tp,
        "query_groups": (cfg.num_query_groups or cfg.num_attention_heads) // tp,
        "kv_channels": cfg.kv_channels,
        "ffn_hidden_size": cfg.ffn_hidden_size // tp,
    }
    wrong = [
        f"{name} {sorted(seen)} (case: {expected[name]})"
        for name, seen in sorted(dims.items())
        if name in expected and seen != {expected[name]}
    ]
    if wrong:
        raise UserError(
            f"capture {capture.path} is of another model than case {spec.case} (TP={tp}): captured "
            f"{'; '.join(wrong)}: use the case and tf.tensor_model_parallel_size the capture ran with"
        )


def _generic_spec(spec: RunSpec, capture: Capture, dtype: str | None) -> RunSpec:
    override = DTYPES[dtype] if dtype else None
    covered = covered_paths(capture)
    ops: list[OpTest] = []
    plan, counts, notes, skipped = [], {}, [], Counter[str]()
    numbers: Counter[str] = Counter()
    for call in sorted(distinct_calls(capture), key=lambda c: (c.record.kind, c.record.callee, -c.count)):
        record = call.record
        if record.kind == "module" and covered.intersection(call.paths):
            skipped[f"{record.class_name} (its own function calls are profiled)"] += 1
            continue
        stem = op_stem(record)
        name = f"{stem}_{numbers[stem]}"
        try:
            build = GenericOp(name, call, spec.device, override)
        except NotReplayable as exc:
            skipped[str(exc)] += 1
            continue
        numbers[stem] += 1
        notes += build.notes
        op = OpTest(name=name, build=build, needs=frozenset(), description=record.callee)
        point = CallPoint(seq_len=None, micro_batch_size=None, signature=signature_label(record))  # type: ignore[arg-type]
        ops.append(op)
        phases = PHASES if build.has_backward else PHASES[:1]
        plan += [(point, op, phase) for phase in phases if phase in spec.phases]
        counts[(name, point.label)] = call.count
    if not ops:
        raise UserError(f"nothing in capture {capture.path} can be replayed: {'; '.join(skipped)}")
    notes.append(f"generic plan of {len(ops)} calls from capture {capture.path} ({_steps_note(capture)})")
    notes += [f"not replayed ({n}x): {reason}" for reason, n in sorted(skipped.items())]
    return dataclasses.replace(
        spec,
        case=f"capture:{capture.path.stem}",
        dtype=_plan_dtype(capture, dtype, spec.dtype),
        ops=ops,
        points=list(dict.fromkeys(p for p, _, _ in plan)),
        plan=plan,
        session=open_generic_session,
        call_counts=counts,
        notes=notes,  # the case's own notes are about a model this plan does not build
    )


def _plan_dtype(capture: Capture, explicit: str | None, fallback: str) -> str:
    """The dtype the rows report: the explicit one, else the most common recorded floating dtype."""
    if explicit:
        return explicit
    seen = Counter(
        arg["tensor"]["dtype"]
        for call in capture.calls
        for arg in call.args
        if isinstance(arg, dict) and isinstance(arg.get("tensor"), dict)
    )
    floating = [name for name, _ in seen.most_common() if name in _DTYPE_NAMES]
    return _DTYPE_NAMES[floating[0]] if floating else fallback


class GenericContext:
    """What generic ops share in a session: the device, the seed, and every op's weights."""

    def __init__(self, weights: nn.ModuleDict, device: torch.device, seed: int) -> None:
        self.weights, self.device, self.seed = weights, device, seed


def open_generic_session(spec: RunSpec) -> tuple[Any, GenericContext]:
    """The session of a generic plan: no Megatron model, only each op's weights, made up front so the
    launchers see them as the model's parameters (excluded from activation bytes, as in the model)."""
    torch.manual_seed(spec.seed)
    weights = nn.ModuleDict(
        {op.name: op.build.make_weights(spec.seed) for op in spec.ops if isinstance(op.build, GenericOp)}
    )
    return weights, GenericContext(weights, spec.device, spec.seed)


register_feed("capture", feed)
