"""The peak memory of a process while it measures one (point, op, phase), estimated before anything runs.

Each phase runs on meta tensors (shapes and dtypes, no storage) in the order the observers run it, under
:class:`LiveStorages`, a dispatch mode that sees every tensor an operation makes and, through a weak
reference to its storage, when the storage is freed: what is alive at the highest sum is the phase's
make-up. A backward runs as the ``peak_bytes`` sensor runs it, the heaviest of its passes: a fresh forward,
zeroed gradient buffers for the weights, then the backward from output gradients. The terms of
:class:`MemoryEstimate`, at that moment:

* weights: parameters and buffers of the model parts the run builds, resident the whole run;
* gradients: of the weights, of the op's inputs, and the output gradients the backward starts from;
* activations: the op's inputs and outputs, and what autograd saved for backward;
* attention scores: tensors ``[..., s, s]`` (scores, probabilities, their gradients), saved or not;
* temporaries: everything else alive (a backward's intermediates);
* optimizer: 0, op profiling runs no optimizer step (no Adam moments, no master weights);
* workspace: the process's runtime, measured (its resident set before the model is built on a CPU: the
  interpreter, torch, Megatron; 0 on a GPU, whose ``max_memory_allocated`` counts tensors only), get_data's
  rotated input copies, cache-flush buffer and held graphs (by the rules it uses), Megatron's buffer for
  the attention scores (its global memory buffer: one ``[b * heads, s, s]`` tensor, kept once made; on a
  GPU only, as on a CPU no page of it is ever written, so none is resident), and the allocator.

The allocator's term (on a CPU the C library's heap, which a run never trims, beside the large blocks
it maps and gives back: :data:`HEAP_FRAGMENTATION`, :func:`plan_estimates`; 0 on a GPU) is explained in
docs/memory_and_fit.md.

Not seen: memory a kernel allocates and frees inside itself (a CPU GEMM's packing buffers) and Python's
objects for the graph; measured peaks show them small (docs/memory_and_fit.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The heap's size over the highest demand made of it: the free blocks between live ones that no later
# request fits. Measured on this project's CPU VM (glibc's mallinfo2): a llama-shaped block's backward
# (hidden 1024, s1024) grew the heap to 1.14 of its demand, one of hidden 512 (blocks of 2-11 MiB) to
# 1.8; 0.6, between them, puts the estimates of docs/memory_and_fit.md within 0.8-1.1 of the measured peaks.
HEAP_FRAGMENTATION = 0.6


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    return tensor.untyped_storage()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' storages, each once (a view and its base are one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(_storage(t))] = _storage(t).nbytes()
    return sum(seen.values())


class LiveStorages(TorchDispatchMode):
    """Every storage an operation makes while active, live until the storage is freed: the highest sum
    and what made it up, and, where blocks from ``mapped_from`` bytes are mapped apart from the heap, the
    heap's running highest demand beside the mapped bytes alive (:attr:`frontier`). Storages are numbered
    in the order made (a freed storage's id() may be reused by a later one, its number is not)."""

    def __init__(self, mapped_from: int | None = None) -> None:
        super().__init__()
        self.mapped_from = mapped_from
        self.live: dict[int, int] = {}  # number -> bytes
        self.shapes: dict[int, tuple[int, ...]] = {}  # number -> shape of the tensor that made it
        self.total = 0
        self.peak = 0
        self.at_peak: dict[int, int] = {}
        self.heap = 0  # the live blocks under mapped_from
        self.heap_peak = 0  # their highest sum so far
        self.frontier: dict[int, int] = {}  # heap_peak -> the most mapped bytes alive beside it
        self.operations = 0  # aten operations dispatched (autotuner.runner.eta: their host overhead)
        self._number: dict[int, int] = {}  # id(storage) -> number, while it lives

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.operations += 1
        # an output on an input's storage (a view, an in-place op) makes none: a view of a storage made
        # before (Megatron's attention-score buffer, sliced for each call) is not the phase's
        given = {_storage(t)._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage(t)._cdata not in given:
                self._track(t)
        return out

    def _mapped(self, size: int) -> bool:
        return self.mapped_from is not None and size >= self.mapped_from

    def _track(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if id(storage) in self._number:
            return
        number, size = len(self.shapes), storage.nbytes()
        self._number[id(storage)] = number
        self.live[number] = size
        self.shapes[number] = tuple(tensor.shape)
        self.total += size
        if not self._mapped(size):
            self.heap += size
            self.heap_peak = max(self.heap_peak, self.heap)
        mapped = self.total - self.heap
        self.frontier[self.heap_peak] = max(self.frontier.get(self.heap_peak, 0), mapped)
        weakref.finalize(storage, self._freed, id(storage), number)
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.live)

    def _freed(self, key: int, number: int) -> None:
        self._number.pop(key, None)
        size = self.live.pop(number, 0)
        self.total -= size
        if not self._mapped(size):
            self.heap -= size

    def numbers(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The numbers of the live storages of ``tensors`` (those made while active)."""
        found = (self._number.get(id(_storage(t))) for t in tensors)
        return {n for n in found if n is not None}


@dataclass(frozen=True)
class PhasePeak:
    """What one phase holds at its own peak above the resident weights (bytes), the heap's demand beside
    the mapped blocks over the phase (:attr:`LiveStorages.frontier`), and the aten operations it ran."""

    gradients: int
    activations: int
    attention_scores: int
    temporaries: int
    input_bytes: int  # the op's inputs (in activations), which get_data's rotation copies
    input_grad_bytes: int  # their gradients (in gradients) when the phase is a backward
    operations: int
    buffer_bytes: int = 0  # Megatron's buffer for the attention scores the phase asks for (kept once made)
    frontier: tuple[tuple[int, int], ...] = ()  # (heap demand so far, mapped bytes alive), the inputs' apart

    @property
    def total(self) -> int:
        return self.gradients + self.activations + self.attention_scores + self.temporaries

    def resident(self, heap_before: int, heap_extra: int, fragmentation: float) -> tuple[int, int]:
        """(the phase's highest resident set above the weights and runtime, the heap's demand after it):
        the heap at the larger of ``heap_before`` (demand held from earlier phases) and this phase's own
        (``heap_extra`` added to it: rotated copies), grown by ``fragmentation``, beside the mapped blocks
        alive. Without a frontier (no heap apart: a GPU) the phase's tensors and ``heap_extra``."""
        if not self.frontier:
            return self.total + heap_extra, heap_before
        worst = 0
        for demand, mapped in self.frontier:
            heap = max(heap_before, demand + heap_extra)
            worst = max(worst, int(heap * (1 + fragmentation)) + mapped)
        return worst, max(heap_before, max(demand for demand, _ in self.frontier) + heap_extra)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def phase_peak(
    phase: Any,
    seq_len: int,
    gradient_buffers: Callable[[list[torch.Tensor]], None],
    mapped_from: int | None = None,
) -> PhasePeak:
    """Run ``phase`` (an autotuner.runner.Phase on meta tensors) as its heaviest pass runs it, under
    :class:`LiveStorages`, and sort what was alive at the peak into the terms (module docstring).
    ``gradient_buffers`` makes the weights' zeroed gradients before a backward (the sensor's own);
    ``mapped_from``: the size from which the process's allocator maps blocks apart from its heap."""
    inputs = list(phase.call.inputs)
    params = phase.parameters
    weights = {id(_storage(p)) for p in params}
    saved: set[int] = set()
    outputs: list[torch.Tensor] = []
    tracker = LiveStorages(mapped_from)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.update(tracker.numbers([t]))
        return t.detach()  # not ``t``: see autotuner.measure.memory.SavedTensorsMeter._pack

    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if phase.prepare is None:
            outputs = _tensors(phase.run())
        else:
            phase.prepare()  # a fresh forward, its output gradients drawn
            outputs = list(phase._outputs)
            gradient_buffers(params)
            phase.run()
        grads = [t.grad for t in (*params, *inputs) if t.grad is not None]
        grad_keys = tracker.numbers([*grads, *(phase._grads or [])])
        held = tracker.numbers(outputs) | saved
        scores, gradients, activations, temporaries = 0, 0, 0, 0
        for key, size in tracker.at_peak.items():
            shape = tracker.shapes[key]
            if len(shape) >= 3 and shape[-1] == shape[-2] == seq_len:  # [b * heads, s, s] or [b, heads, s, s]
                scores += size
            elif key in grad_keys:
                gradients += size
            elif key in held:
                activations += size
            else:
                temporaries += size
        input_grads = storage_bytes(t.grad for t in inputs if t.grad is not None)
    input_bytes = storage_bytes(t for t in inputs if id(_storage(t)) not in weights)
    # the inputs are made before the phase: in the heap or mapped, as their size says
    inputs_mapped = sum(
        _storage(t).nbytes()
        for t in {id(_storage(t)): t for t in inputs if id(_storage(t)) not in weights}.values()
        if mapped_from is not None and _storage(t).nbytes() >= mapped_from
    )
    frontier = tuple(
        (demand + input_bytes - inputs_mapped, mapped + inputs_mapped)
        for demand, mapped in sorted(tracker.frontier.items())
    )
    for t in (*params, *inputs):
        t.grad = None
    return PhasePeak(
        gradients=gradients,
        activations=activations + input_bytes,
        attention_scores=scores,
        temporaries=temporaries,
        input_bytes=input_bytes,
        input_grad_bytes=input_grads,
        operations=tracker.operations,
        frontier=frontier if mapped_from is not None else (),
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimated peak of the process while it measures one row, by term (bytes; module docstring)."""

    weights: int
    gradients: int
    activations: int
    attention_scores: int
    temporaries: int
    optimizer: int
    runtime: int  # workspace: the process before the model is built (CPU resident set; 0 on a GPU)
    rotated_inputs: int  # workspace: get_data's extra copies of the inputs (and of their gradients)
    flush_buffer: int  # workspace: get_data's cache-flush buffer (timing.flush_cache)
    held_graphs: int  # workspace: get_data's held forward graphs (timing.held_activations_mib)
    score_buffer: int  # workspace: Megatron's buffer for the attention scores, kept once made
    allocator: int  # workspace: the heap kept at its highest demand so far, and its fragmentation

    @property
    def workspace(self) -> int:
        return (
            self.runtime
            + self.rotated_inputs
            + self.flush_buffer
            + self.held_graphs
            + self.score_buffer
            + self.allocator
        )

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class Workspace:
    """What the observer and the process hold beside the op (module docstring): the runtime, measured;
    get_data's rotation of inputs smaller than ``rotate_below`` bytes (0: none), its cache-flush buffer
    and held graphs, whether each forward sample follows the op's backward; from which size the
    allocator maps blocks apart from its heap (None: no heap apart, as on a GPU)."""

    runtime: int
    mapped_from: int | None = None
    rotate_below: int = 0
    flush_buffer: int = 0
    held_activation_bytes: float = 0.0
    forward_after_backward: bool = False

    @classmethod
    def of_process(cls, device: torch.device) -> Workspace:
        """This process's runtime, measured now (its resident set on a CPU: call it before the model is
        built; 0 on a GPU) and its allocator's threshold; no observer's extras."""
        import platform

        from autotuner.measure.limits import resident_bytes
        from autotuner.model.host_heap import MMAP_THRESHOLD_CEILING

        if device.type != "cpu":
            return cls(0)
        # glibc with its heap kept (autotuner.model.host_heap) maps from its threshold (blocks of about its
        # size land in the heap too: module docstring); another C library is taken as one heap that keeps
        # all it got
        glibc = platform.libc_ver()[0] == "glibc"
        return cls(resident_bytes(), mapped_from=2 * MMAP_THRESHOLD_CEILING if glibc else 2**62)

    @classmethod
    def of(cls, cfg: Any, device: torch.device) -> Workspace:
        """The workspace of a run of ``cfg`` on ``device``: :meth:`of_process`, and for get_data the extras
        its settings ask for, by the rules and cache sizes it uses."""
        import dataclasses

        from autotuner.measure.cache import last_level_cache_bytes, shared_cache_bytes

        process = cls.of_process(device)
        if cfg.launcher.name != "get_data":  # the profilers' observers neither rotate, flush nor hold
            return process
        timing = cfg.timing
        rotates = timing.rotate_inputs and not timing.flush_cache
        return dataclasses.replace(
            process,
            rotate_below=last_level_cache_bytes(device) if rotates else 0,
            flush_buffer=4 * shared_cache_bytes(device) if timing.flush_cache else 0,  # CacheFlusher's
            held_activation_bytes=float(timing.held_activations_mib) * 2**20,
            forward_after_backward=bool(timing.forward_after_backward),
        )


@dataclass(frozen=True)
class PlannedPhase:
    """One row of the plan as the estimate needs it: its phase, its peak (None: it could not run on meta)
    and, for a forward, the same op's backward at the same point."""

    phase: str
    peak: PhasePeak | None
    backward: PhasePeak | None = None


def plan_estimates(
    rows: Sequence[PlannedPhase], weights: int, workspace: Workspace, limit: int | None = None
) -> list[MemoryEstimate | None]:
    """Each row's :class:`MemoryEstimate`, in plan order: the heap's demand and Megatron's buffer for the
    attention scores (kept once a row made it) carry from row to row, as in the one process that runs
    them (module docstring); a row over ``limit`` is not run (the fit check refuses it): neither carries."""
    from autotuner.measure.cache import rotation_sets
    from autotuner.measure.memory import graphs_to_hold

    heap, kept, out = 0, 0, []
    for row in rows:
        peak = row.peak
        if peak is None:
            out.append(None)
            continue
        if row.phase == "forward" and workspace.forward_after_backward and row.backward is not None:
            peak = max(peak, row.backward, key=lambda p: p.total)  # each forward sample follows a backward
        sets = rotation_sets(peak.input_bytes, workspace.rotate_below) if workspace.rotate_below else 1
        # each copy of the inputs, and in a backward its gradient, which lives until its turn comes again
        rotated = (sets - 1) * (peak.input_bytes + (peak.input_grad_bytes if row.phase == "backward" else 0))
        graph = peak.activations + peak.attention_scores - peak.input_bytes  # a forward's output and saves
        held = 0
        if workspace.held_activation_bytes > 0 and graph > 0:
            held = (graphs_to_hold(graph, workspace.held_activation_bytes) - 1) * graph
        fragmentation = HEAP_FRAGMENTATION if workspace.mapped_from is not None else 0.0
        resident, heap_after = peak.resident(heap, rotated + held, fragmentation)
        # on a CPU never a resident page: Megatron makes it with torch.empty, and baddbmm with beta=0
        # reads nothing of it; a GPU's allocator counts it
        buffer = max(kept, peak.buffer_bytes) if workspace.mapped_from is None else 0
        guess = MemoryEstimate(
            weights=weights,
            gradients=peak.gradients,
            activations=peak.activations,
            attention_scores=peak.attention_scores,
            temporaries=peak.temporaries,
            optimizer=0,
            runtime=workspace.runtime,
            rotated_inputs=rotated,
            flush_buffer=workspace.flush_buffer,
            held_graphs=held,
            score_buffer=buffer,
            allocator=max(0, resident - peak.total - rotated - held),
        )
        if limit is None or guess.total <= limit:
            heap, kept = heap_after, buffer
        out.append(guess)
    return out


def build_peak(weights: int, largest_weight: int, workspace: Workspace, cpu_initialization: bool) -> int:
    """The process's peak while it builds the model: its runtime and weights and, where Megatron
    initialises on the host (``use_cpu_initialization``: a CPU run), each weight's full master copy and the
    concatenated copy of this rank's part beside it, the largest weight's at most."""
    return workspace.runtime + weights + (2 * largest_weight if cpu_initialization else 0)


def describe_estimate(guess: MemoryEstimate, title: str, parts: str) -> list[str]:
    """``guess`` term by term, under ``title`` (``{total}`` in it is the total); ``parts``: the model parts
    the run builds, in words."""
    from autotuner.results.units import human_bytes

    workspace = {
        "runtime": guess.runtime,
        "rotated inputs": guess.rotated_inputs,
        "cache flush": guess.flush_buffer,
        "held graphs": guess.held_graphs,
        "score buffer": guess.score_buffer,
        "allocator": guess.allocator,
    }
    shown = ", ".join(f"{name} {human_bytes(size)}" for name, size in workspace.items() if size)
    terms = [
        (guess.weights, f"weights: parameters and buffers of the parts the run builds ({parts})"),
        (guess.gradients, "gradients: of the weights, the inputs and the outputs"),
        (guess.activations, "activations: the op's inputs and outputs, what autograd saved for backward"),
        (guess.attention_scores, "attention scores: the s x s tensors, saved or temporary"),
        (guess.temporaries, "temporaries: the other intermediates alive at the peak"),
        (guess.optimizer, "optimizer: none, op profiling runs no optimizer step"),
        (guess.workspace, f"workspace: {shown or 'none'}"),
    ]
    return [
        title.format(total=human_bytes(guess.total)) + ", of which",
        *(f"  {human_bytes(size):>10}  {what}" for size, what in terms),
    ]
