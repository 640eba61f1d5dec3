"""The supported HuggingFace model families: one entry per ``model_type``, and the one place that says how
each field of the family's config class reaches Megatron-Core.

Every field is one of three kinds (:class:`Rule`): **mapped** (it sets a TransformerConfig or GPTModel
argument, or a piece of the layer spec, exactly), **irrelevant** (it changes neither the work nor the
memory of training, with the reason), or **noted** (it would change them and is not expressed: a run
prints a note naming it when its value is in force). A value that cannot be expressed at all is refused
in one line (``refused``). tests/test_families.py walks every field of each family's config class against
this table and checks the kinds against the mapping itself; docs/model_families.md is its rendering.

A ``model_type`` not in :data:`FAMILIES` is refused naming the supported ones: no family is mapped by
resemblance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from autotuner.errors import UserError

Kind = Literal["mapped", "irrelevant", "noted"]


@dataclass(frozen=True)
class Rule:
    """What one HF config field does here: ``kind``, and in words where it goes (mapped), why it does not
    matter (irrelevant) or what is not expressed (noted); ``refused``: the values refused, if any."""

    kind: Kind
    text: str
    refused: str = ""
    alias_of: str = ""  # another name transformers' config class answers to (its attribute_map)


def mapped(text: str, refused: str = "") -> Rule:
    return Rule("mapped", text, refused)


def irrelevant(text: str) -> Rule:
    return Rule("irrelevant", text)


def noted(text: str, refused: str = "") -> Rule:
    return Rule("noted", text, refused)


def alias(field: str, kind: Kind = "mapped") -> Rule:
    """A second name of ``field`` in transformers' config class: the same rule."""
    return Rule(kind, f"another name of {field}", alias_of=field)


@dataclass(frozen=True)
class Moe:
    """How a family spells its Mixture-of-Experts layer. ``experts``/``width``: the fields of the routed
    expert count and of one expert's width (None: ``intermediate_size``, as Mixtral); ``shared``: how the
    shared experts are given (``n_shared_experts`` experts of the routed width, or one
    ``shared_expert_intermediate_size`` wide, gated by a sigmoid in Qwen2-MoE); ``score``: the router's
    scoring; ``renormalise``: the field saying whether the top-k weights are renormalised, or a fixed
    answer; ``dense``: how the dense layers are chosen (``first_k_dense_replace``, or
    ``decoder_sparse_step`` with ``mlp_only_layers``)."""

    experts: str
    width: str | None = "moe_intermediate_size"
    shared: Literal["count", "width", None] = None
    shared_gate: bool = False
    score: Literal["softmax", "sigmoid"] = "softmax"
    expert_bias: bool = False
    renormalise: str | bool = "norm_topk_prob"
    groups: bool = False
    scaling: bool = False
    dense: Literal["first_k_dense_replace", "sparse_step", None] = None
    aux: str | None = "router_aux_loss_coef"
    jitter: bool = False


