"""The links of the machine a job runs on, measured level by level: each collective at a few sizes inside
every node at once, and between the nodes at once (the ranks of one local index across the nodes, each
group over its own GPU's network card), as a training step's groups run them.

Every rank calls :func:`measure_links` with the same arguments. A sample starts after a barrier over the
whole job, and the sampler's decisions are taken by all ranks together (autotuner.measure.timer.
RankAgreement), so every rank calls its group's collective equally often; a size's time is the slowest
rank's median (a collective ends when its last rank does). Bus bandwidth follows nccl-tests (bytes x the
collective's bus factor / time); the fit of time against bytes is autotuner.predict.cluster's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autotuner.measure.timer import DeviceTimer, RankAgreement, SamplingPolicy, sample

LEVEL_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def level_groups(world: int, per_node: int) -> dict[str, list[list[int]]]:
    """{level: its groups' ranks}: inside each node (consecutive ranks, torchrun's numbering), and between
    the nodes (the ranks of one local index); a level of groups of one rank is left out."""
    nodes = world // per_node
    levels = {}
    if per_node > 1:
        levels["intra_node"] = [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
    if nodes > 1:
        levels["inter_node"] = [list(range(local, world, per_node)) for local in range(per_node)]
    return levels


def _call(
    kind: str, nbytes: int, group: Any, ranks: list[int], device: torch.device
) -> tuple[Callable[[], Any], int]:
    """The timed call of one ``kind`` of about ``nbytes`` (the full buffer; for all_to_all and send_recv
    what a rank sends) over ``group``, and its exact bytes. Buffers are allocated once, outside the calls."""
    dist = torch.distributed
    n = len(ranks)
    elements = max(n, nbytes // 4 // n * n)
    full = torch.ones(elements, dtype=torch.float32, device=device)
    shard = torch.ones(elements // n, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), elements * 4
    # torch 2.13 renamed the one-tensor collectives (``*_single``); older torch has only the old names
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(full, shard, group=group)), elements * 4
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(shard, full, group=group)), elements * 4
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full, group=group)), elements * 4
    me = ranks.index(dist.get_rank())
    received = torch.empty_like(full)

    def exchange() -> None:  # to the next rank of the group, from the previous: a pipeline stage's
        ops = [
            dist.P2POp(dist.isend, full, ranks[(me + 1) % n], group=group),
            dist.P2POp(dist.irecv, received, ranks[(me - 1) % n], group=group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    return exchange, elements * 4


def measure_links(
    device: torch.device,
    per_node: int,
    sizes: tuple[int, ...],
    policy: SamplingPolicy,
    kinds: tuple[str, ...],
) -> dict[str, dict[str, dict[str, Any]]]:
    """{level: {kind: {"ranks", "bytes", "seconds"}}} of the job's default group with ``per_node`` ranks a
    node (module docstring); every rank returns the same."""
    dist = torch.distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    agreement = RankAgreement(device)
    timer = DeviceTimer(device, barrier=True)
    measured: dict[str, dict[str, dict[str, Any]]] = {}
    for level, groups in level_groups(world, per_node).items():
        made = [(ranks, dist.new_group(ranks)) for ranks in groups]  # every rank makes every group
        ranks, group = next((r, g) for r, g in made if rank in r)
        measured[level] = {}
        for kind in kinds:
            exact, seconds = [], []
            for nbytes in sizes:
                run, size = _call(kind, nbytes, group, ranks, device)
                timed = sample(timer, run, policy, agreement=agreement)
                exact.append(size)
                seconds.append(agreement.max(timed.median_ns * 1e-9)[0])
            measured[level][kind] = {"ranks": len(ranks), "bytes": exact, "seconds": seconds}
    return measured
