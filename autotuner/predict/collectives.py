"""A collective's time on a cluster (autotuner.predict.cluster), from where its group's ranks lie.

**Where a group lies.** Megatron-Core numbers the ranks tp fastest, then cp, ep, dp, pp (its default
``order="tp-cp-ep-dp-pp"``; the experts' own grid, at expert_tensor_parallel_size 1, puts ep fastest), so
a group is ``size`` ranks ``stride`` apart (:func:`megatron_groups`): tp consecutive (stride 1), cp tp apart,
the data-parallel group with context parallelism ``dp*cp`` ranks tp apart, pp ``tp*cp*dp`` apart.
With ``gpus_per_node`` GPUs a node, the group holding rank 0 has ``k`` ranks in each of ``N`` nodes
(:func:`span`; the fullest node's count where the stride does not divide the node).

**The formulas** (B: the collective's full buffer in bytes: the all-reduced tensor, the gathered output,
the scattered input; for ``all_to_all`` what each rank sends, for ``send_recv`` what one rank sends;
W_i / W_e: what a GPU sends each way inside a node / between nodes; a: a level's ring step latency):

* all_reduce, hierarchical: a reduce-scatter inside each node, an all-reduce of each GPU's 1/k share
  between the nodes (the k GPUs of a node each over its own NIC, in parallel), an all-gather inside:
  ``max(2(k-1)/k * B/W_i, 2(N-1)/N * B/(k*W_e)) + base + 2(k-1) a_i + 2(N-1) a_e``;
* all_gather, reduce_scatter: the same halves, ``max((k-1)/k * B/W_i, (N-1)/N * B/(k*W_e)) + base +
  (k-1) a_i + (N-1) a_e``;
* all_to_all (expert dispatch): of the n = k*N ranks' shares, k-1 go over the node's links and n-k
  through the rank's NIC: ``max((k-1)/n * B/W_i, (n-k)/n * B/W_e) + base + a_i [k > 1] + a_e [N > 1]``;
* send_recv (a pipeline stage's exchange, batched send and receive): ``B/W + base + a``, W and a of the
  level the two ranks share.

Assumptions: the levels are pipelined (NCCL moves chunks through both at once), so the slower sets the
rate; the latency terms are NCCL's ring (Simple protocol) accounting, ``nsteps`` hops each at its
level's latency (src/graph/tuning.cc); every GPU's NIC is its own (rail-optimised) and every group of
the layout runs its collective at once, so no NIC is shared. NCCL's flat ring over the same ranks moves
``2(n-1)/n`` of B through the NICs where this moves ``2(N-1)/N``: up to ``(1-1/n)/(1-1/N)`` slower (1.5 at
2 nodes of 2 ranks, 1.17 at 6 of 8), and in-network reduction (NVLS, SHARP) can be faster; neither is
modelled. Where the cluster file holds a level's measured fit for the collective (calibrate links=true),
that level's bandwidth and latency are the fit's (its latency scaled by the ring's steps from the ranks it
was measured at), else the link's nominal figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from autotuner.predict.cluster import Cluster


@dataclass(frozen=True)
class Group:
    """A process group: ``size`` ranks, ``stride`` apart in the global rank order, named as Megatron does."""

    name: str
    size: int
    stride: int = 1


def megatron_groups(tp: int, cp: int, dp: int, pp: int, ep: int = 1) -> dict[str, Group]:
    """The groups of a layout in Megatron-Core's default rank order (module docstring). ``dp`` is the
    data-parallel size without context parallelism: the gradients are reduced over ``dp * cp`` ranks
    (``dp`` here: Megatron's dp-cp group); ``expert_dp`` the ranks holding the same routed experts."""
    return {
        "tp": Group("tp", tp, 1),
        "cp": Group("cp", cp, tp),
        "dp": Group("dp", dp * cp, tp),
        "pp": Group("pp", pp, tp * cp * dp),
        "ep": Group("ep", ep, 1),
        "expert_dp": Group("expert_dp", tp * cp * dp // ep, ep),
    }


def span(group: Group, gpus_per_node: int) -> tuple[int, int]:
    """(ranks of the group in its fullest node, nodes it spans): the group holding rank 0."""
    nodes = Counter((index * group.stride) // gpus_per_node for index in range(group.size))
    return max(nodes.values()), len(nodes)


@dataclass(frozen=True)
class LevelRate:
    """The bandwidth and the latency of one step at one level for one collective, and how they were had."""

    bandwidth: float
    step_latency: float
    base: float  # what the collective pays once at this level (0 where a fit's latency holds it)
    how: str


def _steps(kind: str, ranks: int) -> int:
    """Ring steps of ``kind`` over ``ranks`` (NCCL's nsteps; one hop for a pairwise exchange)."""
    if ranks <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (ranks - 1)
    if kind in ("all_gather", "reduce_scatter"):
        return ranks - 1
    return 1


def _rate(cluster: Cluster, level: str, kind: str, ranks: int) -> LevelRate:
    fit = cluster.measured.get((level, kind))
    if fit is not None:
        steps = max(1, _steps(kind, fit.ranks))
        return LevelRate(
            fit.bus_bandwidth,
            fit.latency / steps,
            0.0,
            f"{level} {kind} measured over {fit.ranks} ranks: {fit.bus_bandwidth / 1e9:.4g} GB/s bus "
            f"bandwidth, {fit.latency * 1e6:.3g} us latency",
        )
    link = cluster.link(level)
    return LevelRate(
        link.bandwidth,
        link.latency,
        cluster.base_latency,
        f"{level} {link.bandwidth / 1e9:.4g} GB/s, {link.latency * 1e6:.3g} us a step",
    )


def collective_time(cluster: Cluster, kind: str, nbytes: float, group: Group) -> tuple[float, str]:
    """Seconds of one ``kind`` collective of ``nbytes`` over ``group`` on ``cluster`` and the formula with
    its figures (module docstring). One rank or no bytes: 0 s."""
    if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        raise ValueError(f"unknown collective {kind!r}")
    if group.size <= 1 or nbytes <= 0:
        return 0.0, f"{kind} over {group.size} rank(s) of {nbytes:.4g} B: nothing to send"
    n = group.size
    k, nodes = span(group, cluster.gpus_per_node)
    where = (
        f"{group.name} group of {n} ranks {group.stride} apart: {k} a node over {nodes} node"
        f"{'s' if nodes > 1 else ''}"
    )
    intra = _rate(cluster, "intra_node", kind, k) if k > 1 or (kind == "send_recv" and nodes == 1) else None
    inter = _rate(cluster, "inter_node", kind, nodes) if nodes > 1 else None
    if kind == "send_recv":
        rate = inter or intra
        assert rate is not None
        seconds = nbytes / rate.bandwidth + rate.base + rate.step_latency
        return seconds, (
            f"send_recv of {nbytes:.4g} B ({where}): B/W + latency = {nbytes:.4g} B / {rate.how} = "
            f"{seconds * 1e6:.4g} us"
        )
    if kind == "all_to_all":
        terms = [
            ((k - 1) / n * nbytes / intra.bandwidth, f"(k-1)/n * B / W_i [{intra.how}]") if intra else None,
            ((n - k) / n * nbytes / inter.bandwidth, f"(n-k)/n * B / W_e [{inter.how}]") if inter else None,
        ]
        latency = sum(r.step_latency for r in (intra, inter) if r is not None)
    else:
        factor = 2.0 if kind == "all_reduce" else 1.0
        terms = [
            (factor * (k - 1) / k * nbytes / intra.bandwidth, f"{factor:g}(k-1)/k * B / W_i [{intra.how}]")
            if intra
            else None,
            (
                factor * (nodes - 1) / nodes * nbytes / k / inter.bandwidth,
                f"{factor:g}(N-1)/N * B/k / W_e [{inter.how}]",
            )
            if inter
            else None,
        ]
        latency = sum(
            _steps(kind, ranks) * r.step_latency for r, ranks in ((intra, k), (inter, nodes)) if r is not None
        )
    base = max(r.base for r in (intra, inter) if r is not None)
    present = [t for t in terms if t is not None]
    bandwidth_s = max(t[0] for t in present)
    seconds = bandwidth_s + latency + base
    formula = " , ".join(t[1] for t in present)
    slower = "the slower level of " if len(present) > 1 else ""
    return seconds, (
        f"{kind} of {nbytes:.4g} B ({where}): {slower}{formula} = {bandwidth_s * 1e6:.4g} us, + latency "
        f"{(latency + base) * 1e6:.3g} us = {seconds * 1e6:.4g} us"
    )


# What a recorded collective's kind may be called (torch.distributed's functions and our names).
KIND_NAMES: Mapping[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send_recv": "send_recv",
    "batch_isend_irecv": "send_recv",
}