@dataclass(frozen=True)
class Family:
    """One HF ``model_type``: its architecture's choices and the rules of its config fields (besides
    :data:`COMMON`). ``example``: a published model of the family (the docs' and the tests' config).

    * ``norm``/``eps``: the norm and the field of its epsilon; ``zero_centered_norm``: Gemma's norms scale
      by ``1 + weight``.
    * ``activation``: the field naming the MLP's activation; ``gated``: a GLU MLP (gate and up).
    * ``bias``: which fields put biases where: ``attention_mlp`` (``attention_bias`` on q/k/v/o,
      ``mlp_bias`` on the MLP), ``attention`` (``attention_bias`` on q/k/v/o, no MLP bias field),
      ``qkv`` (q/k/v always, Qwen2), ``qkv_field`` (``qkv_bias``), ``all`` (``use_bias`` everywhere),
      ``none``.
    * ``qk_norm``: an RMSNorm of q and k per head (``head``) or over the whole projection
      (``projection``, OLMoE).
    * ``window``: how sliding-window attention is declared: on every layer (``all``) or per layer
      (``layer_types``).
    * ``embedding_scale``: the embedding's output scaled by sqrt(hidden) (Gemma) or by
      ``embedding_multiplier`` (Granite); ``multipliers``: Granite's residual, attention and logit ones;
      ``post_norms``/``softcapping``: Gemma-2's norms after attention and MLP, and its tanh caps.
    """

    model_type: str
    example: str
    fields: Mapping[str, Rule]
    norm: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    eps: str = "rms_norm_eps"
    zero_centered_norm: bool = False
    activation: str = "hidden_act"
    gated: bool = True
    bias: Literal["attention_mlp", "attention", "qkv", "qkv_field", "all", "none"] = "attention_mlp"
    qk_norm: Literal["head", "projection", None] = None
    mla: bool = False
    moe: Moe | None = None
    window: Literal["all", "layer_types", None] = None
    embedding_scale: Literal["sqrt_hidden", "embedding_multiplier", None] = None
    multipliers: bool = False
    post_norms: bool = False
    softcapping: bool = False
    extra_keys: Mapping[str, Rule] = field(default_factory=dict)

    def rule(self, name: str) -> Rule | None:
        """The rule of field ``name``: the family's own, else the common one, else a known extra key."""
        return self.fields.get(name) or COMMON.get(name) or self.extra_keys.get(name)


# --- the rules every family shares --------------------------------------------------------------------

_TOKEN_IDS = irrelevant("a token id: the shapes come from vocab_size")
_RETURNS = irrelevant("what HF's forward returns, not what it computes")
_CLASSIFIER = irrelevant("a classification head's setting: a causal LM builds none")
_ROPE = mapped(
    "rotary_base (rope_theta), rotary_percent (partial_rotary_factor), and by rope_type: llama3 -> "
    "GPTModel rope_scaling/rope_scaling_factor, linear -> seq_len_interpolation_factor, yarn -> MLA's "
    "YaRN; the other types (dynamic, longrope, yarn outside MLA) change the rotary table's values only: noted"
)

COMMON: Mapping[str, Rule] = {
    "model_type": mapped("this table's entry"),
    "_name_or_path": irrelevant("where the config was read from"),
    "architectures": irrelevant("HF's class names: the family is model_type's"),
    "auto_map": irrelevant("remote-code classes: transformers' own classes of the family are the model"),
    "chunk_size_feed_forward": irrelevant("not read by these decoder models"),
    "dtype": irrelevant("the dtype the weights were saved in: a run computes in its dtype= setting"),
    "torch_dtype": irrelevant("the dtype the weights were saved in: a run computes in its dtype= setting"),
    "id2label": _CLASSIFIER,
    "label2id": _CLASSIFIER,
    "problem_type": _CLASSIFIER,
    "is_encoder_decoder": irrelevant("these families are decoder-only; transformers' causal LM ignores it"),
    "output_attentions": _RETURNS,
    "output_hidden_states": _RETURNS,
    "return_dict": _RETURNS,
    "transformers_version": irrelevant("the version that wrote the file"),
    "use_cache": irrelevant("generation's KV cache: training keeps none"),
    "bos_token_id": _TOKEN_IDS,
    "eos_token_id": _TOKEN_IDS,
    "pad_token_id": _TOKEN_IDS,
    "initializer_range": irrelevant("the initial weights' spread: the ops run on seeded values either way"),
    "vocab_size": mapped("GPTModel vocab_size"),
    "tie_word_embeddings": mapped("GPTModel share_embeddings_and_output_weights"),
    "hidden_size": mapped("hidden_size"),
    "num_hidden_layers": mapped("num_layers"),
    "num_attention_heads": mapped("num_attention_heads"),
    "max_position_embeddings": mapped("GPTModel max_sequence_length (the longest shapes.seq_len allowed)"),
    "rope_parameters": _ROPE,
    "rope_scaling": _ROPE,  # transformers < 5, and config.json files written by it
    "rope_theta": _ROPE,
    "partial_rotary_factor": _ROPE,
    "attention_dropout": mapped("attention_dropout"),
    "quantization_config": noted(
        "how the published weights are stored (e.g. fp8 blocks): training computes in dtype=, as profiled"
    ),
}

