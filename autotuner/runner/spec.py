"""From a composed config to a validated RunSpec, and from a RunSpec to a built model.

Every check of user input happens in :func:`resolve_spec`, before any model is built or measured, and
fails with a one-line :class:`UserError`.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from autotuner.errors import UserError
from autotuner.measure.timer import PRECISION_RULES
from autotuner.model import cases
from autotuner.model.emulation import Emulation, check_rank
from autotuner.model.hf_to_megatron import map_hf_config
from autotuner.model.host_heap import keep_freed_memory
from autotuner.model.routing import Routing
from autotuner.model.runtime import (
    DTYPES,
    check_expert_parallel,
    gloo_has_sequence_parallel_collectives,
    process_rank,
    resolve_device,
    resolve_dtype,
)
from autotuner.model.sdpa_attention import resolve as resolve_attention
from autotuner.ops_test.base import BLOCK, OpCall, OpContext, OpTest, ShapePoint
from autotuner.runner import RunSpec
from autotuner.runner.shapes import generate_points, merge

# A feed turns the case's spec into the spec of what another source asks to profile: (spec, cfg) -> spec.
Feed = Callable[[RunSpec, DictConfig], RunSpec]
# Config keys that name a feed, and the feeds registered for them. A feed's module registers itself
# when imported (``capture``: autotuner.capture.replay, imported by the entry points), so this module
# need not import it: the feed sits above the spec, not below it.
FEED_KEYS = ("capture",)
_FEEDS: dict[str, Feed] = {}


def register_feed(key: str, feed: Feed) -> None:
    """Have ``feed`` turn the spec whenever the config key ``key`` (one of :data:`FEED_KEYS`) is set."""
    if key not in FEED_KEYS:
        raise ValueError(f"no config key {key!r} names a feed (FEED_KEYS: {', '.join(FEED_KEYS)})")
    _FEEDS[key] = feed


def _fed(spec: RunSpec, cfg: DictConfig) -> RunSpec:
    for key in FEED_KEYS:
        if not cfg.get(key):
            continue
        if key not in _FEEDS:
            # A programming error, not bad input: the entry point forgot the import that registers it.
            raise RuntimeError(f"{key}= is set but no feed is registered for it: import its module first")
        spec = _FEEDS[key](spec, cfg)
    return spec


def _check_case_shapes(case: cases.Case, settings: DictConfig) -> None:
    """The case's ``shapes:`` block has the keys and types of the ``shapes.*`` settings (the structured
    config's node, which the command line's overrides met in Hydra): a misspelt key, or a number where a
    list is due, is refused naming the case file, not met deep in the shape generators."""
    try:
        OmegaConf.merge(settings, case.shapes)
    except OmegaConfBaseException as exc:
        problem = str(exc).splitlines()[0].rstrip(".")
        raise UserError(
            f"case file {case.path}: {exc.full_key}: {problem}: {cases.FIXES['shapes']}"
        ) from None


def resolve_spec(cfg: DictConfig) -> RunSpec:
    """Validate the config and derive everything the run needs. Raises UserError on bad input."""
    from autotuner.model import build as model_lib
    from autotuner.model.runtime import quiet_megatron_import
    from autotuner.op_mapping import resolve_ops

    case = cases.load_case(cfg.case, cfg.case_dir)
    hf_overrides = OmegaConf.to_container(cfg.hf, resolve=True) or {}
    tf_overrides = OmegaConf.to_container(cfg.tf, resolve=True) or {}
    if cfg.transformer_block_layers <= 0:
        raise UserError("transformer_block_layers must be positive: set transformer_block_layers=2")
    if not 0 <= cfg.seed < 2**32:  # torch takes 64 bits, Megatron adds offsets (rank, 2718) to it
        raise UserError(f"seed={cfg.seed} is out of range: give a seed from 0 to {2**32 - 1}")
    timing = cfg.timing
    not_finite = [
        name for name, value in timing.items() if isinstance(value, float) and not math.isfinite(value)
    ]
    if not_finite:  # nan passes every comparison below; inf would time, or hold, for ever
        raise UserError(f"timing.{not_finite[0]}={timing[not_finite[0]]} is not a number: give a finite one")
    # A time no one means (a typo's extra zeros): one op's sampling, or one wait, longer than this.
    for name, limit in (("budget_s", 3600), ("min_time_s", 3600), ("idle_before_ms", 60_000)):
        if timing[name] > limit:
            raise UserError(
                f"timing.{name}={timing[name]} is over {limit} (per op and phase, or per sample): "
                f"give at most {limit}"
            )
    if (
        timing.warmup < 0
        or timing.min_samples < 1
        or timing.max_samples < timing.min_samples
        or min(
            timing.budget_s,
            timing.target_rel_ci,
            timing.min_block_s,
            timing.threads,
            timing.idle_before_ms,
            timing.min_time_s,
            timing.held_activations_mib,
        )
        < 0
    ):
        raise UserError(
            "timing needs warmup >= 0, 1 <= min_samples <= max_samples and budget_s, "
            "target_rel_ci, min_block_s, threads, idle_before_ms, min_time_s, held_activations_mib >= 0: fix "
            "timing.*"
        )
    if cfg.memory_limit_gib is not None and not cfg.memory_limit_gib > 0:
        raise UserError(
            f"memory_limit_gib={cfg.memory_limit_gib} is no memory: give a positive number of GiB, or leave "
            "it out for what the device has"
        )
    cpus = usable_cpus()
    if timing.threads > cpus:
        # torch would start that many threads (a segfault at 100000) or oversubscribe the cores it times
        raise UserError(
            f"timing.threads={timing.threads} is more than the {cpus} CPU(s) this process may run on: "
            f"set timing.threads between 1 and {cpus}, or 0 for torch's default"
        )
    if timing.precision_rule not in PRECISION_RULES or timing.target_rel_iqr < 0:
        raise UserError(
            f"timing.precision_rule={timing.precision_rule!r}, target_rel_iqr={timing.target_rel_iqr}: "
            f"use one of {', '.join(PRECISION_RULES)} and a target_rel_iqr >= 0"
        )
    routing = Routing(cfg.moe.routing, cfg.moe.zipf_s)  # UserError for a bad moe.routing or moe.zipf_s
    op_names = list(cfg.ops)
    # ops=[captured] (with capture=): the capture's own calls, no op of ours (autotuner.capture.replay)
    op_names = ["all"] if cfg.capture and op_names == ["captured"] else op_names
    ops = resolve_ops(op_names)  # unknown names fail here, before any model work
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
    model_lib.check_tf_overrides(tf_overrides)
    tp = int(tf_overrides.get("tensor_model_parallel_size", 1))
    tf_overrides = _parallel_overrides(args, tf_overrides, device, tp)
    tf_config = model_lib.build_transformer_config(args, tf_overrides, dtype, device, tp)
    if not tf_config.num_moe_experts and routing != Routing():  # nothing reads them: refused, not recorded
        given = [
            f"moe.{k}={cfg.moe[k]}"
            for k, v in (("routing", "mode"), ("zipf_s", "zipf_s"))
            if getattr(routing, v) != getattr(Routing(), v)
        ]
        raise UserError(
            f"{', '.join(given)}: case {cfg.case} has no experts (a dense model), and the routing settings "
            "apply to MoE models only: drop them"
        )
    ops = resolve_ops(op_names, tf_config)  # "all" now means the ops this model has
    # Never a block the model does not have (mixing MoE and dense layers, its layer pattern would be cut
    # short): a model of fewer layers (calibrate's one-layer steps, a cut-down case) has them all.
    block_layers = min(int(cfg.transformer_block_layers), tf_config.num_layers)
    notes = list(args.notes)
    if block_layers < cfg.transformer_block_layers and any(BLOCK in t.needs for t in ops):
        notes.append(
            f"transformer_block measures the model's {block_layers} layer(s), not "
            f"transformer_block_layers={cfg.transformer_block_layers}: the model has no more"
        )
    rank, world = process_rank()  # once per run: below, the spec carries them
    emulation = _emulation(cfg, tf_config, world)
    ranks = emulation.world if emulation is not None else world
    if tp < 1 or ranks % tp:
        raise UserError(
            f"tensor_model_parallel_size={tp} needs a multiple of {tp} processes, this job has {world}: "
            f"launch with torchrun --nproc-per-node={tp}"
        )
    check_expert_parallel(ranks, tf_config.expert_model_parallel_size, tf_config.expert_tensor_parallel_size)
    _check_case_shapes(case, cfg.shapes)
    shapes = merge(case.shapes, OmegaConf.to_container(cfg.shapes, resolve=True))
    points = generate_points(shapes, sequence_multiple=tp if tf_config.sequence_parallel else 1)
    too_long = sorted({p.seq_len for p in points if p.seq_len > args.max_sequence_length})
    if too_long:
        raise UserError(
            f"shapes.seq_len {too_long} exceed max_position_embeddings={args.max_sequence_length}: "
            "use shorter sequences or raise hf.max_position_embeddings"
        )
    use_te = device.type == "cuda" and model_lib.transformer_engine_available()
    attention, chose = resolve_attention(str(cfg.attention), device, use_te, tf_config)
    if chose is not None:
        notes.append(chose)
    spec = RunSpec(
        case=cfg.case,
        model_args=args,
        tf_config=tf_config,
        ops=ops,
        points=points,
        device=device,
        dtype=dtype,
        seed=int(cfg.seed),
        block_layers=block_layers,
        use_transformer_engine=use_te,
        attention=attention,
        threads=int(timing.threads),
        notes=notes,
        rank=rank,
        world=world,
        routing=routing,
        emulation=emulation,
    )
    if emulation is not None and cfg.parallel.rank is None and emulation.ep > 1:
        if cfg.dry_run:  # a preview allocates no weight, and finding the busiest rank routes real ones
            spec.notes.append(
                "dry_run previews rank 0 of the expert-parallel layout: a run defaults to the busiest rank "
                "(give parallel.rank=N to preview another)"
            )
        else:
            spec.emulation = busiest_expert_rank(spec)
    if emulation is not None:
        spec.notes.append(
            f"emulated: rank {spec.emulation.rank} of {spec.emulation.describe()} in this one process; its "
            "collectives are recorded, not run (docs/parallel_emulation.md)"
        )
    return _fed(spec, cfg)


def _emulation(cfg: DictConfig, tf_config: Any, world: int) -> Emulation | None:
    """The layout this process emulates one rank of: without torchrun, where TP or EP x ETP is above 1
    (None otherwise); ``parallel.rank`` checked against it (the default rank, None for EP, is settled by
    :func:`busiest_expert_rank`). UserError (one line) for ``parallel.rank`` without such a layout, a rank
    outside it, and what an emulated rank cannot be (pipeline stages, context parallelism)."""
    wanted = cfg.parallel.rank
    tp, ep = tf_config.tensor_model_parallel_size, tf_config.expert_model_parallel_size
    etp = tf_config.expert_tensor_parallel_size or tp
    if world > 1 or max(tp, ep * etp) == 1:
        if wanted is not None:
            raise UserError(
                f"parallel.rank={wanted} picks the rank of an emulated layout (TP or EP above 1, without "
                "torchrun): drop parallel.rank"
            )
        return None
    for name, kind in (("pipeline_model_parallel_size", "pipeline"), ("context_parallel_size", "context")):
        size = getattr(tf_config, name, 1) or 1
        if size != 1:
            raise UserError(
                f"tf.{name}={size}: an emulated rank holds no {kind} parallelism: set tf.{name}=1 "
                "(autotuner.predict models it)"
            )
    emulation = Emulation(tp, ep, etp, bool(tf_config.sequence_parallel))
    if wanted is None:
        return emulation  # rank 0; under EP the busiest, settled once the spec exists
    return dataclasses.replace(emulation, rank=check_rank(wanted, emulation.world, emulation.describe()))


def busiest_expert_rank(spec: RunSpec) -> Emulation:
    """``spec.emulation`` at its busiest rank: the one whose local experts get the most token assignments
    over the spec's shape points, each routed as the MoE ops route it (the profiled layer's router, the
    run's ``moe.routing`` forced on it, on the seeded hidden states of that rank's sequence slice); the
    lowest such rank on a tie. Every rank's peers hold its data (autotuner.model.emulation), so a rank's
    tokens are its own routing's, times the group size. Found on a model built as rank 0, then stopped."""
    from autotuner.model import cpu_bridges
    from autotuner.model import emulation as emulated
    from autotuner.model.build import build_model, moe_layer_pattern
    from autotuner.model.runtime import seed_everything
    from autotuner.op_mapping import model_parts

    assert spec.emulation is not None
    layout = spec.emulation
    cpu_bridges.apply(spec.device)
    emulated.start(layout)
    try:
        seed_everything(spec.seed, spec.device)
        parts = model_parts(
            spec.ops,
            spec.block_layers,
            spec.model_args.tie_word_embeddings,
            moe_layer_pattern(spec.tf_config),
        )
        model = build_model(spec.model_args, spec.tf_config, parts, spec.device, spec.use_transformer_engine)
        context = _context(spec, model)
        router = context.layer.mlp.router
        experts = spec.tf_config.num_moe_experts
        load = [0] * layout.world
        with torch.no_grad():
            for point in spec.points:
                full = context.randn(
                    (point.seq_len, point.micro_batch_size, spec.tf_config.hidden_size), "hidden"
                )
                part = point.seq_len // layout.tp if layout.sequence_parallel else point.seq_len
                for rank in range(layout.world):
                    start = layout.tp_rank(rank) * part if layout.sequence_parallel else 0
                    routing_map = router(full[start : start + part])[1]
                    mine = layout.local_experts(experts, rank)
                    load[rank] += int(routing_map[:, mine.start : mine.stop].sum())
    except Exception as exc:
        raise UserError(
            f"cannot find the busiest rank of {layout.describe()} ({_first_line(exc)}): give parallel.rank=N"
        ) from exc
    finally:
        emulated.stop()
        model = context = router = None
        _free_memory(spec.device)  # the run builds its own model, as another process may (nsys's worker)
    busiest = max(range(layout.world), key=lambda r: (load[r], -r))
    spec.notes.append(
        f"parallel.rank defaults to the busiest rank, {busiest}: token assignments to each rank's experts "
        f"over the shape points {load} (moe.routing={spec.routing.mode})"
    )
    return dataclasses.replace(layout, rank=busiest)


