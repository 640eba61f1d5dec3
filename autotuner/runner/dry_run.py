"""``dry_run=true``: the plan of a run, what each op holds and costs, before any weight is allocated.

The model is Megatron's own GPTModel built on the ``meta`` device (shapes and dtypes, no storage), so the
parameter counts are those of the model a run builds, not a formula beside it. Each planned op is built by
its own op builder (autotuner.ops_test) on that model, with meta inputs, and its phases run on meta
tensors: torch's FlopCounterMode counts their FLOPs as the ``flops`` metric counts a measured phase, and
:meth:`autotuner.runner.Phase.bytes_moved` counts their bytes from the tensors' shapes. Nothing is timed,
nothing is written. The layer spec is the local one (Transformer-Engine's fuses the norms into the next
linear on a GPU: per-op parameters move, the totals do not).

The parameter counts, total and active, are autotuner.model.counts's, of the same meta model.

A Mixture-of-Experts layer's work depends on data: its dispatcher counts the tokens each expert got on
the host (``tokens_per_expert.cpu()``) and selects them (``masked_select``), which meta tensors cannot do.
The preview therefore routes with a forced map made on the host (autotuner.ops_test.moe_ops.force_routing):
the run's ``moe.routing`` where it forces one, ``balanced`` in place of ``learned`` (whose choice depends on
the weights' values), and says so. Inside the MoE ops, :class:`_HostCounts` lets meta tensors be selected
and indexed by those host tensors: the experts then run on the number of tokens the map gives them, so
their FLOPs are those of that routing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from autotuner.errors import one_line
from autotuner.measure.flops import flop_counter
from autotuner.measure.memory import gradient_buffers
from autotuner.model.counts import META, build_meta_model, count_parameters, meta_session
from autotuner.model.routing import Routing
from autotuner.notices import Notices
from autotuner.ops_test.base import OpCall, OpContext, OpTest, ShapePoint
from autotuner.results.units import human_bytes, human_si
from autotuner.runner import Phase, RunSpec
from autotuner.runner.memory_estimate import (
    MemoryEstimate,
    PhasePeak,
    PlannedPhase,
    Workspace,
    build_peak,
    describe_estimate,
    phase_peak,
    plan_estimates,
)
from autotuner.runner.plan import plan

if TYPE_CHECKING:
    from autotuner.measure.limits import MemoryLimit
    from autotuner.runner.fit import FitCheck


@dataclass(frozen=True)
class PhaseCost:
    """One planned (point, op, phase): its op's weights, FLOPs and bytes moved (None where the phase
    could not run on meta tensors; ``error`` says why)."""

    op: str
    phase: str
    point: str
    parameters: int
    weight_bytes: int
    flops: int | None
    bytes_moved: int | None
    error: str | None = None
    memory: PhasePeak | None = None  # what the phase holds at its own peak (autotuner.runner.memory_estimate)


@dataclass(frozen=True)
class Preview:
    """What ``dry_run=true`` prints (see :func:`render`)."""

    case: str
    dtype: str
    total_parameters: int
    active_parameters: int
    parts_bytes: int  # the parameters of the model parts the run builds
    parts: str  # the model parts the run builds, in words
    costs: list[PhaseCost]
    routing: str | None = None  # how the MoE ops were routed, in words; None: no MoE layer built
    notes: tuple[str, ...] = ()  # what the case's model has that the run does not express (RunSpec.notes)
    # per cost, the process's peak while it measures that row (None where the phase could not run on meta)
    estimates: list[MemoryEstimate | None] = dataclasses.field(default_factory=list)
    build_peak: int = 0  # the process's peak while it builds the model parts

    def point_peaks(
        self, refused: Container[tuple[str, str, str]] = ()
    ) -> dict[str, tuple[PhaseCost, MemoryEstimate]]:
        """Per point, its largest row's estimate, the ``refused`` (point, op, phase) left out: the peak of
        a process that measures that point."""
        found: dict[str, tuple[PhaseCost, MemoryEstimate]] = {}
        for cost, guess in zip(self.costs, self.estimates, strict=True):
            if guess is None or (cost.point, cost.op, cost.phase) in refused:
                continue
            if cost.point not in found or guess.total > found[cost.point][1].total:
                found[cost.point] = (cost, guess)
        return found


def _unique_parameters(module: torch.nn.Module | None) -> list[torch.nn.Parameter]:
    """The module's parameters, a tied one once (``parameters()`` already removes duplicates)."""
    return [] if module is None else list(module.parameters())


