"""Any captured call as a benchmark of its own: the generic operator plan.

Each distinct (callee, signature) of a capture, its counts summed over module paths, becomes one op with
one point: the op is named ``<kind>_<callee>_<n>`` (``f_linear_0``, ``t_matmul_0``, ``m_llamarmsnorm_0``:
lower case, digits and underscores, so profiler range names parse back), and the point's label is the
signature (``f32_2x16x64,f32_64x64``). Its inputs come from the seeded data generator
(autotuner.capture.tensors); tensors that were parameters become the op's weights, made once when the
session opens, so they are counted as weights (not activations) as in the model.

What is replayed:
* functions and ``Tensor`` methods of the ``torch`` namespace, called as recorded;
* modules whose class has a rebuild recipe (``nn.Linear(in, out, bias)``, norms, ``nn.Embedding``,
  activations, dropout), built from the recorded attributes. A class outside torch whose name ends in
  ``RMSNorm``/``LayerNorm`` (transformers' ``LlamaRMSNorm``) is replayed as torch's norm of the same shape
  and eps: the same math, not necessarily the same kernels (a note says so).
Not replayed (each listed in the run's notes): other modules, and a module that itself calls a captured
function (an ``nn.Linear`` whose ``F.linear`` call is replayed: timing both would count the work twice).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autotuner.capture.schema import CallRecord, Capture
from autotuner.capture.tensors import NotReplayable, Slot, TensorSpec, decode, fill, make_tensor
from autotuner.capture.values import summary
from autotuner.ops.instrument import call_op
from autotuner.ops_test.base import OpCall, ShapePoint

_NN = "torch.nn.modules."
RECIPES: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    _NN + "linear.Linear": lambda a: nn.Linear(a["in_features"], a["out_features"], bias=a.get("bias", True)),
    _NN + "sparse.Embedding": lambda a: nn.Embedding(
        a["num_embeddings"], a["embedding_dim"], padding_idx=a.get("padding_idx")
    ),
    _NN + "normalization.LayerNorm": lambda a: nn.LayerNorm(
        a["normalized_shape"],
        eps=a["eps"],
        elementwise_affine=a.get("elementwise_affine", True),
        bias=a.get("bias", True),
    ),
    _NN + "normalization.RMSNorm": lambda a: nn.RMSNorm(
        a["normalized_shape"], eps=a.get("eps"), elementwise_affine=a.get("elementwise_affine", True)
    ),
    _NN + "activation.SiLU": lambda a: nn.SiLU(),
    _NN + "activation.GELU": lambda a: nn.GELU(approximate=a.get("approximate", "none")),
    _NN + "activation.ReLU": lambda a: nn.ReLU(),
    _NN + "activation.Tanh": lambda a: nn.Tanh(),
    _NN + "activation.Sigmoid": lambda a: nn.Sigmoid(),
    _NN + "activation.Softmax": lambda a: nn.Softmax(dim=a.get("dim")),
    _NN + "dropout.Dropout": lambda a: nn.Dropout(p=a.get("p", 0.5)),
}
_MAX_LABEL = 120


@dataclass(frozen=True)
class CallPoint(ShapePoint):
    """A generic op's one point: no (seq_len, batch) of a transformer, its signature instead."""

    signature: str = ""

    @property
    def label(self) -> str:
        return self.signature


@dataclass
class GenericCall:
    """One distinct (callee, signature) of a capture, counts summed over the module paths it ran at."""

    record: CallRecord
    count: int
    paths: list[str] = field(default_factory=list)


def distinct_calls(capture: Capture) -> list[GenericCall]:
    found: dict[str, GenericCall] = {}
    for r in capture.calls:
        key = json.dumps(
            [r.kind, r.callee, r.args, r.kwargs, r.attrs, r.grad_enabled, r.training], sort_keys=True
        )
        call = found.setdefault(key, GenericCall(r, 0))
        call.count += r.count
        call.paths.append(r.path)
    return list(found.values())


def covered_paths(capture: Capture) -> set[str]:
    """Module paths inside which a captured function or method ran directly."""
    return {r.path for r in capture.calls if r.kind != "module"}


def _callee(record: CallRecord) -> Callable[..., Any]:
    owner_name, _, attr = record.callee.rpartition(".")
    if record.kind == "method" and owner_name == "torch.Tensor":
        owner: Any = torch.Tensor
    elif record.kind == "function" and (owner_name == "torch" or owner_name.startswith("torch.")):
        owner = importlib.import_module(owner_name)
    else:
        raise NotReplayable(f"{record.callee} is not a function of the torch namespace")
    fn = getattr(owner, attr, None)
    if not callable(fn):
        raise NotReplayable(f"{record.callee} does not exist in this torch")
    return fn


def _module_factory(record: CallRecord) -> tuple[Callable[[], nn.Module], str | None]:
    """How to build the module again and, when it stands in for another class, a note saying so."""
    attrs, base = record.attrs, record.base or ""
    factory: Callable[[], nn.Module] | None = None
    note = None
    if record.callee == base and base in RECIPES:
        factory = lambda: RECIPES[base](attrs)
    shape = attrs.get("weight_shape")
    eps = attrs.get("eps", attrs.get("variance_epsilon"))
    for suffix, norm in (("RMSNorm", nn.RMSNorm), ("LayerNorm", nn.LayerNorm)):
        if (
            factory is None
            and record.class_name.endswith(suffix)
            and isinstance(shape, list)
            and len(shape) == 1
        ):
            factory = lambda norm=norm: norm(shape, eps=eps) if eps is not None else norm(shape)
            note = f"{record.class_name} replayed as torch.nn.{suffix}({shape[0]}, eps={eps})"
    if factory is None:
        raise NotReplayable(f"no rebuild recipe for {record.class_name}")
    try:
        with torch.device("meta"):  # check the attributes rebuild it, without allocating its weights
            factory()
    except (KeyError, TypeError, ValueError) as exc:
        raise NotReplayable(
            f"{record.class_name}: its recorded attributes do not rebuild it ({exc})"
        ) from exc
    return factory, note


