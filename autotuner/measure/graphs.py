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
eagerly and its row carries ``cuda_graph_failed(<error>)`` in ``warnings``. A phase whose work cannot be
repeated at all (a backward that edits what its forward saved) fails in the eager warm-up, before any
capture (:class:`NotReplayable`, ``cuda_graph_failed(not_replayable)``); captures go on after it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
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
    empty: bool = False  # the capture recorded no GPU work: a replay times the replay call alone

    def __call__(self) -> None:
        self.graph.replay()


def capture_phase(phase: Capturable, generators: Sequence[torch.Generator] = (), warmup: int = 3) -> Replay:
    """Capture the phase's timed work into a CUDA graph; return its replay (raises if it cannot be
    captured, leaving the device usable).

    Everything happens on one side stream: the backward's eager forward too, because autograd runs each
    backward op on the stream its forward ran on; had the forward run on the default stream, the backward
    would leave the capture stream. The work is warmed up there first (cuBLAS creates its handle and
    workspace on first use, which must not happen during capture).

    A phase can launch no GPU work at all (a bias-dropout-add backward without bias or dropout hands the
    incoming gradient on): torch then warns that the graph is empty, and the replay says so (``empty``),
    because its time is then the cost of a replay call, not of any kernel. The same warning is also the
    sign of work that escaped the capture stream and ran eagerly, which a row must not hide either.
    """
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    default = torch.cuda.default_generators[torch.cuda.current_device()]
    rng_states = [(g, g.get_state()) for g in (default, *generators)]
    try:
        with torch.cuda.stream(stream):
            work = phase.static_work()
            for _ in range(warmup):
                work()
        stream.synchronize()
    except Exception as exc:  # noqa: BLE001 - eager, before any capture: nothing to recover
        raise NotReplayable(f"{type(exc).__name__}: {exc}") from exc
    try:
        phase.clear_grads()
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            graph.register_generator_state(generator)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.cuda.graph(graph, stream=stream):
                outputs = work()
    except Exception as exc:  # noqa: BLE001 - any failure: recover, then report its first error
        _recover(rng_states)
        raise root_cause(exc) from None
    torch.cuda.synchronize()
    empty = False
    for warning in caught:
        if "Graph is empty" in str(warning.message):
            empty = True
        else:  # not ours to swallow
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return Replay(graph, outputs, empty)


class NotReplayable(RuntimeError):
    """The phase's static work failed when repeated eagerly, before any capture: it cannot be replayed
    (seen: Megatron's cross-entropy backward edits a tensor its forward saved, so a second backward from
    the same forward raises). Nothing was captured, so later captures are safe."""


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


def _recover(rng_states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    """Undo what a failed capture leaves behind. Its end never reached the generators' epilogue, so each
    generator the graph registered still expects a capture and every later random op would raise
    ("Offset increment outside graph capture"): give each a fresh state object, then its seed and offset
    back."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001, S110 - the capture's own error is the one to report
        pass
    for generator, state in rng_states:
        if hasattr(generator, "graphsafe_set_state"):  # torch >= 2.4
            generator.graphsafe_set_state(torch.Generator(device=generator.device).graphsafe_get_state())
        generator.set_state(state)
