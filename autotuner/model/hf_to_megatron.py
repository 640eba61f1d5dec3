"""The one mapping from a HuggingFace model config to Megatron-Core's model arguments.

Megatron-Core ships no such converter, so this is ours. What each field of each supported family does is
written once, in autotuner.model.families (the table docs/model_families.md renders); this module
carries it out: TransformerConfig fields (``transformer``), GPTModel arguments, and the pieces the layer
spec builds where Megatron-Core's TransformerLayer has no switch of its own (autotuner.model.layer_parts).
A present field must be valid (a zero head count is refused, never replaced by a default); only a missing
one takes the family's default. ``hf.<field>=`` overrides apply to the HF config before this mapping,
``tf.<field>=`` overrides to the TransformerConfig arguments after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotuner.errors import UserError
from autotuner.model.families import Family, family_of

# HF activation names -> ours (autotuner.model.layer_parts.ACTIVATIONS); the tanh-approximated gelu has
# three HF names.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
_WINDOW_TYPES = {"full_attention": 0, "sliding_attention": 1}


# Every TransformerConfig field the mapping sets: what the model is (its sizes and its arithmetic), as
# against how a run runs it (parallel sizes, dtypes, kernels), which the run's settings give.
MODEL_FIELDS = frozenset(
    {
        *("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups"),
        *("kv_channels", "layernorm_epsilon", "normalization", "gated_linear_unit", "add_bias_linear"),
        *("add_qkv_bias", "attention_dropout", "hidden_dropout", "qk_layernorm", "softmax_scale"),
        *("window_size", "window_attn_skip_freq", "layernorm_zero_centered_gamma"),
        *("qk_layernorm_span", "post_layernorms", "residual_scale", "attention_softcap"),
        *("embedding_scale", "embedding_dropout", "logit_scale", "logit_softcap"),
        *("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq"),
        *("moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_score_function"),
        *("moe_router_enable_expert_bias", "moe_router_pre_softmax", "moe_router_num_groups"),
        *("moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_aux_loss_coeff"),
        *("moe_router_load_balancing_type", "moe_input_jitter_eps", "moe_router_dtype"),
        *("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim"),
        *("v_head_dim", "rotary_base", "rotary_percent", "rope_type", "rotary_scaling_factor"),
        *("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
    }
)


@dataclass
class MegatronModelArgs:
    """What building the Megatron-Core model needs: TransformerConfig kwargs (``transformer``, with the
    families' fields of autotuner.model.layer_parts.FamilyFields) plus GPTModel kwargs, as plain data.
    ``activation``: silu, gelu or gelu_tanh (the function is looked up when the config is built)."""

    transformer: dict[str, Any]
    activation: str
    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    rotary_percent: float
    tie_word_embeddings: bool
    notes: list[str] = field(default_factory=list)
    family: str = ""
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    seq_len_interpolation_factor: float | None = None


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
    return _checked_float(name, value, low, high, low_open)


def _checked_float(name: str, value: Any, low: float, high: float, low_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value > low if low_open else value >= low) or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise UserError(
            f"HF config field {name}={value!r} must be a number in {bounds}: {_fix(name, f' in {bounds}')}"
        )
    return float(value)


def _bool_field(hf: Any, name: str, default: bool = False) -> bool:
    value = getattr(hf, name, None)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UserError(f"HF config field {name}={value!r} must be true or false: {_fix(name)}")
    return value


def _refuse_true(hf: Any, name: str, why: str) -> None:
    if _bool_field(hf, name):
        raise UserError(
            f"HF config field {name}=true is not expressible in Megatron-Core ({why}): set hf.{name}=false"
        )


def _rope(hf: Any) -> dict[str, Any]:
    """The rope settings as transformers >= 5 keeps them (``rope_parameters``), or as older versions and
    their files do (``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``)."""
    params = getattr(hf, "rope_parameters", None)
    merged: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    scaling = getattr(hf, "rope_scaling", None)
    if isinstance(scaling, dict):
        merged = {**scaling, **merged}
    for name in ("rope_theta", "partial_rotary_factor"):
        if merged.get(name) is None and getattr(hf, name, None) is not None:
            merged[name] = getattr(hf, name)
    return merged


def _rope_kind(rope: dict[str, Any]) -> str:
    return str(rope.get("rope_type") or rope.get("type") or "default")


def _rope_theta(hf: Any) -> float:
    value = _rope(hf).get("rope_theta")
    if value is None:
        return 10000.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(
            f"HF config field rope_theta={value!r} must be a positive number: {_fix('rope_theta')}"
        )
    return float(value)


def _rotary_percent(hf: Any) -> float:
    value = _rope(hf).get("partial_rotary_factor")
    return 1.0 if value is None else _checked_float("partial_rotary_factor", value, 0.0, 1.0, low_open=True)


def _dense_rope(hf: Any, notes: list[str]) -> dict[str, Any]:
    """GPTModel's rope arguments for a model with the dense attention: Llama-3's scaling and linear
    interpolation are Megatron's own; any other scaling changes only the values of the rotary table."""
    rope = _rope(hf)
    kind = _rope_kind(rope)
    if kind == "default":
        return {}
    if kind == "linear":
        factor = _checked_float("rope_parameters.factor", rope.get("factor"), 0.0, 1e6, low_open=True)
        return {"seq_len_interpolation_factor": factor}
    if kind == "llama3":
        factor = _checked_float("rope_parameters.factor", rope.get("factor"), 0.0, 1e6, low_open=True)
        # Megatron's _apply_scaling takes the factor; its other constants are Llama-3.1's.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        other = {k: rope.get(k) for k, v in fixed.items() if rope.get(k) is not None and rope.get(k) != v}
        if other:
            notes.append(
                f"rope_type=llama3 with {other}: Megatron-Core's Llama-3 scaling fixes them at {fixed}; "
                "the rotary table's values differ, the work does not"
            )
        return {"rope_scaling": True, "rope_scaling_factor": factor}
    notes.append(
        f"rope_type={kind} is not Megatron-Core's: the rotary table's values differ from the model's, the "
        "work and memory do not (RoPE is applied the same way)"
    )
    return {}


def _window(hf: Any, family: Family, layers: int) -> dict[str, Any]:
    """Sliding-window attention as Megatron-Core's ``window_size`` (the tokens before each one it sees,
    and after: HF's window counts the token itself) and ``window_attn_skip_freq`` (which layers slide)."""
    if family.window is None:
        return {}
    window = getattr(hf, "sliding_window", None)
    if family.window == "layer_types":
        types = getattr(hf, "layer_types", None)
        if types is None:  # transformers < 5: Gemma-2 slides on even layers, Qwen2 on the top ones
            if family.model_type == "gemma2":
                types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
            elif _bool_field(hf, "use_sliding_window"):
                first = getattr(hf, "max_window_layers", 0) or 0
                types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
            else:
                types = ["full_attention"] * layers
        unknown = sorted(set(types) - set(_WINDOW_TYPES))
        if unknown or len(types) != layers:
            raise UserError(
                f"HF config field layer_types={unknown or len(types)}: only {', '.join(_WINDOW_TYPES)} "
                f"layers, one per layer ({layers}), are expressible: fix layer_types"
            )
        sliding = [_WINDOW_TYPES[t] for t in types]
    else:
        sliding = [1] * layers
    if not window or not any(sliding):
        return {}
    window = _int_field(hf, "sliding_window", " (tokens each token attends to)")
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": None if all(sliding) else sliding}


def _biases(hf: Any, family: Family) -> tuple[bool, bool]:
    """(add_bias_linear, add_qkv_bias): Megatron-Core biases every linear (add_bias_linear) or q/k/v alone
    (add_qkv_bias)."""
    if family.bias == "none":
        return False, False
    if family.bias == "qkv":
        return False, True
    if family.bias == "qkv_field":
        return False, _bool_field(hf, "qkv_bias", default=True)
    if family.bias == "all":
        every = _bool_field(hf, "use_bias", default=True)
        return every, every
    attention = _bool_field(hf, "attention_bias")
    if family.bias == "attention":
        if attention:
            raise UserError(
                "HF config field attention_bias=true (bias on q/k/v/o but not the MLP) has no Megatron-Core "
                "equivalent: set hf.attention_bias=false"
            )
        return False, False
    mlp = _bool_field(hf, "mlp_bias")
    if attention != mlp:
        where = "q/k/v/o but not the MLP" if attention else "the MLP but not q/k/v/o"
        raise UserError(
            f"attention_bias={str(attention).lower()} with mlp_bias={str(mlp).lower()} (bias on {where}) has "
            "no Megatron-Core equivalent (add_bias_linear biases every linear): set both the same"
        )
    return attention, attention


def _dropouts(hf: Any, family: Family) -> tuple[float, float | None]:
    """(hidden_dropout, the embedding's own dropout where it is not hidden_dropout)."""
    hidden_name = {"phi3": "resid_pdrop", "starcoder2": "residual_dropout"}.get(family.model_type)
    embedding_name = {"phi3": "embd_pdrop", "starcoder2": "embedding_dropout"}.get(family.model_type)
    hidden = _float_field(hf, hidden_name, 0.0, 0.0, 1.0, low_open=False) if hidden_name else 0.0
    embedding = _float_field(hf, embedding_name, 0.0, 0.0, 1.0, low_open=False) if embedding_name else 0.0
    return hidden, None if embedding == hidden else embedding


class _TableFields:
    """The HF config as the mapping may read it: only the fields the family's table has a rule for
    (autotuner.model.families); any other reads as absent. So every field that reaches Megatron-Core
    is one the table says it does."""

    def __init__(self, hf: Any, family: Family) -> None:
        self._hf, self._family = hf, family

    def __getattr__(self, name: str) -> Any:
        if self._family.rule(name) is None:
            return None
        return getattr(self._hf, name, None)

    def to_dict(self) -> dict[str, Any]:
        return self._hf.to_dict()


def _unknown_keys(hf: Any, family: Family, notes: list[str]) -> None:
    """Keys of the config the family's table does not know: not mapped, said once (the file's author may
    have meant something by them)."""
    unknown = sorted(k for k in hf.to_dict() if family.rule(k) is None)
    if unknown:
        notes.append(
            f"config key(s) {', '.join(unknown)}: not fields of transformers' {type(hf).__name__} and not in "
            f"the {family.model_type} family's table: not mapped"
        )


def map_hf_config(hf: Any) -> MegatronModelArgs:
    """Map a transformers config to Megatron-Core arguments, rejecting what cannot be expressed and
    noting what is not (autotuner.model.families)."""
    family = family_of(hf.model_type)
    notes: list[str] = []
    _unknown_keys(hf, family, notes)
    hf = _TableFields(hf, family)
    hidden = _int_field(hf, "hidden_size")
    heads = _int_field(hf, "num_attention_heads", f" dividing hidden_size ({hidden})")
    layers = _int_field(hf, "num_hidden_layers")
    vocab = _int_field(hf, "vocab_size")
    max_positions = _int_field(hf, "max_position_embeddings")
    ffn = _int_field(hf, "intermediate_size", " (the MLP width)")
    act = str(getattr(hf, family.activation, None) or "silu")
    if act not in _ACTIVATIONS:
        raise UserError(
            f"HF config field {family.activation}={act!r} is not supported: use one of {sorted(_ACTIVATIONS)}"
        )
    add_bias_linear, add_qkv_bias = _biases(hf, family)
    hidden_dropout, embedding_dropout = _dropouts(hf, family)
    transformer: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        layernorm_epsilon=_float_field(hf, family.eps, 1e-5, 0.0, 1.0, low_open=False),
        normalization=family.norm,
        gated_linear_unit=family.gated,
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        attention_dropout=_float_field(hf, "attention_dropout", 0.0, 0.0, 1.0, low_open=False),
        hidden_dropout=hidden_dropout,
        qk_layernorm=family.qk_norm is not None or family.mla,
    )
    if family.mla:
        _refuse_true(hf, "attention_bias", "MLA's projections are built without bias")
        _refuse_true(hf, "mlp_bias", "the routed experts have no bias to match")
        transformer.update(_mla_fields(hf, notes))
        rope: dict[str, Any] = {}
    else:
        transformer.update(_dense_attention(hf, heads, hidden))
        transformer.update(_window(hf, family, layers))
        rope = _dense_rope(hf, notes)
    transformer.update(_moe_fields(hf, family, layers, notes))
    transformer.update(_family_fields(hf, family, hidden, embedding_dropout))
    _family_checks(hf, family, notes)
    assert set(transformer) <= MODEL_FIELDS, sorted(set(transformer) - MODEL_FIELDS)
    return MegatronModelArgs(
        transformer=transformer,
        activation=_ACTIVATIONS[act],
        vocab_size=vocab,
        max_sequence_length=max_positions,
        rotary_base=_rope_theta(hf),
        rotary_percent=_rotary_percent(hf),
        tie_word_embeddings=_bool_field(hf, "tie_word_embeddings"),
        notes=notes,
        family=family.model_type,
        **rope,
    )


