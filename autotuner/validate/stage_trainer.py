"""One rank's share of a layout's real training steps, built as Megatron-Core builds it: the whole
``GPTModel`` of a case placed on this rank (its pipeline stage, its model chunks), the fixed batch, the
gradient buffers and the optimizer, and each phase of a step as a method (:class:`StageTrainer`).
autotuner.validate.steps times them (the measured side of ``autotuner-validate``);
``benchmarks.row_in_step`` times the model's layers between them.

Data parallelism: the global batch is ``dp`` times a rank's micro-batches; data-parallel rank r takes the
r-th share of them, and the gradients are scaled by 1/dp before the summing all-reduce (Megatron's
gradient_scaling_factor), so dp=2 trains exactly what dp=1 trains on the same global batch. Expert
parallelism (``ep``): Megatron's MoE layer with its experts split over ``ep`` ranks (their parameters
are marked ``allreduce=False``), the tokens exchanged by its dispatcher.

The optimizer is ``torch.optim.Adam`` over gradients and parameters kept as Megatron's DDP, its mixed
precision and its distributed optimizer keep them (autotuner.validate.grad_buffers).

Weights: seeded as every run of the project is (autotuner.model.runtime.seed_everything with the
config's ``seed``), built by autotuner.model.build.build_model. A pipeline stage holds exactly the
weights of the same layers of the single-process model: each rank builds that whole model from the seed
first and copies its stage's parameters from it (a stage built alone would draw its layers' weights from
the start of the random stream); with ``vpp`` model chunks per rank, chunk k of rank r holds the layers
Megatron places there (``get_transformer_layer_offset``). So PP=2 computes the same function as PP=1, and
its loss can be checked against it. The interleaved schedule runs as Megatron-LM runs it (pp
micro-batches per chunk in turn, its exchange overlapped and unbatched): with pp=2 a rank's previous and
next stage are the same rank, and the batched exchange gloo offers then gave different losses (3e-4 at
the first step) where the unbatched one, each direction on its own communicator, gives PP=1's. The batch
is fixed: random tokens from a generator seeded with ``seed``, the labels the next token, an explicit
causal mask.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from autotuner.errors import UserError
from autotuner.predict.layout import Layout
from autotuner.validate.grad_buffers import (
    gather_params,
    grad_buffers,
    master_params,
    reduce_grads,
    sequence_parallel_grads,
)
from autotuner.validate.in_step import ModuleClock

OPTIMIZER = "torch.optim.Adam"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _recompute_overrides(recompute: str) -> list[str]:
    if recompute == "selective":
        return ["tf.recompute_granularity=selective"]
    if recompute == "full":  # every layer re-runs its forward in the backward (Megatron's uniform method)
        return ["tf.recompute_granularity=full", "tf.recompute_method=uniform", "tf.recompute_num_layers=1"]
    return []


def _config_overrides(case: str, overrides: list[str], layout: Layout) -> list[str]:
    """The project's config overrides for this case and layout (the whole model, PP=1: the stage config
    is derived from it)."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+")
        if key in (
            "dtype",
            "tf.tensor_model_parallel_size",
            "tf.pipeline_model_parallel_size",
            "tf.sequence_parallel",
            "tf.expert_model_parallel_size",
        ):
            raise UserError(
                f"{override!r} is set by the layout: give layout.dtype, layout.tp, layout.pp, layout.ep or "
                "layout.sequence_parallel instead"
            )
    return [
        f"case={case}",
        *overrides,
        f"dtype={layout.dtype}",
        f"tf.tensor_model_parallel_size={layout.tp}",
        *([f"tf.expert_model_parallel_size={layout.ep}"] if layout.ep > 1 else []),
        *(["tf.sequence_parallel=true"] if layout.sequence_parallel else []),
        *_recompute_overrides(layout.recompute),
        f"shapes.seq_len=[{layout.seq_len}]",
        f"shapes.micro_batch_size=[{layout.micro_batch_size}]",
    ]


