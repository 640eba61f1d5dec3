"""Instrumented Megatron-Core ops: one mechanism that puts a named range around every op.

Every op of the layer is a module (norms, linears, attention, MLP, the layer, the block, the embedding,
the output layer) or a function (bias-dropout-add, RoPE, the activation). For a module we swap its class
for a cached subclass whose ``forward`` goes through :func:`call_op`; for a function we wrap it with the
same :func:`call_op`. Nothing is copied from Megatron: the subclass calls the original ``forward``, and the
model is built by Megatron's own ``GPTModel``/``build_module`` from the unchanged layer spec, so every
launcher runs exactly the modules training runs.

:func:`call_op` does nothing but call through while no annotator is active (the ``get_data`` launcher).
With one active it pushes ``<op>.forward [point] #iteration`` around the call and, when autograd records,
adds two identity autograd nodes that bracket the op's backward:

* on the outputs, a node whose backward *pushes* ``<op>.backward ...``: autograd runs it first, as soon as
  the gradients of all outputs are ready;
* on the inputs that require grad, a node whose backward *pops*: autograd runs it once all input
  gradients exist, i.e. after the op's own backward. An op whose inputs need no gradient (the embedding)
  pops once every one of its parameters has accumulated its gradient.

Module backward hooks cannot do this for functions (bias-dropout-add and RoPE are not modules), and a
range pushed on the main thread around ``backward()`` would miss the kernels that autograd's device
thread launches; these nodes run on the thread that executes the backward.

An op that calls an op of the same name (the ``rope`` op test calls the instrumented RoPE function) gets
one range, not two.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autotuner.ops.annotate import STATE
from autotuner.ops.naming import format_range

_local = threading.local()


def _active_ops() -> list[str]:
    if not hasattr(_local, "ops"):
        _local.ops = []
    return _local.ops


class _PushOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str, keepalive: Any, *tensors: torch.Tensor) -> Any:
        ctx.name = name
        ctx.keepalive = keepalive  # lives as long as this graph: see _ParamCountdown
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if STATE.annotator is not None:
            STATE.annotator.push(ctx.name)
        return (None, None, *grads)


class _PopOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> Any:
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if STATE.annotator is not None:
            STATE.annotator.pop()
        return grads


class _ParamCountdown:
    """Pops the backward range once every parameter of an op has accumulated its gradient.

    Owned only by the graph (the push node keeps it alive); when a forward's graph is dropped without a
    backward, this object dies and removes its hooks, so they never fire in a later backward.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.remaining = len(params)
        ref = weakref.ref(self)
        self.handles = [
            p.register_post_accumulate_grad_hook(lambda _p, ref=ref: ref() and ref().fire()) for p in params
        ]

    def fire(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.remove()
            if STATE.annotator is not None:
                STATE.annotator.pop()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __del__(self) -> None:
        self.remove()


def _grad_tensor_slots(values: Sequence[Any]) -> list[int]:
    return [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad]


def _replace(values: Sequence[Any], slots: list[int], new: Any) -> list[Any]:
    new = new if isinstance(new, tuple) else (new,)
    out = list(values)
    for slot, tensor in zip(slots, new, strict=True):
        out[slot] = tensor
    return out


def call_op(
    op: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    module: torch.nn.Module | None = None,
) -> Any:
    """Call ``fn`` as op ``op``: straight through without an annotator, inside its ranges with one."""
    annotator = STATE.annotator
    active = _active_ops()
    if annotator is None or (active and active[-1] == op) or STATE.only_op not in (None, op):
        return fn(*args, **kwargs)
    context = (STATE.point, STATE.iteration, STATE.warmup)
    backward = STATE.backward_ranges and torch.is_grad_enabled()
    keepalive = None
    bwd_name = ""
    if backward:
        bwd_name = format_range(op, "backward", *context)
        in_slots = _grad_tensor_slots(args)
        if in_slots:
            args = _replace(args, in_slots, _PopOnBackward.apply(*(args[i] for i in in_slots)))
        else:
            params = [p for p in (module.parameters() if module is not None else ()) if p.requires_grad]
            if params:
                keepalive = _ParamCountdown(params)
            else:
                backward = False  # nothing upstream of the op has a gradient: no backward to mark
    annotator.push(format_range(op, "forward", *context))
    active.append(op)
    try:
        out = fn(*args, **kwargs)
    finally:
        active.pop()
        annotator.pop()
    if not backward:
        return out
    if isinstance(out, torch.Tensor):
        return _PushOnBackward.apply(bwd_name, keepalive, out) if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        slots = _grad_tensor_slots(out)
        if slots:
            marked = _replace(
                out, slots, _PushOnBackward.apply(bwd_name, keepalive, *(out[i] for i in slots))
            )
            return type(out)(marked)
    return out


_CLASS_CACHE: dict[tuple[type, str], type] = {}


def instrumented_class(cls: type[torch.nn.Module], op: str) -> type[torch.nn.Module]:
    """The subclass of ``cls`` whose forward runs as op ``op`` (cached: one class per (cls, op))."""
    key = (cls, op)
    if key not in _CLASS_CACHE:

        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return call_op(op, super(sub, self).forward, args, kwargs, module=self)

        sub = type(
            f"Instrumented{cls.__name__}",
            (cls,),
            {
                "forward": forward,
                "autotuner_op": op,
                "__module__": __name__,
                "__qualname__": f"Instrumented{cls.__name__}",
            },
        )
        _CLASS_CACHE[key] = sub
    return _CLASS_CACHE[key]


def instrument_module(module: torch.nn.Module, op: str) -> torch.nn.Module:
    """Make a built module run as op ``op``, in place (its parameters and state are untouched)."""
    if getattr(type(module), "autotuner_op", None) == op:
        return module
    module.__class__ = instrumented_class(type(module), op)
    return module


def instrumented_function(fn: Callable[..., Any], op: str) -> Callable[..., Any]:
    """Wrap a function so each call runs as op ``op``."""
    if getattr(fn, "autotuner_op", None) == op:
        return fn

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return call_op(op, fn, args, kwargs)

    wrapper.autotuner_op = op  # type: ignore[attr-defined]
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(fn, "__name__", op)
    return wrapper


def instrumented_factory(factory: Callable[..., Callable[..., Any]], op: str) -> Callable[..., Any]:
    """Wrap a function factory (Megatron's ``get_bias_dropout_add``) so the functions it returns run
    as ``op``."""
    if getattr(factory, "autotuner_op", None) == op:
        return factory

    def wrapper(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        return instrumented_function(factory(*args, **kwargs), op)

    wrapper.autotuner_op = op  # type: ignore[attr-defined]
    wrapper.__wrapped__ = factory  # type: ignore[attr-defined]
    return wrapper
