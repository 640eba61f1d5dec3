"""Core attention by torch's ``scaled_dot_product_attention`` in Megatron's ``core_attention`` slot.

The ``attention`` setting picks the module the layer spec puts there: ``local`` (Megatron-Core's unfused
``DotProductAttention``: the s x s scores materialised by a baddbmm, a separate mask-and-softmax, a
bmm), ``sdpa`` (this module), ``te`` (Transformer-Engine's, on its spec) or ``auto`` (:func:`resolve`).
:func:`sdpa_attention` subclasses the local class, so its constructor is Megatron's own (heads per
tensor-parallel partition, softmax scale, dropout, MLA's head widths) and only the forward differs:
causal by ``is_causal`` (no mask tensor), grouped-query attention by ``enable_gqa`` (k and v are not
repeated), Megatron's layout [s, b, heads, d] viewed as sdpa's [b, heads, s, d], out [s, b, heads*d].
The softmax scale is the one Megatron's scores end with: ``apply_query_key_layer_scaling`` divides the
scale by the layer number and multiplies the scores by it again inside the softmax, the same product.
What sdpa cannot express (a sliding window, capped scores, another softmax, a mask that is not causal,
context parallelism) is refused, naming the setting (:func:`sdpa_refusal`).

Which of torch's kernels ran (:func:`sdpa_backend`) is read from the aten operator the dispatcher
called for the op's own inputs (flash, efficient, cudnn, overrideable; on a CPU the flash kernel is
``_scaled_dot_product_flash_attention_for_cpu``); where none of them ran torch composed the attention
from matrix products and a softmax, its ``math`` path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autotuner.errors import UserError

ATTENTIONS = ("auto", "local", "sdpa", "te")
# torch's fused attention operators by the backend name torch.nn.attention.SDPBackend gives them
BACKEND_OF_OP = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
GQA_TORCH = (2, 5)  # the first torch whose scaled_dot_product_attention takes enable_gqa


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def sdpa_refusal(config: Any) -> str | None:
    """Why ``attention=sdpa`` cannot compute this TransformerConfig's attention (a one-line reason
    naming the setting), or None."""
    if getattr(config, "attention_softcap", None) is not None:
        return f"attention_softcap={config.attention_softcap} (capped scores) is not expressible in sdpa"
    if config.window_size is not None:
        return (
            f"window_size={tuple(config.window_size)} (sliding-window attention) is not expressible in sdpa"
        )
    if config.softmax_type != "vanilla":
        return (
            f"softmax_type={config.softmax_type} is not expressible in sdpa (it has the vanilla softmax only)"
        )
    if config.context_parallel_size != 1:
        return f"context_parallel_size={config.context_parallel_size} needs Transformer-Engine's attention"
    if config.num_query_groups != config.num_attention_heads and _torch_version() < GQA_TORCH:
        return (
            f"grouped-query attention ({config.num_query_groups} groups) needs enable_gqa, which torch "
            f"{torch.__version__} lacks (torch >= 2.5)"
        )
    return None


def resolve(
    asked: str, device: torch.device, transformer_engine: bool, config: Any
) -> tuple[str, str | None]:
    """The attention to build for ``attention=asked`` and a note where ``auto`` had to choose around
    something. ``auto``: Transformer-Engine's where its spec is used, sdpa on a GPU without it, the local
    one on a CPU (the unfused reference the tool's CPU figures have always been). Raises UserError for
    what cannot be built."""
    if asked not in ATTENTIONS:
        raise UserError(f"attention={asked!r} is not one of {', '.join(ATTENTIONS)}: choose one of them")
    capped = getattr(config, "attention_softcap", None) is not None
    if asked == "auto":
        chosen = "te" if transformer_engine else "sdpa" if device.type == "cuda" else "local"
        if capped and chosen != "local":  # only the local attention caps its scores
            cap = config.attention_softcap
            return "local", f"attention=auto: local, as only it caps scores (attention_softcap={cap})"
        refusal = sdpa_refusal(config) if chosen == "sdpa" else None
        if refusal is not None:
            return "local", f"attention=auto: local, as {refusal}"
        return chosen, None
    if asked == "te" and not transformer_engine:
        raise UserError(
            f"attention=te needs Transformer-Engine's layer spec, built only on a CUDA device where "
            f"transformer_engine imports (here: device {device.type}): use attention=sdpa or local"
        )
    if asked == "te" and capped:
        raise UserError(
            f"attention=te: Transformer-Engine's attention has no score cap (attention_softcap="
            f"{config.attention_softcap}): use attention=local"
        )
    if asked == "sdpa":
        refusal = sdpa_refusal(config)
        if refusal is not None:
            raise UserError(f"attention=sdpa: {refusal}: use attention=local")
    return asked, None


class _SdpaForward:
    """Mixed into Megatron's local DotProductAttention: the same constructor, sdpa's forward."""

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: Any, *args: Any, **kwargs: Any
    ) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)  # type: ignore[call-arg]
        refusal = sdpa_refusal(config)
        if refusal is None and attn_mask_type != AttnMaskType.causal:
            refusal = f"attn_mask_type={attn_mask_type.name}: sdpa here computes causal attention only"
        if refusal is not None:
            raise ValueError(f"attention=sdpa: {refusal}")
        if config.apply_query_key_layer_scaling:  # the scores' scale, not the one before the softmax's coeff
            self.softmax_scale *= self.layer_number
        self.gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """[s, b, heads, d] q, k, v (k and v with the query groups' heads) -> [s, b, heads * d_v]; the
        causal mask is sdpa's own, ``attention_mask`` (Megatron's explicit causal mask) is not read."""
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("attention=sdpa takes no attention bias and no packed sequences")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(f"attention=sdpa: attn_mask_type={attn_mask_type.name}, only causal")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        dropout = self.attention_dropout.p if self.training else 0.0
        extra = {"enable_gqa": True} if self.gqa else {}
        fork = tensor_parallel.get_cuda_rng_tracker().fork
        with fork() if dropout and not self.config.sequence_parallel else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale, **extra
            )
        s, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads * d_v]


@functools.cache
def sdpa_attention(base: type) -> type:
    """The sdpa core attention over ``base``, Megatron's local DotProductAttention (or its MLA form)."""
    cls = type(f"Sdpa{base.__name__}", (_SdpaForward, base), {})
    cls.__qualname__ = cls.__name__
    return cls


def is_sdpa(module: Any) -> bool:
    return isinstance(module, _SdpaForward)


def attention_backend(module: Any, run: Callable[[], Any]) -> str:
    """The ``attention_backend`` column of a core attention ``module`` (autotuner.results.Row), ``run``
    one call of it with the op's inputs (run only for sdpa)."""
    if is_sdpa(module):
        return sdpa_backend(run)
    transformer_engine = any(
        cls.__module__.startswith("megatron.core.extensions") for cls in type(module).__mro__
    )
    return "te" if transformer_engine else "local"


class _AtenOps(TorchDispatchMode):
    """The names of the aten operators called while active (after composite ones are decomposed)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def sdpa_backend(run: Callable[[], Any]) -> str:
    """The backend of torch's scaled_dot_product_attention that ``run()`` (one call of the op) ran: the
    fused operator the dispatcher called, or ``math`` where it called none (torch composed it)."""
    with _AtenOps() as seen:
        run()
    ran = sorted({BACKEND_OF_OP[name] for name in seen.names if name in BACKEND_OF_OP})
    if len(ran) > 1:
        raise ValueError(f"one attention call ran several sdpa backends: {', '.join(ran)}")
    return ran[0] if ran else "math"