def _stage_model(spec: Any, layout: Layout, device: Any) -> list[Any]:
    """This rank's model chunks (one, or ``vpp`` for the interleaved schedule) of the GPTModel, with the
    single-process model's weights (see the module doc)."""
    import dataclasses

    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from autotuner.model.build import ModelParts, build_model
    from autotuner.model.runtime import DTYPES, seed_everything

    args, config = spec.model_args, spec.tf_config
    whole = ModelParts(num_layers=config.num_layers, pre_process=True, post_process=True)
    seed_everything(spec.seed, device)
    model = build_model(args, config, whole, device, spec.use_transformer_engine, spec.attention)
    if layout.pp == 1:
        return [model]
    vpp = layout.vpp if layout.vpp > 1 else None
    stage_config = dataclasses.replace(
        config,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        # Megatron-LM's defaults for the interleaved schedule: pp micro-batches on a chunk before the next,
        # and the exchange overlapped with compute, unbatched (each direction on its own communicator: with
        # pp=2 both neighbours are one rank, and a batched exchange could match an activation with a gradient)
        microbatch_group_size_per_vp_stage=layout.pp if vpp else None,
        overlap_p2p_comm=bool(vpp),
        batch_p2p_comm=not vpp,
        pipeline_dtype=DTYPES[spec.dtype],
    )
    source = dict(model.named_parameters())
    chunks = []
    for vp_stage in range(layout.vpp) if vpp else [None]:
        stage = ModelParts(
            num_layers=config.num_layers,  # the whole model's: Megatron builds this chunk's share of them
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        part = build_model(args, stage_config, stage, device, spec.use_transformer_engine, spec.attention)
        offset = get_transformer_layer_offset(stage_config, vp_stage=vp_stage)
        with torch.no_grad():
            for name, param in part.named_parameters():
                param.copy_(source[_whole_name(name, offset)])
        chunks.append(part)
    del model, source
    return chunks


def _whole_name(name: str, offset: int) -> str:
    """A chunk's parameter name in the whole model: its layers are the whole model's from ``offset``."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _batches(spec: Any, layout: Layout, device: Any, dp_rank: int) -> list[dict[str, Any]]:
    """This data-parallel rank's share of the global batch, as micro-batches: seeded random tokens (the
    same global batch for every layout), next-token labels, a causal mask."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed)
    s, b, m = layout.seq_len, layout.micro_batch_size, layout.microbatches
    tokens = torch.randint(spec.model_args.vocab_size, (m * layout.dp, b, s + 1), generator=generator)
    tokens = tokens[dp_rank * m : (dp_rank + 1) * m]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    positions = torch.arange(s, device=device).expand(b, s)
    return [
        {
            "input_ids": t[:, :-1].to(device),
            "labels": t[:, 1:].to(device),
            "position_ids": positions,
            "mask": mask,
        }
        for t in tokens
    ]


def _forward_step(data: Iterator[dict[str, Any]], model: Any) -> tuple[Any, Callable[[Any], Any]]:
    batch = next(data)
    losses = model(batch["input_ids"], batch["position_ids"], batch["mask"], labels=batch["labels"])

    def loss_func(per_token: Any) -> tuple[Any, dict[str, Any]]:
        # the legacy two-value form: the schedule divides the loss by the number of micro-batches
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides ``loss`` in place

    return losses, loss_func