def _dense_attention(hf: Any, heads: int, hidden: int) -> dict[str, Any]:
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
    return dict(num_query_groups=kv_heads, kv_channels=head_dim)


def _family_fields(hf: Any, family: Family, hidden: int, embedding_dropout: float | None) -> dict[str, Any]:
    """What the family computes beyond TransformerConfig's own switches (FamilyFields, and Megatron's
    zero-centred norms): a field is set only where it differs from Megatron's default."""
    fields: dict[str, Any] = {}
    if family.zero_centered_norm:
        fields["layernorm_zero_centered_gamma"] = True
    if family.qk_norm == "projection":
        fields["qk_layernorm_span"] = "projection"
    if family.post_norms:
        fields["post_layernorms"] = True
    if embedding_dropout is not None:
        fields["embedding_dropout"] = embedding_dropout
    if family.embedding_scale == "sqrt_hidden":
        fields["embedding_scale"] = float(hidden) ** 0.5
    elif family.embedding_scale == "embedding_multiplier":
        value = _float_field(hf, "embedding_multiplier", 1.0, 0.0, 1e6, low_open=True)
        if value != 1.0:
            fields["embedding_scale"] = value
    if family.multipliers:
        residual = _float_field(hf, "residual_multiplier", 1.0, 0.0, 1e6, low_open=True)
        if residual != 1.0:
            fields["residual_scale"] = residual
        logits = _float_field(hf, "logits_scaling", 1.0, 0.0, 1e6, low_open=True)
        if logits != 1.0:
            fields["logit_scale"] = 1.0 / logits
        attention = getattr(hf, "attention_multiplier", None)
        if attention is not None:
            fields["softmax_scale"] = _checked_float(
                "attention_multiplier", attention, 0.0, 1e6, low_open=True
            )
    if family.softcapping:
        for name, key in (
            ("attn_logit_softcapping", "attention_softcap"),
            ("final_logit_softcapping", "logit_softcap"),
        ):
            value = getattr(hf, name, None)
            if value is not None:
                fields[key] = _checked_float(name, value, 0.0, 1e9, low_open=True)
        scalar = getattr(hf, "query_pre_attn_scalar", None)
        if scalar is not None:
            fields["softmax_scale"] = (
                _checked_float("query_pre_attn_scalar", scalar, 0.0, 1e9, low_open=True) ** -0.5
            )
    return fields


