"""Build the Megatron-Core model the ops come from, exactly as training builds it.

One ``GPTModel`` built by Megatron's own constructor from the layer spec supplies every op: its embedding,
the layers of its decoder (a ``TransformerBlock``), the block's final norm and the output layer. Only the
parts the selected ops need are built (``pre_process``/``post_process`` off when no op uses the embedding
or the head; one layer unless ``transformer_block`` is asked for; a layer without its attention or its MLP
when no op needs that half).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

import torch

from autotuner.errors import UserError
from autotuner.model.hf_to_megatron import MegatronModelArgs
from autotuner.model.layer_parts import (
    ACTIVATIONS,
    ProjectionKNorm,
    ProjectionQNorm,
    ZeroCenteredRMSNorm,
    adapt_model,
    config_class,
    softcapped_attention,
)
from autotuner.model.runtime import DTYPES


def transformer_engine_available() -> bool:
    """Whether Transformer-Engine imports. A half-installed TE raises RuntimeError (a missing cuDNN),
    not ImportError, so every exception counts as 'not available'."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - see docstring
        return False
    return True


def transformer_config_fields() -> set[str]:
    """Every field ``tf.`` may set: TransformerConfig's, the Multi-Latent Attention ones of its subclass
    MLATransformerConfig (used for an MLA model), and the families' (autotuner.model.layer_parts)."""
    return {f.name for f in dataclasses.fields(config_class(True))}


@functools.cache
def _transformer_config_types() -> dict[str, Any]:
    return typing.get_type_hints(config_class(True))


# Annotations no override can satisfy: the command line and a case file give numbers, strings, booleans
# and lists, never a torch.dtype or a function. TransformerConfig takes such a value without a word, and
# it fails later (a string as ``params_dtype`` in the first ``torch.empty``) or never (an activation that
# is not a function). Where the tool has a setting for the same thing, the error names it.
_OBJECT_HINTS = {
    "params_dtype": "set dtype=fp32, bf16 or fp16 instead",
    "pipeline_dtype": "set dtype=fp32, bf16 or fp16 instead",
    "autocast_dtype": "set dtype=fp32, bf16 or fp16 instead",
    "activation_func": "set hf.hidden_act instead",
}


def _takes_object(expected: Any) -> bool:
    """Whether the annotation wants a Python object (a dtype, a callable, a context manager), alone or in
    a union."""
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        return any(_takes_object(arg) for arg in typing.get_args(expected))
    origin = typing.get_origin(expected) or expected
    return (
        expected is torch.dtype
        or origin in (collections.abc.Callable, typing.ContextManager)
        or (isinstance(origin, type) and issubclass(origin, typing.ContextManager))
    )


def _enum_member(expected: type[enum.Enum], value: Any) -> enum.Enum | None:
    """The member of an enum field named by ``value`` (as Megatron's own arguments name them:
    ``tf.attention_backend=local``), or the member itself; None if it names none."""
    if isinstance(value, expected):
        return value
    return expected.__members__.get(value) if isinstance(value, str) else None


