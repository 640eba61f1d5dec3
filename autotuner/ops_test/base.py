"""How an op is tested: a registry of op builders, the inputs they share, and the call they return.

Adding an op is one decorated function (in the spirit of tritonbench's ``register_benchmark``)::

    @register_op("linear_qkv", aliases=("qkv",), needs=LAYER)
    def linear_qkv(ctx: OpContext, point: ShapePoint) -> OpCall:
        attention = ctx.layer.self_attention
        return OpCall(attention.linear_qkv, (ctx.hidden(point),), module=attention.linear_qkv)

The function receives the built model (through :class:`OpContext`) and a shape point, and returns an
:class:`OpCall`: the instrumented op, the tensors it is called with, and the module whose parameters are
its weights. Inputs are made the way the model makes them: seeded random hidden states [s, b, h] (leaves
that require grad, so backward computes the input gradient as inside the model), a real boolean causal
mask, rotary embeddings from the model's own ``RotaryEmbedding``, token ids within the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autotuner.ops.naming import PHASES

# What an op needs built (see autotuner.model.ModelParts); FUNCTIONAL ops need no model at all.
LAYER, BLOCK, EMBEDDING, HEAD, FUNCTIONAL = "layer", "block", "embedding", "head", "functional"


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
    the roofline's choice.
    """

    fn: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    module: torch.nn.Module | None = None
    bytes_moved: dict[str, int] | None = None
    ceiling: str | None = None
    graphable: bool = True  # False: never CUDA-graph captured (a pageable host copy)


class OpNotApplicable(Exception):
    """The op does not exist in this build (e.g. a norm that the Transformer-Engine spec fuses away)."""


@dataclass(frozen=True)
class OpTest:
    """A registered op: its canonical name, accepted aliases, what it needs built, how to build its call."""

    name: str
    build: Callable[[OpContext, ShapePoint], OpCall]
    aliases: tuple[str, ...] = ()
    needs: frozenset[str] = field(default_factory=frozenset)
    requires: str | None = None  # an optional package the op needs
    description: str = ""
    phases: tuple[str, ...] = PHASES  # the functional ops have no backward


REGISTRY: dict[str, OpTest] = {}


def register_op(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    needs: str | tuple[str, ...] = LAYER,
    requires: str | None = None,
    phases: tuple[str, ...] = PHASES,
) -> Callable[[Callable[[OpContext, ShapePoint], OpCall]], Callable[[OpContext, ShapePoint], OpCall]]:
    """Register an op builder under ``name`` (and its aliases); the docstring becomes its description."""

    def decorate(
        build: Callable[[OpContext, ShapePoint], OpCall],
    ) -> Callable[[OpContext, ShapePoint], OpCall]:
        if name in REGISTRY:
            raise ValueError(f"op {name!r} registered twice")
        REGISTRY[name] = OpTest(
            name=name,
            build=build,
            aliases=aliases,
            needs=frozenset((needs,) if isinstance(needs, str) else needs),
            requires=requires,
            phases=phases,
            description=(build.__doc__ or "").strip().splitlines()[0] if build.__doc__ else "",
        )
        return build

    return decorate


class OpContext:
    """The built model and the seeded input makers every op builder shares."""

    def __init__(
        self, model: Any, device: torch.device, dtype: torch.dtype, seed: int, config: Any = None
    ) -> None:
        self.model = model  # None when only functional ops run (then ``config`` is the TransformerConfig)
        self.config = model.config if model is not None else config
        self.device = device
        self.dtype = dtype
        self.seed = seed

    @property
    def layer(self) -> Any:
        return self.model.decoder.layers[0]

    def generator(self, salt: str) -> torch.Generator:
        """A CPU generator seeded from the run's seed and the input's name: the same inputs on every run."""
        gen = torch.Generator()
        gen.manual_seed((self.seed * 1_000_003 + sum(map(ord, salt)) * 7919) % (2**63))
        return gen

    def randn(self, shape: tuple[int, ...], salt: str, requires_grad: bool = True) -> torch.Tensor:
        data = torch.randn(shape, generator=self.generator(salt), dtype=torch.float32)
        return data.to(device=self.device, dtype=self.dtype).requires_grad_(requires_grad)

    def hidden(self, point: ShapePoint, salt: str = "hidden") -> torch.Tensor:
        """Hidden states [s, b, h]."""
        return self.randn((point.seq_len, point.micro_batch_size, self.config.hidden_size), salt)

    def causal_mask(self, point: ShapePoint) -> torch.Tensor:
        """Boolean causal mask [1, 1, s, s], True where attention is masked out (Megatron's convention)."""
        s = point.seq_len
        return torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), diagonal=1)[None, None]

    def rotary(self, point: ShapePoint) -> torch.Tensor:
        """Rotary embedding table [s, 1, 1, d] from the model's own RotaryEmbedding."""
        return self.model.rotary_pos_emb(point.seq_len)

    def token_ids(self, point: ShapePoint) -> torch.Tensor:
        shape = (point.micro_batch_size, point.seq_len)
        ids = torch.randint(0, self.model.vocab_size, shape, generator=self.generator("tokens"))
        return ids.to(self.device)

    def position_ids(self, point: ShapePoint) -> torch.Tensor:
        positions = torch.arange(point.seq_len, device=self.device)
        return positions.unsqueeze(0).expand(point.micro_batch_size, -1)
