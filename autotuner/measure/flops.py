"""FLOPs of one phase, counted by ``torch.utils.flop_counter`` (matrix products and attention kernels,
the operations that dominate; element-wise work counts zero).

torch's counter has formulas for its CUDA attention kernels (flash, memory-efficient, cuDNN: two matrix
products forward, five backward, the scores recomputed) but none for the CPU flash kernel that
``scaled_dot_product_attention`` runs on a CPU, which it would count as zero: :data:`CPU_ATTENTION` gives
that kernel the CUDA kernels' formulas, so an sdpa row counts the same FLOPs on either device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

_aten = torch.ops.aten


def _cpu_attention(query: Any, key: Any, value: Any, *_: Any, out_shape: Any = None, **__: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *_: Any, out_shape: Any = None, **__: Any
) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter with :data:`CPU_ATTENTION` (a context manager; ``get_total_flops()``)."""
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)


def count_flops(run: Callable[[], Any]) -> int:
    """FLOPs executed by ``run()`` (multiply and add counted separately: 2 per MAC)."""
    with flop_counter() as counter:
        run()
    return int(counter.get_total_flops())
