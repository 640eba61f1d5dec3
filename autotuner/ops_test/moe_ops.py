"""The Mixture-of-Experts ops: Megatron-Core's ``MoELayer`` and the steps its forward runs.

``MoELayer.forward`` (0.16) computes the shared experts, routes, then hands the tokens to its token
dispatcher and experts. The ops, registered in that order (model order), and what each measured call
covers, in the model as alone:

* ``moe_layer`` (``mlp`` of an MoE layer): the whole layer, ``mlp(hidden)``.
* ``shared_experts``: the shared experts' MLP on every token (skipped where the model has none).
* ``router``: gating and top-k, ``router(hidden) -> (probs, routing_map)``, in training mode, so with the
  auxiliary load-balancing loss attached when ``moe_aux_loss_coeff > 0`` (its backward included).
* ``token_dispatch``: the dispatcher's three dispatch steps, ``dispatch_preprocess`` (reshape; the
  all-to-all dispatcher's permute), ``token_dispatch`` (the all-gather or all-to-all under expert or
  tensor parallelism) and ``dispatch_postprocess`` (the all-gather dispatcher's permute, tokens per
  expert): ``(hidden, probs, routing_map) -> (permuted tokens, tokens_per_expert, permuted probs)``.
* ``experts``: every local expert on its permuted tokens, ``experts(permuted, tokens_per_expert,
  permuted_probs)`` (SequentialMLP, GroupedMLP or TEGroupedMLP: the row's ``experts_impl``).
* ``token_combine``: the three combine steps, ``combine_preprocess`` (the all-gather dispatcher's
  unpermute), ``token_combine`` (the reduce-scatter or all-to-all) and ``combine_postprocess`` (the
  all-to-all dispatcher's unpermute, the reshape to ``[s, b, h]``).

How the dispatcher's steps are grouped and how routing reaches the ops: docs/model_families.md, "The MoE
ops".
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from autotuner.ops_test.base import (
    FUNCTION,
    MLP,
    OpCall,
    OpContext,
    OpNotApplicable,
    ShapePoint,
    is_moe_layer,
    register_op,
)

if TYPE_CHECKING:
    import torch

    from autotuner.model.routing import ExpertLoad, Routing


# --- the dispatcher's steps, grouped --------------------------------------------------------------


def _base(dispatcher: Any) -> type:
    """Megatron's dispatcher class, past our grouping subclass."""
    return getattr(type(dispatcher), "autotuner_base", type(dispatcher))


def dispatch_steps(
    dispatcher: Any, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dispatcher's three dispatch steps: ``(hidden [s, b, h], probs, routing_map)`` to ``(permuted
    tokens, tokens per local expert, permuted probs)``, as the MoE layer runs them."""
    base = _base(dispatcher)
    hidden, probs = base.dispatch_preprocess(dispatcher, hidden, routing_map, probs)
    hidden, probs = base.token_dispatch(dispatcher, hidden, probs)
    return base.dispatch_postprocess(dispatcher, hidden, probs)


def combine_steps(dispatcher: Any, expert_output: torch.Tensor) -> torch.Tensor:
    """The dispatcher's three combine steps: the experts' output back to ``[s, b, h]``, for the tokens of
    the dispatcher's last dispatch."""
    base = _base(dispatcher)
    output = base.combine_preprocess(dispatcher, expert_output)
    output = base.token_combine(dispatcher, output)
    return base.combine_postprocess(dispatcher, output)


_GROUPED: dict[type, type] = {}


def _grouped_class(cls: type) -> type:
    """The subclass of a Megatron dispatcher class whose dispatch and combine each run whole, as one op
    (docs/model_families.md, "The MoE ops"); cached, one per class."""
    if getattr(cls, "autotuner_base", None) is not None:
        return cls
    if cls not in _GROUPED:
        from autotuner.ops.instrument import call_op

        def dispatch_preprocess(self: Any, hidden: Any, routing_map: Any, probs: Any) -> Any:
            self.autotuner_routing_map = routing_map  # the group runs at token_dispatch
            return hidden, probs

        def token_dispatch(self: Any, hidden: Any, probs: Any) -> Any:
            routing_map, self.autotuner_routing_map = self.autotuner_routing_map, None
            permuted, tokens, permuted_probs = call_op(
                "token_dispatch", dispatch_steps, (self, hidden, probs, routing_map), {}
            )
            self.autotuner_tokens_per_expert = tokens
            return permuted, permuted_probs

        def dispatch_postprocess(self: Any, hidden: Any, probs: Any) -> Any:
            tokens, self.autotuner_tokens_per_expert = self.autotuner_tokens_per_expert, None
            return hidden, tokens, probs

        def combine_preprocess(self: Any, hidden: Any) -> Any:
            return hidden  # the group runs at token_combine

        def token_combine(self: Any, hidden: Any) -> Any:
            return call_op("token_combine", combine_steps, (self, hidden), {})

        def combine_postprocess(self: Any, hidden: Any) -> Any:
            return hidden

        methods = dict(
            dispatch_preprocess=dispatch_preprocess,
            token_dispatch=token_dispatch,
            dispatch_postprocess=dispatch_postprocess,
            combine_preprocess=combine_preprocess,
            token_combine=token_combine,
            combine_postprocess=combine_postprocess,
        )
        name = f"Grouped{cls.__name__}"
        _GROUPED[cls] = type(
            name,
            (cls,),
            {**methods, "autotuner_base": cls, "__module__": __name__, "__qualname__": name},
        )
    return _GROUPED[cls]


