"""The one mapping from a HuggingFace model config to Megatron-Core's model arguments.

Megatron-Core ships no such converter, so this is ours. Every HF field that shapes the network maps to a
``TransformerConfig`` field or a ``GPTModel`` argument:

==============================  =====================================================
HF config                       Megatron-Core
==============================  =====================================================
num_hidden_layers               TransformerConfig.num_layers
hidden_size                     hidden_size
intermediate_size               ffn_hidden_size
num_attention_heads             num_attention_heads
num_key_value_heads (GQA)       num_query_groups
head_dim (or hidden/heads)      kv_channels
rms_norm_eps / layer_norm_eps   layernorm_epsilon
model_type llama/mistral/qwen2  normalization="RMSNorm" (LayerNorm otherwise)
hidden_act silu + gated MLP     gated_linear_unit=True, activation_func=F.silu (SwiGLU)
attention_bias                  add_qkv_bias (Qwen2: q/k/v only) or add_bias_linear (Llama: q/k/v/o)
mlp_bias                        add_bias_linear (must agree with attention_bias for Llama)
attention_dropout               attention_dropout; hidden_dropout = 0 (HF decoders have none)
vocab_size                      GPTModel vocab_size
max_position_embeddings         GPTModel max_sequence_length
rope theta                      GPTModel rotary_base (position_embedding_type="rope")
partial_rotary_factor           GPTModel rotary_percent
tie_word_embeddings             GPTModel share_embeddings_and_output_weights
model_type qwen3/qwen3_moe      qk_layernorm=True (RMSNorm on each head's q and k)
==============================  =====================================================

Mixture-of-Experts fields (see :func:`_moe_fields`):

======================================  ==============================================================
HF config                               Megatron-Core
======================================  ==============================================================
num_local_experts / num_experts /       num_moe_experts
n_routed_experts
num_experts_per_tok                     moe_router_topk
moe_intermediate_size (else             moe_ffn_hidden_size (each routed expert's width)
intermediate_size, as Mixtral)
n_shared_experts x moe_intermediate     moe_shared_expert_intermediate_size (DeepSeek: one MLP as wide
_size; shared_expert_intermediate_size  as all shared experts); Qwen2-MoE's also moe_shared_expert_gate
first_k_dense_replace; decoder_sparse_  moe_layer_freq, a 0/1 list (0: a dense layer of width
step, mlp_only_layers                   intermediate_size)
norm_topk_prob, scoring (softmax)       moe_router_pre_softmax: softmax over all experts before top-k
                                        (DeepSeek, and Qwen3-MoE without norm_topk_prob); with the
                                        renormalisation, softmax over the top-k logits (Megatron's default)
routed_scaling_factor                   moe_router_topk_scaling_factor
router_aux_loss_coef / aux_loss_alpha   moe_aux_loss_coeff (load-balancing loss, "aux_loss")
======================================  ==============================================================

Multi-Latent Attention fields (DeepSeek-V2/V3; built with an ``MLATransformerConfig``):

======================================  ==============================================================
kv_lora_rank, q_lora_rank (null: no     kv_lora_rank, q_lora_rank (None: one q projection)
q LoRA)
qk_nope_head_dim, qk_rope_head_dim,     qk_head_dim, qk_pos_emb_head_dim, v_head_dim
v_head_dim
rope_scaling / rope_parameters yarn     rope_type="yarn", rotary_scaling_factor, original_max_position_
                                        embeddings, beta_fast, beta_slow, mscale, mscale_all_dim
======================================  ==============================================================

What the token dispatcher and the experts' implementation are depends on the device, not the model:
autotuner.model.build chooses them.

``hf.<field>=`` overrides are applied to the HF config before this mapping, ``tf.<field>=`` overrides to
the TransformerConfig arguments after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotuner.errors import UserError

_RMSNORM_MODELS = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
}
_QK_NORM_MODELS = {"qwen3", "qwen3_moe"}
_MLA_MODELS = {"deepseek_v2", "deepseek_v3"}
_GATED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu"}
# Llama-family attention puts attention_bias on q, k, v and o; Qwen2 on q, k, v only.
_QKV_ONLY_BIAS_MODELS = {"qwen2", "qwen2_moe"}


@dataclass
class MegatronModelArgs:
    """What building the Megatron-Core model needs: TransformerConfig kwargs plus GPTModel kwargs.

    ``activation`` is kept by name (``silu``/``gelu``) so the arguments stay plain data; the function is
    looked up when the TransformerConfig is built.
    """

    transformer: dict[str, Any]
    activation: str
    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    rotary_percent: float
    tie_word_embeddings: bool
    notes: list[str] = field(default_factory=list)


def _fix(name: str, hint: str = "") -> str:
    """How to fix field ``name``: the override that sets it (the same field in the case file works too)."""
    return f"set hf.{name}=<value>{hint} or fix {name} in the case file"


def _int_field(hf: Any, name: str, hint: str = "", required: bool = True) -> int | None:
    """A positive integer field. Missing: None (an error when ``required``); present but anything else
    (0, negative, a string, a bool) is an error, never replaced by a default."""
    value = getattr(hf, name, None)
    if value is None:
        if required:
            raise UserError(f"the case's HF config has no {name}: {_fix(name, hint)}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"HF config field {name}={value!r} must be a positive integer: {_fix(name, hint)}")
    return value


def _float_field(hf: Any, name: str, default: float, low: float, high: float, low_open: bool) -> float:
    """A number in [low, high] (or (low, high] when ``low_open``); only a missing field takes ``default``."""
    value = getattr(hf, name, None)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value > low if low_open else value >= low) or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise UserError(
            f"HF config field {name}={value!r} must be a number in {bounds}: {_fix(name, f' in {bounds}')}"
        )
    return float(value)


def _bool_field(hf: Any, name: str) -> bool:
    value = getattr(hf, name, None)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise UserError(f"HF config field {name}={value!r} must be true or false: {_fix(name)}")
    return value


def _rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    value = params.get("rope_theta") if isinstance(params, dict) else None  # transformers >= 5
    if value is None:
        value = getattr(hf, "rope_theta", None)
    if value is None:
        return 10000.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(
            f"HF config field rope_theta={value!r} must be a positive number: {_fix('rope_theta')}"
        )
    return float(value)


def _layernorm_epsilon(hf: Any) -> float:
    for name in ("rms_norm_eps", "layer_norm_eps"):
        if getattr(hf, name, None) is not None:
            return _float_field(hf, name, 1e-5, 0.0, 1.0, low_open=False)
    return 1e-5


def map_hf_config(hf: Any) -> MegatronModelArgs:
    """Map a transformers config to Megatron-Core arguments, rejecting what cannot be expressed.

    A field that is present must be valid; only a missing one takes its default (a zero head count
    must not quietly become multi-head attention)."""
    model_type = hf.model_type
    hidden = _int_field(hf, "hidden_size")
    heads = _int_field(hf, "num_attention_heads", f" dividing hidden_size ({hidden})")
    kv_heads = _int_field(
        hf,
        "num_key_value_heads",
        f" dividing num_attention_heads ({heads}), or leave it out for multi-head attention,",
        required=False,
    )
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim = _int_field(hf, "head_dim", " (the width of one head)", required=False)
    if head_dim is None:
        if hidden % heads:
            raise UserError(
                f"num_attention_heads ({heads}) does not divide hidden_size ({hidden}): "
                "change hf.num_attention_heads or set hf.head_dim"
            )
        head_dim = hidden // heads
    if heads % kv_heads:
        raise UserError(
            f"num_key_value_heads ({kv_heads}) does not divide num_attention_heads ({heads}): "
            "set hf.num_key_value_heads to a divisor of the head count"
        )
    layers = _int_field(hf, "num_hidden_layers")
    ffn = _int_field(hf, "intermediate_size", " (the MLP width)")
    vocab = _int_field(hf, "vocab_size")
    max_positions = _int_field(hf, "max_position_embeddings")
    act = str(getattr(hf, "hidden_act", "silu"))
    gated = model_type in _RMSNORM_MODELS  # these families all use a gated (GLU) MLP
    if act not in _GATED_ACTIVATIONS:
        raise UserError(f"hidden_act {act!r} is not supported: use one of {sorted(_GATED_ACTIVATIONS)}")
    attention_bias = _bool_field(hf, "attention_bias")
    mlp_bias = _bool_field(hf, "mlp_bias")
    notes = []
    if model_type in _QKV_ONLY_BIAS_MODELS:
        add_bias_linear, add_qkv_bias = mlp_bias, True
    else:
        if attention_bias != mlp_bias and attention_bias:
            raise UserError(
                "attention_bias=true with mlp_bias=false (bias on q/k/v/o but not the MLP) has no "
                "Megatron-Core equivalent: set hf.mlp_bias=true or hf.attention_bias=false"
            )
        add_bias_linear = attention_bias and mlp_bias
        add_qkv_bias = add_bias_linear
    window = getattr(hf, "sliding_window", None)
    if window:
        notes.append(
            f"sliding_window={window} is not mapped: attention is full causal, "
            f"identical to the model's for sequences up to {window} tokens"
        )
    transformer = dict(
        qk_layernorm=model_type in _QK_NORM_MODELS or model_type in _MLA_MODELS,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        layernorm_epsilon=_layernorm_epsilon(hf),
        normalization="RMSNorm" if model_type in _RMSNORM_MODELS else "LayerNorm",
        gated_linear_unit=gated,
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        attention_dropout=_float_field(hf, "attention_dropout", 0.0, 0.0, 1.0, low_open=False),
        hidden_dropout=0.0,
    )
    transformer.update(_moe_fields(hf, layers, notes))
    if model_type in _MLA_MODELS:
        transformer.update(_mla_fields(hf, notes))
    return MegatronModelArgs(
        transformer=transformer,
        activation=_GATED_ACTIVATIONS[act],
        vocab_size=vocab,
        max_sequence_length=max_positions,
        rotary_base=_rope_theta(hf),
        rotary_percent=_float_field(hf, "partial_rotary_factor", 1.0, 0.0, 1.0, low_open=True),
        tie_word_embeddings=_bool_field(hf, "tie_word_embeddings"),
        notes=notes,
    )


def _moe_layer_pattern(hf: Any, layers: int) -> list[int] | int:
    """Which layers are MoE (1) and which dense (0): DeepSeek's first ``first_k_dense_replace`` layers are
    dense; Qwen-MoE's layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers. 1 (Megatron's "every layer") when all are."""
    first_dense = getattr(hf, "first_k_dense_replace", None) or 0
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or not 0 <= first_dense < layers:
        raise UserError(
            f"HF config field first_k_dense_replace={first_dense!r} must be an integer in [0, {layers}): "
            f"{_fix('first_k_dense_replace')}"
        )
    step = getattr(hf, "decoder_sparse_step", None) or 1
    dense_only = set(getattr(hf, "mlp_only_layers", None) or ())
    pattern = [int(i >= first_dense and (i + 1) % step == 0 and i not in dense_only) for i in range(layers)]
    if not any(pattern):
        raise UserError(
            "the case's HF config makes no layer an MoE layer (first_k_dense_replace, decoder_sparse_step, "
            "mlp_only_layers): fix those fields, or drop the expert fields for a dense model"
        )
    return 1 if all(pattern) else pattern


def _moe_fields(hf: Any, layers: int, notes: list[str]) -> dict[str, Any]:
    """The TransformerConfig fields of a Mixture-of-Experts model; {} for a dense one."""
    experts = _int_field(hf, "num_experts", " (the routed experts per layer)", required=False)
    if experts is None:
        return {}
    topk = _int_field(hf, "num_experts_per_tok", f" (experts per token, at most {experts})")
    if topk > experts:
        raise UserError(
            f"num_experts_per_tok ({topk}) exceeds the {experts} experts: "
            f"set hf.num_experts_per_tok <= {experts}"
        )
    expert_ffn = _int_field(hf, "moe_intermediate_size", " (one expert's MLP width)", required=False)
    expert_ffn = expert_ffn or _int_field(hf, "intermediate_size")  # Mixtral: every expert as wide as the MLP
    fields: dict[str, Any] = dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=expert_ffn,
        moe_layer_freq=_moe_layer_pattern(hf, layers),
        moe_router_load_balancing_type="aux_loss",
    )
    shared = _int_field(hf, "n_shared_experts", required=False)
    if shared:  # DeepSeek: the shared experts are one MLP as wide as all of them
        fields["moe_shared_expert_intermediate_size"] = shared * expert_ffn
    shared_width = _int_field(hf, "shared_expert_intermediate_size", required=False)
    if shared_width:  # Qwen2-MoE: one shared expert, its output scaled by a sigmoid gate
        fields.update(moe_shared_expert_intermediate_size=shared_width, moe_shared_expert_gate=True)
    # Softmax over every expert before the top-k (DeepSeek; Qwen-MoE without norm_topk_prob), or over the
    # chosen k logits (Mixtral; Qwen-MoE's renormalised top-k is the same numbers): Megatron's default.
    renormalised = hf.model_type == "mixtral" or _bool_field(hf, "norm_topk_prob")
    fields["moe_router_pre_softmax"] = not renormalised
    scaling = _float_field(hf, "routed_scaling_factor", 1.0, 0.0, 1e6, low_open=True)
    if scaling != 1.0:
        fields["moe_router_topk_scaling_factor"] = scaling
    for name in ("router_aux_loss_coef", "aux_loss_alpha"):
        if getattr(hf, name, None) is not None:
            fields["moe_aux_loss_coeff"] = _float_field(hf, name, 0.0, 0.0, 1e6, low_open=False)
    if hf.model_type in _MLA_MODELS:
        fields["moe_router_dtype"] = "fp32"  # DeepSeek's gate computes its logits in fp32 whatever the dtype
    method = getattr(hf, "topk_method", None)
    if method not in (None, "greedy"):
        notes.append(
            f"topk_method={method} is mapped as greedy top-k: the group-limited choice is not expressed "
            "(the experts' sizes and counts are unchanged)"
        )
    return fields


def _rope_scaling(hf: Any) -> dict[str, Any]:
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(hf, name, None)
        if isinstance(value, dict) and (value.get("rope_type") or value.get("type")) not in (None, "default"):
            return value
    return {}


def _mla_fields(hf: Any, notes: list[str]) -> dict[str, Any]:
    """The MLATransformerConfig fields of a Multi-Latent Attention model (DeepSeek-V2/V3)."""
    fields: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=_int_field(hf, "q_lora_rank", required=False),
        kv_lora_rank=_int_field(hf, "kv_lora_rank", " (the compressed kv width)"),
        qk_head_dim=_int_field(hf, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_int_field(hf, "qk_rope_head_dim"),
        v_head_dim=_int_field(hf, "v_head_dim"),
        rotary_base=_rope_theta(hf),  # MLA's own rotary embedding reads these from its config
        rotary_percent=_float_field(hf, "partial_rotary_factor", 1.0, 0.0, 1.0, low_open=True),
    )
    # Megatron's core attention sizes its output by kv_channels: each head's value width.
    fields["kv_channels"] = fields["v_head_dim"]
    scaling = _rope_scaling(hf)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "yarn":
        fields.update(
            rope_type="yarn",
            rotary_scaling_factor=float(scaling.get("factor", 1.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
            beta_fast=float(scaling.get("beta_fast", 32)),
            beta_slow=float(scaling.get("beta_slow", 1)),
            mscale=float(scaling.get("mscale", 1.0)),
            mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
        )
    else:
        if kind:
            notes.append(f"rope scaling {kind!r} is not mapped for MLA: plain RoPE is used")
        fields["rope_type"] = "rope"
    return fields


def layer_parameter_count(tf: Any) -> int:
    """Parameters of one TransformerLayer, computed from a TransformerConfig (or anything with its fields)."""
    h, ffn, d = tf.hidden_size, tf.ffn_hidden_size, tf.kv_channels
    nq, nkv = tf.num_attention_heads, tf.num_query_groups or tf.num_attention_heads
    norm = h if tf.normalization == "RMSNorm" else 2 * h
    qkv_out = (nq + 2 * nkv) * d
    qkv = h * qkv_out + (qkv_out if (tf.add_bias_linear or tf.add_qkv_bias) else 0)
    proj = nq * d * h + (h if tf.add_bias_linear else 0)
    fc1_out = ffn * (2 if tf.gated_linear_unit else 1)
    fc1 = h * fc1_out + (fc1_out if tf.add_bias_linear else 0)
    fc2 = ffn * h + (h if tf.add_bias_linear else 0)
    qk_norm = 0
    if tf.qk_layernorm:
        qk_norm = 2 * (d if tf.normalization == "RMSNorm" else 2 * d)
    return 2 * norm + qkv + proj + fc1 + fc2 + qk_norm


def model_parameter_count(tf: Any, vocab_size: int, tie_word_embeddings: bool) -> int:
    """Parameters of the whole GPT model: embedding, every layer, final norm, output layer."""
    h = tf.hidden_size
    final_norm = h if tf.normalization == "RMSNorm" else 2 * h
    embedding = vocab_size * h
    output = 0 if tie_word_embeddings else vocab_size * h
    return embedding + tf.num_layers * layer_parameter_count(tf) + final_norm + output
