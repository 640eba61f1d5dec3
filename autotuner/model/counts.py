"""Parameter counts of the Megatron model a run builds, read off the model itself built on the meta device
(shapes and dtypes, no storage): never a formula beside it, so every family's pieces count as built.

Active parameters are those one token's forward pass uses (the embedding and output matrices whole, the
convention of published figures): a Mixture-of-Experts layer's router sends a token to top-k of its
routed experts, so the others do not count; shared experts and the router do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

META = torch.device("meta")


@dataclass(frozen=True)
class LayerCount:
    """One TransformerLayer of a kind (dense or MoE): its parameters, those one token uses, those of its
    routed experts (all of them), and the parameter tensors (what an unfused optimizer loops over)."""

    parameters: int
    active: int
    routed_experts: int = 0
    tensors: int = 0
    routed_expert_tensors: int = 0


@dataclass(frozen=True)
class ParameterCount:
    """The whole model's parameters by part. ``layers``: each layer's kind (True: MoE), in order."""

    embedding: int
    output_layer: int  # 0 where tied to the embedding
    final_norm: int
    final_norm_tensors: int
    dense_layer: LayerCount | None
    moe_layer: LayerCount | None
    layers: tuple[bool, ...]

    def layer(self, moe: bool) -> LayerCount:
        found = self.moe_layer if moe else self.dense_layer
        assert found is not None, "no layer of that kind in this model"
        return found

    def _with_layers(self, of_layer: str) -> int:
        ends = self.embedding + self.output_layer + self.final_norm
        return ends + sum(getattr(self.layer(moe), of_layer) for moe in self.layers)

    @property
    def total(self) -> int:
        return self._with_layers("parameters")

    @property
    def active(self) -> int:
        """One token's: the routed experts it is not sent to left out."""
        return self._with_layers("active")


def routed_experts(module: torch.nn.Module) -> tuple[torch.nn.Module, int, int] | None:
    """(the routed experts, how many, how many a token uses) of an MoE layer; None for any other module.

    Megatron-Core's ``MoELayer`` holds its routed experts in ``experts`` (``num_local_experts`` of them)
    and its router's ``topk``."""
    experts, router = getattr(module, "experts", None), getattr(module, "router", None)
    if experts is None or router is None or not hasattr(experts, "num_local_experts"):
        return None
    return experts, int(experts.num_local_experts), int(router.topk)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied weight once


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token's forward pass uses: all, less the routed experts it is not sent to."""
    total = _numel(model)
    for module in model.modules():
        found = routed_experts(module)
        if found is not None:
            experts, count, topk = found
            total -= _numel(experts) // count * (count - topk)
    return total


def _layer_count(layer: torch.nn.Module) -> LayerCount:
    found = next((routed_experts(m) for m in layer.modules() if routed_experts(m) is not None), None)
    experts = found[0] if found else None
    return LayerCount(
        parameters=_numel(layer),
        active=active_parameters(layer),
        routed_experts=_numel(experts) if experts is not None else 0,
        tensors=len(list(layer.parameters())),
        routed_expert_tensors=len(list(experts.parameters())) if experts is not None else 0,
    )


