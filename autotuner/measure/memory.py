"""Memory sensors: weight bytes, activation bytes (saved for backward) and peak bytes of a phase.

* ``weight_bytes``: the op's parameters, each storage counted once (a tied weight is one storage).
* ``activation_bytes``: what the forward leaves for the backward, read from autograd's saved-tensor
  hooks. Each storage is counted once, whole: a view saved for backward keeps its entire base alive.
  Parameters saved for backward (a linear saves its weight) are weights, not activations, and are
  excluded. The op's own inputs count when saved: inside the model they are activations too.
* ``peak_bytes``: the highest memory in use during the phase above what was in use when it began.
  On CUDA from the caching allocator's counters (``max_memory_allocated`` after a peak reset). On CPU
  from the allocation and free events that ``torch.profiler`` records with ``profile_memory=True``: the
  running sum of their sizes, whose maximum is the peak. Two guards keep memory that predates the phase
  out of it: a garbage collection first, so no cycle left by earlier work is freed in the middle; and
  a free counts only against an allocation of the same size made during the phase (the events carry no
  address), so releasing an older block never hides a peak. Process RSS would also count the
  allocator's caching, Python objects and pages the OS has not reclaimed, so it is not used.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
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


class SavedTensorsMeter:
    """Counts the bytes autograd saves for backward while active (a context manager)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self._storages: dict[tuple[str, int], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._exclude:
            self._storages[key] = tensor.untyped_storage().nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> SavedTensorsMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


# Freeing a block allocated before profiling began is expected here and handled in peak_bytes.
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


def peak_bytes(run: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes in use during ``run()`` above the bytes in use when it started."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with _kineto_quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())  # stable: equal stamps keep the recorded order
    outstanding: Counter[int] = Counter()
    live = peak = 0
    for event in events:
        size = event.nbytes()
        if size > 0:
            outstanding[size] += 1
        elif outstanding[-size] > 0:
            outstanding[-size] -= 1
        else:
            continue  # a block allocated before the phase
        live += size
        peak = max(peak, live)
    return peak
