"""Build the Megatron-Core model the ops come from, exactly as training builds it.

One ``GPTModel`` built by Megatron's own constructor from the layer spec supplies every op: its embedding,
the layers of its decoder (a ``TransformerBlock``), the block's final norm and the output layer. Only the
parts the selected ops need are built (``pre_process``/``post_process`` off when no op uses the embedding
or the head; one layer unless ``transformer_block`` is asked for; a layer without its attention or its MLP
when no op needs that half).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

import torch

from autotuner.errors import UserError
from autotuner.model.hf_to_megatron import MegatronModelArgs
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
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


@functools.cache
def _transformer_config_types() -> dict[str, Any]:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return typing.get_type_hints(TransformerConfig)


def _accepts(expected: Any, value: Any) -> bool:
    """Whether ``value`` fits the annotation ``expected``. Only plain types are judged (bool, int, float,
    str, None, Literal, lists and unions of them); anything else (callables, dtypes, enums) is left to
    TransformerConfig itself."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(expected))
    if origin is typing.Literal:
        return value in typing.get_args(expected)
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


def check_tf_overrides(tf_overrides: dict[str, Any]) -> None:
    """Each ``tf.<field>=`` value has its field's type and range, before any work. Raises UserError."""
    unknown = sorted(set(tf_overrides) - transformer_config_fields())
    if unknown:
        raise UserError(
            f"unknown TransformerConfig field(s) {unknown}: check the spelling of tf.<field> overrides"
        )
    types_ = _transformer_config_types()
    for name, value in tf_overrides.items():
        expected = types_.get(name)
        if expected is not None and not _accepts(expected, value):
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


def build_transformer_config(
    args: MegatronModelArgs,
    tf_overrides: dict[str, Any],
    dtype: str,
    device: torch.device,
    tensor_parallel: int,
) -> Any:
    """The TransformerConfig of the whole model: the HF mapping, then device settings, then ``tf.``
    overrides."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_tf_overrides(tf_overrides)
    kwargs = dict(args.transformer)
    kwargs.update(
        activation_func={"silu": F.silu, "gelu": F.gelu}[args.activation],
        params_dtype=DTYPES[dtype],
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu_initialization=device.type == "cpu",
        tensor_model_parallel_size=tensor_parallel,
    )
    kwargs.update(tf_overrides)
    tp = kwargs["tensor_model_parallel_size"]
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if kwargs[name] is not None and kwargs[name] % tp:
            raise UserError(
                f"tensor_model_parallel_size={tp} does not divide {name}={kwargs[name]}: "
                "choose a TP size that divides it"
            )
    try:
        return TransformerConfig(**kwargs)
    except (AssertionError, ValueError, TypeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise UserError(f"invalid TransformerConfig: {message}: fix the hf./tf. overrides") from exc


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


def layer_spec(tf_config: Any, use_transformer_engine: bool, parts: ModelParts | None = None) -> Any:
    """The layer spec training uses: Transformer-Engine's on a GPU where it imports, else the local one;
    without the halves ``parts`` leaves out."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp

    if use_transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=tf_config.qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=tf_config.qk_layernorm, normalization=tf_config.normalization
        )
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

    config = dataclasses.replace(tf_config, num_layers=parts.num_layers)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, use_transformer_engine, parts),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_sequence_length,
        pre_process=parts.pre_process,
        post_process=parts.post_process,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=args.rotary_percent,
        rotary_base=int(args.rotary_base),
    )
    model.to(device)
    # Megatron's training wraps the model in Float16Module, which casts every parameter to the half dtype,
    # the norms' too (torch.nn norms ignore params_dtype): do the same, so each op sees training's dtypes.
    if config.bf16:
        model.bfloat16()
    elif config.fp16:
        model.half()
    return model
