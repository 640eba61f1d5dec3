"""The data generator of replayed calls: seeded tensors made to a recorded spec (shape, dtype, strides).

Values are seeded random normals for floating point, ones for booleans (an all-True SDPA mask keeps every
position) and integers in ``[0, bound)`` where the callee says what an index may be (an embedding's rows, a
loss's classes), else in ``{0, 1}``. Strides are reproduced, because a transposed or sliced input can take
a different kernel than a contiguous one:

* dense strides (a permutation of contiguous, e.g. a transposed matrix) give a leaf tensor with those
  strides (``empty_strided``), which ``Tensor.clone`` keeps when the runner rotates copies of the inputs;
* non-dense or overlapping strides (a slice of a fused projection, an ``expand``) give a flat leaf holding
  the whole storage, viewed with ``as_strided`` at each call (a view costs about a microsecond, inside the
  measured time, as the view in the model is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


class NotReplayable(Exception):
    """A captured call that cannot be rebuilt; the message says why."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None
    requires_grad: bool
    parameter: bool

    @classmethod
    def from_json(cls, spec: dict[str, Any], dtype_override: torch.dtype | None) -> TensorSpec:
        try:
            shape = tuple(int(d) for d in spec["shape"])
            dtype = getattr(torch, str(spec["dtype"]))
            stride = tuple(int(s) for s in spec["stride"]) if spec.get("stride") is not None else None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise NotReplayable(f"malformed tensor description {spec}") from exc
        if not isinstance(dtype, torch.dtype):
            raise NotReplayable(f"unknown dtype {spec['dtype']!r}")
        if dtype_override is not None and dtype.is_floating_point:
            dtype = dtype_override
        differentiable = dtype.is_floating_point or dtype.is_complex
        return cls(
            shape=shape,
            dtype=dtype,
            stride=stride if stride is not None and len(stride) == len(shape) else None,
            requires_grad=bool(spec.get("requires_grad")) and differentiable,
            parameter=bool(spec.get("parameter")),
        )

    @property
    def storage_size(self) -> int:
        """Elements of the storage the strides reach (``numel`` for a dense layout)."""
        if self.stride is None:
            return math.prod(self.shape)
        if any(d == 0 for d in self.shape):
            return 0
        return 1 + sum((d - 1) * s for d, s in zip(self.shape, self.stride, strict=True))

    @property
    def dense(self) -> bool:
        return self.stride is None or self.storage_size == math.prod(self.shape)


def random_values(
    spec: TensorSpec, count: int, generator: torch.Generator, bound: int | None
) -> torch.Tensor:
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        return torch.randn(count, generator=generator, dtype=torch.float32)
    if spec.dtype == torch.bool:
        return torch.ones(count, dtype=torch.bool)
    return torch.randint(0, max(bound or 2, 1), (count,), generator=generator)


def make_tensor(
    spec: TensorSpec, generator: torch.Generator, device: torch.device, bound: int | None = None
) -> torch.Tensor:
    """A leaf tensor for ``spec``: shaped and strided as recorded if dense, else the flat storage (see the
    module docstring); it requires grad as recorded."""
    count = spec.storage_size
    data = random_values(spec, count, generator, bound).to(device=device, dtype=spec.dtype)
    if spec.stride is None or (spec.dense and _contiguous(spec)):
        leaf = data.view(spec.shape)
    elif spec.dense:
        leaf = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
        with torch.no_grad():
            leaf.copy_(data.view(spec.shape))
    else:
        leaf = data
    return leaf.requires_grad_(spec.requires_grad)


def _contiguous(spec: TensorSpec) -> bool:
    expected, stride = 1, []
    for size in reversed(spec.shape):
        stride.append(expected)
        expected *= max(size, 1)
    return spec.stride == tuple(reversed(stride)) or math.prod(spec.shape) <= 1


class Slot:
    """Where a made tensor goes in the call: ``inputs[index]`` (or ``weights[index]``), viewed with the
    recorded strides when its layout is not dense."""

    __slots__ = ("index", "weight", "view")

    def __init__(self, index: int, weight: bool, spec: TensorSpec) -> None:
        self.index, self.weight = index, weight
        self.view = None if spec.dense else (spec.shape, spec.stride)

    def take(self, inputs: tuple[torch.Tensor, ...], weights: Any) -> torch.Tensor:
        tensor = weights[self.index] if self.weight else inputs[self.index]
        return tensor if self.view is None else tensor.as_strided(*self.view)


def fill(template: Any, inputs: tuple[torch.Tensor, ...], weights: Any) -> Any:
    """The argument ``template`` with every Slot replaced by its tensor."""
    cls = type(template)
    if cls is Slot:
        return template.take(inputs, weights)
    if cls is list:
        return [fill(t, inputs, weights) for t in template]
    if cls is tuple:
        return tuple([fill(t, inputs, weights) for t in template])
    if cls is dict:
        return {k: fill(v, inputs, weights) for k, v in template.items()}
    return template


def decode(value: Any, device: torch.device, tensor: Any) -> Any:
    """A recorded VALUE as a Python value; ``tensor(spec_json)`` makes the Slot of a tensor."""
    if not isinstance(value, dict) or len(value) == 0:
        raise NotReplayable(f"malformed argument {value!r}")
    if "tensor" in value:
        return tensor(value["tensor"])
    if "value" in value:
        return value["value"]
    if "float" in value:
        return float(value["float"])
    if "tuple" in value or "list" in value:
        items = [decode(v, device, tensor) for v in value.get("tuple", value.get("list", []))]
        return tuple(items) if "tuple" in value else items
    if "dict" in value:
        return {k: decode(v, device, tensor) for k, v in value["dict"].items()}
    if "dtype" in value:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise NotReplayable(f"unknown dtype {value['dtype']!r}")
        return dtype
    if "device" in value:
        return device  # replayed on this run's device, whatever the capture ran on
    raise NotReplayable(f"an argument of type {value.get('object', '?')} cannot be rebuilt")