# Fields of the dense attention and MLP (the llama shape) that most families share.
_DENSE = {
    "intermediate_size": mapped("ffn_hidden_size (the dense MLP's width)"),
    "num_key_value_heads": mapped("num_query_groups (GQA; MQA at 1)"),
    "head_dim": mapped("kv_channels"),
    "rms_norm_eps": mapped("layernorm_epsilon"),
    "hidden_act": mapped("activation_func (silu: SwiGLU, gelu_pytorch_tanh: GeGLU with tanh gelu)"),
}
_ATTENTION_BIAS = mapped(
    "add_qkv_bias and add_bias_linear (q, k, v and o, with the MLP's)",
    refused="true where the MLP has no bias of its own: Megatron-Core puts add_bias_linear on every linear",
)
_SLIDING = mapped(
    "window_size (left = sliding_window - 1, as HF's mask), on the layers layer_types makes sliding "
    "(window_attn_skip_freq)"
)
_WINDOW_LAYERS = {
    "sliding_window": _SLIDING,
    "use_sliding_window": mapped("whether sliding_window is in force (through layer_types)"),
    "max_window_layers": mapped("which layers slide (through layer_types)"),
    "layer_types": mapped(
        "window_attn_skip_freq: which layers are sliding_attention, which full_attention",
        refused="any other layer type (chunked, linear attention)",
    ),
}
_PRETRAINING_TP = irrelevant(
    "HF splits each linear into pretraining_tp products: the same FLOPs and weights as one"
)
_ROUTER_LOGITS = irrelevant(
    "whether HF's forward returns the router logits; training here computes the load-balancing loss "
    "from moe_aux_loss_coeff"
)
_AUX = mapped("moe_aux_loss_coeff (aux_loss load balancing)")
_TOPK = mapped("moe_router_topk")
_MLP_BIAS = mapped(
    "add_bias_linear",
    refused="attention_bias and mlp_bias that differ: Megatron-Core biases every linear or none",
)
_DENSE_MOE_FIELDS = {
    "decoder_sparse_step": mapped("moe_layer_freq: layer i is MoE when (i + 1) % step == 0"),
    "mlp_only_layers": mapped("moe_layer_freq: these layers have a dense MLP of intermediate_size"),
}
_NORM_TOPK_PROB = mapped(
    "moe_router_pre_softmax: false -> softmax over every expert before the top-k, not renormalised; "
    "true -> softmax over the chosen k (the same weights as renormalising)"
)
_MLA = {
    "kv_lora_rank": mapped("kv_lora_rank (MLATransformerConfig)"),
    "q_lora_rank": mapped("q_lora_rank (null: one q projection, mla_q_proj)"),
    "qk_nope_head_dim": mapped("qk_head_dim"),
    "qk_rope_head_dim": mapped("qk_pos_emb_head_dim"),
    "v_head_dim": mapped("v_head_dim (and kv_channels, core attention's output width)"),
    "qk_head_dim": irrelevant("derived: qk_nope_head_dim + qk_rope_head_dim"),
    "head_dim": irrelevant(
        "transformers sets it to qk_rope_head_dim; MLA's widths come from the three above"
    ),
    "num_key_value_heads": irrelevant("MLA has a key and value per head, made from the shared latent"),
    "attention_bias": mapped(
        "no bias in MLA's projections", refused="true: MLA's projections are built without bias"
    ),
    "rms_norm_eps": mapped("layernorm_epsilon"),
    "hidden_act": mapped("activation_func (silu: SwiGLU)"),
    "intermediate_size": mapped("ffn_hidden_size (the dense layers' MLP)"),
    "moe_intermediate_size": mapped("moe_ffn_hidden_size (one routed expert's width)"),
    "n_shared_experts": mapped("moe_shared_expert_intermediate_size = n_shared_experts x the expert width"),
    "num_experts_per_tok": _TOPK,
    "first_k_dense_replace": mapped("moe_layer_freq: the first k layers dense"),
    "routed_scaling_factor": mapped("moe_router_topk_scaling_factor"),
    "pretraining_tp": _PRETRAINING_TP,
    "output_router_logits": _ROUTER_LOGITS,
}

