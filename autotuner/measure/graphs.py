"""CUDA-graph replay of a phase (``timing.cuda_graph=true``): device time without host launch overhead.

Why: a small op's kernels can finish faster than the host launches them. Back-to-back eager calls then
time the host's launch rate (Python, the dispatcher, the caching allocator), not the GPU's work; inside a
training step that overhead is often hidden behind earlier kernels, or removed by a captured step. A CUDA
graph launches all of a phase's kernels with one call, so a replay's time is the kernels' time.

What a replay does not repeat, and the row therefore excludes (it says ``cuda_graph=True``): Python and
dispatch, autograd's graph building in the forward, allocations (the graph owns a private pool), and
input rotation (a graph reads fixed addresses). Only phases whose eager call is shorter than
``timing.cuda_graph_below_us`` are replayed; longer ones are launch-bound in no meaningful way.

Backward: the forward runs once, eagerly, outside the graph, and its outputs (with the activations the
backward reads) stay alive; the backward alone is captured, as ``torch.autograd.grad`` with
``retain_graph`` so those activations are not freed under the graph (autotuner.runner.Phase.static_work
says why not ``backward()``). Each replay recomputes the same gradients into the same buffers.

Pageable host copies are never captured (the driver stages them synchronously; capture refuses them).
After a capture fails for another reason, the observer stops capturing for the rest of the run: a failed
capture can leave memory the caching allocator never gets back (seen on an H100: three failed backward
captures, then 75 GiB reserved but unusable and every later op out of memory).

A phase that cannot be captured (a host synchronisation inside, an op CUDA graphs do not support) is timed
eagerly and its row carries ``cuda_graph_failed(<error>)`` in ``warnings``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Capturable(Protocol):
    """What :func:`capture_phase` needs of a phase (autotuner.runner.Phase)."""

    def static_work(self) -> Callable[[], Any]: ...

    def clear_grads(self) -> None: ...


@dataclass
class Replay:
    """A captured phase: calling it replays the graph, which rewrites ``outputs`` (what the captured call
    returned: a forward's output, a backward's gradients) in place."""

    graph: torch.cuda.CUDAGraph
    outputs: Any

    def __call__(self) -> None:
        self.graph.replay()


def capture_phase(phase: Capturable, warmup: int = 3) -> Replay:
    """Capture the phase's timed work into a CUDA graph; return its replay (raises if it cannot be
    captured, leaving the device usable).

    Everything happens on one side stream: the backward's eager forward too, because autograd runs each
    backward op on the stream its forward ran on; had the forward run on the default stream, the backward
    would leave the capture stream. The work is warmed up there first (cuBLAS creates its handle and
    workspace on first use, which must not happen during capture); gradients are cleared before the
    capture so the captured backward writes them afresh.
    """
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    rng_state = generator.get_state()
    try:
        with torch.cuda.stream(stream):
            work = phase.static_work()
            for _ in range(warmup):
                work()
        stream.synchronize()
        phase.clear_grads()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outputs = work()
    except Exception as exc:  # noqa: BLE001 - any failure: recover, then report its first error
        _recover(generator, rng_state)
        raise root_cause(exc) from None
    torch.cuda.synchronize()
    return Replay(graph, outputs)


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream() -> torch.cuda.Stream:
    """One side stream per device for every capture: the caching allocator reuses a freed block only for
    the stream it was allocated on, so a fresh stream per capture would strand each capture's warm-up
    memory (seen on an H100: 75 GiB reserved and unusable after a few dozen captures)."""
    device = torch.cuda.current_device()
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream()
    return _STREAMS[device]


def root_cause(exc: BaseException) -> BaseException:
    """The first error of a failed capture: when the captured work raises, ending the capture raises
    again ("operation failed due to a previous error during capture") and hides it as the context."""
    while exc.__context__ is not None and exc.__context__ is not exc:
        exc = exc.__context__
    return exc


def _recover(generator: torch.Generator, rng_state: torch.Tensor) -> None:
    """Undo what a failed capture leaves behind. Its end never reached the generator's epilogue, so the
    default CUDA generator still expects a capture and every later random op would raise ("Offset
    increment outside graph capture"): give it a fresh state object, then its seed and offset back."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001, S110 - the capture's own error is the one to report
        pass
    if hasattr(generator, "graphsafe_set_state"):  # torch >= 2.4
        generator.graphsafe_set_state(torch.Generator(device=generator.device).graphsafe_get_state())
    generator.set_state(rng_state)
