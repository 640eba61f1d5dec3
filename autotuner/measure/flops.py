"""FLOPs of one phase, counted by ``torch.utils.flop_counter`` (matrix products and attention kernels,
the operations that dominate; element-wise work counts zero)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.flop_counter import FlopCounterMode


def count_flops(run: Callable[[], Any]) -> int:
    """FLOPs executed by ``run()`` (multiply and add counted separately: 2 per MAC)."""
    with FlopCounterMode(display=False) as counter:
        run()
    return int(counter.get_total_flops())