def _accepts(expected: Any, value: Any) -> bool:
    """Whether ``value`` fits the annotation ``expected``. Plain types are judged (bool, int, float, str,
    None, Literal, enums by member name, lists and unions of them); a dtype or a callable takes no value an
    override can give; anything else (tuples, Megatron's own classes) is left to TransformerConfig."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(expected))
    if origin is typing.Literal:
        return value in typing.get_args(expected)
    if _takes_object(expected):  # a union's None was judged above
        return False
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return _enum_member(expected, value) is not None
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    if expected is list or origin is list:
        return isinstance(value, list)
    return True


def _describe(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(expected))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(expected)))
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return "one of " + ", ".join(expected.__members__)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(expected, "a list" if expected is list or origin is list else str(expected))


# TransformerConfig fields with a range beyond their type; TransformerConfig itself checks none of them,
# and a bad value fails deep inside the model's construction (a negative tensor dimension) or not at all.
_POSITIVE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "tensor_model_parallel_size",
)
_PROBABILITY_FIELDS = ("attention_dropout", "hidden_dropout")


def check_tf_overrides(tf_overrides: dict[str, Any]) -> dict[str, Any]:
    """Each ``tf.<field>=`` value has its field's type and range, before any work. Raises UserError.
    Returns the overrides as TransformerConfig takes them: an enum field's name is its member."""
    unknown = sorted(set(tf_overrides) - transformer_config_fields())
    if unknown:
        raise UserError(
            f"unknown TransformerConfig field(s) {unknown}: check the spelling of tf.<field> overrides"
        )
    types_ = _transformer_config_types()
    for name, value in tf_overrides.items():
        expected = types_.get(name)
        if expected is not None and not _accepts(expected, value):
            if _takes_object(expected):
                raise UserError(
                    f"tf.{name}={value!r}: TransformerConfig.{name} takes a Python object, which an "
                    f"override cannot give: {_OBJECT_HINTS.get(name, 'drop it')}"
                )
            raise UserError(
                f"tf.{name}={value!r} is not {_describe(expected)} (TransformerConfig.{name}): "
                f"set tf.{name} to {_describe(expected)}, or drop it"
            )
        if value is None:
            continue
        if name in _POSITIVE_FIELDS and value <= 0:
            raise UserError(f"tf.{name}={value!r} must be a positive integer: set tf.{name}=<n> or drop it")
        if name in _PROBABILITY_FIELDS and not 0 <= value <= 1:
            raise UserError(
                f"tf.{name}={value!r} is a probability: set tf.{name} between 0 and 1 (0: no dropout)"
            )
    taken = dict(tf_overrides)
    for name, value in tf_overrides.items():
        expected = types_.get(name)
        if isinstance(expected, enum.EnumMeta):
            taken[name] = _enum_member(expected, value)
    return taken


# The norms Megatron-Core's local layer spec builds (its WrappedTorchNorm and L2Norm); another name
# passes TransformerConfig and fails as each op builds its layer.
_LOCAL_NORMS = ("LayerNorm", "RMSNorm", "L2Norm")


def _check_buildable(kwargs: dict[str, Any], args: MegatronModelArgs) -> None:
    """What TransformerConfig takes but the layer's construction (or its first forward) refuses, so that a
    ``tf.`` override that cannot build fails here, one line, and not in every op of the run."""
    heads, groups = (
        kwargs["num_attention_heads"],
        kwargs.get("num_query_groups") or kwargs["num_attention_heads"],
    )
    if heads % groups:
        raise UserError(
            f"num_query_groups={groups} does not divide num_attention_heads={heads}: "
            "set tf.num_query_groups (or hf.num_key_value_heads) to a divisor of the head count"
        )
    if kwargs.get("normalization", "LayerNorm") not in _LOCAL_NORMS:
        raise UserError(
            f"tf.normalization={kwargs['normalization']!r} is not a norm Megatron-Core builds: "
            f"use one of {', '.join(_LOCAL_NORMS)}"
        )
    if kwargs.get("context_parallel_size", 1) != 1:
        raise UserError(
            f"tf.context_parallel_size={kwargs['context_parallel_size']}: context parallelism is not "
            "profiled (it needs Transformer-Engine's attention and a process group per split): drop it"
        )
    channels = kwargs.get("kv_channels")
    if not kwargs.get("multi_latent_attention") and channels and int(channels * args.rotary_percent) % 2:
        raise UserError(
            f"kv_channels={channels} with rotary_percent={args.rotary_percent} gives an odd rotary width, "
            "which RoPE cannot rotate in pairs: set tf.kv_channels (or hf.head_dim) to an even number"
        )


