"""Shared set-up for the benchmarks: a tiny-family model on the CPU and a few of its ops as callables, and
the small helpers several benchmarks use."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from autotuner.config import compose_config
from autotuner.ops_test.base import ShapePoint
from autotuner.runner import Phase
from autotuner.runner.spec import open_session, resolve_spec

# A model a bit wider than case=tiny so ops take 0.1-10 ms on a laptop CPU.
OVERRIDES = ["case=tiny", "device=cpu", "hf.hidden_size=256", "hf.head_dim=64", "hf.intermediate_size=704"]
POINT = ShapePoint(128, 4)


def spec_for(extra: list[str] | None = None) -> Any:
    return resolve_spec(compose_config([*OVERRIDES, *(extra or [])]))


def op_callables(names: list[str]) -> list[tuple[str, Callable[[], Any]]]:
    """(label, forward callable) for each op, built from the real Megatron model."""
    spec = spec_for([f"ops=[{','.join(names)}]"])
    _, context = open_session(spec)
    callables = []
    for test in spec.ops:
        phase = Phase("forward", test.build(context, POINT), seed=0)
        callables.append((f"{test.name}.forward", phase.run))
    return callables


def two_or_more(what: str) -> Callable[[str], int]:
    """An argparse type: a whole number of ``what``, 2 or more."""

    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 2:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of {what}, 2 or more")
        return int(text)

    return parse


def dropping_result(run: Callable[[], Any]) -> None:
    """``run()`` with what it returns dropped as it returns: freed inside a timed window, as
    torch.utils.benchmark's loop frees it (get_data's timer frees it after its end mark)."""
    run()