def _parallel_overrides(
    args: Any, tf_overrides: dict[str, Any], device: torch.device, tp: int
) -> dict[str, Any]:
    """Check the sequence- and expert-parallel settings against the model and the device, and settle the
    expert tensor-parallel size; the ``tf.`` overrides to build with (a copy where changed).

    * Sequence parallelism on a CPU needs gloo's reduce-scatter and all-gather into one tensor, which the
      installed torch is probed for (autotuner.model.runtime.gloo_has_sequence_parallel_collectives).
    * An MoE model with TP > 1 needs ``tf.sequence_parallel=true``: Megatron-Core's MoE layer refuses to
      train without it (ValueError in its forward), as every token would reach the experts TP times. It
      is required, not turned on, because it changes every op's inputs (sequence-sharded) and the
      collectives linear_qkv, linear_proj and the MLP linears run: the rows then measure the settings the
      user wrote and the run record shows.
    * Expert parallelism needs experts, and EP dividing them (autotuner.model.build checks the latter).
    * With EP > 1 the experts are not tensor-sharded unless ``tf.expert_tensor_parallel_size`` says so
      (ETP 1, where Megatron's default is the TP size): EP then spreads the experts over the same
      processes as TP, so TP=2 with EP=2 runs on 2 processes instead of needing EP x TP = 4.
    """
    experts = tf_overrides.get("num_moe_experts", args.transformer.get("num_moe_experts"))
    ep = tf_overrides.get("expert_model_parallel_size", 1)
    sequence_parallel = bool(tf_overrides.get("sequence_parallel"))
    if not isinstance(ep, int) or ep < 1:
        raise UserError(
            f"expert_model_parallel_size={ep!r} must be a whole number of at least 1: "
            "set tf.expert_model_parallel_size=1 or a divisor of the number of experts"
        )
    if device.type == "cpu" and sequence_parallel and not gloo_has_sequence_parallel_collectives():
        raise UserError(
            f"sequence_parallel needs reduce-scatter and all-gather collectives that gloo lacks in torch "
            f"{torch.__version__}: upgrade torch, drop tf.sequence_parallel or run on GPUs"
        )
    if experts and tp > 1 and not sequence_parallel:
        raise UserError(
            f"an MoE model with tensor_model_parallel_size={tp} needs sequence parallelism (Megatron-Core's "
            "MoE layer refuses TP without it in training): add tf.sequence_parallel=true"
        )
    if ep != 1 and not experts:
        raise UserError(
            f"expert_model_parallel_size={ep} but this model has no experts: "
            "drop tf.expert_model_parallel_size or choose an MoE case"
        )
    if ep > 1 and tf_overrides.get("expert_tensor_parallel_size") is None:
        return {**tf_overrides, "expert_tensor_parallel_size": 1}
    return tf_overrides


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a container or taskset narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