def build_transformer_config(
    args: MegatronModelArgs,
    tf_overrides: dict[str, Any],
    dtype: str,
    device: torch.device,
    tensor_parallel: int,
) -> Any:
    """The TransformerConfig of the whole model: the HF mapping, then device settings, then ``tf.``
    overrides."""
    tf_overrides = check_tf_overrides(tf_overrides)
    kwargs = dict(args.transformer)
    kwargs.update(
        activation_func=ACTIVATIONS[args.activation],
        params_dtype=DTYPES[dtype],
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu_initialization=device.type == "cpu",
        tensor_model_parallel_size=tensor_parallel,
    )
    if kwargs.get("num_moe_experts"):
        kwargs.update(moe_implementation(device))
    kwargs.update(tf_overrides)
    _check_buildable(kwargs, args)
    tp = kwargs["tensor_model_parallel_size"]
    if kwargs.get("qk_layernorm_span") == "projection" and tp > 1:
        raise UserError(
            f"tensor_model_parallel_size={tp}: this family's q/k norms span every head, which a "
            "tensor-parallel rank holds only part of (Megatron-Core has no such norm across ranks): use TP 1"
        )
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if kwargs[name] is not None and kwargs[name] % tp:
            raise UserError(
                f"tensor_model_parallel_size={tp} does not divide {name}={kwargs[name]}: "
                "choose a TP size that divides it"
            )
    experts, ep = kwargs.get("num_moe_experts"), kwargs.get("expert_model_parallel_size", 1)
    if experts and experts % ep:
        raise UserError(
            f"expert_model_parallel_size={ep} does not divide the {experts} experts: "
            "choose an EP size that divides num_moe_experts"
        )
    family_config = config_class(bool(kwargs.get("multi_latent_attention")))
    try:
        return family_config(**kwargs)
    except (AssertionError, ValueError, TypeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        message = megatron_flags_as_overrides(message, family_config)
        raise UserError(f"invalid TransformerConfig: {message}: fix the hf./tf. overrides") from exc


def megatron_flags_as_overrides(message: str, config_class: type) -> str:
    """Megatron's message with its training script's flags (``--moe-router-pre-softmax``) written as the
    override a user of this tool types (``tf.moe_router_pre_softmax=true``): a flag named after a field of
    ``config_class``, with its value (``--x=v``: ``tf.x=v``), ``=true`` for a boolean field's bare flag.
    Any other flag is left as Megatron wrote it."""
    kinds = {f.name: f.type for f in dataclasses.fields(config_class)}

    def override(match: re.Match[str]) -> str:
        name = match[1].replace("-", "_")
        if name not in kinds:
            return match[0]
        if match[2]:
            return f"tf.{name}{match[2]}"
        return f"tf.{name}=true" if kinds[name] in (bool, "bool") else f"tf.{name}"

    return re.sub(r"--([a-z][a-z0-9-]*[a-z0-9])(=[^\s,;]+)?", override, message)


def moe_implementation(device: torch.device) -> dict[str, Any]:
    """How an MoE layer runs on ``device`` (``tf.`` overrides win): on a GPU the all-to-all dispatcher,
    with grouped GEMM experts where Transformer-Engine imports; on a CPU the all-gather dispatcher (the
    all-to-all one creates CUDA streams when built) and ``SequentialMLP`` experts (one MLP per expert)."""
    if device.type == "cuda":
        return dict(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=transformer_engine_available())
    return dict(moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)


@dataclass(frozen=True)
class ModelParts:
    """Which parts of the GPTModel to build. ``attention``/``mlp``: whether each layer holds that half
    (a half no op needs is Megatron's IdentityOp, so a model whose MLP would not fit in memory can still
    give its attention ops)."""

    num_layers: int = 1
    pre_process: bool = False
    post_process: bool = False
    attention: bool = True
    mlp: bool = True
    vp_stage: int | None = None  # the model chunk of the interleaved schedule (autotuner.predict.steps)


def moe_layer_pattern(tf_config: Any) -> list[bool]:
    """For each layer of the model, whether it is an MoE layer (Megatron's ``moe_layer_freq``: 1 every
    layer, N every N-th, or a 0/1 list)."""
    layers = tf_config.num_layers
    if not tf_config.num_moe_experts:
        return [False] * layers
    freq = tf_config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(layers)]
    return [bool(flag) for flag in freq]


