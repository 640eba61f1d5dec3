"""Where each op sits in the model, and what follows from it: model order, parents, the layer's parts and
halves, and what the instrumentation wraps where.

Each op declares its place when it registers (:func:`autotuner.ops_test.base.register_op`): ``where``, its
attribute path in its container. The containers nest: every TransformerLayer is an element of the GPTModel's
``decoder.layers`` (:data:`LAYERS`), so every placed op has one path in the GPTModel
(``self_attention.linear_qkv`` in the layer is ``decoder.layers.self_attention.linear_qkv``). From the paths:

* **parent**: the op at the longest path that is a proper prefix of the op's own (``linear_qkv`` is inside
  ``self_attention``; ``transformer_layer``, at ``decoder.layers``, inside ``transformer_block``, at
  ``decoder``). Of two ops at one path (told apart by ``module_class``) it is the one naming no class; an
  op below the other names its ``parent``.
* **model order**, the order of the forward pass: a parent before its children (its range opens first),
  siblings in the order they registered (each op module registers its ops in forward order; the package
  imports the modules by name), ops sharing a path next to each other. Ops with no place (the functional
  group) follow, as registered.
* **half** of the layer (what :func:`autotuner.op_mapping.model_parts` builds): declared on the layer's
  direct parts, inherited by everything inside them.

:func:`op_tree` derives all of it from the registry as it stands; the module-level names elsewhere
(``OP_ORDER``, ``LAYER_PARTS``, ...) are the tree at import. Nothing here imports torch, so the report can
read the layer's parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import autotuner.ops_test  # noqa: F401  (registers every op)
from autotuner.ops_test.base import LAYER, REGISTRY, OpTest

# Where the GPTModel keeps its TransformerLayers: the path in the model of each layer op's container.
LAYERS = "decoder.layers"


def model_path(test: OpTest) -> tuple[str, ...]:
    """The op's path in the GPTModel, as components (``()`` is the model itself)."""
    if test.where is None:
        raise ValueError(f"op {test.name!r} has no place in the model")
    inside = tuple(filter(None, test.where.split(".")))
    return (*LAYERS.split("."), *inside) if test.container == LAYER else inside


@dataclass(frozen=True)
class OpTree:
    """A registry's ops as the model nests them. ``order``: every op, the placed ones in model order, then
    the others as registered; ``parents``: the placed ops' parents (None at the top)."""

    tests: Mapping[str, OpTest]
    order: tuple[str, ...]
    parents: Mapping[str, str | None]

    @cached_property  # the tree is frozen; the predictor asks for children millions of times in a tune
    def model_order(self) -> tuple[str, ...]:
        """The ops with a place in the model, in the order of the forward pass."""
        return tuple(name for name in self.order if name in self.parents)

    @cached_property
    def _children(self) -> dict[str | None, tuple[str, ...]]:
        found: dict[str | None, list[str]] = {}
        for name in self.model_order:
            found.setdefault(self.parents[name], []).append(name)
        return {parent: tuple(names) for parent, names in found.items()}

    def children(self, op: str) -> tuple[str, ...]:
        """The ops directly inside ``op``, in model order."""
        return self._children.get(op, ())

    def half(self, op: str) -> str | None:
        """The half of the layer ``op`` needs built (ATTENTION or MLP), or None (both, or no layer)."""
        name: str | None = op
        while name is not None:
            if self.tests[name].half is not None:
                return self.tests[name].half
            name = self.parents.get(name)
        return None

    @property
    def layer_ops(self) -> tuple[str, ...]:
        """The ops inside one TransformerLayer (not the layer itself), in model order."""
        return tuple(n for n in self.model_order if self.tests[n].container == LAYER and self.tests[n].where)

    def in_half(self, half: str) -> frozenset[str]:
        """The layer's ops that live in ``half``."""
        return frozenset(name for name in self.layer_ops if self.half(name) == half)

    def placed(self, container: str, kind: str) -> dict[str, tuple[OpTest, ...]]:
        """Path in ``container`` -> the ops of ``kind`` there (several only when told apart by class)."""
        found: dict[str, tuple[OpTest, ...]] = {}
        for name in self.model_order:
            test = self.tests[name]
            if test.container == container and test.kind == kind:
                found[test.where] = (*found.get(test.where, ()), test)
        return found

    def paths(self, container: str, kind: str) -> dict[str, str]:
        """Path in ``container`` -> the op of ``kind`` there that names no module class."""
        return {
            path: test.name
            for path, tests in self.placed(container, kind).items()
            for test in tests
            if test.module_class is None
        }


def op_tree(registry: Mapping[str, OpTest] | None = None) -> OpTree:
    """The ops of ``registry`` (default: every registered op) as the model nests them. Raises ValueError
    for a parent the paths cannot settle."""
    tests = dict(REGISTRY if registry is None else registry)
    paths = {name: model_path(test) for name, test in tests.items() if test.where is not None}
    at: dict[tuple[str, ...], list[str]] = {}
    for name, path in paths.items():
        at.setdefault(path, []).append(name)
    parents = {name: _parent(tests, name, paths, at) for name in paths}

    # Siblings keep registration order, except that ops sharing a path (alternatives, as a dense MLP and an
    # MoE layer) stay together, where the first of them registered.
    first: dict[tuple[str, ...], int] = {}
    for index, path in enumerate(paths.values()):
        first.setdefault(path, index)
    inside: dict[str | None, list[str]] = {}
    for name in sorted(paths, key=lambda n: first[paths[n]]):  # sorted() is stable
        inside.setdefault(parents[name], []).append(name)
    order: list[str] = []
    pending = list(reversed(inside.get(None, [])))
    while pending:  # depth first, a parent before its children
        name = pending.pop()
        order.append(name)
        pending.extend(reversed(inside.get(name, [])))
    order += [name for name in tests if name not in paths]
    return OpTree(tests=tests, order=tuple(order), parents=parents)


def _parent(
    tests: Mapping[str, OpTest],
    name: str,
    paths: Mapping[str, tuple[str, ...]],
    at: Mapping[tuple[str, ...], list[str]],
) -> str | None:
    test, path = tests[name], paths[name]
    if test.parent is not None:
        above = paths.get(test.parent)
        if above is None or len(above) >= len(path) or path[: len(above)] != above:
            raise ValueError(f"op {test.name!r}: its parent {test.parent!r} is not an op above its path")
        return test.parent
    for cut in range(len(path) - 1, -1, -1):
        candidates = at.get(path[:cut], [])
        if len(candidates) == 1:
            return candidates[0]
        if candidates:  # alternatives: the one naming no class (the dense MLP beside an MoE layer)
            default = [c for c in candidates if tests[c].module_class is None]
            if not default:
                raise ValueError(
                    f"op {name!r}: {candidates} all sit at {'.'.join(path[:cut])!r}: name one with parent="
                )
            return default[0]
    return None


def op_for(tests: tuple[OpTest, ...], obj: Any) -> OpTest | None:
    """Which of the ops sharing a path ``obj`` (the module found there) is: the one naming a class in its
    class hierarchy, else the one naming none."""
    classes = {cls.__name__ for cls in type(obj).__mro__}
    named = next((test for test in tests if test.module_class in classes), None)
    return named or next((test for test in tests if test.module_class is None), None)
