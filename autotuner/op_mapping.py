"""Op names to op tests: canonical names, the design card's aliases, selection and what to build.

The canonical order is model order, so tables and timelines read top to bottom like the forward pass. It,
the layer's sub-ops and which half of the layer each lives in are derived from the places the ops declare
(autotuner.ops_test.places); the names below are that derivation at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotuner.errors import UserError
from autotuner.model.build import ModelParts
from autotuner.ops_test.base import (
    ATTENTION,
    BLOCK,
    EMBEDDING,
    FACTORY,
    FUNCTION,
    FUNCTIONAL,
    HEAD,
    LAYER,
    MLP,
    MODEL,
    MODULE,
    REGISTRY,
    OpTest,
)
from autotuner.ops_test.places import LAYERS, OpTree, op_for, op_tree

_TREE = op_tree()
# The ops of the model, in the order of its forward pass.
OP_ORDER = _TREE.model_order
# The sub-ops inside one TransformerLayer, in the order its forward runs them.
LAYER_SUB_OPS = _TREE.layer_ops
# Which half of the layer each sub-op lives in: a layer built with that half alone holds it.
ATTENTION_OPS = _TREE.in_half(ATTENTION)
MLP_OPS = _TREE.in_half(MLP)

# Packages an op may need, and whether they import here (filled lazily; see available_ops).
OPTIONAL_PACKAGES = {"transformer_engine": "transformer-engine[pytorch]"}


def _alias_table() -> dict[str, str]:
    table = {}
    for test in REGISTRY.values():
        table[test.name.lower()] = test.name
        for alias in test.aliases:
            table[alias.lower()] = test.name
    return table


def ordered_tests() -> list[OpTest]:
    """Every registered op test (those registered since import too): the model's in model order, then
    the ones with no place in the model (the functional group), as registered."""
    return [REGISTRY[name] for name in op_tree().order]


def _package_available(package: str) -> bool:
    if package == "transformer_engine":
        from autotuner.model.build import transformer_engine_available

        return transformer_engine_available()
    try:
        __import__(package)
    except Exception:  # noqa: BLE001 - a broken optional package counts as missing
        return False
    return True


# Names that select several ops: "all" is every op of the model (the functional group is asked for by name).
GROUPS = ("all", FUNCTIONAL)


def resolve_ops(names: Sequence[str] | None, config: Any = None) -> list[OpTest]:
    """The op tests for ``ops=[...]`` in model order. None or ["all"]: every available op of the model
    (given the model's TransformerConfig ``config``, not the ops it lacks: OpTest.missing_from);
    "functional": the device's base capabilities (autotuner.ops_test.functional_ops); both combine with
    op names.

    Unknown names and ops whose optional package is missing are errors naming the fix.
    """
    available = [t for t in ordered_tests() if t.requires is None or _package_available(t.requires)]
    if names is not None and not list(names):
        # An empty list is a slip (a sweep value left blank, a script's empty variable), not a request.
        raise UserError(
            "ops=[] selects no op: name the ops (ops=[linear_qkv,mlp]), or ops=[all] for every op"
        )
    names = list(names or ["all"])
    table = _alias_table()
    chosen = set()
    for name in names:
        if str(name).lower() in GROUPS:
            functional = str(name).lower() == FUNCTIONAL
            # a group holds the ops of this model only (with config): no MLA rows for a dense model
            chosen.update(
                t.name
                for t in available
                if (FUNCTIONAL in t.needs) == functional and t.absent_reason(config) is None
            )
            continue
        canonical = table.get(str(name).lower())
        if canonical is None:
            choices = ", ".join([*GROUPS, *(t.name for t in ordered_tests())])
            raise UserError(f"unknown op {name!r}: choose from {choices}")
        test = REGISTRY[canonical]
        if test not in available:
            raise UserError(
                f"op {canonical!r} needs the package "
                f"{OPTIONAL_PACKAGES.get(test.requires, test.requires)}: install it"
            )
        chosen.add(canonical)
    return [t for t in available if t.name in chosen]


def ops_in_model(config: Any) -> tuple[str, ...]:
    """The ops a model of ``config`` (its TransformerConfig) has, in model order: OP_ORDER less the ops
    it lacks (OpTest.missing_from: no MLA projection in a dense model, no dense MLP in Mixtral)."""
    return tuple(name for name in op_tree().model_order if REGISTRY[name].absent_reason(config) is None)


def needs_model(tests: Sequence[OpTest]) -> bool:
    """Whether any selected op comes from the Megatron model (the functional ops do not)."""
    return any(FUNCTIONAL not in t.needs for t in tests)


def _layer_halves(test: OpTest, tree: OpTree) -> tuple[bool, bool]:
    """(attention, mlp): the halves of a layer ``test`` runs. An op of the layer in neither half (the
    layer itself, or one with no place) gets both."""
    if not test.needs & {LAYER, BLOCK}:
        return False, False
    half = tree.half(test.name) if test.name in tree.parents else None
    return half != MLP, half != ATTENTION


def _in_subtree(tree: OpTree, op: str, root: str) -> bool:
    name: str | None = op
    while name is not None:
        if name == root:
            return True
        name = tree.parents.get(name)
    return False


def _layers_for_kinds(tests: Sequence[OpTest], tree: OpTree, moe_pattern: Sequence[bool]) -> int:
    """How many of the model's first layers hold a layer of each kind the ops need: a dense MLP for the
    ``mlp`` op and the ops inside it, an MoE layer for the other layer ops where the model has one
    (OpContext.layer, OpContext.dense_layer). 1 for a model whose layers are all alike."""
    if len(set(moe_pattern)) < 2:
        return 1
    layer_ops = [t.name for t in tests if LAYER in t.needs and t.name in tree.parents]
    dense = any(_in_subtree(tree, name, "mlp") for name in layer_ops)
    moe = any(not _in_subtree(tree, name, "mlp") for name in layer_ops)
    needed = [moe_pattern.index(False) + 1 if dense else 1, moe_pattern.index(True) + 1 if moe else 1]
    return max(needed)


def model_parts(
    tests: Sequence[OpTest], block_layers: int, tied_embeddings: bool, moe_pattern: Sequence[bool] = ()
) -> ModelParts:
    """The smallest GPTModel that holds every selected op. ``moe_pattern``: which of the model's layers
    are MoE layers (autotuner.model.build.moe_layer_pattern), where it mixes them with dense ones."""
    needs = set().union(*(t.needs for t in tests)) if tests else set()
    tree = op_tree()
    halves = [_layer_halves(t, tree) for t in tests]
    return ModelParts(
        num_layers=max(block_layers if BLOCK in needs else 1, _layers_for_kinds(tests, tree, moe_pattern)),
        pre_process=EMBEDDING in needs or (HEAD in needs and tied_embeddings),
        post_process=HEAD in needs,
        attention=any(attention for attention, _ in halves),
        mlp=any(mlp for _, mlp in halves),
    )


# What the instrumentation wraps, by attribute path, from the places the ops declare (as registered at
# import; instrument_gpt itself reads the registry as it stands). Modules of a TransformerLayer and the op
# each one is:
LAYER_MODULE_OPS = op_tree().paths(LAYER, MODULE)
# Functions a TransformerLayer holds as attributes (bias-dropout-add factories).
LAYER_FACTORY_OPS = op_tree().paths(LAYER, FACTORY)
# Modules of the GPTModel around the layers.
MODEL_MODULE_OPS = op_tree().paths(MODEL, MODULE)


def _get(module: Any, path: str) -> Any:
    for name in filter(None, path.split(".")):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def instrument_gpt(model: Any) -> None:
    """Give every op of the model its range (see autotuner.ops.instrument), in place, after
    autotuner.model.build.build_model: each op where it
    declared it sits (autotuner.ops_test.places), in the GPTModel and in every TransformerLayer."""
    from autotuner.ops.instrument import instrument_module, instrumented_factory

    tree = op_tree()
    containers = [(MODEL, model)] + [(LAYER, layer) for layer in _get(model, LAYERS) or ()]
    for container, owner in containers:
        for path, tests in tree.placed(container, MODULE).items():
            module = _get(owner, path)
            test = op_for(tests, module) if module is not None else None
            if test is not None and test.absent_reason(model.config) is None:  # no range for a placeholder
                instrument_module(module, test.name)
        for path, tests in tree.placed(container, FACTORY).items():
            holder_path, _, attr = path.rpartition(".")
            holder = _get(owner, holder_path)
            factory = getattr(holder, attr, None) if holder is not None else None
            test = op_for(tests, factory) if factory is not None else None
            if test is not None:
                setattr(holder, attr, instrumented_factory(factory, test.name))
    # Functions Megatron calls by name (RoPE, the activation): each op wraps its own where it is looked up.
    for name in tree.model_order:
        test = tree.tests[name]
        if test.kind == FUNCTION and test.absent_reason(model.config) is None:
            test.instrument(model, name)