@functools.cache
def _local_mla_core_attention() -> type:
    """Megatron-Core's local DotProductAttention for Multi-Latent Attention.

    MLA builds its core attention with ``k_channels`` (q and k head width, 192 for DeepSeek-V2) and
    ``v_channels`` (v head width, 128), which Transformer-Engine's attention takes and 0.16's local
    DotProductAttention does not (a TypeError at construction). The local one already computes with any
    q/k width (it reshapes q and k by their own last dimension) and sizes its output by ``kv_channels``,
    which the MLA mapping sets to the v head width: this subclass accepts the two arguments, checks the v
    width, and is otherwise that class (MLA's softmax scale is passed in as it is to TE)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(
            self, config: Any, *args: Any, k_channels: Any = None, v_channels: Any = None, **kw: Any
        ):
            if v_channels is not None and v_channels != config.kv_channels:
                raise ValueError(f"MLA v head width {v_channels} != kv_channels {config.kv_channels}")
            super().__init__(config, *args, **kw)

    return MLADotProductAttention


def layer_spec(
    tf_config: Any,
    use_transformer_engine: bool,
    parts: ModelParts | None = None,
    moe: bool | None = None,
) -> Any:
    """The layer spec training uses: Transformer-Engine's on a GPU where it imports, else the local one;
    an MoE layer's (``moe``; default: whether the model has experts) or a dense one's; with the family's
    pieces the config asks for (autotuner.model.layer_parts); without the halves ``parts`` leaves out."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp

    moe = bool(tf_config.num_moe_experts) if moe is None else moe
    experts = tf_config.num_moe_experts if moe else None
    mla = bool(getattr(tf_config, "multi_latent_attention", False))
    if use_transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts,
            moe_grouped_gemm=tf_config.moe_grouped_gemm,
            qk_layernorm=tf_config.qk_layernorm,
            multi_latent_attention=mla,
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=experts,
            moe_grouped_gemm=tf_config.moe_grouped_gemm,
            qk_layernorm=tf_config.qk_layernorm,
            multi_latent_attention=mla,
            normalization=tf_config.normalization,
        )
    if mla and not use_transformer_engine:
        spec = _replace_in(spec, "self_attention", core_attention=_local_mla_core_attention())
    spec = _family_pieces(spec, tf_config)
    left_out: dict[str, Any] = {}
    if parts is not None and not parts.attention:
        left_out["self_attention"] = IdentityOp
    if parts is not None and not parts.mlp:
        left_out["mlp"] = IdentityOp
    if not left_out:
        return spec
    # The bias-dropout-add functions stay (they hold no memory, and instrument_gpt wraps them). A new
    # spec: Megatron may hand out one spec object to every caller.
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **left_out))


def _replace_in(spec: Any, part: str, **submodules: Any) -> Any:
    """``spec`` with the layer's ``part`` (a ModuleSpec: self_attention, mlp) given other ``submodules``."""
    inner = getattr(spec.submodules, part)
    inner = dataclasses.replace(inner, submodules=dataclasses.replace(inner.submodules, **submodules))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **{part: inner}))


def _family_pieces(spec: Any, config: Any) -> Any:
    """The layer spec with what the family adds (autotuner.model.families): Gemma's zero-centred norms
    (which the local spec's torch norms refuse), OLMoE's q/k norms over the whole projection, Gemma-2's
    capped scores. (Post norms and output scales are added to the built model: autotuner.model.
    layer_parts.adapt_model.)"""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp

    layer = spec.submodules
    local_norm = layer.input_layernorm is not IdentityOp  # TE fuses the input norm into linear_qkv
    if config.layernorm_zero_centered_gamma and local_norm:
        norms = {
            name: ZeroCenteredRMSNorm
            for name in ("input_layernorm", "pre_mlp_layernorm")
            if getattr(layer, name) is not IdentityOp
        }
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(layer, **norms))
    if config.qk_layernorm and getattr(config, "qk_layernorm_span", "head") == "projection":
        spec = _replace_in(spec, "self_attention", q_layernorm=ProjectionQNorm, k_layernorm=ProjectionKNorm)
    if getattr(config, "attention_softcap", None) is not None:
        # Transformer-Engine's attention has no cap: the local one, capped, on either spec
        capped = softcapped_attention(DotProductAttention, config.attention_softcap)
        spec = _replace_in(spec, "self_attention", core_attention=capped)
    return spec


