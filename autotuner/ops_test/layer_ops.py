"""The ops inside one TransformerLayer, each called as the layer calls it (Megatron-Core layout [s, b, h]).

A test chains these in model order, each fed what the previous returned, and matches ``layer(x)``. They
are registered in the order the layer's forward runs them: that is their model order among siblings
(autotuner.ops_test.places). The layer's direct parts say which half of it they are in; the ops inside
``self_attention`` and ``mlp`` inherit it.

A layer's attention is either the dense one (``linear_qkv``) or Multi-Latent Attention (DeepSeek-V2's MLA,
Megatron-Core's ``MLASelfAttention``: ``mla_q_proj``, or ``q_down_proj``/``q_layernorm``/``q_up_proj`` with q
LoRA, then ``kv_down_proj``, ``kv_layernorm``, ``kv_up_proj``); the ops of the other kind are skipped with a
reason (OpNotApplicable). ``rope``, ``core_attention`` and ``linear_proj`` are in both, each with its shapes.
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


def _mla_only(config: Any) -> str | None:
    """``missing_from`` of the MLA projections and norms: in MLA models only."""
    if getattr(config, "multi_latent_attention", False):
        return None
    return "a Multi-Latent Attention op; this model's attention is the dense one (linear_qkv)"


def _q_lora_only(config: Any) -> str | None:
    return _mla_only(config) or (
        "exists only with q LoRA (q_lora_rank); this model's is mla_q_proj"
        if config.q_lora_rank is None
        else None
    )


def _without_q_lora_only(config: Any) -> str | None:
    rank = getattr(config, "q_lora_rank", None)
    return _mla_only(config) or (
        f"exists only without q LoRA; q_lora_rank={rank}: see q_down_proj, q_up_proj"
        if rank is not None
        else None
    )


def _dense_attention_only(config: Any) -> str | None:
    if getattr(config, "multi_latent_attention", False):
        return (
            "Multi-Latent Attention has no fused linear_qkv: see mla_q_proj (or q_down_proj, q_up_proj), "
            "kv_down_proj, kv_up_proj"
        )
    return None


def _q_norm_only(config: Any) -> str | None:
    if getattr(config, "multi_latent_attention", False):
        return _q_lora_only(config)
    return (
        None if config.qk_layernorm else "exists only with qk_layernorm (per-head q/k norms) or MLA's q LoRA"
    )


def _dense_mlp_only(config: Any) -> str | None:
    """``missing_from`` of the dense MLP and its ops: absent where every layer is an MoE layer."""
    from autotuner.model.build import moe_layer_pattern

    if all(moe_layer_pattern(config)):
        return "every layer of this model has an MoE layer, not a dense MLP: see moe_layer"
    return None


def _is_mla(ctx: OpContext) -> bool:
    """Whether the model's attention is Multi-Latent Attention (an MLATransformerConfig)."""
    return bool(getattr(ctx.config, "multi_latent_attention", False))


def _mla_attention(ctx: OpContext, op: str) -> Any:
    """The layer's MLASelfAttention; OpNotApplicable for a model with the dense attention."""
    if not _is_mla(ctx):
        raise OpNotApplicable(
            f"{op} is a Multi-Latent Attention op; this model's attention is the dense one (linear_qkv)"
        )
    return ctx.layer.self_attention


def _q_lora(ctx: OpContext, op: str, wanted: bool) -> Any:
    """The MLA attention, where the query is projected the way ``op`` does it: through a low-rank q
    (``q_lora_rank`` set: q_down_proj, q_layernorm, q_up_proj) or in one (mla_q_proj)."""
    attention = _mla_attention(ctx, op)
    rank = ctx.config.q_lora_rank
    if wanted and rank is None:
        raise OpNotApplicable(f"{op} exists only with q LoRA (q_lora_rank); this model's is mla_q_proj")
    if not wanted and rank is not None:
        raise OpNotApplicable(
            f"{op} exists only without q LoRA; q_lora_rank={rank}: see q_down_proj, q_up_proj"
        )
    return attention