def _moe_layers(model: Any) -> list[Any]:
    decoder = getattr(model, "decoder", None)
    return [layer for layer in getattr(decoder, "layers", ()) if is_moe_layer(layer)]


def instrument_dispatcher(model: Any, op: str) -> None:
    """Give every MoE layer's dispatch and combine their ranges: its dispatcher's class becomes the
    grouping subclass (the same for both ops; its state is untouched)."""
    for layer in _moe_layers(model):
        dispatcher = layer.mlp.token_dispatcher
        dispatcher.__class__ = _grouped_class(type(dispatcher))


# --- routing ---------------------------------------------------------------------------------------


def forced_map(
    routing: Routing, seed: int, num_tokens: int, num_experts: int, topk: int, device: torch.device
) -> torch.Tensor:
    """The forced routing map of a call of ``num_tokens`` tokens: drawn on the host from the run's seed
    and the token count (the ops and the layer at one shape get the same map), then put on ``device``."""
    import torch

    from autotuner.model.routing import forced_routing_map

    generator = torch.Generator().manual_seed((seed * 1_000_003 + num_tokens * 7919 + 104_729) % (2**63))
    return forced_routing_map(num_tokens, num_experts, topk, routing, generator).to(device)


def _map_device(router: Any) -> torch.device:
    """Where a forced map lives: with the router's weight, except on the meta device (dry_run), where it
    stays on the host so the dispatcher can count and permute by it (autotuner.runner.dry_run)."""
    import torch

    device = router.weight.device
    return torch.device("cpu") if device.type == "meta" else device