def _norm_class(config: Any, spec: Any) -> Any:
    """The class of the layer's norms (for the norms added after building): Gemma's where the local spec
    builds the norms, the local spec's input norm, or Transformer-Engine's norm where its spec fuses
    that one into linear_qkv."""
    from megatron.core.transformer.identity_op import IdentityOp

    layer = spec.layer_specs[0] if hasattr(spec, "layer_specs") else spec
    norm = layer.submodules.input_layernorm
    if norm is IdentityOp:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return norm


class ModelBuildError(RuntimeError):
    """The parts of the model an op needs could not be built (out of memory): that op fails, the plan
    goes on (autotuner.runner.spec)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception is an allocation failure: CUDA's OutOfMemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory"), which Megatron re-raises with its own
    suffix but the same type."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def build_model(
    args: MegatronModelArgs,
    tf_config: Any,
    parts: ModelParts,
    device: torch.device,
    use_transformer_engine: bool,
) -> Any:
    """Build the GPTModel with only the requested parts, on ``device``, as training builds it; the ops'
    ranges are added by autotuner.op_mapping.instrument_gpt (the model part knows nothing of ops)."""
    from megatron.core.models.gpt import GPTModel

    config, spec = _decoder(tf_config, parts, use_transformer_engine)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_sequence_length,
        pre_process=parts.pre_process,
        post_process=parts.post_process,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=args.rotary_percent,
        rotary_base=int(args.rotary_base),
        rope_scaling=args.rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.seq_len_interpolation_factor,
        vp_stage=parts.vp_stage,
    )
    adapt_model(model, _norm_class(config, spec))
    if config.num_moe_experts:
        # Megatron's per-layer record of the auxiliary losses is sized by the first model whose router ran
        # in this process: a model of more layers built after it (an op's own parts, another case) would
        # index past its end. A new model starts a new record.
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    model.to(device)
    # Megatron's training wraps the model in Float16Module, which casts every parameter to the half dtype,
    # the norms' too (torch.nn norms ignore params_dtype): do the same, so each op sees training's dtypes.
    if config.bf16:
        model.bfloat16()
    elif config.fp16:
        model.half()
    return model


def _decoder(tf_config: Any, parts: ModelParts, use_transformer_engine: bool) -> tuple[Any, Any]:
    """The config and the layer (or block) spec of a model of ``parts.num_layers`` layers.

    A model whose layers are all alike gets one layer spec; one that mixes dense and MoE layers
    (DeepSeek's first dense layers), or whose final norm is not Megatron's, a block spec of one spec per
    layer. A model of fewer layers than the whole holds the model's first layers, as the first pipeline
    stage does (autotuner.op_mapping.model_parts asks for enough of them to hold a layer of each kind its
    ops need): the per-layer lists (MoE layers, sliding-window layers) are cut to it."""
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    pattern = moe_layer_pattern(tf_config)[: parts.num_layers]
    replace: dict[str, Any] = {"num_layers": parts.num_layers}
    if tf_config.num_moe_experts:
        replace["moe_layer_freq"] = 1 if all(pattern) else [int(flag) for flag in pattern]
    if isinstance(tf_config.window_attn_skip_freq, list):
        replace["window_attn_skip_freq"] = tf_config.window_attn_skip_freq[: parts.num_layers]
    config = dataclasses.replace(tf_config, **replace)
    specs = {moe: layer_spec(config, use_transformer_engine, parts, moe=moe) for moe in set(pattern)}
    zero_centered = config.layernorm_zero_centered_gamma and not use_transformer_engine
    if len(specs) == 1 and not zero_centered:  # one spec: Megatron builds the stage's layers from it
        return config, specs[pattern[0]]
    norm = ZeroCenteredRMSNorm if zero_centered else LayerNormImpl
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm as norm
    return config, TransformerBlockSubmodules(layer_specs=[specs[moe] for moe in pattern], layer_norm=norm)