class StageTrainer:
    """One rank's share of the layout's real training steps: the case's model built and placed as
    Megatron places it (its stage, its chunks), the fixed batch, the flat gradient buffers, the optimizer,
    and each phase of a step as a method, in the order a step calls them (autotuner.validate.steps):
    :meth:`forward_backward`, :meth:`reduce`, :meth:`optimizer_step`, then with the distributed optimizer
    :meth:`gather_params`. autotuner.validate.steps.measure_steps times them; ``benchmarks.row_in_step``
    times the model's layers between them. Under torchrun every rank builds its own."""

    def __init__(
        self, case: str, overrides: list[str] | tuple[str, ...], layout: Layout, lr: float = 1e-3
    ) -> None:
        import torch
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from autotuner.config import compose_config
        from autotuner.model import cpu_bridges
        from autotuner.model.host_heap import keep_freed_memory
        from autotuner.model.runtime import init_parallel
        from autotuner.runner.spec import resolve_spec

        self.spec = spec = resolve_spec(compose_config(_config_overrides(case, list(overrides), layout)))
        self.layout = layout
        config = spec.tf_config
        layout.check(
            config.num_layers, config.num_attention_heads, config.num_query_groups, config.num_moe_experts
        )
        if spec.world != layout.gpus:
            raise UserError(
                f"layout tp={layout.tp} pp={layout.pp} dp={layout.dp} needs {layout.gpus} processes, this "
                f"job has {spec.world}: run it with torchrun --nproc-per-node={layout.gpus}"
            )
        self.device = device = spec.device
        if spec.threads:
            torch.set_num_threads(spec.threads)
        keep_freed_memory(device)  # as the profiling processes keep theirs (autotuner.model.host_heap)
        cpu_bridges.apply(device)
        init_parallel(
            device,
            layout.tp,
            config.expert_model_parallel_size,
            config.expert_tensor_parallel_size,
            pipeline_parallel=layout.pp,
            virtual_pipeline=layout.vpp if layout.vpp > 1 else None,
        )
        if parallel_state.get_pipeline_model_parallel_world_size() != layout.pp:
            raise UserError(
                "Megatron's parallel state in this process was set up for another layout: "
                f"measure pp={layout.pp} in a fresh process (python -m autotuner.validate.steps_main)"
            )
        self.chunks = chunks = _stage_model(spec, layout, device)
        # every chunk's parameters, for the gradients and the optimizer
        self.model = model = torch.nn.ModuleList(chunks)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.batches = _batches(spec, layout, device, self.dp_rank)
        self.params = params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = mixed = params[0].dtype != torch.float32  # bf16/fp16: fp32 main grads and masters
        self.sharded = sharded = layout.distributed_optimizer
        self.buffers = buffers = grad_buffers(model, torch.float32 if mixed else None, sharded)
        # the ops' times inside the steps; not with recompute, whose re-run forward fires the hooks twice.
        # After the buffers: a backward timed to a parameter's accumulation holds its main-gradient add.
        self.clock = ModuleClock(chunks, device) if layout.recompute == "none" else None
        # what Adam updates, with its gradient: the distributed optimizer's share of each flat buffer,
        # else each parameter (through an fp32 master in bf16/fp16; fp32 parameters carry their .grad)
        if sharded:
            self.pairs = [(buffer.share(buffer.params), buffer.share(buffer.flat)) for buffer in buffers]
        else:
            self.pairs = [(p, p.main_grad) for p in params] if mixed else []
        self.masters = master_params(self.pairs, mixed) if self.pairs else params
        self.optimizer = torch.optim.Adam(self.masters, lr=lr)
        self.schedule = get_forward_backward_func()

    def sync(self) -> None:
        """Wait for the device (a GPU's queued kernels) before a time is read."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize()

    def forward_backward(self) -> list[dict[str, Any]]:
        """This rank's micro-batches through Megatron-Core's schedule: forward, loss, backward."""
        chunks, layout = self.chunks, self.layout
        return self.schedule(
            forward_step_func=_forward_step,
            # the interleaved schedule takes a list of chunks and one data iterator per chunk
            data_iterator=[iter(self.batches) for _ in chunks] if len(chunks) > 1 else iter(self.batches),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=layout.microbatches,
            seq_length=layout.seq_len,
            micro_batch_size=layout.micro_batch_size,
            forward_only=False,
        )

    def reduce(self) -> None:
        """The gradients summed over their groups (sequence-parallel ones over TP; the buffers over DP)."""
        if self.layout.sequence_parallel:
            sequence_parallel_grads(self.model)
        reduce_grads(self.buffers, self.layout.dp, self.sharded)

    def optimizer_step(self) -> None:
        """Adam's step (and the masters into the model's bf16/fp16 tensors), then the gradients zeroed."""
        import torch

        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for (tensor, _), master in zip(self.pairs, self.masters, strict=True):
                    tensor.copy_(master)
        self.zero_gradients()

    def zero_gradients(self) -> None:
        """The gradient buffers zeroed for the next step; they stay allocated (Megatron's DDP buffer)."""
        for buffer in self.buffers:
            buffer.flat.zero_()

    def gather_params(self) -> None:
        """The distributed optimizer's last step: every rank's updated share into every rank's parameters."""
        if self.sharded:
            gather_params(self.buffers)

    def resident_bytes(self) -> int:
        """What the steps hold between them: parameters, masters, gradient buffers, Adam's states."""
        import torch

        from autotuner.measure.memory import weight_bytes

        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        grads = [buffer.flat for buffer in self.buffers]
        return weight_bytes([*self.params, *self.masters, *grads, *state])  # each storage counted once


def flush_inside_layers(chunks: list[Any], device: Any) -> None:
    """Evict the last-level cache inside every layer's forward and backward (hooks on its MLP, so inside
    the span autotuner.validate.in_step times as the layer's): what runs between the ops, the host work,
    then finds the caches as a model whose ops sweep more than the cache leaves them. The calibration's
    flushed host work (autotuner.calibrate.host_work) is timed so; the flushes add to the layers' times,
    which that calibration does not read."""
    from autotuner.measure.cache import CacheFlusher

    flush = CacheFlusher(device)
    for chunk in chunks:
        for layer in getattr(chunk, "module", chunk).decoder.layers:
            layer.mlp.register_forward_hook(lambda *_: flush())
            layer.mlp.register_full_backward_hook(lambda *_: flush())