# What DeepSeek-V2 and V3 share: their MoE spelling, and keys of DeepSeek's own config class that their
# published files carry (transformers' classes have none of them as fields).
_DEEPSEEK_MOE = dict(
    experts="n_routed_experts",
    shared="count",
    groups=True,
    scaling=True,
    dense="first_k_dense_replace",
    aux="aux_loss_alpha",
)
_DEEPSEEK_KEYS = {
    "aux_loss_alpha": mapped("moe_aux_loss_coeff (with seq_aux: seq_aux_loss balancing)"),
    "seq_aux": mapped("moe_router_load_balancing_type seq_aux_loss (else aux_loss)"),
    "ep_size": irrelevant("DeepSeek's inference expert-parallel hint: EP is tf.expert_model_parallel_size"),
    "moe_layer_freq": mapped(
        "1, as transformers' model (every layer after the dense ones)", refused="anything but 1"
    ),
}

# --- the families ---------------------------------------------------------------------------------------

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family(
            "llama",
            "meta-llama/Llama-3.1-8B",
            {
                **_DENSE,
                "attention_bias": mapped("add_qkv_bias and add_bias_linear, with mlp_bias"),
                "mlp_bias": _MLP_BIAS,
                "pretraining_tp": _PRETRAINING_TP,
            },
        ),
        Family(
            "mistral",
            "mistralai/Mistral-7B-v0.1",
            {**_DENSE, "sliding_window": _SLIDING},
            bias="none",
            window="all",
        ),
        Family(
            "mixtral",
            "mistralai/Mixtral-8x7B-v0.1",
            {
                **_DENSE,
                "intermediate_size": mapped("moe_ffn_hidden_size (every expert as wide as the MLP)"),
                "sliding_window": _SLIDING,
                "num_local_experts": mapped("num_moe_experts"),
                "num_experts": alias("num_local_experts"),
                "num_experts_per_tok": _TOPK,
                "router_aux_loss_coef": _AUX,
                "router_jitter_noise": mapped(
                    "moe_input_jitter_eps (the router input's multiplicative noise)"
                ),
                "output_router_logits": _ROUTER_LOGITS,
            },
            bias="none",
            window="all",
            moe=Moe("num_local_experts", width=None, renormalise=True, jitter=True),
        ),
        Family(
            "qwen2",
            "Qwen/Qwen2.5-7B",
            {**_DENSE, **_WINDOW_LAYERS},
            bias="qkv",
            window="layer_types",
        ),
        Family(
            "qwen2_moe",
            "Qwen/Qwen1.5-MoE-A2.7B-Chat",
            {
                **_DENSE,
                **_WINDOW_LAYERS,
                **_DENSE_MOE_FIELDS,
                "qkv_bias": mapped("add_qkv_bias (q, k and v)"),
                "num_experts": mapped("num_moe_experts"),
                "num_experts_per_tok": _TOPK,
                "moe_intermediate_size": mapped("moe_ffn_hidden_size"),
                "shared_expert_intermediate_size": mapped(
                    "moe_shared_expert_intermediate_size, with moe_shared_expert_gate (its sigmoid gate)"
                ),
                "norm_topk_prob": _NORM_TOPK_PROB,
                "router_aux_loss_coef": _AUX,
                "output_router_logits": _ROUTER_LOGITS,
            },
            bias="qkv_field",
            window="layer_types",
            moe=Moe("num_experts", shared="width", shared_gate=True, dense="sparse_step"),
        ),
        Family(
            "qwen3",
            "Qwen/Qwen3-8B",
            {**_DENSE, **_WINDOW_LAYERS, "attention_bias": _ATTENTION_BIAS},
            bias="attention",
            qk_norm="head",
            window="layer_types",
        ),
        Family(
            "qwen3_moe",
            "Qwen/Qwen3-30B-A3B",
            {
                **_DENSE,
                **_DENSE_MOE_FIELDS,
                "attention_bias": _ATTENTION_BIAS,
                "sliding_window": mapped("window_size (left = sliding_window - 1) on every layer"),
                "use_sliding_window": mapped("whether sliding_window is in force"),
                "num_local_experts": mapped("num_moe_experts"),
                "num_experts": alias("num_local_experts"),
                "num_experts_per_tok": _TOPK,
                "moe_intermediate_size": mapped("moe_ffn_hidden_size"),
                "norm_topk_prob": _NORM_TOPK_PROB,
                "router_aux_loss_coef": _AUX,
                "output_router_logits": _ROUTER_LOGITS,
            },
            bias="attention",
            qk_norm="head",
            window="all",
            moe=Moe("num_local_experts", dense="sparse_step"),
        ),
        Family(
            "deepseek_v2",
            "deepseek-ai/DeepSeek-V2-Lite",
            {
                **_MLA,
                "n_routed_experts": mapped("num_moe_experts"),
                "num_experts": alias("n_routed_experts"),
                "norm_topk_prob": irrelevant(
                    "transformers' DeepseekV2 router never renormalises: softmax over every expert, top-k "
                    "(moe_router_pre_softmax)"
                ),
                "topk_method": mapped(
                    "greedy: plain top-k; group_limited_greedy: moe_router_num_groups/moe_router_group_topk",
                    refused="any other method",
                ),
                "n_group": mapped("moe_router_num_groups (with group_limited_greedy)"),
                "topk_group": mapped("moe_router_group_topk (with group_limited_greedy)"),
                "mlp_bias": mapped(
                    "no bias in the MLPs", refused="true: the routed experts have no bias to match"
                ),
            },
            mla=True,
            moe=Moe(renormalise=False, **_DEEPSEEK_MOE),
            extra_keys={
                **_DEEPSEEK_KEYS,
                "scoring_func": mapped("softmax, as transformers' model", refused="anything but softmax"),
            },
        ),
        Family(
            "deepseek_v3",
            "deepseek-ai/DeepSeek-V3",
            {
                **_MLA,
                "n_routed_experts": mapped("num_moe_experts"),
                "norm_topk_prob": noted(
                    "true: the chosen experts' sigmoid weights renormalised, as Megatron's sigmoid router "
                    "always does; false is noted (the same work, other weights)"
                ),
                "n_group": mapped("moe_router_num_groups (group-limited top-k)"),
                "topk_group": mapped("moe_router_group_topk"),
                "num_nextn_predict_layers": noted(
                    "the multi-token-prediction layers: transformers' model does not build them, nor does "
                    "a run here"
                ),
                "num_mtp_layers": alias("num_nextn_predict_layers", "noted"),
                "num_local_experts": alias("n_routed_experts"),
                "rope_interleave": noted(
                    "which pairs RoPE rotates: Megatron-Core's MLA rotates halves (rotary_interleaved is "
                    "refused with MLA); the same work, other values"
                ),
            },
            mla=True,
            moe=Moe(score="sigmoid", expert_bias=True, renormalise="norm_topk_prob", **_DEEPSEEK_MOE),
            extra_keys={
                **_DEEPSEEK_KEYS,
                "scoring_func": mapped(
                    "moe_router_score_function sigmoid, as transformers' model",
                    refused="anything but sigmoid",
                ),
                "topk_method": mapped(
                    "noaux_tc: the expert bias (moe_router_enable_expert_bias) with group-limited top-k",
                    refused="anything but noaux_tc",
                ),
            },
        ),
        Family(
            "gemma",
            "google/gemma-7b",
            {
                **_DENSE,
                "attention_bias": _ATTENTION_BIAS,
                "use_bidirectional_attention": mapped(
                    "causal attention", refused="true: bidirectional (encoder) attention is not profiled"
                ),
            },
            bias="attention",
            zero_centered_norm=True,
            embedding_scale="sqrt_hidden",
        ),
        Family(
            "gemma2",
            "google/gemma-2-9b-it",
            {
                **{k: v for k, v in _DENSE.items() if k != "hidden_act"},
                **_WINDOW_LAYERS,
                "hidden_activation": mapped("activation_func (gelu_pytorch_tanh: GeGLU with tanh gelu)"),
                "attention_bias": _ATTENTION_BIAS,
                "query_pre_attn_scalar": mapped("softmax_scale = query_pre_attn_scalar ** -0.5"),
                "attn_logit_softcapping": mapped("core attention's scores capped: cap * tanh(scores / cap)"),
                "final_logit_softcapping": mapped(
                    "the output layer's logits capped: cap * tanh(logits / cap)"
                ),
                "use_bidirectional_attention": mapped(
                    "causal attention", refused="true: bidirectional (encoder) attention is not profiled"
                ),
            },
            bias="attention",
            activation="hidden_activation",
            zero_centered_norm=True,
            embedding_scale="sqrt_hidden",
            window="layer_types",
            post_norms=True,
            softcapping=True,
            extra_keys={
                "hidden_act": irrelevant(
                    "transformers' Gemma-2 reads hidden_activation (the published files carry both)"
                ),
                "cache_implementation": irrelevant("generation's KV cache: training keeps none"),
                "sliding_window_size": irrelevant(
                    "an older name of sliding_window, which transformers' model reads"
                ),
            },
        ),
        Family(
            "phi3",
            "microsoft/Phi-3-mini-4k-instruct",
            {
                **_DENSE,
                "sliding_window": _SLIDING,
                "resid_pdrop": mapped("hidden_dropout (after attention and after the MLP)"),
                "embd_pdrop": mapped("the embedding's dropout"),
                "original_max_position_embeddings": irrelevant(
                    "longrope's switch between its short and long factors: the rotary table's values"
                ),
            },
            bias="none",
            window="all",
        ),
        Family(
            "olmoe",
            "allenai/OLMoE-1B-7B-0924",
            {
                **_DENSE,
                "intermediate_size": mapped("moe_ffn_hidden_size (each expert's width)"),
                "attention_bias": _ATTENTION_BIAS,
                "clip_qkv": noted(
                    "q, k and v clamped to +-clip_qkv: an elementwise clamp Megatron's attention does not "
                    "run (its time is not in the rows)"
                ),
                "num_experts": mapped("num_moe_experts"),
                "num_local_experts": alias("num_experts"),
                "num_experts_per_tok": _TOPK,
                "norm_topk_prob": _NORM_TOPK_PROB,
                "router_aux_loss_coef": _AUX,
                "output_router_logits": _ROUTER_LOGITS,
            },
            bias="attention",
            qk_norm="projection",
            moe=Moe("num_experts", width=None),
        ),
        Family(
            "granite",
            "ibm-granite/granite-3.3-8b-instruct",
            {
                **_DENSE,
                "attention_bias": mapped("add_qkv_bias and add_bias_linear, with mlp_bias"),
                "mlp_bias": _MLP_BIAS,
                "embedding_multiplier": mapped("the embedding's output scaled"),
                "residual_multiplier": mapped(
                    "the attention's and the MLP's outputs scaled before the residual add"
                ),
                "attention_multiplier": mapped("softmax_scale"),
                "logits_scaling": mapped("the output layer's logits divided by it"),
            },
            embedding_scale="embedding_multiplier",
            multipliers=True,
        ),
        Family(
            "granitemoe",
            "ibm-granite/granite-3.1-3b-a800m-instruct",
            {
                **_DENSE,
                "intermediate_size": mapped("moe_ffn_hidden_size (each expert's width)"),
                "attention_bias": _ATTENTION_BIAS,
                "embedding_multiplier": mapped("the embedding's output scaled"),
                "residual_multiplier": mapped("the attention's and the MoE layer's outputs scaled"),
                "attention_multiplier": mapped("softmax_scale"),
                "logits_scaling": mapped("the output layer's logits divided by it"),
                "num_local_experts": mapped("num_moe_experts"),
                "num_experts_per_tok": _TOPK,
                "router_aux_loss_coef": _AUX,
                "output_router_logits": _ROUTER_LOGITS,
            },
            bias="attention",
            embedding_scale="embedding_multiplier",
            multipliers=True,
            moe=Moe("num_local_experts", width=None, renormalise=True),
        ),
        Family(
            "starcoder2",
            "bigcode/starcoder2-7b",
            {
                **{k: v for k, v in _DENSE.items() if k != "rms_norm_eps"},
                "hidden_act": mapped(
                    "activation_func (gelu_pytorch_tanh: tanh gelu; a plain MLP, not gated)"
                ),
                "norm_epsilon": mapped("layernorm_epsilon (LayerNorm with bias)"),
                "use_bias": mapped("add_bias_linear (every linear)"),
                "sliding_window": _SLIDING,
                "residual_dropout": mapped("hidden_dropout (after attention and after the MLP)"),
                "embedding_dropout": mapped("the embedding's dropout"),
            },
            norm="LayerNorm",
            eps="norm_epsilon",
            gated=False,
            bias="all",
            window="all",
            extra_keys={  # the published files carry keys of BigCode's training config
                key: irrelevant("a key of BigCode's training config that transformers' model does not read")
                for key in (
                    "activation_function",
                    "attention_softmax_in_fp32",
                    "layer_norm_epsilon",
                    "mlp_type",
                    "norm_type",
                    "scale_attention_softmax_in_fp32",
                    "scale_attn_weights",
                )
            },
        ),
    )
}


