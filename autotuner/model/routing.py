"""Routing control for the MoE ops: which experts the tokens go to is an input of the measurement.

An expert's time depends on how many tokens it gets, and a grouped GEMM waits for its busiest expert, so
the same layer at the same shape is fast or slow depending on the router's output. ``moe.routing`` says
where that output comes from (:data:`ROUTINGS`):

* ``learned``: the model's own router on the seeded hidden states (its gating weights are the seeded
  initial ones, so this is the routing of an untrained model, roughly uniform but not exactly).
* ``uniform``: each token picks ``topk`` distinct experts uniformly at random (seeded).
* ``balanced``: every expert gets the same number of assignments (within one), deterministically: the
  best case a load-balancing loss aims for.
* ``zipf``: expert ``i`` is drawn with weight ``1 / (i + 1) ** zipf_s`` (expert 0 the hottest), without
  replacement per token: a skewed, realistic worst case. With ``topk > 1`` a token cannot take the same
  expert twice, so the shares are flatter than the weights (the hot experts saturate at one assignment per
  token); with ``topk == 1`` they follow the weights.

The forced modes replace the router's output: :func:`forced_routing_map` makes the ``routing_map`` and
:func:`forced_probs` the ``probs`` that Megatron's ``TopKRouter.forward`` would return, in its layout
(both ``[num_tokens, num_experts]``; probs dense with zeros off the chosen experts, in the logits' dtype;
the map boolean). :class:`ExpertLoad` turns a map (or the dispatcher's tokens per expert) into the row
columns every MoE row records. Nothing here imports Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from autotuner.errors import UserError, short_repr

ROUTINGS = ("learned", "uniform", "balanced", "zipf")
LEARNED = "learned"


def check_routing(mode: Any, zipf_s: Any) -> None:
    """Raise UserError (one line, naming the fix) unless ``mode`` is one of :data:`ROUTINGS` and ``zipf_s``
    a finite number above 0."""
    if mode not in ROUTINGS:
        raise UserError(
            f"moe.routing={short_repr(mode)} is not one of {', '.join(ROUTINGS)}: "
            f"set moe.routing={'|'.join(ROUTINGS)}"
        )
    if isinstance(zipf_s, bool) or not isinstance(zipf_s, (int, float)) or not (0 < zipf_s < math.inf):
        raise UserError(
            f"moe.zipf_s={short_repr(zipf_s)} must be a finite number above 0 (the Zipf exponent; 1.2 is "
            "the default): set moe.zipf_s=1.2"
        )


@dataclass(frozen=True)
class Routing:
    """How the MoE ops' router output is made (see the module docstring); always valid once built."""

    mode: str = LEARNED
    zipf_s: float = 1.2

    def __post_init__(self) -> None:
        check_routing(self.mode, self.zipf_s)

    @property
    def forced(self) -> bool:
        """Whether the router's output is replaced (every mode but ``learned``)."""
        return self.mode != LEARNED


def zipf_log_weights(num_experts: int, zipf_s: float) -> torch.Tensor:
    """The logarithms of the ``zipf`` mode's draw weights ``1 / (i + 1) ** zipf_s`` (float64, unnormalised):
    finite for any exponent, where the weights themselves would underflow to 0 for a large one."""
    return -zipf_s * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64))


def zipf_weights(num_experts: int, zipf_s: float) -> torch.Tensor:
    """The ``zipf`` mode's draw weights, normalised to sum to 1 (float64)."""
    return torch.softmax(zipf_log_weights(num_experts, zipf_s), dim=0)