def _numel(params: list[torch.nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


class MetaContext(OpContext):
    """The op builders' inputs as meta tensors of the shapes and dtypes a run makes (no data drawn)."""

    def randn(self, shape: tuple[int, ...], salt: str, requires_grad: bool = True) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=META).requires_grad_(requires_grad)

    def causal_mask(self, point: ShapePoint) -> torch.Tensor:
        return torch.empty((1, 1, point.seq_len, point.seq_len), dtype=torch.bool, device=META)

    def token_ids(self, point: ShapePoint) -> torch.Tensor:
        return torch.empty((point.micro_batch_size, point.seq_len), dtype=torch.long, device=META)

    def rotary(self, point: ShapePoint) -> torch.Tensor:
        # Megatron makes the rotary table's frequencies on the host whatever the default device: a small
        # table ([s, 1, 1, d]), moved to meta like the rest.
        table = super().rotary(point)
        return None if table is None else table.to(META)  # None: MLA makes its own inside the attention


class _MetaPhase(Phase):
    """A Phase whose output gradients are meta tensors (a real run draws them seeded on the host)."""

    def _output_grads(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._grads is None:
            self._grads = [torch.empty_like(t, device=META) for t in outputs]
        return self._grads


class _HostCounts(TorchDispatchMode):
    """Meta tensors operated on with host tensors whose values decide shapes (a forced routing map, the
    indices permuted by it): ``masked_select`` of a meta tensor by a host mask gives a meta tensor of as
    many elements as the mask selects; in any other operation with a meta tensor, a host tensor (not a
    0-d scalar, which torch already mixes) is taken to the meta device, as its shape is all that counts
    there. Operations on host tensors alone run as they are (the dispatcher counts its tokens there)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat, layout = tree_flatten((args, kwargs or {}))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if not any(t.device.type == "meta" for t in tensors):
            return func(*args, **(kwargs or {}))
        if func is torch.ops.aten.masked_select.default:
            source, mask = args
            if mask.device.type != "meta":
                shape = torch.broadcast_shapes(source.shape, mask.shape)
                return source.new_empty((int(mask.expand(shape).sum()),))
        flat = [
            t.to(META) if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.dim() else t
            for t in flat
        ]
        args, kwargs = tree_unflatten(flat, layout)
        return func(*args, **kwargs)


def preview_routing(routing: Routing) -> Routing:
    """The routing the preview costs the MoE ops with: the run's where forced, else ``balanced``."""
    return routing if routing.forced else Routing("balanced", routing.zipf_s)


def model_parameters(spec: RunSpec) -> tuple[int, int]:
    """(total, active) parameters of the whole model: every layer, the embedding and the output layer."""
    counts = count_parameters(spec.model_args, spec.tf_config)
    return counts.total, counts.active


def _phase_cost(
    op: OpTest, point: ShapePoint, phase: str, call: OpCall | Exception, mapped_from: int | None, buffer: Any
) -> PhaseCost:
    base = {"op": op.name, "phase": phase, "point": point.label}
    if isinstance(call, Exception):  # the op could not be built (not in this layer spec, ...)
        return PhaseCost(
            **base, parameters=0, weight_bytes=0, flops=None, bytes_moved=None, error=one_line(call)
        )
    params = _unique_parameters(call.module)
    weights = sum(p.numel() * p.element_size() for p in params)
    base["parameters"] = _numel(params)
    try:
        moved = _MetaPhase(phase, call, 0).bytes_moved()
        counted = _MetaPhase(phase, call, 0)
        if counted.prepare is not None:
            counted.prepare()
        with flop_counter() as counter:
            counted.run()
        flops = int(counter.get_total_flops())
        del counted
        buffer.take_asked()
        memory = phase_peak(_MetaPhase(phase, call, 0), point.seq_len, gradient_buffers, mapped_from)
        memory = dataclasses.replace(memory, buffer_bytes=buffer.take_asked())
    except Exception as exc:  # noqa: BLE001 - the preview says which op it cannot cost, and goes on
        return PhaseCost(**base, weight_bytes=weights, flops=None, bytes_moved=None, error=one_line(exc))
    return PhaseCost(**base, weight_bytes=weights, flops=flops, bytes_moved=moved, memory=memory)


def preview(
    spec: RunSpec, workspace: Workspace | None = None, totals: bool = True, limit: int | None = None
) -> Preview:
    """Count the whole model's parameters and cost every planned (point, op, phase) on meta tensors: its
    FLOPs, bytes moved, and the peak memory of the process while it measures it (the resident weights of
    the parts the run builds, autotuner.op_mapping.model_parts, the phase's own peak and ``workspace``:
    autotuner.runner.memory_estimate; by default this process's runtime and no observer's extras).
    ``totals=False`` leaves the whole model's parameter counts out (0), which take a model of every layer.
    ``limit``: the memory the process can hold, over which a row is not run (autotuner.runner.fit)."""
    from autotuner.model.build import moe_layer_pattern
    from autotuner.op_mapping import model_parts, needs_model
    from autotuner.ops_test.base import is_moe_layer
    from autotuner.ops_test.moe_ops import force_routing

    args = spec.model_args
    workspace = workspace or Workspace.of_process(spec.device)
    total, active = model_parameters(spec) if totals else (0, 0)
    tf = spec.tf_config  # under torchrun, the job's own groups: each rank's shards
    sizes = (tf.tensor_model_parallel_size, tf.expert_model_parallel_size, tf.expert_tensor_parallel_size)
    with meta_session(spec.emulation, sizes if spec.world > 1 else (1, 1, None)) as buffer:
        parts = model_parts(
            spec.ops, spec.block_layers, args.tie_word_embeddings, moe_layer_pattern(spec.tf_config)
        )
        model = build_meta_model(spec.model_args, spec.tf_config, parts) if needs_model(spec.ops) else None
        routing = preview_routing(spec.routing)
        moe = model is not None and any(is_moe_layer(layer) for layer in model.decoder.layers)
        if moe:  # every MoE layer, so the layers and the block that call one route on the host too
            force_routing(model, routing, spec.seed)
        context = MetaContext(
            model, META, spec.tf_config.params_dtype, spec.seed, config=spec.tf_config, routing=routing
        )
        costs: list[PhaseCost] = []
        calls: dict[tuple[ShapePoint, str], OpCall | Exception] = {}
        with _HostCounts():
            for point, op, phase in plan(spec):
                key = (point, op.name)
                if key not in calls:
                    try:
                        calls[key] = op.build(context, point)
                    except Exception as exc:  # noqa: BLE001 - as a run records it: this op's rows say why
                        calls[key] = exc
                costs.append(_phase_cost(op, point, phase, calls[key], workspace.mapped_from, buffer))
    parts_bytes = sum(p.numel() * p.element_size() for p in _unique_parameters(model))
    tensors = [*_unique_parameters(model), *(model.buffers() if model is not None else ())]
    resident = sum(t.numel() * t.element_size() for t in tensors)
    backwards = {(c.point, c.op): c.memory for c in costs if c.phase == "backward"}
    rows = [PlannedPhase(c.phase, c.memory, backwards.get((c.point, c.op))) for c in costs]
    largest = max((t.numel() * 4 for t in tensors), default=0)  # Megatron's master copies are fp32
    tp = spec.tf_config.tensor_model_parallel_size
    return Preview(
        case=spec.case,
        dtype=spec.dtype,
        total_parameters=total,
        active_parameters=active,
        parts_bytes=parts_bytes,
        parts=_describe_parts(parts) if model is not None else "none: no op of the model",
        costs=costs,
        routing=_describe_routing(spec.routing, routing) if moe else None,
        notes=(*spec.notes, *_attention_note(spec)),
        estimates=plan_estimates(rows, resident, workspace, limit),
        build_peak=build_peak(resident, largest * tp, workspace, spec.device.type == "cpu"),
    )


def _attention_note(spec: RunSpec) -> tuple[str, ...]:
    """The preview costs Megatron's local attention on meta tensors, whatever ``attention`` builds."""
    if spec.attention == "local" or not any(op.name == "core_attention" for op in spec.ops):
        return ()
    return (
        f"core_attention is previewed as the local attention, the run builds attention={spec.attention}: "
        "a fused kernel's backward recomputes the scores, five matrix products where the preview counts four",
    )


def _describe_routing(asked: Routing, used: Routing) -> str:
    mode = f"zipf (s={used.zipf_s})" if used.mode == "zipf" else used.mode
    if asked == used:
        return f"MoE ops routed as moe.routing={mode} asks"
    return (
        f"MoE ops routed {mode}: moe.routing={asked.mode} depends on the router's weights, which a dry "
        "run does not have (the measured rows record the learned routing)"
    )


def _describe_parts(parts: Any) -> str:
    words = [f"{parts.num_layers} layer{'s' if parts.num_layers > 1 else ''}"]
    if not (parts.attention and parts.mlp):
        words[0] += " with " + ("attention" if parts.attention else "MLP") + " only"
    words += [
        name for name, built in (("embedding", parts.pre_process), ("head", parts.post_process)) if built
    ]
    return ", ".join(words)


def render(result: Preview, fit: FitCheck | None = None) -> str:
    """The preview as text: the counts, one line per planned phase with the process's estimated peak
    while it measures it (``refused`` where the ``fit`` check refuses it), then per point its largest
    row's peak by term, and the check's verdict."""
    from tabulate import tabulate

    def peak(cost: PhaseCost, guess: MemoryEstimate | None) -> str:
        if guess is None:
            return "n/a"
        refused = fit is not None and (cost.point, cost.op, cost.phase) in fit.refused
        return human_bytes(guess.total) + (" refused" if refused else "")

    rows = [
        [
            c.op,
            c.phase,
            c.point,
            c.parameters,
            human_bytes(c.weight_bytes),
            human_si(c.flops, "FLOP") if c.flops is not None else f"n/a ({c.error})",
            human_bytes(c.bytes_moved),
            peak(c, guess),
        ]
        for c, guess in zip(result.costs, result.estimates, strict=True)
    ]
    table = tabulate(
        rows,
        headers=["op", "phase", "point", "parameters", "weights", "flops", "bytes_moved", "peak"],
        disable_numparse=True,
    )
    lines = [
        f"dry run of case={result.case} ({result.dtype}): nothing built on a device, nothing measured",
        f"parameters: total {result.total_parameters}, active {result.active_parameters}",
        *([result.routing] if result.routing else []),
        *Notices().note(*result.notes).lines(),
        "",
        table,
        "",
        "peak: the process's estimated peak memory while it measures the row (docs/memory_and_fit.md)",
        f"building the model: peak {human_bytes(result.build_peak)}",
    ]
    refused = fit.refused if fit is not None else set()
    for point, (cost, guess) in result.point_peaks(refused).items():
        title = f"{point}: peak {{total}} at {cost.op} {cost.phase}"
        if any(key[0] == point for key in refused):
            title += " (of the rows that fit)"
        lines += ["", *describe_estimate(guess, title, result.parts)]
    if fit is not None:
        verdict = fit.advice or f"every row fits in {human_bytes(fit.limit.bytes)} ({fit.limit.source})"
        lines += ["", f"fit check: {verdict}"]
    return "\n".join(lines)


def dry_run(spec: RunSpec, workspace: Workspace | None = None, limit: MemoryLimit | None = None) -> str:
    """The preview of one resolved run, as text, with the fit check a run would make now. ``workspace``:
    what the run's observer adds to the model's tensors (autotuner.runner.memory_estimate.Workspace.of);
    None: this process's runtime alone. ``limit``: the run's (autotuner.runner.fit.run_limit); None: what
    the device lets this process hold now. Raises UserError for what it cannot preview."""
    from autotuner.errors import UserError
    from autotuner.measure.limits import memory_limit
    from autotuner.runner.fit import judge

    if spec.session is not None:  # a capture's generic plan: no Megatron model to build on meta
        raise UserError(
            "dry_run=true previews plans of the Megatron model, not a capture's generic calls: "
            "drop capture= or dry_run=true"
        )
    workspace, limit = workspace or Workspace.of_process(spec.device), limit or memory_limit(spec.device)
    seen = preview(spec, workspace, limit=limit.bytes)
    return render(seen, judge(spec, workspace, limit, seen))
