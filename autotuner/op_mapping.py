"""Op names to op tests: canonical names, the design card's aliases, selection and what to build.

The canonical order is model order, so tables and timelines read top to bottom like the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotuner.errors import UserError
from autotuner.model import ModelParts
from autotuner.ops_test import layer_ops, model_ops  # noqa: F401  (registers the ops)
from autotuner.ops_test.base import BLOCK, EMBEDDING, HEAD, REGISTRY, OpTest

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
    """Every registered op test, in model order (ops registered elsewhere come last, by name)."""
    rank = {name: i for i, name in enumerate(OP_ORDER)}
    return sorted(REGISTRY.values(), key=lambda t: (rank.get(t.name, len(rank)), t.name))


def _package_available(package: str) -> bool:
    if package == "transformer_engine":
        from autotuner.model import transformer_engine_available

        return transformer_engine_available()
    try:
        __import__(package)
    except Exception:  # noqa: BLE001 - a broken optional package counts as missing
        return False
    return True


def resolve_ops(names: Sequence[str] | None) -> list[OpTest]:
    """The op tests for ``ops=[...]`` (None or ["all"]: every available op), in model order.

    Unknown names and ops whose optional package is missing are errors naming the fix.
    """
    available = [t for t in ordered_tests() if t.requires is None or _package_available(t.requires)]
    if not names or list(names) == ["all"]:
        return available
    table = _alias_table()
    chosen = set()
    for name in names:
        canonical = table.get(str(name).lower())
        if canonical is None:
            raise UserError(f"unknown op {name!r}: choose from {', '.join(t.name for t in ordered_tests())}")
        test = REGISTRY[canonical]
        if test not in available:
            raise UserError(
                f"op {canonical!r} needs the package "
                f"{OPTIONAL_PACKAGES.get(test.requires, test.requires)}: install it"
            )
        chosen.add(canonical)
    return [t for t in available if t.name in chosen]


def model_parts(tests: Sequence[OpTest], block_layers: int, tied_embeddings: bool) -> ModelParts:
    """The smallest GPTModel that holds every selected op."""
    needs = set().union(*(t.needs for t in tests)) if tests else set()
    return ModelParts(
        num_layers=block_layers if BLOCK in needs else 1,
        pre_process=EMBEDDING in needs or (HEAD in needs and tied_embeddings),
        post_process=HEAD in needs,
    )
