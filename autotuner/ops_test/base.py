"""How an op is tested: a registry of op builders, the inputs they share, and the call they return.

Adding an op is one decorated function (in the spirit of tritonbench's ``register_benchmark``)::

    @register_op("linear_qkv", aliases=("qkv",), needs=LAYER, where="self_attention.linear_qkv")
    def linear_qkv(ctx: OpContext, point: ShapePoint) -> OpCall:
        attention = ctx.layer.self_attention
        return OpCall(attention.linear_qkv, (ctx.hidden(point),), module=attention.linear_qkv)

The decorator says where the op sits (``where``: its attribute path in the TransformerLayer for a ``LAYER``
op, in the GPTModel otherwise; ``kind``: how it is instrumented there), in the spirit of Megatron-Core's
``ModuleSpec``: its parent op, its place in model order and its half of the layer follow from that
(autotuner.ops_test.places), so no table lists the ops.

The function receives the built model (through :class:`OpContext`) and a shape point, and returns an
:class:`OpCall`: the instrumented op, the tensors it is called with, and the module whose parameters are
its weights. Inputs are made the way the model makes them: seeded random hidden states [s, b, h] (leaves
that require grad, so backward computes the input gradient as inside the model), a real boolean causal
mask, rotary embeddings from the model's own ``RotaryEmbedding``, token ids within the vocabulary.

Nothing here, nor in the op modules, imports torch or Megatron at import time (both are imported where an
op is built): the report reads the ops' places, and the results side imports nothing of torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotuner.ops.naming import PHASES

if TYPE_CHECKING:
    import torch

    from autotuner.model.routing import Routing

# What an op needs built (see autotuner.model.ModelParts); FUNCTIONAL ops need no model at all.
LAYER, BLOCK, EMBEDDING, HEAD, FUNCTIONAL = "layer", "block", "embedding", "head", "functional"
# How an op at its place is instrumented (autotuner.model.build.instrument_gpt): a module's class is
# swapped; a factory attribute (bias-dropout-add) is wrapped so the functions it returns are; a function
# Megatron calls by name (RoPE, the activation) is wrapped by the op's own ``instrument`` hook.
MODULE, FACTORY, FUNCTION = "module", "factory", "function"
KINDS = (MODULE, FACTORY, FUNCTION)
# The halves of a TransformerLayer a model can be built with (autotuner.model.build.ModelParts).
ATTENTION, MLP = "attention", "mlp"
# The container of the ops around the layers (the ops that need LAYER live in each TransformerLayer).
MODEL = "model"


@dataclass(frozen=True)
class ShapePoint:
    """One point of the shape sweep."""

    seq_len: int
    micro_batch_size: int

    @property
    def label(self) -> str:
        return f"s{self.seq_len}_b{self.micro_batch_size}"


@dataclass
class OpCall:
    """An op ready to run: ``fn(*inputs)`` is its forward as the model runs it.

    ``bytes_moved`` (per phase) replaces the counted minimum of autotuner.runner.Phase.bytes_moved where
    the op knows better (a copy's destination is an input it only writes; a lookup reads only the rows it
    gathers); ``ceiling`` names the calibration entry its
    rate is judged against (a copy: "memory_bandwidth"; a host transfer: "h2d_pinned", ...) instead of
    the roofline's choice. ``row_fields`` are columns the op knows about its own call (an MoE op's tokens
    per expert and routing: autotuner.model.routing.ExpertLoad.row_fields), written into both phases'
    rows by every launcher; only the columns of autotuner.results.CALL_COLUMNS.
    """

    fn: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    module: torch.nn.Module | None = None
    bytes_moved: dict[str, int] | None = None
    ceiling: str | None = None
    graphable: bool = True  # False: never CUDA-graph captured (a pageable host copy)
    row_fields: dict[str, Any] | None = None


class OpNotApplicable(Exception):
    """The op does not exist in this build (e.g. a norm that the Transformer-Engine spec fuses away)."""


@dataclass(frozen=True)
class OpTest:
    """A registered op: its canonical name, accepted aliases, what it needs built, how to build its call,
    and where it sits in the model (``where`` None: nowhere, as the functional ops)."""

    name: str
    build: Callable[[OpContext, ShapePoint], OpCall]
    aliases: tuple[str, ...] = ()
    needs: frozenset[str] = field(default_factory=frozenset)
    requires: str | None = None  # an optional package the op needs
    description: str = ""
    phases: tuple[str, ...] = PHASES  # the functional ops have no backward
    where: str | None = None  # attribute path in its container ("" the container itself)
    kind: str = MODULE
    half: str | None = None  # ATTENTION or MLP; unset: its parent's
    parent: str | None = None  # only where the path leaves it open (see autotuner.ops_test.places)
    module_class: str | None = None  # the op of this class when several ops share a path
    instrument: Callable[[Any, str], None] | None = None  # FUNCTION ops: (model, op) wraps the function
    # Which models the op is in: (TransformerConfig) -> None where a model of that config has it, else the
    # reason it has not (an MLA projection in a dense model). None: in every model.
    missing_from: Callable[[Any], str | None] | None = None

    def absent_reason(self, config: Any) -> str | None:
        """Why a model of ``config`` has no such op, or None where it has (see ``missing_from``)."""
        return None if self.missing_from is None or config is None else self.missing_from(config)

    @property
    def container(self) -> str | None:
        """Whose attribute path ``where`` is: ``LAYER`` (each TransformerLayer) for an op that needs a
        layer, else the GPTModel (``"model"``); None for an op with no place."""
        if self.where is None:
            return None
        return LAYER if LAYER in self.needs else MODEL


REGISTRY: dict[str, OpTest] = {}


def register_op(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    needs: str | tuple[str, ...] = LAYER,
    requires: str | None = None,
    phases: tuple[str, ...] = PHASES,
    where: str | None = None,
    kind: str = MODULE,
    half: str | None = None,
    parent: str | None = None,
    module_class: str | None = None,
    instrument: Callable[[Any, str], None] | None = None,
    missing_from: Callable[[Any], str | None] | None = None,
) -> Callable[[Callable[[OpContext, ShapePoint], OpCall]], Callable[[OpContext, ShapePoint], OpCall]]:
    """Register an op builder under ``name`` (and its aliases); the docstring becomes its description.

    Its place: ``where``, the attribute path of the op in its container (the TransformerLayer for an op
    that ``needs`` LAYER, the GPTModel otherwise; for a FUNCTION op, the path of the module that calls it
    plus a name of the op's own); ``kind``, how it is instrumented there (MODULE, FACTORY, or FUNCTION with
    its ``instrument`` hook); ``half``, the half of the layer it needs built (the layer's direct parts say
    it; the ops inside them inherit it). ``parent`` and ``module_class`` are for the rare path that does
    not settle it: of two ops at one path (a dense MLP and an MoE layer at ``mlp``), the one that is not
    the default names its ``module_class``, and an op below it names it as its ``parent``.
    ``missing_from(config)`` says in which models the op is not (None: it is): ``ops=[all]`` leaves it
    out of those, and an op asked for by name is ``skipped`` there with that reason. Model order
    follows: after its parent, and after the siblings registered before it (autotuner.ops_test.places).
    """

    def decorate(
        build: Callable[[OpContext, ShapePoint], OpCall],
    ) -> Callable[[OpContext, ShapePoint], OpCall]:
        if name in REGISTRY:
            raise ValueError(f"op {name!r} registered twice")
        test = OpTest(
            name=name,
            build=build,
            aliases=aliases,
            needs=frozenset((needs,) if isinstance(needs, str) else needs),
            requires=requires,
            phases=phases,
            description=" ".join((build.__doc__ or "").strip().split("\n\n")[0].replace("``", "").split()),
            where=where,
            kind=kind,
            half=half,
            parent=parent,
            module_class=module_class,
            instrument=instrument,
            missing_from=missing_from,
        )
        _check_place(test)
        REGISTRY[name] = test
        return build

    return decorate


def _check_place(test: OpTest) -> None:
    """A place that cannot be instrumented or ordered is a programming error: say so at registration."""
    name, where = test.name, test.where
    if test.kind not in KINDS:
        raise ValueError(f"op {name!r}: kind={test.kind!r} is none of {KINDS}")
    if (test.kind == FUNCTION) != (test.instrument is not None):
        raise ValueError(f"op {name!r}: a {FUNCTION} op, and only one, names its instrument hook")
    if where is None and (test.half or test.parent or test.module_class or test.instrument):
        raise ValueError(f"op {name!r}: half, parent, module_class and instrument need a where")
    if where is not None and FUNCTIONAL in test.needs:
        raise ValueError(f"op {name!r}: a {FUNCTIONAL} op has no place in the model")
    if test.half not in (None, ATTENTION, MLP):
        raise ValueError(f"op {name!r}: half={test.half!r} is neither {ATTENTION!r} nor {MLP!r}")
    if test.half is not None and test.container != LAYER:
        raise ValueError(f"op {name!r}: only an op inside the layer (needs={LAYER!r}) has a half")
    if test.kind == FUNCTION and not where:
        raise ValueError(f"op {name!r}: a {FUNCTION} op's where names its caller and itself")
    for other in REGISTRY.values():
        if where is not None and (other.container, other.where, other.module_class) == (
            test.container,
            where,
            test.module_class,
        ):
            raise ValueError(
                f"op {name!r}: {other.name!r} already sits at {where!r}: "
                "give each a module_class to tell them apart"
            )


def is_moe_layer(layer: Any) -> bool:
    """Whether a TransformerLayer's MLP is a Mixture-of-Experts layer (Megatron-Core's ``MoELayer``)."""
    return any(cls.__name__ == "MoELayer" for cls in type(layer.mlp).__mro__)


class OpContext:
    """The built model and the seeded input makers every op builder shares; ``routing`` (moe.routing) says
    how the MoE ops make their router output (autotuner.model.routing)."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        config: Any = None,
        routing: Routing | None = None,
    ) -> None:
        from autotuner.model.routing import Routing  # here: importing this module imports no torch

        self.model = model  # None when only functional ops run (then ``config`` is the TransformerConfig)
        self.config = model.config if model is not None else config
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.routing = routing if routing is not None else Routing()

    @property
    def layer(self) -> Any:
        """The TransformerLayer the layer ops profile: the model's first MoE layer where it has one (most
        of an MoE model's layers are; DeepSeek's first is dense), else its first layer."""
        layers = self.model.decoder.layers
        return next((layer for layer in layers if is_moe_layer(layer)), layers[0])

    @property
    def dense_layer(self) -> Any:
        """The first layer with a dense MLP, whose ops (``mlp`` and inside it) profile it. Raises
        OpNotApplicable when every layer built is an MoE layer."""
        layer = next((layer for layer in self.model.decoder.layers if not is_moe_layer(layer)), None)
        if layer is None:
            raise OpNotApplicable(
                "every layer of this model has an MoE layer, not a dense MLP: see moe_layer"
            )
        return layer

    def generator(self, salt: str) -> torch.Generator:
        """A CPU generator seeded from the run's seed and the input's name: the same inputs on every run."""
        import torch

        gen = torch.Generator()
        gen.manual_seed((self.seed * 1_000_003 + sum(map(ord, salt)) * 7919) % (2**63))
        return gen

    def randn(self, shape: tuple[int, ...], salt: str, requires_grad: bool = True) -> torch.Tensor:
        import torch

        data = torch.randn(shape, generator=self.generator(salt), dtype=torch.float32)
        return data.to(device=self.device, dtype=self.dtype).requires_grad_(requires_grad)

    def hidden(self, point: ShapePoint, salt: str = "hidden", width: int | None = None) -> torch.Tensor:
        """Hidden states [s, b, h]: the residual stream the layer's ops take. Under sequence parallelism
        each tensor-parallel rank holds its slice of the sequence, [s / TP, b, h], as in training (the
        layer gathers it where it needs the whole): the full draw, sliced, so the ranks' slices together
        are the input a TP=1 run gets. ``width`` instead of h: a tensor laid out as they are (MLA's q and
        kv latents)."""
        shape = (point.seq_len, point.micro_batch_size, width or self.config.hidden_size)
        tp = self.config.tensor_model_parallel_size
        if not self.config.sequence_parallel or tp == 1:
            return self.randn(shape, salt)
        from megatron.core import parallel_state

        part = point.seq_len // tp  # the shape points are multiples of TP under SP (runner.spec)
        start = parallel_state.get_tensor_model_parallel_rank() * part
        return self.randn(shape, salt, requires_grad=False)[start : start + part].clone().requires_grad_()

    def causal_mask(self, point: ShapePoint) -> torch.Tensor:
        """Boolean causal mask [1, 1, s, s], True where attention is masked out (Megatron's convention)."""
        import torch

        s = point.seq_len
        return torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), diagonal=1)[None, None]

    def rotary(self, point: ShapePoint) -> torch.Tensor:
        """Rotary embedding table [s, 1, 1, d] from the model's own RotaryEmbedding; None for a
        Multi-Latent Attention model, whose attention makes its own (as GPTModel passes it None)."""
        if getattr(self.config, "multi_latent_attention", False):
            return None
        return self.model.rotary_pos_emb(point.seq_len)

    def token_ids(self, point: ShapePoint) -> torch.Tensor:
        import torch

        shape = (point.micro_batch_size, point.seq_len)
        ids = torch.randint(0, self.model.vocab_size, shape, generator=self.generator("tokens"))
        return ids.to(self.device)

    def position_ids(self, point: ShapePoint) -> torch.Tensor:
        import torch

        positions = torch.arange(point.seq_len, device=self.device)
        return positions.unsqueeze(0).expand(point.micro_batch_size, -1)
