"""The ops inside one TransformerLayer, each called as the layer calls it (Megatron-Core layout [s, b, h]).

A test chains these in model order, each fed what the previous returned, and matches ``layer(x)``. They
are registered in the order the layer's forward runs them: that is their model order among siblings
(autotuner.ops_test.places). The layer's direct parts say which half of it they are in; the ops inside
``self_attention`` and ``mlp`` inherit it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotuner.ops_test.base import (
    ATTENTION,
    FACTORY,
    FUNCTION,
    MLP,
    OpCall,
    OpContext,
    OpNotApplicable,
    ShapePoint,
    register_op,
)

if TYPE_CHECKING:
    import torch


def _check_present(module: Any, op: str, fused_into: str) -> None:
    from megatron.core.transformer.identity_op import IdentityOp

    if isinstance(module, IdentityOp):
        raise OpNotApplicable(f"{op} is fused into {fused_into} by the Transformer-Engine layer spec")


def _heads(ctx: OpContext) -> tuple[int, int, int]:
    """(query heads, kv groups, head dim) on this tensor-parallel rank."""
    attention = ctx.layer.self_attention
    return (
        attention.num_attention_heads_per_partition,
        attention.num_query_groups_per_partition,
        attention.hidden_size_per_attention_head,
    )


def split_mixed_qkv(
    attention: Any, mixed_qkv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split linear_qkv's output into q [s,b,nq,d], k and v [s,b,nkv,d], as
    ``SelfAttention.get_query_key_value_tensors`` does after calling linear_qkv (TP=1 layout)."""
    groups = attention.num_query_groups_per_partition
    per_group = attention.num_attention_heads_per_partition // groups
    d = attention.hidden_size_per_attention_head
    mixed = mixed_qkv.view(*mixed_qkv.shape[:-1], groups, (per_group + 2) * d)
    query, key, value = mixed.split([per_group * d, d, d], dim=3)
    query = query.reshape(query.size(0), query.size(1), -1, d)
    return query, key, value


def rope_call(ctx: OpContext, point: ShapePoint) -> Any:
    """RoPE on q and k, through the same (instrumented) function SelfAttention calls."""
    from megatron.core.transformer import attention

    from autotuner.ops.instrument import instrumented_function

    freqs = ctx.rotary(point)
    config = ctx.config

    def rope(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            attention.apply_rotary_pos_emb(query, freqs, config=config),
            attention.apply_rotary_pos_emb(key, freqs, config=config),
        )

    return instrumented_function(rope, "rope")


def activation_call(ctx: OpContext) -> Any:
    """The MLP's activation including the GLU gating, as ``MLP.forward`` computes it unfused."""
    from autotuner.ops.instrument import instrumented_function

    config = ctx.config
    mlp = ctx.layer.mlp
    bias = mlp.linear_fc1.bias if getattr(mlp.linear_fc1, "skip_bias_add", False) else None

    def activation(intermediate: torch.Tensor) -> torch.Tensor:
        if bias is not None:
            intermediate = intermediate + bias
        if config.gated_linear_unit:
            gate, linear = intermediate.chunk(2, dim=-1)
            return config.activation_func(gate) * (linear + getattr(config, "glu_linear_offset", 0.0))
        return mlp.activation_func(intermediate)

    return instrumented_function(activation, "activation")


