"""Bridges that let Megatron-Core run on the CPU, on a machine with or without CUDA.

Megatron-Core assumes CUDA in a few places (checked on 0.16.1 and 0.19.2). Each bridge below names the
code it replaces and says why; nothing else in the project patches Megatron. ``apply(device)`` installs
them once and points them at the run's device, so a CPU run on a GPU machine (``device=cpu``) keeps its
tensors on the CPU, and a CUDA run in the same process afterwards is untouched.

1. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on first use. The
   bridge leaves it on the device it was made on (the CPU when the model was built for the CPU).
2. ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on ``torch.cuda.current_device()``:
   the bridge makes that the run's device.
   For both, ``torch.cuda.current_device`` answers "cpu" for the duration of that one call only, rather
   than being replaced process-wide.
3. The model-parallel RNG tracker: ``get_cuda_rng_tracker().fork()`` (used around attention dropout)
   raises without a CUDA RNG state. For a CPU run the inference tracker (whose fork is a no-op) is
   installed; dropout then draws from the CPU generator, which ``torch.manual_seed`` seeds. A CUDA run
   re-creates the real tracker (autotuner.model.runtime.seed_everything).
4. ``get_default_causal_mask`` builds its mask on "cuda" when the attention mask is None: not bridged,
   because our op inputs always pass an explicit boolean causal mask (True = masked).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_INSTALLED = False
_RUN_DEVICE = torch.device("cpu")


@contextlib.contextmanager
def _current_device_is(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":  # nothing to bridge
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _get_emb(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bridged(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _current_device_is(self.inv_freq.device):
            return original(self, *args, **kwargs)

    bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    return bridged


def _on_run_device(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bridged(*args: Any, **kwargs: Any) -> Any:
        with _current_device_is(_RUN_DEVICE):
            return original(*args, **kwargs)

    bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    return bridged


def apply(device: torch.device) -> None:
    """Install the bridges (once) and aim them at ``device``; a CPU run also gets the no-op RNG tracker."""
    global _INSTALLED, _RUN_DEVICE
    _RUN_DEVICE = device
    from megatron.core.tensor_parallel import random as mcore_random

    if not _INSTALLED:
        from megatron.core import utils as mcore_utils
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        RotaryEmbedding.get_emb = _get_emb(RotaryEmbedding.get_emb)
        mcore_utils.GlobalMemoryBuffer.get_tensor = _on_run_device(mcore_utils.GlobalMemoryBuffer.get_tensor)
        _INSTALLED = True
    if device.type == "cpu":
        mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