def _family_checks(hf: Any, family: Family, notes: list[str]) -> None:
    """The family's refused values and notes that belong to no group of fields above."""
    if family.model_type in ("gemma", "gemma2"):
        _refuse_true(hf, "use_bidirectional_attention", "bidirectional (encoder) attention is not profiled")
    clip = getattr(hf, "clip_qkv", None)
    if family.model_type == "olmoe" and clip is not None:
        notes.append(
            f"clip_qkv={clip}: the model clamps q, k and v to +-{clip}, an elementwise op Megatron-Core's "
            "attention does not run: its time is not in the rows"
        )
    quantization = getattr(hf, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        notes.append(
            f"quantization_config ({method}) says how the published weights are stored: a run computes "
            "in its dtype= setting, as training does"
        )
    if family.model_type == "deepseek_v3":
        mtp = getattr(hf, "num_nextn_predict_layers", None)
        if mtp:
            notes.append(
                f"num_nextn_predict_layers={mtp}: the multi-token-prediction layers are not built "
                "(transformers' model leaves them out too): their parameters and ops are not counted"
            )
        if _bool_field(hf, "rope_interleave", default=True):
            notes.append(
                "rope_interleave=true: Megatron-Core's MLA rotates the RoPE dimensions by halves, not by "
                "pairs: the same work, other values"
            )
    for key, wanted in (
        ("scoring_func", "sigmoid" if family.moe and family.moe.score == "sigmoid" else "softmax"),
    ):
        value = getattr(hf, key, None)
        if family.mla and value is not None and value != wanted:
            raise UserError(
                f"HF config key {key}={value!r} contradicts transformers' {family.model_type} model, which "
                f"scores with {wanted}: set hf.{key}={wanted} or drop it"
            )
    if family.mla:
        freq = getattr(hf, "moe_layer_freq", None)
        if freq not in (None, 1):
            raise UserError(
                f"HF config key moe_layer_freq={freq!r}: transformers' {family.model_type} model makes every "
                "layer after first_k_dense_replace an MoE layer: set hf.moe_layer_freq=1 or drop it"
            )


def _moe_layer_pattern(hf: Any, family: Family, layers: int) -> list[int] | int:
    """Which layers are MoE (1) and which dense (0): DeepSeek's first ``first_k_dense_replace`` layers are
    dense; Qwen-MoE's layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers. 1 (Megatron's "every layer") when all are."""
    assert family.moe is not None
    first_dense, step, dense_only = 0, 1, set()
    if family.moe.dense == "first_k_dense_replace":
        first_dense = getattr(hf, "first_k_dense_replace", None) or 0
        if isinstance(first_dense, bool) or not isinstance(first_dense, int) or not 0 <= first_dense < layers:
            raise UserError(
                f"HF config field first_k_dense_replace={first_dense!r} must be an integer in [0, {layers}): "
                f"{_fix('first_k_dense_replace')}"
            )
    elif family.moe.dense == "sparse_step":
        step = _int_field(hf, "decoder_sparse_step", required=False) or 1
        dense_only = set(getattr(hf, "mlp_only_layers", None) or ())
    pattern = [int(i >= first_dense and (i + 1) % step == 0 and i not in dense_only) for i in range(layers)]
    if not any(pattern):
        raise UserError(
            "the case's HF config makes no layer an MoE layer (first_k_dense_replace, decoder_sparse_step, "
            "mlp_only_layers): fix those fields"
        )
    return 1 if all(pattern) else pattern


def _moe_fields(hf: Any, family: Family, layers: int, notes: list[str]) -> dict[str, Any]:
    """The TransformerConfig fields of a Mixture-of-Experts family; {} for a dense one."""
    moe = family.moe
    if moe is None:
        return {}
    experts = _int_field(hf, moe.experts, " (the routed experts per layer)")
    topk = _int_field(hf, "num_experts_per_tok", f" (experts per token, at most {experts})")
    if topk > experts:
        raise UserError(
            f"num_experts_per_tok ({topk}) exceeds the {experts} experts: "
            f"set hf.num_experts_per_tok <= {experts}"
        )
    width = (
        _int_field(hf, moe.width, " (one expert's MLP width)")
        if moe.width
        else _int_field(hf, "intermediate_size")
    )
    fields: dict[str, Any] = dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=width,
        moe_layer_freq=_moe_layer_pattern(hf, family, layers),
    )
    if moe.shared == "count":
        shared = _int_field(hf, "n_shared_experts", required=False)
        if shared:  # DeepSeek: the shared experts are one MLP as wide as all of them
            fields["moe_shared_expert_intermediate_size"] = shared * width
    elif moe.shared == "width":
        shared_width = _int_field(hf, "shared_expert_intermediate_size", required=False)
        if shared_width:
            fields.update(
                moe_shared_expert_intermediate_size=shared_width, moe_shared_expert_gate=moe.shared_gate
            )
    fields.update(_router_fields(hf, moe, experts, topk, notes))
    if family.mla:
        fields["moe_router_dtype"] = "fp32"  # DeepSeek's gate computes its logits in fp32 whatever the dtype
    return fields