def _index_bound(record: CallRecord, specs: list[TensorSpec]) -> int | None:
    """What an integer input may hold: an embedding's rows, a loss's classes."""
    floats = [s for s in specs if s.dtype.is_floating_point]
    name = record.callee.rsplit(".", 1)[-1]
    if record.kind == "module" and "num_embeddings" in record.attrs:
        return int(record.attrs["num_embeddings"])
    if name == "embedding" and floats:
        return floats[0].shape[0]
    if name in ("cross_entropy", "nll_loss") and floats and floats[0].shape:
        return floats[0].shape[1] if len(floats[0].shape) >= 2 else floats[0].shape[0]
    return None


class GenericOp:
    """The build of one generic op (an OpTest's ``build``), and the weights it owns."""

    def __init__(self, name: str, call: GenericCall, device: torch.device, dtype: torch.dtype | None) -> None:
        record = call.record
        self.name, self.call, self.device, self.dtype = name, call, device, dtype
        self.notes: list[str] = []
        self.specs: list[TensorSpec] = []
        self.factory: Callable[[], nn.Module] | None = None
        self.fn: Callable[..., Any] | None = None
        if record.kind == "module":
            self.factory, note = _module_factory(record)
            self.notes += [note] if note else []
        else:
            self.fn = _callee(record)
        kwargs = dict(record.kwargs)
        if kwargs.get("inplace") == {"value": True}:
            kwargs["inplace"] = {"value": False}  # in place on a leaf that needs grad would fail
            self.notes.append(f"{name}: replayed with inplace=False")
        self.args = [decode(v, device, self._slot) for v in record.args]
        self.kwargs = {k: decode(v, device, self._slot) for k, v in kwargs.items()}
        trainable = bool(record.attrs.get("trainable")) if self.factory is not None else False
        self.has_backward = record.grad_enabled and (trainable or any(s.requires_grad for s in self.specs))

    def _slot(self, spec_json: dict[str, Any]) -> Slot:
        spec = TensorSpec.from_json(spec_json, self.dtype)
        if not self.call.record.grad_enabled:  # recorded under no_grad: no graph, no backward
            spec = dataclasses.replace(spec, requires_grad=False)
        index = sum(1 for s in self.specs if s.parameter == spec.parameter)
        self.specs.append(spec)
        return Slot(index, spec.parameter, spec)

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed((seed * 1_000_003 + sum(map(ord, self.name)) * 7919) % 2**63)

    def make_weights(self, seed: int) -> nn.Module:
        """This op's parameters: the rebuilt module (torch's own init) and the parameter arguments."""
        holder = nn.Module()
        gen, bound = self._generator(seed + 1), _index_bound(self.call.record, self.specs)
        holder.params = nn.ParameterList(
            nn.Parameter(make_tensor(s, gen, self.device, bound), requires_grad=s.requires_grad)
            for s in self.specs
            if s.parameter
        )
        if self.factory is not None:
            record = self.call.record
            dtype = self.dtype or getattr(torch, str(record.attrs.get("param_dtype", "float32")))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # torch's own init, seeded: the same weights on every run
                module = self.factory()
            holder.module = module.to(device=self.device, dtype=dtype)
            holder.module.train(record.training is not False)
            holder.module.requires_grad_(bool(record.attrs.get("trainable")) and record.grad_enabled)
        return holder

    def __call__(self, ctx: Any, point: ShapePoint) -> OpCall:
        holder = ctx.weights[self.name]
        gen, bound = self._generator(ctx.seed), _index_bound(self.call.record, self.specs)
        inputs = tuple(make_tensor(s, gen, self.device, bound) for s in self.specs if not s.parameter)
        name, weights, args, kwargs = self.name, holder.params, self.args, self.kwargs
        fn = holder.module if self.factory is not None else self.fn

        def run(*tensors: torch.Tensor) -> Any:
            return fn(*fill(args, tensors, weights), **fill(kwargs, tensors, weights))

        def call(*tensors: torch.Tensor) -> Any:
            # the holder, so profiler ranges mark the backward of an op whose inputs need no gradient
            # (an embedding's token ids) by its weights' gradients, as for a module op
            return call_op(name, run, tensors, {}, module=holder)

        return OpCall(call, inputs, holder)


def op_stem(record: CallRecord) -> str:
    """``f_linear``, ``torch_bmm``, ``t_matmul``, ``m_llamarmsnorm``: the op name before its number."""
    owner, _, short = record.callee.rpartition(".")
    if record.kind == "module":
        prefix, short = "m", record.callee.rsplit(".", 1)[-1]
    elif record.kind == "method":
        prefix = "t"
    else:
        prefix = "f" if owner == "torch.nn.functional" else owner
    return re.sub(r"[^a-z0-9_]", "_", f"{prefix}_{short}".lower())


def signature_label(record: CallRecord) -> str:
    """The signature as a point label: tensors by dtype and shape, other set arguments as name=value,
    in characters safe in file names and profiler range names."""
    parts = [summary(v) for v in record.args if v != {"value": None}]
    parts += [f"{k}={summary(v)}" for k, v in record.kwargs.items() if v != {"value": None}]
    label = re.sub(r"[^A-Za-z0-9_.,=()+-]", "_", ",".join(parts)) or "noargs"
    return label if len(label) <= _MAX_LABEL else label[: _MAX_LABEL - 1] + "+"