def bda_call(layer: Any, factory_attr: str, bias: torch.Tensor | None) -> Any:
    """Bias-dropout-add as the layer calls it: ``bda(training, fusion)((out, bias), residual, p)``."""
    bda = getattr(layer, factory_attr)(layer.training, layer.config.bias_dropout_fusion)

    def call(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return bda((out, bias), residual, layer.hidden_dropout)

    return call


def _linear_bias(linear: Any) -> torch.Tensor | None:
    """The bias a row-parallel linear hands to bias-dropout-add (skip_bias_add), if any."""
    return linear.bias if getattr(linear, "skip_bias_add", False) else None


def instrument_rope(model: Any, op: str) -> None:
    """RoPE is a function SelfAttention calls by name from its module's namespace: wrap it there. The
    fused variant (a TE/apex kernel chosen by ``apply_rope_fusion``) bypasses the name and carries no
    range of its own."""
    from megatron.core.transformer import attention

    from autotuner.ops.instrument import instrumented_function

    attention.apply_rotary_pos_emb = instrumented_function(attention.apply_rotary_pos_emb, op)


def instrument_activation(model: Any, op: str) -> None:
    """The activation is the function the MLP reads from the config: wrap it there, unless a fused
    bias-activation kernel (``bias_activation_fusion``) runs instead and carries no range of its own."""
    from autotuner.ops.instrument import instrumented_function

    config = model.config
    if not config.bias_activation_fusion:
        config.activation_func = instrumented_function(config.activation_func, op)


@register_op("input_layernorm", aliases=("pre_layernorm",), where="input_layernorm", half=ATTENTION)
def input_layernorm(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The norm before self-attention (RMSNorm or LayerNorm)."""
    norm = ctx.layer.input_layernorm
    _check_present(norm, "input_layernorm", "linear_qkv")
    return OpCall(norm, (ctx.hidden(point),), norm)


@register_op("self_attention", aliases=("self_attn",), where="self_attention", half=ATTENTION)
def self_attention(ctx: OpContext, point: ShapePoint) -> OpCall:
    """SelfAttention: linear_qkv, RoPE, core attention and linear_proj."""
    attention = ctx.layer.self_attention
    mask, rotary = ctx.causal_mask(point), ctx.rotary(point)
    return OpCall(
        lambda h: attention(h, attention_mask=mask, rotary_pos_emb=rotary), (ctx.hidden(point),), attention
    )


@register_op("linear_qkv", aliases=("qkv",), where="self_attention.linear_qkv")
def linear_qkv(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The fused q/k/v projection (column-parallel)."""
    linear = ctx.layer.self_attention.linear_qkv
    return OpCall(linear, (ctx.hidden(point),), linear)


def _qkv_shapes(ctx: OpContext, point: ShapePoint) -> tuple[tuple[int, ...], tuple[int, ...]]:
    nq, nkv, d = _heads(ctx)
    s, b = point.seq_len, point.micro_batch_size
    return (s, b, nq, d), (s, b, nkv, d)


@register_op(
    "rope",
    aliases=("rotary_pos_emb",),
    where="self_attention.rope",
    kind=FUNCTION,
    instrument=instrument_rope,
)
def rope(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Rotary position embedding applied to q and k."""
    q_shape, kv_shape = _qkv_shapes(ctx, point)
    inputs = (ctx.randn(q_shape, "query"), ctx.randn(kv_shape, "key"))
    return OpCall(rope_call(ctx, point), inputs)


@register_op(
    "core_attention",
    aliases=("TEDotProductAttention", "DotProductAttention"),
    where="self_attention.core_attention",
)
def core_attention(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Scaled dot-product attention with the causal mask (softmax(QK^T)V)."""
    from megatron.core.transformer.enums import AttnMaskType

    module = ctx.layer.self_attention.core_attention
    mask = ctx.causal_mask(point)
    q_shape, kv_shape = _qkv_shapes(ctx, point)
    inputs = (ctx.randn(q_shape, "query"), ctx.randn(kv_shape, "key"), ctx.randn(kv_shape, "value"))

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return module(
            q, k, v, mask, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=None
        )

    return OpCall(call, inputs, module)


@register_op("linear_proj", where="self_attention.linear_proj")
def linear_proj(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The attention output projection (row-parallel)."""
    linear = ctx.layer.self_attention.linear_proj
    nq, _, d = _heads(ctx)
    return OpCall(linear, (ctx.randn((point.seq_len, point.micro_batch_size, nq * d), "context"),), linear)


@register_op("self_attn_bda", where="self_attn_bda", kind=FACTORY, half=ATTENTION)
def self_attn_bda(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Bias-dropout-add after attention: residual + dropout(out + bias)."""
    layer = ctx.layer
    call = bda_call(layer, "self_attn_bda", _linear_bias(layer.self_attention.linear_proj))
    return OpCall(call, (ctx.hidden(point, "attention_out"), ctx.hidden(point, "residual")))


@register_op("pre_mlp_layernorm", aliases=("Norm",), where="pre_mlp_layernorm", half=MLP)
def pre_mlp_layernorm(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The norm before the MLP."""
    norm = ctx.layer.pre_mlp_layernorm
    _check_present(norm, "pre_mlp_layernorm", "linear_fc1")
    return OpCall(norm, (ctx.hidden(point),), norm)


@register_op("mlp", aliases=("MLP",), where="mlp", half=MLP)
def mlp(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The MLP: linear_fc1, activation (with GLU gating), linear_fc2."""
    module = ctx.layer.mlp
    return OpCall(module, (ctx.hidden(point),), module)


@register_op("linear_fc1", aliases=("fc1_op",), where="mlp.linear_fc1")
def linear_fc1(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The MLP up (and gate) projection (column-parallel)."""
    linear = ctx.layer.mlp.linear_fc1
    return OpCall(linear, (ctx.hidden(point),), linear)


def _fc1_width(ctx: OpContext) -> int:
    tp = ctx.config.tensor_model_parallel_size
    width = ctx.config.ffn_hidden_size // tp
    return 2 * width if ctx.config.gated_linear_unit else width


@register_op(
    "activation",
    aliases=("activation_op",),
    where="mlp.activation",
    kind=FUNCTION,
    instrument=instrument_activation,
)
def activation(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The activation function including the GLU gating (SwiGLU: silu(gate) * up)."""
    shape = (point.seq_len, point.micro_batch_size, _fc1_width(ctx))
    return OpCall(activation_call(ctx), (ctx.randn(shape, "fc1_out"),))


@register_op("linear_fc2", aliases=("fc2_op",), where="mlp.linear_fc2")
def linear_fc2(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The MLP down projection (row-parallel)."""
    linear = ctx.layer.mlp.linear_fc2
    width = ctx.config.ffn_hidden_size // ctx.config.tensor_model_parallel_size
    return OpCall(
        linear, (ctx.randn((point.seq_len, point.micro_batch_size, width), "activation_out"),), linear
    )


@register_op("mlp_bda", where="mlp_bda", kind=FACTORY, half=MLP)
def mlp_bda(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Bias-dropout-add after the MLP."""
    layer = ctx.layer
    call = bda_call(layer, "mlp_bda", _linear_bias(layer.mlp.linear_fc2))
    return OpCall(call, (ctx.hidden(point, "mlp_out"), ctx.hidden(point, "residual")))