@contextlib.contextmanager
def meta_session(emulation: Any = None, sizes: tuple[int, int, int | None] = (1, 1, None)) -> Iterator[Any]:
    """What building and running Megatron's modules on meta tensors needs, undone afterwards: its
    parallel state (a one-process group, as a CPU run has; with ``emulation``, an
    autotuner.model.emulation.Emulation, that rank of its layout; under torchrun the job's groups of
    ``sizes``, TP, EP and ETP; one it started it ends), the no-op RNG tracker, and a scratch
    buffer (core attention's) that hands out meta tensors, yielded (what each phase asks of it:
    ``take_asked``). The buffer is a fresh one, put back afterwards: the cached one would keep the meta
    tensors, and a later real run in this process would be handed them.
    So is the MoE auxiliary loss's backward scale, which Megatron makes on the first backward through a
    router, on the device of that backward's loss, and keeps for the process: made on meta, it failed
    every later real backward through a router ("Cannot copy out of meta tensor")."""
    from megatron.core import parallel_state
    from megatron.core import utils as mcore_utils
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from autotuner.model import cpu_bridges
    from autotuner.model.runtime import end_model_parallel, init_parallel

    class MetaBuffer(mcore_utils.GlobalMemoryBuffer):
        """As Megatron's: one buffer per (name, dtype), the largest asked for, kept for the process (the
        attention scores' input); made outside any dispatch mode, so a phase's tracker sees it as a run
        sees it, made before (autotuner.runner.memory_estimate: the ``score_buffer`` term)."""

        def __init__(self) -> None:
            super().__init__()
            self.asked: dict[tuple[str, torch.dtype], int] = {}  # since the last take_asked

        def get_tensor(self, tensor_shape: Any, dtype: torch.dtype, name: str, *args: Any, **kw: Any) -> Any:
            from torch.utils._python_dispatch import _disable_current_modes

            numel = int(torch.Size(tensor_shape).numel())
            self.asked[(name, dtype)] = max(self.asked.get((name, dtype), 0), numel * dtype.itemsize)
            held = self.buffer.get((name, dtype))
            if held is None or held.numel() < numel:
                with _disable_current_modes():
                    self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device=META)
            return self.buffer[(name, dtype)][:numel].view(*tensor_shape)

        def take_asked(self) -> int:
            """The bytes asked for since the last call: the buffer a phase needs."""
            asked, self.asked = sum(self.asked.values()), {}
            return asked

    cpu_bridges.apply(torch.device("cpu"))  # the no-op RNG tracker; a real run applies its own again
    started = not parallel_state.model_parallel_is_initialized()  # by this session: ended with it
    if emulation is not None:
        from autotuner.model import emulation as emulated

        emulated.start(emulation)
    else:
        init_parallel(torch.device("cpu"), *sizes)
    saved_buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    saved_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    buffer = MetaBuffer()
    parallel_state._GLOBAL_MEMORY_BUFFER = buffer
    try:
        yield buffer
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = saved_buffer
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved_scale
        if started and emulation is None:  # else the run's own start (torchrun's TP) would find it made
            end_model_parallel()


def build_meta_model(model_args: Any, tf_config: Any, parts: Any) -> Any:
    """The GPTModel of ``parts`` on the meta device, built by autotuner.model.build.build_model (inside
    :func:`meta_session`)."""
    from autotuner.model.build import build_model

    config = dataclasses.replace(tf_config, use_cpu_initialization=True, perform_initialization=False)
    with torch.device(META):
        model = build_model(model_args, config, parts, META, use_transformer_engine=False)
    # Multi-Latent Attention makes its own rotary table from frequencies its embedding keeps on the host
    # (plain attributes, which no default device or .to() moves): on meta, as the activations they meet.
    for module in model.modules():
        if any(cls.__name__ == "MultiLatentAttention" for cls in type(module).__mro__):
            rotary = module.rotary_pos_emb
            for name, value in list(vars(rotary).items()):
                if isinstance(value, torch.Tensor) and name.startswith("inv_freq"):
                    setattr(rotary, name, value.to(META))
    return model


def count_parameters(model_args: Any, tf_config: Any) -> ParameterCount:
    """The parameters of the whole model, from its first layers of each kind, its embedding, final norm
    and output layer built on meta (the layers of a kind are alike)."""
    from autotuner.model.build import ModelParts, moe_layer_pattern

    pattern = tuple(moe_layer_pattern(tf_config))
    depth = max(pattern.index(kind) + 1 for kind in set(pattern))
    with meta_session():
        model = build_meta_model(
            model_args, tf_config, ModelParts(depth, pre_process=True, post_process=True)
        )
    layers = list(model.decoder.layers)
    first = {kind: _layer_count(layers[pattern.index(kind)]) for kind in set(pattern)}
    norm = model.decoder.final_layernorm
    output = 0 if model_args.tie_word_embeddings else _numel(model.output_layer)
    return ParameterCount(
        embedding=_numel(model.embedding),
        output_layer=output,
        final_norm=_numel(norm),
        final_norm_tensors=len(list(norm.parameters())),
        dense_layer=first.get(False),
        moe_layer=first.get(True),
        layers=pattern,
    )
