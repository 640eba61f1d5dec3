"""The one runner: executes a plan of (op, shape point, phase) and hands each phase to an observer.

The launchers differ only in their observer: ``get_data`` times and meters each phase itself, ``nsys``
and ``torch_profiler`` run the phase under their profiler's ranges. Everything else (building the model,
making inputs, the forward/backward split, failure handling, incremental results, resume) is here.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm import tqdm

from autotuner.errors import one_line
from autotuner.measure.memory import frozen_heap
from autotuner.model.emulation import Emulation
from autotuner.model.hf_to_megatron import MegatronModelArgs
from autotuner.model.routing import Routing
from autotuner.ops.naming import PHASES
from autotuner.ops_test.base import OpCall, OpContext, OpNotApplicable, OpTest, ShapePoint
from autotuner.results import CALL_COLUMNS, ResultsWriter, RowKey
from autotuner.runner.plan import plan, row_identity
from autotuner.termination import check_stop

if TYPE_CHECKING:
    from autotuner.runner.eta import Forecast
    from autotuner.runner.fit import FitCheck


@dataclass
class RunSpec:
    """Everything a run needs, validated (see autotuner.runner.spec.resolve_spec)."""

    case: str
    model_args: MegatronModelArgs
    tf_config: Any
    ops: list[OpTest]
    points: list[ShapePoint]
    device: torch.device
    dtype: str
    seed: int
    block_layers: int
    use_transformer_engine: bool = False
    # the core attention built (autotuner.model.sdpa_attention.resolve: local, sdpa or te)
    attention: str = "local"
    threads: int = 0
    phases: tuple[str, ...] = PHASES
    notes: list[str] = field(default_factory=list)
    # This process's rank and the job's world size (torchrun's RANK and WORLD_SIZE; read once, in
    # autotuner.runner.spec.resolve_spec, by autotuner.model.runtime.process_rank).
    rank: int = 0
    world: int = 1
    # How the session of a plan that builds no Megatron model is opened (a capture's generic plan sets it:
    # autotuner.capture.replay); None: autotuner.runner.spec.open_session builds the model.
    session: Callable[[RunSpec], tuple[Any, Any]] | None = None
    # A capture's generic plan: (point, op, phase) triples, each op at its own point (None: every point
    # x op x phase), and (op, point label) -> calls in the captured run (autotuner.capture.replay).
    plan: list[tuple[ShapePoint, OpTest, str]] | None = None
    call_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    # How the MoE ops make their router output (moe.routing, moe.zipf_s; autotuner.model.routing).
    routing: Routing = field(default_factory=Routing)
    # The layout this one process is a rank of, without torchrun (autotuner.model.emulation); None: the
    # process is itself (one of torchrun's ranks, or a layout of one rank).
    emulation: Emulation | None = None

    @property
    def row_rank(self) -> int:
        """The rank the rows are of: the emulated one, else this process's."""
        return self.emulation.rank if self.emulation is not None else self.rank


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


@contextlib.contextmanager
def _fresh_parameters(module: torch.nn.Module | None) -> Iterator[list[torch.nn.Parameter]]:
    """Within the block, every parameter of ``module`` is replaced by a new leaf parameter sharing its
    storage and attributes (a tied weight by one shared twin); yields the twins, restores on exit."""
    if module is None:
        yield []
        return
    twins: dict[int, torch.nn.Parameter] = {}
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is None:
                    continue
                if id(param) not in twins:
                    twin = torch.nn.Parameter(param.detach(), requires_grad=param.requires_grad)
                    twin.__dict__.update(param.__dict__)  # Megatron's attributes (tensor_model_parallel, ...)
                    twins[id(param)] = twin
                owner._parameters[name] = twins[id(param)]
                swapped.append((owner, name, param))
        yield list(twins.values())
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


