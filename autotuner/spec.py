"""From a composed config to a validated RunSpec, and from a RunSpec to a built model.

Every check of user input happens in :func:`resolve_spec`, before any model is built or measured, and
fails with a one-line :class:`UserError`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from autotuner import cases
from autotuner.errors import UserError
from autotuner.hf_to_megatron import map_hf_config
from autotuner.measure.timer import PRECISION_RULES
from autotuner.ops_test.base import OpContext
from autotuner.runner import RunSpec
from autotuner.runtime import DTYPES, resolve_device, resolve_dtype
from autotuner.shapes import generate_points, merge


def resolve_spec(cfg: DictConfig) -> RunSpec:
    """Validate the config and derive everything the run needs. Raises UserError on bad input."""
    from autotuner import model as model_lib
    from autotuner.op_mapping import resolve_ops
    from autotuner.runtime import quiet_megatron_import

    case = cases.load_case(cfg.case, cfg.case_dir)
    hf_overrides = OmegaConf.to_container(cfg.hf, resolve=True) or {}
    tf_overrides = OmegaConf.to_container(cfg.tf, resolve=True) or {}
    if cfg.transformer_block_layers <= 0:
        raise UserError("transformer_block_layers must be positive: set transformer_block_layers=2")
    timing = cfg.timing
    if (
        timing.warmup < 0
        or timing.min_samples < 1
        or timing.max_samples < timing.min_samples
        or min(timing.budget_s, timing.target_rel_ci, timing.min_block_s, timing.threads) < 0
        or timing.check_every < 1
    ):
        raise UserError(
            "timing needs warmup >= 0, 1 <= min_samples <= max_samples, check_every >= 1 and budget_s, "
            "target_rel_ci, min_block_s, threads >= 0: fix timing.*"
        )
    if timing.precision_rule not in PRECISION_RULES or timing.target_rel_iqr < 0:
        raise UserError(
            f"timing.precision_rule={timing.precision_rule!r}, target_rel_iqr={timing.target_rel_iqr}: "
            f"use one of {', '.join(PRECISION_RULES)} and a target_rel_iqr >= 0"
        )
    op_names = list(cfg.ops)
    # ops=[captured] (with capture=): the capture's own calls, no op of ours (autotuner.capture.replay)
    ops = resolve_ops(["all"] if cfg.capture and op_names == ["captured"] else op_names)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if timing.cuda_graph and device.type != "cuda":
        raise UserError(
            f"timing.cuda_graph replays CUDA graphs, but the device is {device.type}: "
            "drop timing.cuda_graph or run with device=cuda"
        )
    hf_config = cases.build_hf_config(case.hf_fields, hf_overrides)
    args = map_hf_config(hf_config)
    quiet_megatron_import()
    tp = int(tf_overrides.get("tensor_model_parallel_size", 1))
    if device.type == "cpu" and tf_overrides.get("sequence_parallel"):
        raise UserError(
            "sequence_parallel needs reduce-scatter and all-gather collectives that gloo lacks on CPU: "
            "drop tf.sequence_parallel or run on GPUs"
        )
    tf_config = model_lib.build_transformer_config(args, tf_overrides, dtype, device, tp)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if tp < 1 or world % tp:
        raise UserError(
            f"tensor_model_parallel_size={tp} needs a multiple of {tp} processes, this job has {world}: "
            f"launch with torchrun --nproc-per-node={tp}"
        )
    shapes = merge(case.shapes, OmegaConf.to_container(cfg.shapes, resolve=True))
    points = generate_points(shapes, sequence_multiple=tp if tf_config.sequence_parallel else 1)
    too_long = sorted({p.seq_len for p in points if p.seq_len > args.max_sequence_length})
    if too_long:
        raise UserError(
            f"shapes.seq_len {too_long} exceed max_position_embeddings={args.max_sequence_length}: "
            "use shorter sequences or raise hf.max_position_embeddings"
        )
    use_te = device.type == "cuda" and model_lib.transformer_engine_available()
    spec = RunSpec(
        case=cfg.case,
        model_args=args,
        tf_config=tf_config,
        ops=ops,
        points=points,
        device=device,
        dtype=dtype,
        seed=int(cfg.seed),
        block_layers=int(cfg.transformer_block_layers),
        use_transformer_engine=use_te,
        threads=int(timing.threads),
        notes=list(args.notes),
    )
    if cfg.capture:
        from autotuner.capture.replay import case_from_capture

        spec = case_from_capture(spec, cfg.capture, op_names, None if cfg.dtype == "auto" else dtype)
    return spec


def open_session(spec: RunSpec) -> tuple[Any, OpContext]:
    """Start the process group, seed, and build the instrumented model holding the selected ops."""
    from autotuner import cpu_bridges
    from autotuner.model import build_model
    from autotuner.op_mapping import model_parts, needs_model
    from autotuner.runtime import init_parallel, seed_everything

    if spec.threads:
        torch.set_num_threads(spec.threads)
    if spec.ops and not any(op.needs for op in spec.ops):  # a capture's generic plan: no Megatron model
        from autotuner.capture.replay import open_generic_session

        return open_generic_session(spec)
    cpu_bridges.apply(spec.device)
    init_parallel(spec.device, spec.tf_config.tensor_model_parallel_size)
    seed_everything(spec.seed, spec.device)
    if not needs_model(spec.ops):  # only the functional ops: nothing to build
        context = OpContext(None, spec.device, DTYPES[spec.dtype], spec.seed, config=spec.tf_config)
        return torch.nn.Module(), context
    parts = model_parts(spec.ops, spec.block_layers, spec.model_args.tie_word_embeddings)
    model = build_model(spec.model_args, spec.tf_config, parts, spec.device, spec.use_transformer_engine)
    return model, OpContext(model, spec.device, DTYPES[spec.dtype], spec.seed)
