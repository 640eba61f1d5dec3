"""The pieces the layer spec builds where Megatron-Core's TransformerLayer has no switch for a family's
architecture (autotuner.model.families), so that the built model has the HF model's shapes, parameters and
work exactly:

* :class:`ZeroCenteredRMSNorm`: Gemma's RMSNorm, ``x / rms(x) * (1 + weight)`` in fp32.
* :class:`ProjectionQNorm`/:class:`ProjectionKNorm`: OLMoE's RMSNorm over the whole q (every head's) and
  the whole k projection, where Megatron's qk_layernorm normalises each head alone.
* the attention and the MLP with a norm after it (Gemma-2's post norms: the module ``post_layernorm``
  inside each) and/or their output scaled (Granite's residual multiplier): :func:`adapt_model`.
* :func:`softcapped_attention`: core attention whose scores are capped, ``cap * tanh(scores / cap)``,
  before the mask and softmax (Gemma-2).
* the embedding's output scaled and its own dropout, the output layer's logits scaled or capped
  (:func:`adapt_model`, on a built GPTModel).

Each is a subclass of the Megatron module it extends (or a module of the signature the spec builds), so
the instrumentation and the op builders see Megatron's classes in its hierarchy. What a model has of them
is said by :class:`FamilyFields`, fields added to Megatron's TransformerConfig (``config_class``): they
travel with the config (environment.json, ``tf.`` overrides, ``dataclasses.replace``) like its own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class FamilyFields:
    """What a family's layers and model ends compute beyond Megatron-Core's TransformerConfig (Gemma's
    zero-centred norms are Megatron's own ``layernorm_zero_centered_gamma``).

    ``qk_layernorm_span``: with qk_layernorm, one norm per head (Megatron's) or over the whole q and k
    projections (``projection``, OLMoE). ``post_layernorms``: a norm after the attention and after the MLP
    (Gemma-2). ``residual_scale``: the attention's and the MLP's outputs scaled before the residual add
    (Granite). ``attention_softcap``: core attention's scores capped, ``cap * tanh(s / cap)`` (Gemma-2).
    ``embedding_scale``/``embedding_dropout``: the embedding's output scaled, and its dropout where it is
    not hidden_dropout. ``logit_scale``/``logit_softcap``: the output layer's logits scaled, then capped."""

    qk_layernorm_span: Literal["head", "projection"] = "head"
    post_layernorms: bool = False
    residual_scale: float | None = None
    attention_softcap: float | None = None
    embedding_scale: float | None = None
    embedding_dropout: float | None = None
    logit_scale: float | None = None
    logit_softcap: float | None = None


@functools.cache
def config_class(multi_latent_attention: bool) -> type:
    """Megatron's TransformerConfig (MLATransformerConfig for MLA) with :class:`FamilyFields`."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    base = MLATransformerConfig if multi_latent_attention else TransformerConfig
    return dataclasses.dataclass(type(f"Family{base.__name__}", (base, FamilyFields), {}))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF's gelu_pytorch_tanh, gelu_new)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": gelu_tanh}


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm: normalised in fp32, scaled by ``1 + weight`` (the weight starts at zero)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class _ProjectionNorm(torch.nn.RMSNorm):
    """An RMSNorm over every head of q (or k) at once: built where Megatron builds a per-head q/k norm
    (``hidden_size`` is then one head's width), it takes q or k as [s, b, heads, head_dim]."""

    heads = "num_attention_heads"

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(getattr(config, self.heads) * hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


class ProjectionQNorm(_ProjectionNorm):
    heads = "num_attention_heads"


class ProjectionKNorm(_ProjectionNorm):
    heads = "num_query_groups"


class _OutputAdapted(torch.nn.Module):
    """Mixed into a layer's attention or MLP (forward returns (output, bias)): the output normed by its
    ``post_layernorm`` where it has one, then scaled by ``autotuner_scale``, as the family's layer does
    before the residual add."""

    autotuner_scale: float | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(*args, **kwargs)  # type: ignore[misc]
        norm = getattr(self, "post_layernorm", None)
        if norm is not None:
            if bias is not None:  # no family has both: a bias is added after the norm otherwise
                raise ValueError("a post norm after a linear with a separate bias")
            output = norm(output)
        if self.autotuner_scale is not None:
            output = output * self.autotuner_scale
            bias = None if bias is None else bias * self.autotuner_scale
        return output, bias


class _CappedSoftmax(torch.nn.Module):
    """Megatron's scale-mask-softmax with the scores capped first."""

    def __init__(self, softmax: torch.nn.Module, cap: float) -> None:
        super().__init__()
        self.softmax, self.cap = softmax, cap

    def forward(self, scores: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.softmax(torch.tanh(scores / self.cap) * self.cap, *args, **kwargs)


@functools.cache
def softcapped_attention(base: type, cap: float) -> type:
    """Megatron's local ``DotProductAttention`` (``base``) with its scores capped before the mask."""

    class SoftcappedAttention(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.scale_mask_softmax = _CappedSoftmax(self.scale_mask_softmax, cap)

    SoftcappedAttention.__name__ = SoftcappedAttention.__qualname__ = f"Softcapped{base.__name__}"
    return SoftcappedAttention


class _ScaledEmbedding(torch.nn.Module):
    """Mixed into the GPTModel's embedding: its output times ``autotuner_scale`` (Gemma's sqrt(hidden)
    in the activations' dtype, Granite's embedding_multiplier)."""

    autotuner_scale: float | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        output = super().forward(*args, **kwargs)  # type: ignore[misc]
        scale = self.autotuner_scale
        return output if scale is None else output * torch.tensor(scale, dtype=output.dtype)


class _AdaptedLogits(torch.nn.Module):
    """Mixed into the GPTModel's output layer: logits times ``autotuner_scale``, then capped at
    ``autotuner_cap`` (``cap * tanh(logits / cap)``)."""

    autotuner_scale: float | None = None
    autotuner_cap: float | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        logits, bias = super().forward(*args, **kwargs)  # type: ignore[misc]
        if self.autotuner_scale is not None:
            logits = logits * self.autotuner_scale
        if self.autotuner_cap is not None:
            logits = torch.tanh(logits / self.autotuner_cap) * self.autotuner_cap
        return logits, bias


@functools.cache
def _mixed(mixin: type, base: type) -> type:
    return type(base.__name__, (mixin, base), {})


def adapt_model(model: Any, norm: type) -> None:
    """Give a built GPTModel (in place, before it moves to its device) the family's arithmetic around the
    layer spec's modules (its config's :class:`FamilyFields`): each layer's attention and MLP their post
    norms (of class ``norm``) and output scale; the embedding its scale and its own dropout; the output
    layer its logit scale and cap. Done on the built modules rather than through the spec because
    Megatron-Core's TransformerLayer picks the MLP's constructor arguments by its exact class."""
    from megatron.core.transformer.identity_op import IdentityOp

    config = model.config
    layers = getattr(getattr(model, "decoder", None), "layers", None) or ()
    if config.post_layernorms or config.residual_scale is not None:
        for layer in layers:
            for part in (layer.self_attention, layer.mlp):
                if isinstance(part, IdentityOp):
                    continue
                part.__class__ = _mixed(_OutputAdapted, type(part))
                part.autotuner_scale = config.residual_scale
                if config.post_layernorms:
                    part.post_layernorm = norm(
                        config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
                    )
    embedding = getattr(model, "embedding", None)
    if embedding is not None and (config.embedding_scale is not None or config.embedding_dropout is not None):
        embedding.__class__ = _mixed(_ScaledEmbedding, type(embedding))
        embedding.autotuner_scale = config.embedding_scale
        if config.embedding_dropout is not None:
            embedding.embedding_dropout = torch.nn.Dropout(config.embedding_dropout)
    output = getattr(model, "output_layer", None)
    if output is not None and (config.logit_scale is not None or config.logit_softcap is not None):
        output.__class__ = _mixed(_AdaptedLogits, type(output))
        output.autotuner_scale, output.autotuner_cap = config.logit_scale, config.logit_softcap
