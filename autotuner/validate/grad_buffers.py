"""The gradients and the optimizer's parameters of the real steps (autotuner.validate.steps), kept as
Megatron's DDP and its optimizers keep them.

Flat buffers: each gradient is a view of one flat buffer (a bucket of Megatron's DDP), the dense
parameters' reduced over the data-parallel group and the experts' (``allreduce=False``) over the
expert-data-parallel group.

The optimizer is ``torch.optim.Adam`` (not Megatron's ``DistributedOptimizer``, which needs Megatron's
DDP wrapper and its grad buffers), kept as Megatron keeps its optimizer. On fp32 parameters: two states
per parameter, the gradients in the flat buffers. On a bf16/fp16 model, Megatron's mixed precision
(Megatron-LM accumulates bf16 gradients in fp32): the flat buffers are fp32 "main gradients", each
parameter's gradient added into its slice by a hook as autograd finishes it and then dropped (Megatron's
DDP backward hook; without gradient-accumulation fusion), and Adam steps fp32 master copies of the
parameters whose gradients are those slices, then the masters are copied into the model (Megatron's
``Float16OptimizerWithFloat16Params``): 18 bytes per parameter held, as the prediction counts them.

The distributed optimizer (``distributed_optimizer``, Megatron's ``DistributedOptimizer``, ZeRO-1): the
parameters live in flat buffers too (the model's parameters are views of them, as in Megatron's DDP),
each buffer padded to a multiple of its group's size; after the backward the gradient buffer is
reduce-scattered over its group instead of all-reduced, so each rank holds the summed gradients of its
1/group share; Adam keeps masters and states for that share alone (fp32: the share of the parameter
buffer itself), steps it, and the parameter buffer is all-gathered from the shares. Held per parameter:
the weights and the full gradient buffer, plus the optimizer's 8 (fp32) or 12 (bf16/fp16) bytes over
the group's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def sequence_parallel_grads(model: Any) -> None:
    """All-reduce over TP the gradients of parameters every TP rank holds whole but sees a sequence slice
    of (the norms under sequence parallelism), as Megatron's finalize_model_grads does."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    for param in model.parameters():
        grad = getattr(param, "main_grad", param.grad)
        if getattr(param, "sequence_parallel", False) and grad is not None:
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())


@dataclass(frozen=True)
class GradBuffer:
    """One flat gradient buffer, reduced over ``group`` after the backward, as a bucket of Megatron's DDP
    is. Its views are the parameters' gradients: their ``.grad`` (autograd accumulates into them in
    place) when the buffer has the parameters' dtype, else (fp32 main gradients of a bf16/fp16 model)
    their ``main_grad``, which a hook adds each finished ``.grad`` into. With the distributed optimizer
    the parameters are views of ``params``, a flat buffer laid out as this one, and both are padded to a
    multiple of the group's size so that each rank owns an equal share (:meth:`share`)."""

    flat: Any  # torch.Tensor
    group: Any  # torch.distributed ProcessGroup
    params: Any = None  # torch.Tensor: the distributed optimizer's flat parameter buffer

    def share(self, tensor: Any) -> Any:
        """This rank's contiguous share of ``tensor`` (this buffer's or ``params``)."""
        size = tensor.numel() // self.group.size()
        return tensor[self.group.rank() * size : (self.group.rank() + 1) * size]


def accumulate_into_main_grad(param: Any) -> None:
    """Megatron's DDP backward hook: the gradient autograd just finished, added into the fp32 main
    gradient, then dropped so that no second copy is held."""
    param.main_grad.add_(param.grad)
    param.grad = None


def grad_buffers(model: Any, main_dtype: Any = None, sharded: bool = False) -> list[GradBuffer]:
    """The dense parameters' buffer (reduced over the data-parallel group) and the expert parameters'
    (``allreduce=False``: reduced over the expert-data-parallel group), each a single bucket, in
    ``main_dtype`` (fp32 main gradients) or else the parameters' dtype; ``sharded`` (the distributed
    optimizer): with the parameters moved into a flat buffer of the same layout, both padded."""
    import torch
    from megatron.core import parallel_state

    params = [p for p in model.parameters() if p.requires_grad]
    kinds = [
        ([p for p in params if getattr(p, "allreduce", True)], parallel_state.get_data_parallel_group()),
        (
            [p for p in params if not getattr(p, "allreduce", True)],
            parallel_state.get_expert_data_parallel_group(),
        ),
    ]
    buffers = []
    for members, group in kinds:
        if not members:
            continue
        dtype = main_dtype or members[0].dtype
        numel = sum(p.numel() for p in members)
        if sharded:
            numel = -(-numel // group.size()) * group.size()
        flat = torch.zeros(numel, dtype=dtype, device=members[0].device)
        flat_params = torch.zeros(numel, dtype=members[0].dtype, device=flat.device) if sharded else None
        offset = 0
        for p in members:
            view = flat[offset : offset + p.numel()].view_as(p)
            if dtype == p.dtype:
                p.grad = view
            else:
                p.main_grad = view
                p.register_post_accumulate_grad_hook(accumulate_into_main_grad)
            if flat_params is not None:
                place = flat_params[offset : offset + p.numel()].view_as(p)
                place.copy_(p.detach())
                p.data = place
            offset += p.numel()
        buffers.append(GradBuffer(flat, group, flat_params))
    return buffers


def master_params(pairs: list[tuple[Any, Any]], mixed: bool) -> list[Any]:
    """What Adam steps, one per (parameter tensor, its gradient) pair: an fp32 copy of the tensor for a
    bf16/fp16 model (Megatron's master weights, copied back after each step), else the tensor itself
    (a Parameter sharing its storage), each with that gradient as ``.grad``."""
    import torch

    masters = []
    for tensor, grad in pairs:
        master = torch.nn.Parameter(tensor.detach().float() if mixed else tensor)
        master.grad = grad
        masters.append(master)
    return masters


def reduce_grads(buffers: list[GradBuffer], dp: int, sharded: bool) -> None:
    """Megatron's default DDP reduction: every gradient scaled by 1/dp (the mean over the global batch;
    an expert's gradient already sums the tokens the dispatcher brought from the other EP ranks), then
    summed over its buffer's group: all-reduced, or with the distributed optimizer reduce-scattered into
    this rank's share (in place, as Megatron does)."""
    import torch.distributed as dist

    for buffer in buffers:
        if dp > 1:
            buffer.flat.mul_(1.0 / dp)
        if buffer.group.size() == 1:
            continue
        if sharded:
            dist.reduce_scatter_tensor(buffer.share(buffer.flat), buffer.flat, group=buffer.group)
        else:
            dist.all_reduce(buffer.flat, group=buffer.group)


def gather_params(buffers: list[GradBuffer]) -> None:
    """The distributed optimizer's last step: every rank's updated share into every rank's parameters."""
    import torch.distributed as dist

    for buffer in buffers:
        if buffer.group.size() > 1:
            dist.all_gather_into_tensor(buffer.params, buffer.share(buffer.params), group=buffer.group)
