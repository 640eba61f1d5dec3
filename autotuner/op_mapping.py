"""Op names to op tests: canonical names, the design card's aliases, selection and what to build.

The canonical order is model order, so tables and timelines read top to bottom like the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotuner.errors import UserError
from autotuner.model.build import ModelParts
from autotuner.ops_test import functional_ops, layer_ops, model_ops  # noqa: F401  (registers the ops)
from autotuner.ops_test.base import BLOCK, EMBEDDING, FUNCTIONAL, HEAD, LAYER, REGISTRY, OpTest
from autotuner.ops_test.functional_ops import FUNCTIONAL_OPS

OP_ORDER = (
    "embedding",
    "transformer_block",
    "transformer_layer",
    "input_layernorm",
    "self_attention",
    "linear_qkv",
    "rope",
    "core_attention",
    "linear_proj",
    "self_attn_bda",
    "pre_mlp_layernorm",
    "mlp",
    "linear_fc1",
    "activation",
    "linear_fc2",
    "mlp_bda",
    "final_layernorm",
    "output_layer",
)

# The sub-ops inside one TransformerLayer, in the order its forward runs them.
LAYER_SUB_OPS = OP_ORDER[OP_ORDER.index("input_layernorm") : OP_ORDER.index("mlp_bda") + 1]
# Which half of the layer each sub-op lives in: a layer built with that half alone holds it.
ATTENTION_OPS = frozenset(LAYER_SUB_OPS[: LAYER_SUB_OPS.index("self_attn_bda") + 1])
MLP_OPS = frozenset(LAYER_SUB_OPS[LAYER_SUB_OPS.index("pre_mlp_layernorm") :])

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
    """Every registered op test, in model order, then the functional group (ops registered elsewhere come
    last, by name)."""
    rank = {name: i for i, name in enumerate((*OP_ORDER, *FUNCTIONAL_OPS))}
    return sorted(REGISTRY.values(), key=lambda t: (rank.get(t.name, len(rank)), t.name))


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


def resolve_ops(names: Sequence[str] | None) -> list[OpTest]:
    """The op tests for ``ops=[...]`` in model order. None or ["all"]: every available op of the model;
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
            chosen.update(t.name for t in available if (FUNCTIONAL in t.needs) == functional)
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


def needs_model(tests: Sequence[OpTest]) -> bool:
    """Whether any selected op comes from the Megatron model (the functional ops do not)."""
    return any(FUNCTIONAL not in t.needs for t in tests)


def _layer_halves(test: OpTest) -> tuple[bool, bool]:
    """(attention, mlp): the halves of a layer ``test`` runs. An op of the layer this table does not know
    (one registered elsewhere) gets both."""
    if not test.needs & {LAYER, BLOCK}:
        return False, False
    if test.name in ATTENTION_OPS:
        return True, False
    if test.name in MLP_OPS:
        return False, True
    return True, True


def model_parts(tests: Sequence[OpTest], block_layers: int, tied_embeddings: bool) -> ModelParts:
    """The smallest GPTModel that holds every selected op."""
    needs = set().union(*(t.needs for t in tests)) if tests else set()
    halves = [_layer_halves(t) for t in tests]
    return ModelParts(
        num_layers=block_layers if BLOCK in needs else 1,
        pre_process=EMBEDDING in needs or (HEAD in needs and tied_embeddings),
        post_process=HEAD in needs,
        attention=any(attention for attention, _ in halves),
        mlp=any(mlp for _, mlp in halves),
    )
