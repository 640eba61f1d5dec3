"""Run by tests/test_moe_parallel.py under torchrun (2 processes): case=tiny_moe with expert parallelism 2
(and TP as given, with sequence parallelism where TP is 2), the MoE layer's forward on this rank's slice
of one token set, saved on rank 0 with everything an EP=1 layer needs to recompute it.

Rank r feeds the tokens ``inputs[r * n : (r + 1) * n]`` along the sequence (a data-parallel rank's own
tokens under TP=1, its sequence-parallel slice under TP=2); the layer's dispatcher all-gathers the tokens
of both ranks, each rank's experts take their share, and the combine hands each rank its own tokens back.
Rank 0 saves: ``inputs`` (the whole token set), ``outputs`` (the ranks' outputs put together in rank order),
``router`` (the router's weight, the same on every rank) and ``experts`` (every global expert's parameters,
gathered from the rank that holds it, keyed ``<global expert>.<parameter name>``).
Usage: torchrun --nproc-per-node=2 tests/ep_reference.py OUT TP
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from autotuner.config import compose_config
from autotuner.runner.spec import open_session, resolve_spec

SEQ, BATCH = 16, 2


def main(out: str, tp: int) -> None:
    overrides = ["case=tiny_moe", "device=cpu", "ops=[moe_layer]", "tf.expert_model_parallel_size=2"]
    if tp > 1:
        overrides += [f"tf.tensor_model_parallel_size={tp}", "tf.sequence_parallel=true"]
    spec = resolve_spec(compose_config(overrides))
    _, ctx = open_session(spec)
    from megatron.core import parallel_state

    mlp = ctx.layer.mlp
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = torch.randn((SEQ, BATCH, spec.tf_config.hidden_size), generator=torch.Generator().manual_seed(7))
    part = SEQ // world
    with torch.no_grad():
        output, _ = mlp(inputs[rank * part : (rank + 1) * part].clone())
    outputs = [torch.empty_like(output) for _ in range(world)]
    dist.all_gather(outputs, output.contiguous())

    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_rank, ep = parallel_state.get_expert_model_parallel_rank(), dist.get_world_size(ep_group)
    assert ep_rank == rank and ep == world, "this script assumes the EP group is the whole job"
    local = list(mlp.experts.local_experts)
    experts = {}
    for index, expert in enumerate(local):
        for name, param in expert.named_parameters():
            gathered = [torch.empty_like(param) for _ in range(ep)]
            dist.all_gather(gathered, param.detach().contiguous(), group=ep_group)
            for holder, value in enumerate(gathered):
                experts[f"{holder * len(local) + index}.{name}"] = value
    if rank == 0:
        torch.save(
            {
                "inputs": inputs,
                "outputs": torch.cat(outputs, dim=0),
                "router": mlp.router.weight.detach().clone(),
                "experts": experts,
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