class Phase:
    """One phase of an op as callables an observer can run: ``prepare()`` (untimed) then ``run()``.

    * forward: ``run`` is the op's forward with autograd recording, as in training (it saves activations).
    * backward: ``prepare`` clears the gradients and runs a fresh forward; ``run`` is the backward alone,
      from seeded random output gradients. Backward is measured on its own, never as a difference of
      forward+backward and forward.

    Each ``run`` returns what a step would still hold after it (the forward's output; the backward's spent
    outputs), for the caller to free outside its timed window (autotuner.measure.timer).

    :meth:`rotate` makes copies of the inputs that successive calls cycle through, so an op whose inputs
    fit in the cache does not read them from cache in every sample (as it would not inside the model).
    """

    def __init__(self, name: str, call: OpCall, seed: int) -> None:
        self.name = name
        self.call = call
        self.seed = seed
        self.input_sets: list[tuple[torch.Tensor, ...]] = [call.inputs]
        self._next = 0
        self._outputs: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] | None = None
        self.prepare: Callable[[], Any] | None = None if name == "forward" else self._forward_for_backward
        self.run: Callable[[], Any] = self._forward if name == "forward" else self._backward

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.call.module.parameters()) if self.call.module is not None else []

    @property
    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.call.inputs)

    def bytes_moved(self) -> int:
        """A counted minimum of the bytes the phase must move: every tensor it needs read once, every
        tensor it makes written once. Forward: inputs, weights, outputs. Backward: the output gradients,
        the inputs and weights (read to form the gradients), the input and weight gradients. Re-reads,
        intermediates and saved activations other than the inputs are not counted, so the GB/s derived
        from it is a lower bound of the traffic."""
        if self.call.bytes_moved is not None and self.name in self.call.bytes_moved:
            return self.call.bytes_moved[self.name]
        weights = sum(p.numel() * p.element_size() for p in self.parameters)
        if self.name == "forward":
            outputs = _tensors(self.call.fn(*self.call.inputs))
            return self.input_bytes + weights + sum(t.numel() * t.element_size() for t in outputs)
        if self._grads is None:
            self._forward_for_backward()
            self._outputs = []
        grad_outputs = sum(g.numel() * g.element_size() for g in self._grads or [])
        grad_inputs = sum(t.numel() * t.element_size() for t in self.call.inputs if t.requires_grad)
        weight_grads = sum(p.numel() * p.element_size() for p in self.parameters if p.requires_grad)
        return grad_outputs + self.input_bytes + weights + grad_inputs + weight_grads

    def rotate(self, sets: int) -> None:
        """Cycle through ``sets`` copies of the inputs (the original included); a pinned host tensor's copies
        are pinned too (a host transfer's speed depends on it)."""

        def copy(t: torch.Tensor) -> torch.Tensor:
            twin = t.detach().clone()
            return (twin.pin_memory() if t.is_pinned() else twin).requires_grad_(t.requires_grad)

        copies = [tuple(copy(t) for t in self.call.inputs) for _ in range(max(sets, 1) - 1)]
        self.input_sets = [self.call.inputs, *copies]

    def _inputs(self) -> tuple[torch.Tensor, ...]:
        inputs = self.input_sets[self._next % len(self.input_sets)]
        self._next += 1
        return inputs

    def _forward(self) -> Any:
        return self.call.fn(*self._inputs())

    def clear_grads(self) -> None:
        """The gradients of the weights and of every copy of the inputs (:meth:`rotate`) gone."""
        for tensor in (*(t for inputs in self.input_sets for t in inputs), *self.parameters):
            tensor.grad = None

    def static_work(self) -> Callable[[], Any]:
        """The timed work on fixed tensors, repeatable with no per-call Python state: what a CUDA graph
        captures (autotuner.measure.graphs). Backward: one forward now, whose outputs and activations
        the returned call keeps (``retain_graph``) for every call; it returns the gradients of the inputs
        and weights (``torch.autograd.grad``) instead of accumulating them into ``.grad``.

        That forward runs on fresh leaves: the inputs detached, the weights swapped for parameters that
        share their storage (:func:`_fresh_parameters`). A leaf's AccumulateGrad node remembers the stream
        it was created on and lives as long as any graph holding it; an earlier eager forward on the
        default stream would otherwise make the backward sync with that stream, which a capture on a side
        stream refuses ("would make the legacy stream depend on a capturing blocking stream", seen on an
        H100 and an H200). The kernels are the same."""
        self.rotate(1)
        if self.name == "forward":
            inputs = self.call.inputs
            return lambda: self.call.fn(*inputs)
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in self.call.inputs)
        with _fresh_parameters(self.call.module) as weights:
            outputs = [t for t in _tensors(self.call.fn(*inputs)) if t.requires_grad]
        if not outputs:
            raise RuntimeError("the op's outputs need no gradient: it has no backward")
        grads = self._output_grads(outputs)
        wrt = [t for t in (*inputs, *weights) if t.requires_grad]
        return lambda: torch.autograd.grad(outputs, wrt, grads, retain_graph=True, allow_unused=True)

    def _output_grads(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Seeded random gradients of the outputs, drawn once: every sample feeds the same."""
        if self._grads is None:
            gen = torch.Generator().manual_seed(self.seed)
            self._grads = [
                torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype)
                for t in outputs
            ]
        return self._grads

    def _forward_for_backward(self) -> None:
        inputs = self._inputs()
        for tensor in (*inputs, *self.parameters):
            tensor.grad = None
        outputs = [t for t in _tensors(self.call.fn(*inputs)) if t.requires_grad]
        if not outputs:
            raise RuntimeError("the op's outputs need no gradient: it has no backward")
        self._output_grads(outputs)
        self._outputs = outputs

    def _backward(self) -> list[torch.Tensor]:
        outputs, self._outputs = self._outputs, []
        torch.autograd.backward(outputs, self._grads)
        return outputs  # the spent graph's nodes go with them

    @contextlib.contextmanager
    def training_order(self, graphs: int = 1) -> Iterator[TrainingOrder]:
        """Within the block, this phase in training's order, with up to ``graphs`` forward graphs (each an
        output and the activations it saved) held at once, as a step holds its micro-batches' until their
        backward (autotuner.measure.timer, "A forward follows its backward" and "Activations a step
        holds"):

        * forward: ``run`` keeps its output's graph, and ``prepare``, once ``graphs`` are kept (from the
          start where ``graphs`` is over 1: as many forwards run on entry), runs the oldest one's backward
          (untimed, from the backward phase's seeded gradients, the gradients cleared first as the backward
          phase clears them). So every sample (with one graph, every sample after the first) follows the
          op's own backward, as every forward of an op in a training step follows its previous
          micro-batch's backward, and writes what it saves into memory the held graphs' ``graphs - 1``
          calls ago wrote.
        * backward: ``prepare`` runs forwards until ``graphs`` are held and takes the oldest; ``run`` is its
          backward, which reads activations written ``graphs - 1`` forwards before. With ``graphs`` 1 the
          phase is as without the block: each backward after its own fresh forward.

        Yields what it did: ``followed`` (a forward) stays False for an op whose output needs no gradient
        (nothing to run backward: its samples ran back to back, nothing held). On exit the held graphs are
        freed and the phase is as before."""
        if graphs < 1:
            raise ValueError(f"graphs={graphs}: at least the sample's own")
        order = TrainingOrder()
        plain_run, plain_prepare = self.run, self.prepare
        held: collections.deque[list[torch.Tensor]] = collections.deque()

        def run_forward() -> Any:
            output = plain_run()
            outputs = [t for t in _tensors(output) if t.requires_grad]
            if outputs:
                held.append(outputs)
            return output

        def prepare_forward() -> None:
            while len(held) >= graphs:
                outputs = held.popleft()
                self.clear_grads()
                torch.autograd.backward(outputs, self._output_grads(outputs))
                order.followed = True

        def prepare_backward() -> None:
            while len(held) < graphs:
                self._forward_for_backward()
                held.append(self._outputs)
            self._outputs = held.popleft()
            self.clear_grads()

        if self.name == "forward":
            self.run, self.prepare = run_forward, prepare_forward
        elif graphs > 1:
            self.prepare = prepare_backward
        try:
            for _ in range(graphs if self.name == "forward" and graphs > 1 else 0):
                run_forward()  # held from the first sample on, as from the last
            yield order
        finally:
            self.run, self.prepare, self._outputs = plain_run, plain_prepare, []
            held.clear()
            self.clear_grads()


@dataclass
class TrainingOrder:
    """What :meth:`Phase.training_order` did: whether any forward sample followed the op's backward."""

    followed: bool = False


