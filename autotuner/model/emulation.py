"""One rank of a tensor- and expert-parallel layout in one process, and the collectives it issues.

Without torchrun, a layout with TP or EP above 1 runs as one of its ranks: torch.distributed is started
with this module's ``emulated`` backend (a Python process group over torch's ``FakeStore``) at the
layout's world size and the chosen rank, and Megatron's parallel state over it, so every module built is
Megatron's own shard of that rank: its shapes, FLOPs, weights and saved activations are the real rank's.

The backend runs no collective. Each one it is handed is recorded, while :func:`recording` is open, as
``{"kind", "bytes", "group"}`` (kind: autotuner.predict.collectives' names; bytes: the full buffer, as
the cluster model prices it: the all-reduced tensor, the gathered output, the scattered input, what a
rank sends in an all-to-all; group: Megatron's name of the process group). Hooking the backend, not
torch.distributed's functions, sees every call whatever alias Megatron holds (it binds
``all_gather_into_tensor`` at import), and costs nothing between collectives.

What a collective leaves in its output: what the real one would if every rank of the group held this
rank's data (a gather repeats this rank's part; an all-to-all hands back this rank's own share from every
peer), and for a reduction this rank's part alone (an all-reduce leaves its tensor as it is; a
reduce-scatter keeps its own chunk). Where all ranks do hold the same data (forced routing, or expert
parallelism without sequence sharding), the MoE dispatcher's token counts are the real rank's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autotuner.errors import UserError

BACKEND = "emulated"


@dataclass(frozen=True)
class Emulation:
    """The layout one process stands for: TP, EP, the experts' TP (ETP), sequence parallelism, the
    world size it needs (the least that holds TP and EP x ETP, as Megatron makes the rest data-parallel)
    and the rank it is."""

    tp: int
    ep: int
    etp: int
    sequence_parallel: bool
    rank: int = 0

    @property
    def world(self) -> int:
        return math.lcm(self.tp, self.ep * self.etp)

    def tp_rank(self, rank: int) -> int:
        """The TP rank of global ``rank`` (Megatron's order: TP fastest)."""
        return rank % self.tp

    def ep_rank(self, rank: int) -> int:
        """The EP rank of global ``rank`` (Megatron's experts' grid: ETP fastest, then EP)."""
        return (rank // self.etp) % self.ep

    def local_experts(self, num_experts: int, rank: int) -> range:
        """The routed experts global ``rank`` holds (Megatron: a contiguous block per EP rank)."""
        per_rank = num_experts // self.ep
        return range(self.ep_rank(rank) * per_rank, (self.ep_rank(rank) + 1) * per_rank)

    def describe(self) -> str:
        """The layout as the rows' ``emulated_layout`` column holds it."""
        sp = "true" if self.sequence_parallel else "false"
        return f"tp={self.tp} ep={self.ep} etp={self.etp} sp={sp} world={self.world}"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world": self.world,
            "tp": self.tp,
            "ep": self.ep,
            "etp": self.etp,
            "sequence_parallel": self.sequence_parallel,
        }


def check_rank(rank: Any, world: int, layout: str) -> int:
    """``parallel.rank`` as an int in ``[0, world)``; UserError (one line) otherwise."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise UserError(
            f"parallel.rank={rank!r} is not a rank of the emulated layout {layout}: give 0 <= rank < {world}"
        )
    return rank


# --- the backend -----------------------------------------------------------------------------------

_log: list[dict[str, Any]] | None = None  # the collectives of the open recording (None: not recording)
# id(process group), and its ranks, -> Megatron's name of it: filled by start(), then by _name_of
_names: dict[Any, str] = {}


def _name_of(group: EmulatedGroup) -> str:
    """Megatron's name of ``group``: its own where :func:`start` named it, else that of the named group
    over the same ranks (the aux loss's TP x CP group at CP 1 holds the TP group's ranks), else its ranks."""
    if id(group) not in _names:
        ranks = tuple(torch.distributed.get_process_group_ranks(group))
        _names[id(group)] = _names.get(ranks, f"ranks{list(ranks)}")
    return _names[id(group)]


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


class EmulatedGroup(torch.distributed.ProcessGroup):
    """A process group of the emulated layout: every collective recorded, none run (module docstring)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size

    def _record(self, kind: str, nbytes: int) -> Any:
        if _log is not None:
            _log.append({"kind": kind, "bytes": int(nbytes), "group": _name_of(self)})
        return _done()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("all_reduce", _nbytes(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("all_reduce", _nbytes(tensors))

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        with torch.no_grad():
            for out, inp in zip(outputs, inputs, strict=True):
                for part in out:
                    part.copy_(inp)
        return self._record("all_gather", _nbytes(outputs))

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        with torch.no_grad():
            output.view(self._size, *inp.shape).copy_(inp.unsqueeze(0).expand(self._size, *inp.shape))
        return self._record("all_gather", _nbytes(output))

    _allgather_base = all_gather_single

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        with torch.no_grad():
            for out, parts in zip(outputs, inputs, strict=True):
                out.copy_(parts[self._rank])
        return self._record("reduce_scatter", _nbytes(inputs))

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        with torch.no_grad():
            output.copy_(inp.reshape(self._size, *output.shape)[self._rank])
        return self._record("reduce_scatter", _nbytes(inp))

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(
        self, output: torch.Tensor, inp: torch.Tensor, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        # every peer holds this rank's data: each sends this rank the share this rank's input keeps for it
        n = self._size
        sizes = list(in_splits) if in_splits else [inp.shape[0] // n] * n
        outs = list(out_splits) if out_splits else [output.shape[0] // n] * n
        if all(size == sizes[self._rank] for size in outs):
            start = sum(sizes[: self._rank])
            share = inp[start : start + sizes[self._rank]]
            with torch.no_grad():
                output.copy_(torch.cat([share] * n) if n > 1 else share)
        return self._record("all_to_all", _nbytes(inp))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        with torch.no_grad():
            for out in outputs:
                if out.shape == inputs[self._rank].shape:
                    out.copy_(inputs[self._rank])
        return self._record("all_to_all", _nbytes(inputs))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("broadcast", _nbytes(tensors))

    def barrier(self, opts: Any = None) -> Any:
        return _done()


def _done() -> Any:
    from torch._C._distributed_c10d import _create_work_from_future

    future: torch.futures.Future = torch.futures.Future()
    future.set_result([])
    return _create_work_from_future(future)


def _create(store: Any, rank: int, size: int, timeout: Any) -> EmulatedGroup:
    return EmulatedGroup(rank, size)


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Within the block, the collectives the emulated rank issues, in order, appended to the list yielded."""
    global _log
    outer, _log = _log, []
    try:
        yield _log
    finally:
        _log = outer


# --- starting and stopping -------------------------------------------------------------------------


def _group_names(emulation: Emulation) -> dict[Any, str]:
    """id(group), and its ranks, -> the name autotuner.predict.collectives gives it, for Megatron's groups."""
    from megatron.core import parallel_state as ps

    getters = [
        ("tp", ps.get_tensor_model_parallel_group),
        ("ep", ps.get_expert_model_parallel_group),
        # the experts' TP x EP group (the all-gather dispatcher's): the EP group's ranks at ETP 1
        ("ep" if emulation.etp == 1 else "tp_ep", ps.get_expert_tensor_and_model_parallel_group),
        ("etp", ps.get_expert_tensor_parallel_group),
        ("dp", ps.get_data_parallel_group),
        ("expert_dp", ps.get_expert_data_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group),
        ("cp", ps.get_context_parallel_group),
    ]
    names: dict[int, str] = {}
    for name, getter in getters:
        try:
            group = getter()
        except (AssertionError, RuntimeError, TypeError):
            continue
        if group is not None:
            names.setdefault(id(group), name)
            names.setdefault(tuple(torch.distributed.get_process_group_ranks(group)), name)
    return names


def stop() -> None:
    """Megatron's parallel state and the process group gone (idempotent)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _names.clear()


def start(emulation: Emulation) -> None:
    """torch.distributed at the layout's world size as ``emulation.rank`` on the emulated backend, and
    Megatron's parallel state for the layout; whatever was started before is stopped first. RuntimeError
    where Megatron numbers the ranks otherwise than :class:`Emulation` assumes."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    stop()
    if BACKEND not in torch.distributed.Backend.backend_list:
        torch.distributed.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    torch.distributed.init_process_group(
        BACKEND, rank=emulation.rank, world_size=emulation.world, store=FakeStore()
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=emulation.tp,
        expert_model_parallel_size=emulation.ep,
        expert_tensor_parallel_size=emulation.etp,
        create_gloo_process_groups=False,  # gloo over a fake store is "Not implemented"
    )
    got = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank())
    want = (emulation.tp_rank(emulation.rank), emulation.ep_rank(emulation.rank))
    if got != want:
        raise RuntimeError(
            f"Megatron gave rank {emulation.rank} of {emulation.describe()} (tp rank, ep rank) {got}, "
            f"the emulation assumed {want}: its rank order changed"
        )
    _names.clear()
    _names.update(_group_names(emulation))
