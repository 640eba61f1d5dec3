"""A call's arguments as a cheap hashable key (every call) and as JSON (once per distinct key).

The key is what keeps capture overhead low: tuples of shapes, dtypes, devices and strides that Python
hashes and compares without formatting anything. The JSON form (see autotuner.capture.schema for the
VALUE encoding) is built only the first time a key is seen.

Gotchas the key handles:
* ``1``, ``1.0`` and ``True`` hash and compare equal in Python, so scalars carry their type.
* ``nan != nan``: a NaN argument would make a new key at every call (and grow memory without bound),
  so NaN keys are a fixed marker.
* A sparse or other non-strided tensor has no strides (``stride()`` raises): its stride is ``None``.
* Long sequences (a list of every parameter, say) are kept as their type and length only.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

MAX_ITEMS = 64
_SCALARS = (type(None), bool, int, float, str)
_TENSOR, _LONG, _NAN, _EMPTY = "T", "L", "nan", ("{}",)


def signature(value: Any) -> Hashable:
    """A hashable key equal for two values exactly when their recorded descriptions are equal.

    On the hot path (every captured call): the common classes are tested by identity first, because
    ``isinstance`` against ``torch.Tensor`` goes through its metaclass and costs several times more.
    """
    cls = value.__class__
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return _tensor_key(value)
    if cls is tuple or cls is list:
        if len(value) > MAX_ITEMS:
            return (cls, _LONG, len(value))
        return (cls, *[signature(v) for v in value])
    if value is None:
        return None
    if cls is dict:
        return (dict, *[(k, signature(v)) for k, v in value.items()]) if value else _EMPTY
    if cls in _SCALARS:
        if cls is float and value != value:
            return (float, _NAN)
        return (cls, value)
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    if isinstance(value, tuple):  # torch.Size, named tuples: recorded as plain tuples
        return signature(tuple(value))
    if isinstance(value, list):
        return signature(list(value))
    if isinstance(value, dict):
        return signature(dict(value))
    if cls is torch.dtype or cls is torch.device or isinstance(value, _SCALARS):
        return (cls, value)  # also int/float subclasses (enums, numpy scalars): encode() keeps their value
    return cls


def _tensor_key(value: torch.Tensor) -> Hashable:
    strided = value.layout == torch.strided  # sparse and other layouts have no strides
    return (
        _TENSOR,
        value.shape,
        value.dtype,
        value.device,
        value.stride() if strided else None,
        value.requires_grad,
        value.__class__ is not torch.Tensor and _is_parameter(value),
    )


def _is_parameter(value: torch.Tensor) -> bool:
    # isinstance(x, Parameter) runs a Python __instancecheck__ (slow on the hot path): plain tensors,
    # the common case, skip it through the class check above.
    return value.__class__ is torch.nn.Parameter or isinstance(value, torch.nn.Parameter)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    strided = tensor.layout == torch.strided
    return {
        "shape": list(tensor.shape),
        "dtype": dtype_name(tensor.dtype),
        "device": str(tensor.device),
        "stride": list(tensor.stride()) if strided else None,
        "contiguous": bool(tensor.is_contiguous()) if strided else False,
        "requires_grad": bool(tensor.requires_grad),
        "parameter": isinstance(tensor, torch.nn.Parameter),
    }


def encode(value: Any) -> dict[str, Any]:
    """The JSON VALUE of one argument (see autotuner.capture.schema)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": describe_tensor(value)}
    if value is None or isinstance(value, (bool, int, str)):
        return {"value": value}
    if isinstance(value, float):
        if math.isfinite(value):
            return {"value": value}
        return {"float": "nan" if value != value else ("inf" if value > 0 else "-inf")}
    if isinstance(value, (tuple, list)):
        kind = "list" if isinstance(value, list) else "tuple"
        if len(value) > MAX_ITEMS:
            return {"object": kind, "length": len(value)}
        return {kind: [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): encode(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    return {"object": qualified_name(type(value))}


def summary(value: dict[str, Any]) -> str:
    """A short, file-name-safe text of a VALUE for labels: ``f32_2x16x64`` for a tensor."""
    if "tensor" in value:
        spec = value["tensor"]
        short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int64": "i64", "bool": "b"}
        dims = "x".join(str(d) for d in spec["shape"]) or "scalar"
        return f"{short.get(spec['dtype'], spec['dtype'])}_{dims}"
    for kind in ("tuple", "list"):
        if kind in value:
            return "(" + ",".join(summary(v) for v in value[kind]) + ")"
    if "value" in value:
        return str(value["value"])
    return str(next(iter(value.values())))


# Module attributes a rebuild needs (nn.Linear(in, out), norms' shape and eps, ...), read once per module.
MODULE_ATTRS = (
    "in_features",
    "out_features",
    "input_size",
    "output_size",
    "num_embeddings",
    "embedding_dim",
    "padding_idx",
    "normalized_shape",
    "eps",
    "variance_epsilon",
    "elementwise_affine",
    "p",
    "dim",
    "approximate",
    "inplace",
    "negative_slope",
)
_BASE_PACKAGES = ("torch.nn.", "megatron.core.")


def _plain(value: Any) -> Any:
    """A finite scalar or a short list of them (``normalized_shape``), else None."""
    if isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    if isinstance(value, (tuple, list)) and len(value) <= MAX_ITEMS:
        items = [_plain(v) for v in value]
        return items if all(v is not None for v in items) else None
    return None


def base_class(cls: type) -> str | None:
    """The nearest torch.nn or Megatron-Core class in ``cls``'s MRO (subclasses, ours included, resolve to
    what they are); nn.Module itself says nothing about what a module computes, so it does not count."""
    found = next(
        (c for c in cls.__mro__ if c.__module__.startswith(_BASE_PACKAGES) and c is not torch.nn.Module), None
    )
    return qualified_name(found) if found is not None else None


def module_attrs(module: torch.nn.Module) -> dict[str, Any]:
    """The constructor-relevant attributes of a module that are plain values, whether it has a bias, its
    weight's shape, its parameters' dtype and whether they train."""
    attrs: dict[str, Any] = {}
    for name in MODULE_ATTRS:
        value = _plain(getattr(module, name, None))
        if value is not None:
            attrs[name] = value
    if hasattr(module, "bias"):
        attrs["bias"] = isinstance(getattr(module, "bias", None), torch.Tensor)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        attrs["weight_shape"] = list(weight.shape)
    params = list(module.parameters(recurse=False))
    if params:
        attrs["param_dtype"] = str(params[0].dtype).removeprefix("torch.")
        attrs["trainable"] = any(p.requires_grad for p in params)
    return attrs
