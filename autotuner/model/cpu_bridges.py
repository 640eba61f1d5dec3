"""Bridges that let Megatron-Core run on the CPU, on a machine with or without CUDA.

Megatron-Core assumes CUDA in a few places (checked on 0.16.1 and 0.19.2). Each bridge below names the
code it replaces and says why; nothing else in the project patches Megatron. ``apply(device)`` installs
them once and points them at the run's device, so a CPU run on a GPU machine (``device=cpu``) keeps its
tensors on the CPU, and a CUDA run in the same process afterwards is untouched.

Each bridge, what it replaces and why: docs/model_families.md, "Megatron on a CPU".
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
    torch.cuda.current_device = lambda: device.type  # type: ignore[assignment]  # "cpu" or "meta"
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


@functools.cache  # the module's names are fixed once it is imported; asked on every router call
def _megatron_gating_runs() -> bool:
    """Whether Megatron's ``router_gating_linear`` can run: its module binds ``te_general_gemm``."""
    from megatron.core.transformer.moe import moe_utils

    return "te_general_gemm" in vars(moe_utils)


def _gating(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bridged(self: Any, input: torch.Tensor) -> torch.Tensor:
        if self.weight.device.type == "cuda" and _megatron_gating_runs():
            return original(self, input)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)

    bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    return bridged


def _on_run_device(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.cuda.current_device()`` is the run's device inside ``original``, or meta where a tensor it
    is given is (the dry run's and the memory estimate's phases on meta tensors)."""

    @functools.wraps(original)
    def bridged(*args: Any, **kwargs: Any) -> Any:
        on_meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values()))
        with _current_device_is(torch.device("meta") if on_meta else _RUN_DEVICE):
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


@contextlib.contextmanager
def _synchronize_is_noop(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":  # a real stream to wait for
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize = original


def _p2p_on_run_device(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bridged(*args: Any, **kwargs: Any) -> Any:
        with _current_device_is(_RUN_DEVICE), _synchronize_is_noop(_RUN_DEVICE):
            return original(*args, **kwargs)

    bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    return bridged


class _TorchWithCudaZerosOnRunDevice:
    """The ``torch`` module as a schedule sees it during a call (bridge 10): ``zeros(..., device="cuda")``
    lands on the run's device; every other name is torch's own."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def zeros(self, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = self._device
        return torch.zeros(*args, device=device, **kwargs)


def _schedule_on_run_device(module: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bridged(*args: Any, **kwargs: Any) -> Any:
        if _RUN_DEVICE.type == "cuda":
            return original(*args, **kwargs)
        module.torch = _TorchWithCudaZerosOnRunDevice(_RUN_DEVICE)
        try:
            return original(*args, **kwargs)
        finally:
            module.torch = torch

    bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    return bridged


def _rng_states_without_cuda(random: Any, get_all: Callable[..., Any], set_all: Callable[..., Any]) -> None:
    """Bridge 12: ``random._get_all_rng_states``/``_set_all_rng_states`` without the CUDA generator for a
    CPU run (None stands in its place in the saved triple)."""

    @functools.wraps(get_all)
    def get_states() -> tuple[Any, Any, Any]:
        if _RUN_DEVICE.type == "cuda":
            return get_all()
        return torch.get_rng_state(), None, random.get_cuda_rng_tracker().get_states()

    @functools.wraps(set_all)
    def set_states(cpu_state: Any, cuda_state: Any, tracker_states: Any) -> None:
        if cuda_state is not None:
            set_all(cpu_state, cuda_state, tracker_states)
            return
        torch.set_rng_state(cpu_state)
        random.get_cuda_rng_tracker().set_states(tracker_states)

    for bridged in (get_states, set_states):
        bridged.__autotuner_cpu_bridge__ = True  # type: ignore[attr-defined]
    random._get_all_rng_states = get_states
    random._set_all_rng_states = set_states


def _sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """``megatron.core.transformer.utils.get_sliding_window_causal_mask`` on the run's device: True where a
    query may not see a key (more than window_size[0] before it, or window_size[1] after)."""
    seen = torch.ones(sq, skv, dtype=torch.bool, device=_RUN_DEVICE)
    seen = torch.triu(seen, diagonal=skv - sq - window_size[0])
    return ~torch.tril(seen, diagonal=skv - sq + window_size[1])


def apply(device: torch.device) -> None:
    """Install the bridges (once) and aim them at ``device``; a CPU run also gets the no-op RNG tracker."""
    global _INSTALLED, _RUN_DEVICE
    _RUN_DEVICE = device
    from megatron.core.tensor_parallel import random as mcore_random

    if not _INSTALLED:
        from megatron.core import utils as mcore_utils
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
        from megatron.core.transformer.moe.router import Router, TopKRouter

        RotaryEmbedding.get_emb = _on_device_of("inv_freq")(RotaryEmbedding.get_emb)
        mcore_utils.GlobalMemoryBuffer.get_tensor = _on_run_device(mcore_utils.GlobalMemoryBuffer.get_tensor)
        Router.gating = _gating(Router.gating)
        TopKRouter.__init__ = _on_run_device(TopKRouter.__init__)
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
        from megatron.core.pipeline_parallel import p2p_communication, schedules

        # get_forward_backward_func returns these by their module names, so it hands out the bridged ones
        for name in (
            "forward_backward_no_pipelining",
            "forward_backward_pipelining_without_interleaving",
            "forward_backward_pipelining_with_interleaving",
        ):
            setattr(schedules, name, _schedule_on_run_device(schedules, getattr(schedules, name)))
        from megatron.core.fusions import fused_softmax

        fused_softmax.get_sliding_window_causal_mask = _sliding_window_mask
        communicator = p2p_communication.P2PCommunicator
        communicator._communicate = _p2p_on_run_device(communicator._communicate)
        communicator._communicate_shapes = _p2p_on_run_device(communicator._communicate_shapes)
        _rng_states_without_cuda(
            mcore_random, mcore_random._get_all_rng_states, mcore_random._set_all_rng_states
        )
        _INSTALLED = True
    if device.type == "cpu":
        mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