def _mla_dims(ctx: OpContext) -> tuple[int, int, int, int]:
    """(query heads on this tensor-parallel rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim) of MLA:
    q and k heads are ``qk_head_dim + qk_pos_emb_head_dim`` wide (RoPE on the last part), v heads
    ``v_head_dim``; k has as many heads as q (its RoPE part is one head, broadcast)."""
    config = ctx.config
    heads = ctx.layer.self_attention.num_attention_heads_per_partition
    return heads, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim


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

    if _is_mla(ctx):
        return mla_rope_call(ctx, point)
    freqs = ctx.rotary(point)
    config = ctx.config

    def rope(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            attention.apply_rotary_pos_emb(query, freqs, config=config),
            attention.apply_rotary_pos_emb(key, freqs, config=config),
        )

    return instrumented_function(rope, "rope")


def mla_rope_call(ctx: OpContext, point: ShapePoint) -> Any:
    """RoPE on the RoPE parts of q [s,b,n,dr] and k [s,b,1,dr] as MLASelfAttention applies it: the table
    (and YaRN's mscale) from its own ``rotary_pos_emb``, through the (instrumented) function it calls."""
    from megatron.core.transformer import multi_latent_attention as mla

    from autotuner.ops.instrument import instrumented_function

    attention = ctx.layer.self_attention
    config = attention.config
    table = attention.rotary_pos_emb(point.seq_len, packed_seq=False)  # the call MLA makes (cached)
    freqs, mscale = table if config.rope_type == "yarn" else (table, 1.0)
    cp_group = attention.pg_collection.cp

    def rope(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = dict(config=config, cu_seqlens=None, mscale=mscale, cp_group=cp_group)
        return (
            mla.apply_rotary_pos_emb(query, freqs, **kwargs),
            mla.apply_rotary_pos_emb(key, freqs, **kwargs),
        )

    return instrumented_function(rope, "rope")


def activation_call(ctx: OpContext) -> Any:
    """The MLP's activation including the GLU gating, as ``MLP.forward`` computes it unfused."""
    from autotuner.ops.instrument import instrumented_function

    config = ctx.config
    mlp = ctx.dense_layer.mlp
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
    """The bias a row-parallel linear hands to bias-dropout-add (skip_bias_add), if any (an MoE layer
    hands none)."""
    return linear.bias if getattr(linear, "skip_bias_add", False) else None


def instrument_rope(model: Any, op: str) -> None:
    """RoPE is a function SelfAttention and MLASelfAttention call by name from their modules' namespaces:
    wrap it in both. The fused variants (a TE/apex kernel chosen by ``apply_rope_fusion``; MLA's fused
    q/kv RoPE kernels) bypass the name and carry no range of their own."""
    from megatron.core.transformer import attention, multi_latent_attention

    from autotuner.ops.instrument import instrumented_function

    for module in (attention, multi_latent_attention):
        module.apply_rotary_pos_emb = instrumented_function(module.apply_rotary_pos_emb, op)


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
    """SelfAttention: linear_qkv, RoPE, core attention and linear_proj (MLA: its projections instead of
    linear_qkv, and the RoPE table it makes itself)."""
    attention = ctx.layer.self_attention
    mask, rotary = ctx.causal_mask(point), ctx.rotary(point)
    return OpCall(
        lambda h: attention(h, attention_mask=mask, rotary_pos_emb=rotary), (ctx.hidden(point),), attention
    )


@register_op(
    "linear_qkv", aliases=("qkv",), where="self_attention.linear_qkv", missing_from=_dense_attention_only
)
def linear_qkv(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The fused q/k/v projection (column-parallel)."""
    if _is_mla(ctx):
        query = "mla_q_proj" if ctx.config.q_lora_rank is None else "q_down_proj, q_up_proj"
        raise OpNotApplicable(
            f"Multi-Latent Attention has no fused linear_qkv: see {query}, kv_down_proj, kv_up_proj"
        )
    linear = ctx.layer.self_attention.linear_qkv
    return OpCall(linear, (ctx.hidden(point),), linear)


def _mla_linear(
    ctx: OpContext, point: ShapePoint, op: str, attr: str, q_lora: bool | None = None, latent: str = ""
) -> OpCall:
    """MLA's projection ``attr`` called as the attention calls it: on the hidden states [s,b,h], or on
    the ``latent`` ("q" or "kv"; see _latent). ``q_lora``: whether the op exists only with q LoRA (True)
    or only without it (False)."""
    attention = _mla_attention(ctx, op) if q_lora is None else _q_lora(ctx, op, wanted=q_lora)
    linear = getattr(attention, attr)
    return OpCall(linear, (_latent(ctx, point, latent) if latent else ctx.hidden(point),), linear)


def _latent(ctx: OpContext, point: ShapePoint, latent: str) -> torch.Tensor:
    """MLA's q or kv latent as its norm and up projection take it: [s, b, q_lora_rank or kv_lora_rank],
    whole on every tensor-parallel rank (the down projection's output is gathered), and under sequence
    parallelism the rank's slice of the sequence, as the hidden states (MLA scatters it back)."""
    return ctx.hidden(point, f"{latent}_latent", width=getattr(ctx.config, f"{latent}_lora_rank"))


# Multi-Latent Attention's projections, registered in the order MLASelfAttention.get_query_key_value_tensors
# runs them (model order): both down projections, both norms, then the up projections (q's first).
@register_op("q_down_proj", where="self_attention.linear_q_down_proj", missing_from=_q_lora_only)
def q_down_proj(ctx: OpContext, point: ShapePoint) -> OpCall:
    """MLA with q LoRA: the query's down projection to q_lora_rank (column-parallel, then gathered)."""
    return _mla_linear(ctx, point, "q_down_proj", "linear_q_down_proj", q_lora=True)


@register_op("kv_down_proj", where="self_attention.linear_kv_down_proj", missing_from=_mla_only)
def kv_down_proj(ctx: OpContext, point: ShapePoint) -> OpCall:
    """MLA: the joint k/v down projection to kv_lora_rank, plus k's RoPE part (qk_pos_emb_head_dim)."""
    return _mla_linear(ctx, point, "kv_down_proj", "linear_kv_down_proj")


@register_op("q_layernorm", where="self_attention.q_layernorm", missing_from=_q_norm_only)
def q_layernorm(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The query norm: MLA's on the q LoRA latent [s,b,q_lora_rank]; the dense attention's per head
    (qk_layernorm) on q [s,b,heads,head_dim]."""
    s, b = point.seq_len, point.micro_batch_size
    if _is_mla(ctx):
        norm = _q_lora(ctx, "q_layernorm", wanted=True).q_layernorm
        _check_present(norm, "q_layernorm", "q_up_proj")
        return OpCall(norm, (_latent(ctx, point, "q"),), norm)
    norm = ctx.layer.self_attention.q_layernorm
    if norm is None or not ctx.config.qk_layernorm:
        raise OpNotApplicable("q_layernorm exists only with qk_layernorm or MLA's q LoRA")
    nq, _, d = _heads(ctx)
    return OpCall(norm, (ctx.randn((s, b, nq, d), "query"),), norm)


@register_op("kv_layernorm", where="self_attention.kv_layernorm", missing_from=_mla_only)
def kv_layernorm(ctx: OpContext, point: ShapePoint) -> OpCall:
    """MLA: the norm of the kv latent [s,b,kv_lora_rank] (after kv_down_proj, its RoPE part split off)."""
    norm = _mla_attention(ctx, "kv_layernorm").kv_layernorm
    _check_present(norm, "kv_layernorm", "kv_up_proj")
    return OpCall(norm, (_latent(ctx, point, "kv"),), norm)


@register_op("mla_q_proj", where="self_attention.linear_q_proj", missing_from=_without_q_lora_only)
def mla_q_proj(ctx: OpContext, point: ShapePoint) -> OpCall:
    """MLA without q LoRA: the query projection to heads x (qk_head_dim + qk_pos_emb_head_dim)."""
    return _mla_linear(ctx, point, "mla_q_proj", "linear_q_proj", q_lora=False)


@register_op("q_up_proj", where="self_attention.linear_q_up_proj", missing_from=_q_lora_only)
def q_up_proj(ctx: OpContext, point: ShapePoint) -> OpCall:
    """MLA with q LoRA: the query's up projection from the normed latent (column-parallel)."""
    return _mla_linear(ctx, point, "q_up_proj", "linear_q_up_proj", q_lora=True, latent="q")


@register_op("kv_up_proj", where="self_attention.linear_kv_up_proj", missing_from=_mla_only)
def kv_up_proj(ctx: OpContext, point: ShapePoint) -> OpCall:
    """MLA: the k (no-RoPE part) and v up projection from the normed kv latent (column-parallel)."""
    return _mla_linear(ctx, point, "kv_up_proj", "linear_kv_up_proj", latent="kv")


def _qkv_shapes(ctx: OpContext, point: ShapePoint) -> tuple[tuple[int, ...], ...]:
    """The shapes of q, k and v as core attention receives them (after RoPE)."""
    s, b = point.seq_len, point.micro_batch_size
    if _is_mla(ctx):
        heads, qk, pos, v = _mla_dims(ctx)
        return (s, b, heads, qk + pos), (s, b, heads, qk + pos), (s, b, heads, v)
    nq, nkv, d = _heads(ctx)
    return (s, b, nq, d), (s, b, nkv, d), (s, b, nkv, d)


@register_op(
    "rope",
    aliases=("rotary_pos_emb",),
    where="self_attention.rope",
    kind=FUNCTION,
    instrument=instrument_rope,
)
def rope(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Rotary position embedding applied to q and k.

    In Multi-Latent Attention RoPE is applied inside ``get_query_key_value_tensors`` to the RoPE parts
    only: q's [s,b,heads,qk_pos_emb_head_dim] and k's one shared head [s,b,1,qk_pos_emb_head_dim], with
    the table (and YaRN's mscale) of the attention's own ``rotary_pos_emb``. The function it calls is
    instrumented there too (instrument_rope), so the op has its range inside MLA as in the dense
    attention, and this call is MLA's (mla_rope_call). MLA's fused RoPE (``apply_rope_fusion``) is other
    kernels with no range: skipped."""
    s, b = point.seq_len, point.micro_batch_size
    if _is_mla(ctx):
        if ctx.config.apply_rope_fusion:
            raise OpNotApplicable("MLA's fused RoPE (apply_rope_fusion) runs in kernels of its own, unranged")
        heads, _, pos, _ = _mla_dims(ctx)
        q_shape, k_shape = (s, b, heads, pos), (s, b, 1, pos)
    else:
        q_shape, k_shape, _ = _qkv_shapes(ctx, point)
    inputs = (ctx.randn(q_shape, "query"), ctx.randn(k_shape, "key"))
    return OpCall(rope_call(ctx, point), inputs)


@register_op(
    "core_attention",
    aliases=("TEDotProductAttention", "DotProductAttention"),
    where="self_attention.core_attention",
)
def core_attention(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Scaled dot-product attention with the causal mask (softmax(QK^T)V); under MLA q and k heads are
    qk_head_dim + qk_pos_emb_head_dim wide and v heads v_head_dim."""
    from megatron.core.transformer.enums import AttnMaskType

    module = ctx.layer.self_attention.core_attention
    mask = ctx.causal_mask(point)
    q_shape, k_shape, v_shape = _qkv_shapes(ctx, point)
    inputs = (ctx.randn(q_shape, "query"), ctx.randn(k_shape, "key"), ctx.randn(v_shape, "value"))

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return module(
            q, k, v, mask, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=None
        )

    return OpCall(call, inputs, module)


@register_op("linear_proj", where="self_attention.linear_proj")
def linear_proj(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The attention output projection (row-parallel), from heads x head_dim (MLA: x v_head_dim)."""
    linear = ctx.layer.self_attention.linear_proj
    if _is_mla(ctx):
        heads, _, _, d = _mla_dims(ctx)
    else:
        heads, _, d = _heads(ctx)
    context = ctx.randn((point.seq_len, point.micro_batch_size, heads * d), "context")
    return OpCall(linear, (context,), linear)


def _post_norms_only(config: Any) -> str | None:
    """``missing_from`` of the post norms: in families with a norm after the attention and the MLP."""
    if getattr(config, "post_layernorms", False):
        return None
    return "exists only with post_layernorms (a norm after the attention and after the MLP, as Gemma-2's)"


def _post_norm(module: Any, op: str) -> Any:
    norm = getattr(module, "post_layernorm", None)
    if norm is None:
        raise OpNotApplicable(f"{op} {_post_norms_only(None)}")
    return norm


@register_op("post_attention_layernorm", where="self_attention.post_layernorm", missing_from=_post_norms_only)
def post_attention_layernorm(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The norm of the attention's output, before the residual add (inside self_attention)."""
    norm = _post_norm(ctx.layer.self_attention, "post_attention_layernorm")
    return OpCall(norm, (ctx.hidden(point, "attention_out"),), norm)


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


@register_op("mlp", aliases=("MLP",), where="mlp", half=MLP, missing_from=_dense_mlp_only)
def mlp(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The MLP: linear_fc1, activation (with GLU gating), linear_fc2."""
    module = ctx.dense_layer.mlp
    return OpCall(module, (ctx.hidden(point),), module)


@register_op("linear_fc1", aliases=("fc1_op",), where="mlp.linear_fc1", missing_from=_dense_mlp_only)
def linear_fc1(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The MLP up (and gate) projection (column-parallel)."""
    linear = ctx.dense_layer.mlp.linear_fc1
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
    missing_from=_dense_mlp_only,
)
def activation(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The activation function including the GLU gating (SwiGLU: silu(gate) * up)."""
    ctx.dense_layer  # noqa: B018 - raises OpNotApplicable where no layer has a dense MLP
    shape = (point.seq_len, point.micro_batch_size, _fc1_width(ctx))
    return OpCall(activation_call(ctx), (ctx.randn(shape, "fc1_out"),))


@register_op("linear_fc2", aliases=("fc2_op",), where="mlp.linear_fc2", missing_from=_dense_mlp_only)
def linear_fc2(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The MLP down projection (row-parallel)."""
    linear = ctx.dense_layer.mlp.linear_fc2
    width = ctx.config.ffn_hidden_size // ctx.config.tensor_model_parallel_size
    return OpCall(
        linear, (ctx.randn((point.seq_len, point.micro_batch_size, width), "activation_out"),), linear
    )


@register_op("post_mlp_layernorm", where="mlp.post_layernorm", missing_from=_post_norms_only)
def post_mlp_layernorm(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The norm of the MLP's output, before the residual add (inside mlp)."""
    norm = _post_norm(ctx.dense_layer.mlp, "post_mlp_layernorm")
    return OpCall(norm, (ctx.hidden(point, "mlp_out"),), norm)


@register_op("mlp_bda", where="mlp_bda", kind=FACTORY, half=MLP)
def mlp_bda(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Bias-dropout-add after the MLP."""
    layer = ctx.layer
    call = bda_call(layer, "mlp_bda", _linear_bias(getattr(layer.mlp, "linear_fc2", None)))
    return OpCall(call, (ctx.hidden(point, "mlp_out"), ctx.hidden(point, "residual")))
