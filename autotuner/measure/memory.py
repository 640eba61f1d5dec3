"""Memory sensors: weight bytes, activation bytes (saved for backward) and peak bytes of a phase.

* ``weight_bytes``: the op's parameters, each storage counted once (a tied weight is one storage).
* ``activation_bytes``: what the forward leaves for the backward, read from autograd's saved-tensor
  hooks. Each storage is counted once, whole: a view saved for backward keeps its entire base alive.
  Parameters saved for backward (a linear saves its weight) are weights, not activations, and are
  excluded. The op's own inputs count when saved: inside the model they are activations too. Only what
  is still saved when the forward returns counts: a graph the forward builds and drops (the router's
  auxiliary terms) frees its saved tensors, whose addresses the allocator may hand to later ones.
* ``peak_bytes``: the highest memory in use during the phase above what was in use when it began. On CUDA
  from the caching allocator's counters (``max_memory_allocated`` after a peak reset). On CPU from the
  allocations and frees that ``torch.profiler`` records with ``profile_memory=True``, each with its block's
  address: the running sum of the blocks allocated in the profiling session and not yet freed, whose maximum
  above its value when the phase began is the peak. The profiler reports the free of a block only if it saw
  the block allocated (CPU allocator: a block from before the session has no recorded size), so the phase's
  untimed ``prepare`` (a backward's forward) runs inside the session: the saved activations it leaves are
  then seen freed as the backward consumes them, as inside a training step, and the CPU figure is the net
  rise the CUDA counters give. A garbage collection first, so no cycle left by earlier work is freed in the
  middle; a free of a block from before the session is not seen (it cannot lower the peak, which on CUDA it
  could). The profiler misses a free made on a thread it does not follow: a gloo collective's worker thread,
  when it drops its reference to a tensor after the caller's (seen: a DP=2 distributed-optimizer step whose
  reduce-scatter's 21 MB copy was never freed by the events, which read a 42 MB peak in 2 of 6 identical
  runs and 21.7 MB in the others; the tiny model's TP=2 step, whose layers all-reduce over gloo, 1.86-2.26
  MB on its ranks over 8 runs). Such a block is known freed when the allocator hands its address out again,
  so a new block at a held address retires the old one first (the same TP=2 step: 1.83-1.96 MB over 12
  ranks' runs); one never handed out again stays counted to the end, so a phase with collectives can still
  read high. Process RSS would also count the allocator's caching, Python objects and pages the OS has not
  reclaimed, so it is not used.
"""

from __future__ import annotations

import bisect
import gc
import math
import os
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (tensor.device.type, tensor.untyped_storage().data_ptr())


def weight_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the given parameters, each storage once."""
    seen: dict[tuple[str, int], int] = {}
    for p in params:
        seen[_storage_key(p)] = p.untyped_storage().nbytes()
    return sum(seen.values())


def saved_bytes(run: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """The bytes one call of ``run`` leaves saved for its backward (:class:`SavedTensorsMeter`, ``exclude``
    not counted): the ``activation_bytes`` sensor's figure, and what get_data's held graphs hold each."""
    with SavedTensorsMeter(exclude=exclude) as saved:
        output = run()
    del output
    return saved.bytes


class SavedTensorsMeter:
    """Counts the bytes autograd saves for backward while active (a context manager)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self._saved: list[weakref.ref[torch.Tensor]] = []
        self.bytes = 0  # set on exit: the storages still saved then, each once
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Not the tensor itself: an output its own node saves (exp, silu, softmax save their result) would
        # then hold its node through the saved object, a cycle of C++ references that nothing frees, and
        # every metered forward would leak what its ops saved of their outputs.
        packed = tensor.detach()
        if _storage_key(tensor) not in self._exclude:
            self._saved.append(weakref.ref(packed))  # dies with the graph that saved it
        return packed

    def __enter__(self) -> SavedTensorsMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        # Keyed by address, so only the living: a dropped graph's storage may share one with a later save.
        live = (ref() for ref in self._saved)
        storages = {_storage_key(t): t.untyped_storage().nbytes() for t in live if t is not None}
        self.bytes = sum(storages.values())
        self._saved.clear()


def gradient_buffers(params: Iterable[torch.Tensor]) -> None:
    """A zeroed gradient for each parameter that needs one, before a metered backward: inside a training
    step Megatron's DDP accumulates gradients into buffers that exist before the step (the predictor
    counts them as the gradients' memory), so the weight gradient a backward computes is a temporary,
    freed once added, not memory the backward keeps."""
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)


