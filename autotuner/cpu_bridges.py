"""Bridges that let Megatron-Core run on a machine without CUDA.

Megatron-Core assumes CUDA in a few places (checked on 0.16.1 and 0.19.2). Each bridge below is applied
only when CUDA is absent, names the code it replaces and says why; nothing else in the project patches
Megatron. ``apply()`` is idempotent.

1. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on first use.
2. ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on ``torch.cuda.current_device()``.
   For both we call the original with ``torch.cuda.current_device`` answering ``"cpu"`` for the
   duration of that one call only, rather than replacing it process-wide.
3. The model-parallel RNG tracker: ``get_cuda_rng_tracker().fork()`` (used around attention dropout)
   raises without a CUDA RNG state. The inference tracker's fork is a no-op; dropout then draws from the
   CPU generator, which ``torch.manual_seed`` seeds.
4. ``get_default_causal_mask`` builds its mask on "cuda" when the attention mask is None: not bridged,
   because our op inputs always pass an explicit boolean causal mask (True = masked).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_APPLIED = False


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _on_cpu(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def bridged(*args: Any, **kwargs: Any) -> Any:
        with _current_device_is_cpu():
            return method(*args, **kwargs)

    bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    return bridged


def apply() -> None:
    """Install the bridges if CUDA is unavailable; a no-op on a GPU machine or when already applied."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random as mcore_random

    RotaryEmbedding.get_emb = _on_cpu(RotaryEmbedding.get_emb)
    mcore_utils.GlobalMemoryBuffer.get_tensor = _on_cpu(mcore_utils.GlobalMemoryBuffer.get_tensor)
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _APPLIED = True