def _router_fields(hf: Any, moe: Any, experts: int, topk: int, notes: list[str]) -> dict[str, Any]:
    """The router: scoring, renormalisation, group-limited top-k, scaling, load balancing, jitter."""
    fields: dict[str, Any] = {}
    renormalised = moe.renormalise if isinstance(moe.renormalise, bool) else _bool_field(hf, moe.renormalise)
    if moe.score == "sigmoid":
        fields["moe_router_score_function"] = "sigmoid"
        fields["moe_router_enable_expert_bias"] = moe.expert_bias
        if not renormalised and topk > 1:
            notes.append(
                "norm_topk_prob=false: Megatron-Core's sigmoid router renormalises the chosen experts' "
                "weights: the same work, other weights"
            )
    else:
        # Softmax over every expert before the top-k, or over the chosen k logits (Megatron's default:
        # the same numbers as renormalising the top-k of a softmax over all).
        fields["moe_router_pre_softmax"] = not renormalised
    if moe.groups:
        fields.update(_group_limited(hf, experts, topk, notes))
    if moe.scaling:
        scaling = _float_field(hf, "routed_scaling_factor", 1.0, 0.0, 1e6, low_open=True)
        if scaling != 1.0:
            fields["moe_router_topk_scaling_factor"] = scaling
    coefficient = getattr(hf, moe.aux, None) if moe.aux else None
    if coefficient is not None:
        fields["moe_aux_loss_coeff"] = _checked_float(moe.aux, coefficient, 0.0, 1e6, low_open=False)
        seq = _bool_field(hf, "seq_aux")
        fields["moe_router_load_balancing_type"] = "seq_aux_loss" if seq else "aux_loss"
    else:
        fields["moe_router_load_balancing_type"] = "none" if moe.expert_bias else "aux_loss"
    if moe.jitter:
        jitter = _float_field(hf, "router_jitter_noise", 0.0, 0.0, 1.0, low_open=False)
        if jitter:
            fields["moe_input_jitter_eps"] = jitter
    return fields