# timing.held_activations_mib: at most this many graphs held besides a sample's own (an op that saves little
# holds less than asked: its row says how much it held)
MAX_HELD_GRAPHS = 256


def graphs_to_hold(saved: int, held_bytes: float) -> int:
    """The graphs a sample runs beside for ``timing.held_activations_mib`` (autotuner.measure.timer,
    "Activations a step holds"): its own and enough earlier ones, each ``saved`` bytes, to hold at least
    ``held_bytes``, at most MAX_HELD_GRAPHS of them; one (nothing held) for an op whose forward saves
    nothing."""
    if saved == 0 or held_bytes <= 0:
        return 1
    return 1 + min(math.ceil(held_bytes / saved), MAX_HELD_GRAPHS)


# Freeing a block allocated before the profiling session is expected here (module docstring).
_EXPECTED_WARNING = "Memory block of unknown size was allocated before the profiling started"


@contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Kineto prints 'USDT ... profiler_start/stop' lines on the C++ side of every profiling session.
    Route fd 2 to a file for the session and give back every other line, so real errors still show."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(("USDT:", "STAGE:")) and _EXPECTED_WARNING not in line:
                    sys.stderr.write(line)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """For the block, every object alive at its start (after a collection) sits in gc's permanent
    generation, so the ``gc.collect()`` before each CPU memory session walks only the objects made since:
    the imports and the model are about half a million objects, and a full collection of them took about
    half a second a row. Unfrozen at the end, so what is dropped afterwards can be collected again."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def peak_bytes(run: Callable[[], Any], device: torch.device, prepare: Callable[[], Any] | None = None) -> int:
    """Peak bytes in use during ``run()`` above the bytes in use when it started (after ``prepare()``)."""
    return peak_and_held_bytes(run, device, prepare)[0]


# The record_function that marks where the metered part of a profiling session begins.
_METERED = "autotuner::metered"


def peak_and_held_bytes(
    run: Callable[[], Any], device: torch.device, prepare: Callable[[], Any] | None = None
) -> tuple[int, int]:
    """The peak bytes in use during ``run()`` above the bytes in use when it started, and the bytes it
    left in use at its end (the next phase's start, for phases metered one after another).
    ``prepare()`` runs first, unmetered, but (on CPU) profiled, so that the frees of what it allocated
    are seen (module docstring)."""
    if device.type == "cuda":
        if prepare is not None:
            prepare()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - before
        return max(0, peak), torch.cuda.memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with _kineto_quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if prepare is not None:
            prepare()
        with record_function(_METERED):
            run()
    return peak_and_live(*_allocator_events(prof))


def peak_and_live(events: Sequence[tuple[int, int]], metered_from: int = 0) -> tuple[int, int]:
    """From a session's allocator events in time order, (address, bytes: + allocated, - freed), of which
    those from index ``metered_from`` on are the phase's: the highest and the last sum of the blocks
    allocated in the session and not yet freed, above that sum when the phase began (module docstring)."""
    held: dict[int, int] = {}  # address -> bytes of the blocks allocated in the session
    live = base = peak = 0
    for i, (address, size) in enumerate(events):
        if i == metered_from:
            base = live
        live -= held.pop(address, 0)  # freed, or (a new block there) freed where the events missed it
        if size > 0:
            held[address] = size
            live += size
            if i >= metered_from:
                peak = max(peak, live - base)
    if metered_from >= len(events):
        base = live
    return peak, live - base


def _allocator_events(prof: Any) -> tuple[list[tuple[int, int]], int]:
    """(address, bytes: + allocated, - freed) of each CPU allocator event the profiler recorded, in time
    order (its event tree holds them under the op that made them, with their addresses), and the index
    of the first one inside the _METERED range (0 without one: all of them, which never reads low)."""
    from torch._C._profiler import _EventType

    found: list[tuple[int, int, int]] = []
    metered_ns = None
    nodes = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while nodes:  # depth first, each node's children in their recorded order
        node = nodes.pop()
        nodes.extend(reversed(node.children))
        if node.name == _METERED and metered_ns is None:
            metered_ns = node.start_time_ns
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            found.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    found.sort(key=lambda event: event[0])  # stable: equal stamps keep the recorded order
    start = 0 if metered_ns is None else bisect.bisect_left([t for t, _, _ in found], metered_ns)
    return [(address, size) for _, address, size in found], start