def _context(spec: RunSpec, model: Any) -> OpContext:
    """The op builders' context for ``spec`` (``model`` None: no model, the TransformerConfig instead)."""
    config = spec.tf_config if model is None else None
    if (
        model is not None
    ):  # a forced moe.routing holds in every op, transformer_layer's too, not only the MoE ops'
        from autotuner.ops_test.moe_ops import force_routing

        force_routing(model, spec.routing, spec.seed)
    return OpContext(model, spec.device, DTYPES[spec.dtype], spec.seed, config=config, routing=spec.routing)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _PartsPerOp:
    """When the model holding every selected op does not fit: each op's own parts (autotuner.op_mapping.
    model_parts of that op alone), built when the op comes up. One such model is alive at a time, so its
    memory is free for the next; an op whose parts cannot be built fails with the reason (the Runner
    records its rows as failed) and the plan goes on."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.parts: Any = None
        self.context: OpContext | None = None
        self.failed: dict[Any, str] = {}

    def context_for(self, op: OpTest) -> OpContext:
        from autotuner.model.build import ModelBuildError, build_model, moe_layer_pattern
        from autotuner.model.runtime import seed_everything
        from autotuner.op_mapping import instrument_gpt, model_parts

        spec = self.spec
        parts = model_parts(
            [op], spec.block_layers, spec.model_args.tie_word_embeddings, moe_layer_pattern(spec.tf_config)
        )
        if parts == self.parts and self.context is not None:
            return self.context
        if parts in self.failed:
            raise ModelBuildError(self.failed[parts])
        self.parts = self.context = None
        _free_memory(spec.device)
        seed_everything(spec.seed, spec.device)  # the same weights whichever op came first
        error = None
        try:
            model = build_model(
                spec.model_args,
                spec.tf_config,
                parts,
                spec.device,
                spec.use_transformer_engine,
                spec.attention,
            )
            instrument_gpt(model)
        except Exception as exc:  # noqa: BLE001 - this op's rows record it; the plan goes on
            error = f"cannot build the model parts {op.name} needs: {_first_line(exc)}"
        if error is not None:
            _free_memory(spec.device)  # after the except block, whose traceback held the partial model
            self.failed[parts] = error
            raise ModelBuildError(error)
        self.parts, self.context = parts, _context(spec, model)
        return self.context

    def build_of(self, op: OpTest) -> Callable[[OpContext, ShapePoint], OpCall]:
        def build(_shared: OpContext, point: ShapePoint) -> OpCall:
            return op.build(self.context_for(op), point)

        return build


def open_session(spec: RunSpec) -> tuple[Any, OpContext]:
    """Start the process group, seed, and build the instrumented model holding the selected ops.

    A model that does not fit in memory is not the end of the run: each op then gets its own parts as it
    comes up (see :class:`_PartsPerOp`; ``spec.ops`` is rebound to builds that do so). Any other error
    while building is a configuration the checks of :func:`resolve_spec` let through: one line, exit 2.
    """
    from autotuner.model import cpu_bridges
    from autotuner.model.build import build_model, is_out_of_memory, moe_layer_pattern
    from autotuner.model.runtime import init_parallel, seed_everything
    from autotuner.op_mapping import instrument_gpt, model_parts, needs_model

    if spec.threads:
        torch.set_num_threads(spec.threads)
    keep_freed_memory(spec.device)
    if spec.session is not None:  # a plan that opens its own session (a capture's generic plan)
        return spec.session(spec)
    cpu_bridges.apply(spec.device)
    tf = spec.tf_config
    if spec.emulation is not None:
        from autotuner.model import emulation

        emulation.start(spec.emulation)
    else:
        init_parallel(
            spec.device,
            tf.tensor_model_parallel_size,
            tf.expert_model_parallel_size,
            tf.expert_tensor_parallel_size,
        )
    seed_everything(spec.seed, spec.device)
    if not needs_model(spec.ops):  # only the functional ops: nothing to build
        return torch.nn.Module(), _context(spec, None)
    parts = model_parts(
        spec.ops, spec.block_layers, spec.model_args.tie_word_embeddings, moe_layer_pattern(spec.tf_config)
    )
    too_large = None
    try:
        model = build_model(
            spec.model_args, spec.tf_config, parts, spec.device, spec.use_transformer_engine, spec.attention
        )
        instrument_gpt(model)
        return model, _context(spec, model)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise UserError(
                f"the model cannot be built from this configuration ({_first_line(exc)}): "
                "fix the hf./tf. overrides or the case file"
            ) from exc
        too_large = _first_line(exc)
    _free_memory(spec.device)  # outside the except block, whose traceback held the partial model
    print(
        f"autotuner: the model with every selected op does not fit ({too_large}): "
        "building each op's parts alone; an op whose parts do not fit is recorded as failed",
        file=sys.stderr,
    )
    per_op = _PartsPerOp(spec)
    spec.ops = [
        op if not needs_model([op]) else dataclasses.replace(op, build=per_op.build_of(op)) for op in spec.ops
    ]
    return torch.nn.Module(), _context(spec, None)