def _forced_forward(router: Any, routing: Routing, seed: int) -> Any:
    """The router's forward, then its output replaced by the forced map (docs/model_families.md, "The
    MoE ops")."""
    from autotuner.model.routing import forced_probs
    from autotuner.ops.instrument import call_op

    made: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    def substituted(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # the class's forward (our instrumented one once the model is instrumented), looked up per call
        probs, routing_map = type(router).forward(router, *args, **kwargs)
        key = (routing_map.shape, probs.dtype, probs.device)
        if key not in made:  # drawn once per shape, outside the timed calls that follow the first
            chosen = forced_map(routing, seed, *routing_map.shape, router.topk, _map_device(router))
            made[key] = (chosen, forced_probs(chosen, probs.dtype).to(probs.device))
        chosen, chosen_probs = made[key]
        # the forced values, with the router's gradient path: its backward (and aux loss's) still runs
        return chosen_probs + (probs - probs.detach()), chosen

    def routed(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return call_op("router", substituted, args, kwargs, module=router)

    routed.autotuner_routing = (routing, seed)  # type: ignore[attr-defined]
    return routed


def force_routing(model: Any, routing: Routing, seed: int) -> None:
    """Make every MoE layer's router in ``model`` hand on ``routing``'s forced map (an instance attribute
    over the class's forward); ``learned``: the router's own output again. Idempotent."""
    for layer in _moe_layers(model):
        router = layer.mlp.router
        current = router.__dict__.get("forward")
        if getattr(current, "autotuner_routing", None) == (routing, seed):
            continue
        router.__dict__.pop("forward", None)
        if routing.forced:
            router.forward = _forced_forward(router, routing, seed)


# --- the ops' inputs -------------------------------------------------------------------------------


def _moe_only(config: Any) -> str | None:
    """``missing_from`` of the MoE ops: in models with experts only."""
    if getattr(config, "num_moe_experts", None):
        return None
    return "a Mixture-of-Experts op; this model's MLP is dense (no num_moe_experts): see mlp"


def _shared_experts_only(config: Any) -> str | None:
    """``missing_from`` of shared_experts: in MoE models with shared experts only."""
    if _moe_only(config) or getattr(config, "moe_shared_expert_intermediate_size", None):
        return _moe_only(config)
    return "this MoE layer has no shared experts (no moe_shared_expert_intermediate_size)"


def _moe(ctx: OpContext) -> Any:
    """The profiled MoE layer's ``MoELayer``, with the run's routing in force on every MoE layer."""
    layer = ctx.layer
    if not is_moe_layer(layer):
        raise OpNotApplicable(_moe_only(ctx.config) or "no layer built holds an MoE layer")
    force_routing(ctx.model, ctx.routing, ctx.seed)
    return layer.mlp


class Routed:
    """One routing of an op's seeded hidden states ``[s, b, h]`` through a layer's router (forced where the
    run forces it) and dispatcher: what each MoE op's inputs and row fields are made from. The probs and
    the dispatched tensors are detached."""

    def __init__(self, ctx: OpContext, mlp: Any, point: ShapePoint) -> None:
        import torch

        self.hidden = ctx.hidden(point)
        # the op's own dispatcher: its state (the last dispatch's permutation) is the op's alone
        self.dispatcher = copy.copy(mlp.token_dispatcher)
        with torch.no_grad():
            probs, self.routing_map = mlp.router(self.hidden)
            self.probs = probs.detach()
            self.permuted, self.tokens_per_expert, self.permuted_probs = dispatch_steps(
                self.dispatcher, self.hidden.detach(), self.probs, self.routing_map
            )
        self.fields = _row_fields(ctx, mlp, self.load)

    @property
    def load(self) -> ExpertLoad:
        from autotuner.model.routing import ExpertLoad

        return ExpertLoad.from_counts(self.tokens_per_expert)


def _row_fields(ctx: OpContext, mlp: Any, load: ExpertLoad) -> dict[str, Any]:
    from autotuner.model.routing import moe_setup_fields

    return {**load.row_fields(ctx.routing.mode), **moe_setup_fields(mlp.experts, ctx.config)}


def _grad_leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(True)


# --- the ops, in the order MoELayer.forward runs them -----------------------------------------------


@register_op(
    "moe_layer",
    aliases=("MoELayer",),
    where="mlp",
    module_class="MoELayer",
    half=MLP,
    missing_from=_moe_only,
)
def moe_layer(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The Mixture-of-Experts MLP: shared experts, router, dispatch, experts, combine."""
    mlp = _moe(ctx)
    routed = Routed(ctx, mlp, point)
    return OpCall(mlp, (routed.hidden,), mlp, row_fields=routed.fields)


@register_op(
    "shared_experts", where="mlp.shared_experts", parent="moe_layer", missing_from=_shared_experts_only
)
def shared_experts(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The shared experts: one MLP every token goes through, beside the routed experts."""
    shared = getattr(_moe(ctx), "shared_experts", None)
    if shared is None:
        raise OpNotApplicable(_shared_experts_only(ctx.config) or "this MoE layer has no shared experts")
    return OpCall(shared, (ctx.hidden(point),), shared)


@register_op(
    "router", aliases=("TopKRouter",), where="mlp.router", parent="moe_layer", missing_from=_moe_only
)
def router(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Gating and top-k routing (with the auxiliary load-balancing loss where enabled)."""
    mlp = _moe(ctx)
    routed = Routed(ctx, mlp, point)
    return OpCall(mlp.router, (routed.hidden,), mlp.router, row_fields=routed.fields)


@register_op(
    "token_dispatch",
    where="mlp.token_dispatch",
    parent="moe_layer",
    kind=FUNCTION,
    instrument=instrument_dispatcher,
    missing_from=_moe_only,
)
def token_dispatch(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The token dispatcher's dispatch: permute the tokens by expert (and gather them across ranks)."""
    from autotuner.ops.instrument import instrumented_function

    routed = Routed(ctx, _moe(ctx), point)
    dispatcher = routed.dispatcher
    steps = instrumented_function(dispatch_steps, "token_dispatch")

    def call(hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> Any:
        return steps(dispatcher, hidden, probs, routing_map)

    inputs = (routed.hidden, _grad_leaf(routed.probs), routed.routing_map)
    return OpCall(call, inputs, row_fields=routed.fields)


@register_op(
    "experts",
    aliases=("SequentialMLP", "GroupedMLP"),
    where="mlp.experts",
    parent="moe_layer",
    missing_from=_moe_only,
)
def experts(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Every local expert on the tokens dispatched to it (grouped GEMM or one MLP per expert)."""
    mlp = _moe(ctx)
    routed = Routed(ctx, mlp, point)
    inputs = (_grad_leaf(routed.permuted), routed.tokens_per_expert, _grad_leaf(routed.permuted_probs))
    return OpCall(mlp.experts, inputs, mlp.experts, row_fields=routed.fields)


@register_op(
    "token_combine",
    where="mlp.token_combine",
    parent="moe_layer",
    kind=FUNCTION,
    instrument=instrument_dispatcher,
    missing_from=_moe_only,
)
def token_combine(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The token dispatcher's combine: un-permute the experts' output (and reduce it across ranks)."""
    from autotuner.ops.instrument import instrumented_function

    routed = Routed(ctx, _moe(ctx), point)
    dispatcher = routed.dispatcher  # holds the permutation of the routing it dispatched
    steps = instrumented_function(combine_steps, "token_combine")
    expert_output = ctx.randn(tuple(routed.permuted.shape), "expert_output")
    return OpCall(lambda out: steps(dispatcher, out), (expert_output,), row_fields=routed.fields)