def _group_limited(hf: Any, experts: int, topk: int, notes: list[str]) -> dict[str, Any]:
    """DeepSeek's group-limited top-k: ``n_group`` groups of experts, ``topk_group`` of them chosen per
    token, then the top-k experts inside them. DeepSeek-V2 says so with ``topk_method``; V3 always does."""
    method = getattr(hf, "topk_method", None)
    if hf.model_type == "deepseek_v2":
        if method in (None, "greedy"):
            return {}
        if method != "group_limited_greedy":
            raise UserError(
                f"HF config field topk_method={method!r} is not one transformers' deepseek_v2 runs: "
                "set hf.topk_method=greedy or group_limited_greedy"
            )
    elif method not in (None, "noaux_tc"):
        raise UserError(
            f"HF config key topk_method={method!r} contradicts transformers' {hf.model_type} model "
            "(noaux_tc: expert bias and group-limited top-k): set hf.topk_method=noaux_tc or drop it"
        )
    groups = _int_field(hf, "n_group", " (expert groups)", required=False) or 1
    chosen = _int_field(hf, "topk_group", " (groups chosen per token)", required=False) or 1
    if groups == 1:
        return {}
    if experts % groups or chosen > groups or topk % chosen:
        raise UserError(
            f"n_group={groups}, topk_group={chosen} with {experts} experts, top-{topk}: the groups must "
            "divide the experts, topk_group be at most n_group and divide num_experts_per_tok: fix "
            "hf.n_group and hf.topk_group"
        )
    if hf.model_type == "deepseek_v3" and topk // chosen != 2:
        notes.append(
            f"n_group={groups}, topk_group={chosen}, top-{topk}: transformers' DeepseekV3 ranks the groups "
            f"by the sum of their top 2 experts, Megatron-Core by that of their top {topk // chosen}: the "
            "same work, sometimes other experts"
        )
    if method == "group_limited_greedy":
        notes.append(
            "topk_method=group_limited_greedy ranks the expert groups by their best expert; Megatron-Core "
            f"by the sum of their top {topk // chosen}: the same work, sometimes other experts"
        )
    return {"moe_router_num_groups": groups, "moe_router_group_topk": chosen}


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
        rotary_percent=_rotary_percent(hf),
    )
    # Megatron's core attention sizes its output by kv_channels: each head's value width; every head has
    # its own key and value (made from the shared latent).
    fields["kv_channels"] = fields["v_head_dim"]
    fields["num_query_groups"] = _int_field(hf, "num_attention_heads")
    rope = _rope(hf)
    kind = _rope_kind(rope)
    if kind == "yarn":
        fields.update(
            rope_type="yarn",
            rotary_scaling_factor=float(rope.get("factor", 1.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
            beta_fast=float(rope.get("beta_fast", 32)),
            beta_slow=float(rope.get("beta_slow", 1)),
            mscale=float(rope.get("mscale", 1.0)),
            mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
        )
    else:
        if kind != "default":
            notes.append(f"rope_type={kind} is not mapped for MLA: plain RoPE is used (the same work)")
        fields["rope_type"] = "rope"
    return fields
