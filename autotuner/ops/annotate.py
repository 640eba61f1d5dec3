"""Range annotators: how an instrumented op marks its forward and backward on a profiler's timeline.

An annotator has two calls, ``push(name)`` and ``pop()``, which nest per thread. The launchers pick one:

* none (``get_data``): instrumented ops call straight through; no range, no overhead.
* :class:`NvtxAnnotator` (``nsys``): NVTX push/pop ranges. CUDA builds of torch carry NVTX
  (``torch.cuda.nvtx``), which every nsys version records. CPU builds raise "NVTX functions not
  installed" there, so we use the ``nvtx`` package; only its 0.2.10/0.2.11 releases record under the
  nsys 2022.4 and 2023.4 that Debian ships (later ones ask ``nvtxDomainIsEnabled``, which those nsys
  never answer, and drop every range silently).
* :class:`RecordFunctionAnnotator` (``torch_profiler``): ``record_function`` ranges, which appear as
  ``user_annotation`` events in the Chrome trace.

Backward ranges are pushed from autograd nodes, so they run on whichever thread executes the backward;
on a GPU that is autograd's device thread, the thread that launches the backward kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch


class Annotator(Protocol):
    def push(self, name: str) -> None: ...

    def pop(self) -> None: ...


class NvtxAnnotator:
    """NVTX push/pop ranges through torch.cuda.nvtx on CUDA builds, the nvtx package elsewhere."""

    def __init__(self) -> None:
        if torch.cuda.is_available():
            self._push = torch.cuda.nvtx.range_push
            self._pop = torch.cuda.nvtx.range_pop
        else:
            import nvtx  # the package; see the module docstring for the version that records

            self._push = nvtx.push_range
            self._pop = nvtx.pop_range

    def push(self, name: str) -> None:
        self._push(name)

    def pop(self) -> None:
        self._pop()


class RecordFunctionAnnotator:
    """``torch.profiler.record_function`` ranges, kept on a per-thread stack of handles."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _stack(self) -> list[Any]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def push(self, name: str) -> None:
        self._stack().append(torch.ops.profiler._record_function_enter_new(name, None))

    def pop(self) -> None:
        # As torch's own record_function.__exit__ does: with __torch_function__ handling on, the exit op
        # costs ~10x more (pytorch/pytorch#76410), time that lands inside the enclosing op's range.
        with torch._C.DisableTorchFunctionSubclass():
            torch.ops.profiler._record_function_exit._RecordFunction(self._stack().pop())


class RecordingAnnotator:
    """Records (event, name, thread) in memory; for tests that check nesting and order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self._local = threading.local()

    def push(self, name: str) -> None:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        self._local.stack.append(name)
        self.events.append(("push", name, threading.get_ident()))

    def pop(self) -> None:
        name = self._local.stack.pop()
        self.events.append(("pop", name, threading.get_ident()))


class _State:
    """What the instrumented ops read on every call: the active annotator and the range context."""

    annotator: Annotator | None = None
    backward_ranges: bool = True
    only_op: str | None = None  # None: every op; a name: that op alone gets ranges (and backward nodes)
    point: str = "-"
    iteration: int = 0
    warmup: bool = False


STATE = _State()


@contextmanager
def annotating(
    annotator: Annotator | None, backward_ranges: bool = True, only_op: str | None = None
) -> Iterator[None]:
    """Activate an annotator for the ops run inside the block.

    ``only_op``: mark that op alone. Every marked sub-op costs its parent's range a push/pop and two
    autograd nodes (tens of microseconds on a CPU), so a parent's *time* is taken with its sub-ops
    unmarked; traces meant for reading keep them all.
    """
    previous = (STATE.annotator, STATE.backward_ranges, STATE.only_op)
    STATE.annotator, STATE.backward_ranges, STATE.only_op = annotator, backward_ranges, only_op
    try:
        yield
    finally:
        STATE.annotator, STATE.backward_ranges, STATE.only_op = previous


def set_range_context(point: str, iteration: int, warmup: bool) -> None:
    """Tell instrumented ops which shape point and iteration the next ranges belong to."""
    STATE.point, STATE.iteration, STATE.warmup = point, iteration, warmup
