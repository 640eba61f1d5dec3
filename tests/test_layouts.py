"""The layouts Megatron-Core accepts (autotuner.predict.layouts), against a brute force written here from
the rules as stated (every combination of sizes up to the GPU count, kept when each rule holds)."""

from __future__ import annotations

import itertools

import pytest

from autotuner.errors import UserError
from autotuner.predict.layouts import ModelDims, enumerate_layouts, model_dims

RECOMPUTE = ("none", "selective", "full")
BATCHES = (1, 2, 4, 8)


def split_ok(layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> bool:
    """Megatron's rules for the layers per pipeline rank (the first and/or last given, the ranks between
    sharing the rest evenly), then the enumeration's choice: per chunk within UNEVEN_SPREAD = 2 of each
    other, no end rank above the ranks between (pp > 2), a rank's own count given only where it differs."""
    ends = [n for n in (first, last) if n is not None]
    if pp == 1:
        return not ends and layers % vpp == 0
    between = pp - len(ends)
    rest = layers - sum(ends)
    if (rest != 0) != (between != 0) or rest < 0 or (between and rest % between):
        return False
    middle = rest // between if between else None
    counts = [
        first if first is not None else middle,
        *[middle] * (pp - 2),
        last if last is not None else middle,
    ]
    if any(n % vpp for n in counts) or (max(counts) - min(counts)) // vpp > 2:
        return False
    if pp == 2:
        return last is None and (first is None or first != counts[1])
    return all(n is None or (n != middle and n < middle) for n in (first, last))


def brute_force(model: ModelDims, gpus: int, gbs: int, seq: int) -> set[tuple]:
    found = set()
    sizes = range(1, gpus + 1)
    for tp, pp, dp, ep, vpp in itertools.product(sizes, sizes, sizes, sizes, range(1, model.num_layers + 1)):
        if tp * pp * dp != gpus:  # the first rule, checked early only to keep the loop short
            continue
        counts = [None, *range(1, model.num_layers + 1)]
        splits = [
            (f, la)
            for f, la in itertools.product(counts, counts)
            if split_ok(model.num_layers, pp, vpp, f, la)
        ]
        for (first, last), mbs, how, sp, distopt in itertools.product(
            splits, BATCHES, RECOMPUTE, (False, True), (False, True)
        ):
            width_ok = all(
                n % tp == 0
                for n in (model.heads, model.query_groups, model.ffn_hidden_size, model.moe_ffn_hidden_size)
                if n
            )
            microbatches_ok = gbs % (mbs * dp) == 0
            rules = [
                tp * pp * dp == gpus,
                width_ok,
                vpp == 1 or pp > 1,
                microbatches_ok,
                vpp == 1 or (microbatches_ok and (gbs // (mbs * dp)) % pp == 0),
                (not sp) or (tp > 1 and seq % tp == 0),
                (model.experts is None and ep == 1)
                or (model.experts is not None and model.experts % ep == 0 and (dp * tp) % ep == 0),
                model.experts is None or tp == 1 or sp,
            ]
            if all(rules):
                found.add((tp, pp, vpp, dp, ep, mbs, how, sp, distopt, first, last))
    return found


def as_tuples(layouts) -> list[tuple]:
    return [
        (
            x.tp,
            x.pp,
            x.vpp,
            x.dp,
            x.ep,
            x.micro_batch_size,
            x.recompute,
            x.sequence_parallel,
            x.distributed_optimizer,
            x.first_stage_layers,
            x.last_stage_layers,
        )
        for x in layouts
    ]


DENSE = ModelDims(num_layers=4, heads=4, query_groups=2, ffn_hidden_size=12)
DEEP = ModelDims(num_layers=10, heads=4, query_groups=2, ffn_hidden_size=12)  # pp=3 and 4 split unevenly only
MOE = ModelDims(num_layers=2, heads=4, query_groups=2, ffn_hidden_size=8, experts=4, moe_ffn_hidden_size=6)


@pytest.mark.parametrize(
    "model, gpus, gbs, seq",
    [
        (DENSE, 8, 16, 32),
        (DENSE, 4, 6, 6),
        (MOE, 8, 8, 32),
        (MOE, 6, 12, 16),
        (DEEP, 6, 12, 32),
        (DEEP, 8, 8, 32),
    ],
    ids=["dense-8gpus", "dense-odd-batch", "moe-8gpus", "moe-6gpus", "deep-6gpus", "deep-8gpus"],
)
def test_the_layouts_are_exactly_those_the_rules_allow(model, gpus, gbs, seq):
    layouts = enumerate_layouts(model, gpus, gbs, seq, dtype="bf16")
    tuples = as_tuples(layouts)
    assert len(tuples) == len(set(tuples))  # no layout twice
    assert set(tuples) == brute_force(model, gpus, gbs, seq)
    assert all(x.gpus == gpus and x.global_batch_size == gbs and x.seq_len == seq for x in layouts)


def test_the_order_is_deterministic_and_nested_by_field():
    layouts = enumerate_layouts(DENSE, 8, 16, 32)
    assert layouts == enumerate_layouts(DENSE, 8, 16, 32)
    rank = {how: i for i, how in enumerate(RECOMPUTE)}
    assert {t[9:] for t in as_tuples(layouts)} == {(None, None), (1, None), (3, None)}  # pp=2: 1+3, 3+1

    def split(first, last):  # the even split first, then by the counts given
        return ((first, last) != (None, None), first or 0, last or 0)

    keys = [(*t[:3], *split(*t[9:]), t[4], t[5], rank[t[6]], t[7], t[8]) for t in as_tuples(layouts)]
    assert keys == sorted(keys)


def test_a_request_nothing_meets_is_one_line():
    with pytest.raises(UserError, match="no layout of 3 GPUs") as info:
        enumerate_layouts(ModelDims(num_layers=2, heads=4, query_groups=4, ffn_hidden_size=8), 3, 1, 16)
    assert "\n" not in str(info.value)


def test_a_case_gives_its_shape():
    assert model_dims("tiny_moe") == ModelDims(
        num_layers=2, heads=4, query_groups=2, ffn_hidden_size=128, experts=8, moe_ffn_hidden_size=128
    )