def family_of(model_type: str) -> Family:
    """The family of ``model_type``; UserError naming the supported ones for any other."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise UserError(
            f"model_type {model_type!r} is not a supported family (no mapping to Megatron-Core is known "
            f"to be exact for it): use one of {', '.join(sorted(FAMILIES))}, or add its entry to "
            "autotuner/model/families.py (docs/model_families.md)"
        )
    return family


def architecture(family: Family) -> str:
    """What the family's model is, in words, as the mapping builds it."""
    parts = [("zero-centred " if family.zero_centered_norm else "") + family.norm]
    act = "GLU" if family.gated else "plain"
    parts.append(f"{act} MLP ({family.activation})")
    parts.append("MLA" if family.mla else "GQA/MHA")
    if family.qk_norm:
        parts.append(f"q/k norm per {'head' if family.qk_norm == 'head' else 'whole projection'}")
    if family.window:
        parts.append("sliding window" + (" per layer" if family.window == "layer_types" else ""))
    if family.softcapping:
        parts.append("capped scores and logits")
    if family.post_norms:
        parts.append("post norms")
    if family.embedding_scale:
        parts.append("scaled embedding")
    if family.multipliers:
        parts.append("residual, attention and logit multipliers")
    if family.moe is not None:
        moe = family.moe
        bits = [f"{moe.score} router"]
        if moe.expert_bias:
            bits.append("expert bias")
        if moe.groups:
            bits.append("group-limited top-k")
        if moe.shared:
            bits.append("shared experts" + (" (gated)" if moe.shared_gate else ""))
        if moe.dense:
            bits.append("dense layers")
        parts.append("MoE: " + ", ".join(bits))
    return "; ".join(parts)


def markdown_table() -> str:
    """The families as docs/model_families.md lists them: one row each, with its noted fields and the
    values it refuses (every field's rule in full: this module)."""
    lines = [
        "| model_type | example | architecture as built | noted | refused |",
        "|---|---|---|---|---|",
    ]
    for name, family in sorted(FAMILIES.items()):
        rules = {**family.extra_keys, **family.fields}
        noted_fields = sorted(k for k, r in rules.items() if r.kind == "noted")
        refused = sorted(f"{k}: {r.refused}" for k, r in rules.items() if r.refused)
        lines.append(
            f"| {name} | {family.example} | {architecture(family)} | {', '.join(noted_fields) or '-'} "
            f"| {'; '.join(refused) or '-'} |"
        )
    return "\n".join(lines)