class Observer(Protocol):
    """How a launcher observes a phase. Returns the row's measured columns."""

    name: str

    def observe(self, op: OpTest, point: ShapePoint, phase: Phase) -> dict[str, Any]: ...


class Runner:
    """Builds the model once, then runs the plan through an observer, writing a row per measurement."""

    def __init__(
        self,
        spec: RunSpec,
        observer: Observer,
        writer: ResultsWriter,
        progress: bool = True,
        fit: FitCheck | None = None,
    ) -> None:
        self.spec = spec
        self.observer = observer
        self.writer = writer
        self.progress = progress
        self.fit = fit  # the rows refused for memory (autotuner.runner.fit); None: every row runs
        self.rank, self.world = spec.rank, spec.world

    def _base_row(self, op: OpTest, point: ShapePoint, phase: str) -> dict[str, Any]:
        return {
            **row_identity(self.spec, op, point, phase, self.observer.name),
            "num_threads": torch.get_num_threads(),  # this process's, where the phase runs
        }

    def run(self, context: OpContext) -> list[dict[str, Any]]:
        """Run every (point, op, phase) not already done; return the rows written in this run."""
        planned = plan(self.spec)
        done = [
            self.writer.done(RowKey(self.spec.case, op.name, phase, point.label, self.spec.row_rank))
            for point, op, phase in planned
        ]
        if self.world > 1:
            # Ranks run an op together (its collectives): skip only what every rank has measured, or a
            # resumed job would have the ranks wait in different ops for ever.
            flags = torch.tensor(done, dtype=torch.int32, device=self.spec.device)  # NCCL wants CUDA
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
            done = [bool(flag) for flag in flags.tolist()]
            if self.fit is not None:  # and refuse what any rank refuses, for the same reason
                self.fit.agree([(p.label, op.name, ph) for p, op, ph in planned], self.spec.device)
        todo = [item for item, finished in zip(planned, done, strict=True) if not finished]
        with frozen_heap():  # the imports and the model stay out of each memory session's gc.collect()
            forecast = self._forecast(todo)
            bar = _progress(len(planned), len(planned) - len(todo), self.progress)
            bar.set_postfix_str(_time_left(forecast), refresh=False)
            return self._measure_all(todo, context, bar, forecast)

    def _measure_all(
        self,
        todo: list[tuple[ShapePoint, OpTest, str]],
        context: OpContext,
        bar: tqdm,
        forecast: Forecast | None,
    ) -> list[dict[str, Any]]:
        written = []
        by_op: dict[tuple[ShapePoint, str], list[str]] = {}
        for point, op, phase in todo:
            by_op.setdefault((point, op.name), []).append(phase)
        ops = {op.name: op for op in self.spec.ops}
        fit = self.fit
        # op -> (tokens, reason): the op ran out of memory at a point of that many tokens; as large a point
        # would too, and is skipped with that reason
        self._out_of_memory: dict[str, tuple[int, str]] = {}
        for (point, name), phases in by_op.items():
            op = ops[name]
            refused = {ph for ph in phases if fit is not None and fit.refuses((point.label, name, ph))}
            # a captured call's point has no sizes: what ran out at one says nothing of another
            tokens = (
                point.seq_len * point.micro_batch_size if point.seq_len and point.micro_batch_size else None
            )
            ran_out = self._out_of_memory.get(name) if tokens is not None else None
            if ran_out is not None and tokens >= ran_out[0]:
                refused = set(phases)  # not built either
            call, build_error = None, None
            if len(refused) < len(phases):  # a refused row's op is not even built (its inputs take memory)
                call, build_error = self._build(op, context, point)
            for phase_name in phases:
                check_stop()  # a stop signal that a finalizer swallowed ends the plan here
                bar.set_description(f"{name}.{phase_name} {point.label}")
                row = self._base_row(op, point, phase_name)
                key = (point.label, name, phase_name)
                if fit is not None:
                    row.update(fit.columns(key))
                if call is not None and call.row_fields:
                    row.update(call.row_fields)  # what the op says of its call, in both phases' rows
                if ran_out is not None and tokens >= ran_out[0]:
                    row.update(status="skipped", error=ran_out[1])
                elif phase_name in refused:
                    row.update(status="refused", error=fit.reason(key) if fit is not None else None)
                else:
                    row.update(self._measure(op, point, phase_name, call, build_error))
                    if row["status"] == "failed" and row["error"].startswith("out of memory"):
                        why = f"{row['error']} at {point.label}: a point as large would run out too"
                        if tokens is not None:
                            self._out_of_memory.setdefault(name, (tokens, why))
                self.writer.write(row)
                written.append(row)
                if forecast is not None:
                    forecast.finished(key)
                bar.set_postfix_str(_time_left(forecast), refresh=False)
                bar.update(1)
                if row["status"] == "failed" and self.world > 1:
                    # The other ranks may be waiting in this op's collectives: going on would hang them.
                    # Exiting makes torchrun stop the job and report this rank's error.
                    raise RuntimeError(f"rank {self.rank}: {name}.{phase_name} {point.label}: {row['error']}")
            if call is not None and call.module is not None:
                # its weights' gradients go with its inputs: the next op's peak holds the weights alone
                # (autotuner.runner.memory_estimate)
                for param in call.module.parameters():
                    param.grad = None
            del call
        bar.close()
        return written

    def _forecast(self, todo: list[tuple[ShapePoint, OpTest, str]]) -> Forecast | None:
        """The rows' estimated seconds (autotuner.runner.eta) and one line saying their sum (rank 0);
        None where the plan has no costs (a capture's generic calls) or the observer no rule."""
        from autotuner.model.runtime import DTYPES
        from autotuner.runner.eta import Forecast, human_seconds, measure_rates

        expected = getattr(self.observer, "expected_seconds", None)
        costs = self.fit.costs if self.fit is not None else {}
        if expected is None or not costs or not todo:
            return None
        rates = measure_rates(self.spec.device, DTYPES[self.spec.dtype])

        def call_s(point: ShapePoint, op: OpTest, phase: str) -> float:
            cost = costs.get((point.label, op.name, phase))
            return rates.call_seconds(*cost) if cost is not None else 0.0

        seconds = {}
        for point, op, phase in todo:
            key = (point.label, op.name, phase)
            if self.fit is not None and self.fit.refuses(key):
                seconds[key] = 0.0
                continue
            times = {ph: call_s(point, op, ph) for ph in op.phases}
            seconds[key] = expected(phase, times.get("forward", 0.0), times.get("backward", 0.0), rates)
        forecast = Forecast(seconds)  # the profiler's start-up was paid by measure_rates
        running = sum(1 for key in seconds if self.fit is None or not self.fit.refuses(key))
        if self.rank == 0:
            print(
                f"autotuner: {running} rows to run, estimated {human_seconds(forecast.total_s)} (their "
                f"FLOPs, bytes and operations at this machine's rates: GEMM {rates.flop_per_s / 1e9:.0f} "
                f"GFLOP/s, copy {rates.byte_per_s / 1e9:.1f} GB/s, {rates.operation_s * 1e6:.0f} us per "
                "operation)",
                file=sys.stderr,
            )
        return forecast

    def _build(
        self, op: OpTest, context: OpContext, point: ShapePoint
    ) -> tuple[OpCall | None, BaseException | None]:
        absent = op.absent_reason(self.spec.tf_config)
        if absent is not None:  # asked for by name in a model without it (an MLA op in a dense model)
            return None, OpNotApplicable(f"{op.name}: {absent}")
        try:
            call = op.build(context, point)
        except Exception as exc:  # noqa: BLE001 - recorded in the row; the plan goes on
            return None, exc
        stray = sorted(set(call.row_fields or ()) - set(CALL_COLUMNS))
        if stray:  # a slip in the op's code: its rows fail saying so, the plan goes on
            return None, ValueError(
                f"op {op.name}: row_fields {', '.join(stray)} are not columns an op may state "
                f"(autotuner.results.CALL_COLUMNS: {', '.join(CALL_COLUMNS)})"
            )
        return call, None

    def _measure(
        self,
        op: OpTest,
        point: ShapePoint,
        phase_name: str,
        call: OpCall | None,
        build_error: BaseException | None,
    ) -> dict[str, Any]:
        if isinstance(build_error, OpNotApplicable):
            return {"status": "skipped", "error": str(build_error)}
        if build_error is not None:
            return {"status": "failed", "error": one_line(build_error)}
        assert call is not None
        try:
            metrics = self.observer.observe(op, point, Phase(phase_name, call, self.spec.seed))
            if self.spec.emulation is not None:
                metrics["collectives"] = _collectives(Phase(phase_name, call, self.spec.seed))
            return {"status": "ok", **metrics}
        except Exception as exc:  # noqa: BLE001 - an op that fails (OOM, an exception) is recorded; the plan goes on
            from autotuner.model.build import is_out_of_memory

            if self.spec.device.type == "cuda":
                torch.cuda.empty_cache()
            if self.progress:
                print(f"\n{op.name}.{phase_name} {point.label} failed:", file=sys.stderr)
                traceback.print_exc(limit=3)
            if is_out_of_memory(exc) and self.fit is not None:  # said as the fit check saw it
                oom = self.fit.out_of_memory((point.label, op.name, phase_name))
                return {"status": "failed", "error": f"{oom}: {one_line(exc)}"}
            return {"status": "failed", "error": one_line(exc)}


def _collectives(phase: Phase) -> list[dict[str, Any]]:
    """The collectives an emulated rank's phase issues, from one untimed call of it (its ``prepare`` not
    recorded): each ``{kind, bytes, group}`` (autotuner.model.emulation)."""
    from autotuner.model.emulation import recording

    if phase.prepare is not None:
        phase.prepare()
    with recording() as issued:
        phase.run()
    phase.clear_grads()
    return issued


def _time_left(forecast: Forecast | None) -> str:
    from autotuner.runner.eta import human_seconds

    return f"{human_seconds(forecast.left_s())} left (estimated)" if forecast is not None else ""


def _progress(total: int, done: int, enabled: bool) -> tqdm:
    """The phases' progress bar on stderr; with ``progress=false`` a disabled bar, whose methods do
    nothing. tqdm is imported at the top: torch imports it anyway, so a lazy import saves nothing."""
    return tqdm(
        total=total,
        initial=done,
        unit="phase",
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
        disable=not enabled,
        # tqdm's own time left assumes rows of equal length (a layer's backward takes a thousand times a
        # norm's): the plan's estimate replaces it (autotuner.runner.eta)
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",  # ", " precedes a postfix
    )
