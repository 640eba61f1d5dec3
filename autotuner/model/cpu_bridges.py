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
4. ``Router.gating`` (Mixture-of-Experts) moves the router's weight to ``torch.cuda.current_device()``,
   then calls ``router_gating_linear``, whose autograd function names Transformer-Engine's GEMM and
   raises NameError without it. For a weight on the CPU the bridge computes what that function computes,
   the logits ``input @ weight.T (+ bias)`` in the router's dtype, with ``F.linear`` (autograd gives the
   same gradients); a CUDA weight takes Megatron's own path.
5. Multi-Latent Attention builds its own ``RotaryEmbedding``/``YarnRotaryEmbedding`` without
   ``use_cpu_initialization``, so their constructors make ``inv_freq`` on ``torch.cuda.current_device()``,
   and the YaRN one moves its tables there on every forward: the bridge makes both the run's device (the
   constructors) and the tables' device (the forward).
6. ``multi_latent_attention.HAVE_TE`` is True whenever Megatron's Transformer-Engine extension module
   imports, which it does without Transformer-Engine, with a ``MagicMock`` standing in for ``TELinear``;
   MLA's constructor then calls ``isinstance(linear_proj, <the mock>)`` (TypeError). Where ``TELinear``
   is not a class the bridge sets ``HAVE_TE`` False, what it means there (a GPU machine without TE
   needs it too).
8. The collectives of sequence parallelism and of the all-gather MoE dispatcher (tensor_parallel.mappings'
   ``_gather_along_first_dim``, ``_gather_along_last_dim``, ``_reduce_scatter_along_first_dim``, and
   the sequence-parallel backward of ``LinearWithGradAccumulationAndAsyncCommunication``) allocate their
   outputs on ``torch.cuda.current_device()``: the bridge makes that the run's device, as in 2. (gloo
   runs these collectives on the CPU from torch 2.x: autotuner.model.runtime probes for them.)
9. ``WrappedTorchNorm`` (the local spec's norm where Apex is absent, as on every CPU) refuses
   ``sequence_parallel`` because it cannot tag its weights for the gradient all-reduce sequence
   parallelism adds; the computation on a rank's sequence slice is the same. The bridge builds it with
   sequence parallelism hidden from it and tags its parameters ``sequence_parallel`` as Megatron's
   fused and Transformer-Engine norms do.
7. ``get_default_causal_mask`` builds its mask on "cuda" when the attention mask is None: not bridged,
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


def _on_device_of(tensor: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A bridge for a method that moves tables to ``torch.cuda.current_device()``: "the current device"
    is, for that call, the device of the instance's attribute ``tensor`` (where the tables were made)."""

    def bridge(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def bridged(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _current_device_is(getattr(self, tensor).device):
                return original(self, *args, **kwargs)

        bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
        if hasattr(original, "cache_clear"):  # an lru_cache (YaRN's forward), which its constructor clears
            bridged.cache_clear = original.cache_clear  # type: ignore[attr-defined]
        return bridged

    return bridge


def _gating(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bridged(self: Any, input: torch.Tensor) -> torch.Tensor:
        if self.weight.device.type == "cuda":
            return original(self, input)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)

    bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    return bridged


def _on_run_device(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bridged(*args: Any, **kwargs: Any) -> Any:
        with _current_device_is(_RUN_DEVICE):
            return original(*args, **kwargs)

    bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    return bridged


class _WithoutSequenceParallel:
    """A TransformerConfig as the norm's constructor reads it, with ``sequence_parallel`` off."""

    sequence_parallel = False

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _norm_new(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bridged(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        norm = original(cls, _WithoutSequenceParallel(config), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

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
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
        from megatron.core.transformer.moe.router import Router

        RotaryEmbedding.get_emb = _on_device_of("inv_freq")(RotaryEmbedding.get_emb)
        mcore_utils.GlobalMemoryBuffer.get_tensor = _on_run_device(mcore_utils.GlobalMemoryBuffer.get_tensor)
        Router.gating = _gating(Router.gating)
        RotaryEmbedding.__init__ = _on_run_device(RotaryEmbedding.__init__)
        YarnRotaryEmbedding.__init__ = _on_run_device(YarnRotaryEmbedding.__init__)
        YarnRotaryEmbedding.forward = _on_device_of("inv_freq_extra")(YarnRotaryEmbedding.forward)
        from megatron.core.tensor_parallel import layers as mcore_layers
        from megatron.core.tensor_parallel import mappings

        for name in ("_gather_along_first_dim", "_gather_along_last_dim", "_reduce_scatter_along_first_dim"):
            setattr(mappings, name, _on_run_device(getattr(mappings, name)))
        linear = mcore_layers.LinearWithGradAccumulationAndAsyncCommunication
        linear.backward = staticmethod(_on_run_device(linear.backward))
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        WrappedTorchNorm.__new__ = staticmethod(_norm_new(WrappedTorchNorm.__new__))  # type: ignore[assignment]
        from megatron.core.transformer import multi_latent_attention

        if not isinstance(multi_latent_attention.TELinear, type):
            multi_latent_attention.HAVE_TE = False
        _INSTALLED = True
    if device.type == "cpu":
        mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