def forced_routing_map(
    num_tokens: int,
    num_experts: int,
    topk: int,
    routing: Routing,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The boolean routing map ``[num_tokens, num_experts]`` of a forced ``routing``: exactly ``topk`` True
    per row, on distinct experts. Made on ``generator``'s device (CPU without one; ``balanced`` draws
    nothing); the same generator state gives the same map.

    ``uniform`` and ``zipf`` draw every token's experts without replacement in one batched top-k over
    ``log(weight) + Gumbel noise``: the Gumbel-top-k trick, whose top k are distributed exactly as k
    successive draws without replacement (what ``torch.multinomial(weights, k, replacement=False)`` gives
    per token), with the weights in log space so ``zipf_s`` may be large. ``balanced`` assigns token t's
    k-th choice to expert ``(t * topk + k) % num_experts``: consecutive, so a token's experts are distinct
    and the counts differ by at most one. ValueError for ``learned`` (the op runs the real router) and for
    sizes that cannot make a map.
    """
    if not routing.forced:
        raise ValueError("routing 'learned' is not forced: run the model's router for its map")
    if num_tokens < 0 or num_experts < 1 or not 1 <= topk <= num_experts:
        raise ValueError(
            f"cannot route {num_tokens} tokens to {topk} of {num_experts} experts: need tokens >= 0 and "
            "1 <= topk <= experts"
        )
    device = generator.device if generator is not None else torch.device("cpu")
    if routing.mode == "balanced":
        slots = torch.arange(num_tokens * topk, device=device).reshape(num_tokens, topk)
        chosen = slots % num_experts
    else:
        if generator is None:
            raise ValueError(f"routing {routing.mode!r} draws at random: pass a seeded torch.Generator")
        if routing.mode == "zipf":
            log_w = zipf_log_weights(num_experts, routing.zipf_s).to(device)
        else:
            log_w = torch.zeros(num_experts, dtype=torch.float64, device=device)
        uniform = torch.rand(
            (num_tokens, num_experts), generator=generator, dtype=torch.float64, device=device
        )
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float64).tiny)))
        chosen = torch.topk(log_w + gumbel, topk, dim=1).indices
    routing_map = torch.zeros((num_tokens, num_experts), dtype=torch.bool, device=device)
    return routing_map.scatter_(1, chosen, True)


def forced_probs(routing_map: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The probabilities the router hands the dispatcher with ``routing_map``: ``1 / topk`` on each token's
    chosen experts, 0 elsewhere (Megatron's layout: dense ``[num_tokens, num_experts]``), in ``dtype`` (the
    router's logits' dtype), on the map's device. They sum to 1 per token, as top-k softmax probs do."""
    chosen = routing_map.to(dtype)
    return chosen / chosen.sum(dim=1, keepdim=True).clamp_min(1)


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per expert of one call and what a row says about them (the expert columns of the rows)."""

    tokens_per_expert: tuple[int, ...]

    @classmethod
    def from_map(cls, routing_map: torch.Tensor, local_experts: range | None = None) -> ExpertLoad:
        """From a routing map ``[num_tokens, num_experts]``: the assignments per expert; with
        ``local_experts`` (an expert-parallel rank's experts, e.g. ``range(rank * n, (rank + 1) * n)``)
        those experts only, the ones this rank computes."""
        counts = routing_map.sum(dim=0)
        if local_experts is not None:
            counts = counts[local_experts.start : local_experts.stop : local_experts.step]
        return cls.from_counts(counts)

    @classmethod
    def from_counts(cls, counts: torch.Tensor | Iterable[int]) -> ExpertLoad:
        """From counts already made, e.g. the ``tokens_per_expert`` Megatron's dispatcher returns (its local
        experts' counts, the routing of ``learned`` included)."""
        values = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        return cls(tuple(int(v) for v in values))

    @property
    def min(self) -> int:
        return min(self.tokens_per_expert, default=0)

    @property
    def max(self) -> int:
        return max(self.tokens_per_expert, default=0)

    @property
    def mean(self) -> float:
        n = len(self.tokens_per_expert)
        return sum(self.tokens_per_expert) / n if n else 0.0

    @property
    def imbalance(self) -> float | None:
        """max / mean: 1.0 when perfectly balanced, the slowdown of a grouped GEMM paced by its busiest
        expert against an even split; None when no expert got a token (nothing to compare)."""
        return self.max / self.mean if self.mean else None

    def row_fields(self, routing_mode: str) -> dict[str, Any]:
        """The row columns of this load (autotuner.results.Row), for ``OpCall.row_fields``."""
        return {
            "routing": routing_mode,
            "tokens_per_expert": list(self.tokens_per_expert),
            "tokens_per_expert_min": self.min,
            "tokens_per_expert_max": self.max,
            "expert_imbalance": self.imbalance,
        }


def experts_impl(experts: Any) -> str:
    """The Megatron class of an experts module (SequentialMLP, GroupedMLP, TEGroupedMLP), past our
    instrumented subclass (autotuner.ops.instrument names it ``Instrumented<Class>``)."""
    for cls in type(experts).__mro__:
        if not cls.__module__.startswith("autotuner."):
            return cls.__name__
    return type(experts).__name__


def moe_setup_fields(experts: Any, config: Any) -> dict[str, Any]:
    """The row columns of how the MoE layer is built: the experts' implementation, the token dispatcher
    (``config.moe_token_dispatcher_type``) and the expert-parallel size."""
    return {
        "experts_impl": experts_impl(experts),
        "token_dispatcher": getattr(config, "moe_token_dispatcher_type", None),
        "expert_parallel": int(getattr(config, "expert_model_parallel_size", 1) or 1),
    }
