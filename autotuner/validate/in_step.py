"""The ops' times inside the real training step, by module hooks: where a step-time error sits.

The predictor sums op rows, each timed alone; autotuner.validate.steps runs the whole step. Where the two
disagree, the step's own per-op times say which op, or which cost between ops, is missing.
``ModuleClock`` hooks the embedding, every decoder layer, the final norm and the output layer with its
loss (as the op rows time them) of each model chunk: a forward from its pre-hook to its hook, a backward
from its output's gradient arriving to its input's gradient being complete (the embedding's, whose input
has none, to its table's gradient being accumulated), so the weight gradients' accumulation of a step is
inside. A mark is ``time.perf_counter`` on a CPU and a recorded CUDA event on a GPU (device time, read
after the step's synchronize). Each timed step's visits are kept as a timeline (:data:`Visit`), the ranks'
on one axis by the wall clock at each rank's start mark (ranks leave the barrier apart), so the gaps
between ops show; cut into the schedule's boxes (:func:`measured_boxes`) they give the hand-overs a stage
waited for (:func:`handovers`) and replay through the predictor's schedule (:func:`replay`). A step with
activation recompute records nothing: a recomputed forward would fire the forward hooks again.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from autotuner.measure.stats import fenced_mean

# One op visit in a step's timeline: (an IN_STEP_KEYS key, the layer's number, 1-based as Megatron counts
# the whole model's layers, 0 for other modules; start and end seconds from the step's start mark).
Visit = tuple[str, int, float, float]
# Where a layer runs: (pipeline rank, model chunk on it), as autotuner.predict.layout.Layout.layer_places.
Place = tuple[int, int]

# What a rank reports, in this order (a fixed list, so that ranks can exchange it as numbers): the
# seconds per visit over the timed steps, their fenced mean as the rows' (what a visit adds to a step:
# autotuner.measure.stats.fenced_mean), NaN where the rank has no such module or phase.
IN_STEP_KEYS = (
    "embedding.forward",
    "embedding.backward",
    "transformer_layer.forward",
    "transformer_layer.backward",
    "final_layernorm.forward",
    "final_layernorm.backward",
    "output_layer.forward",
    "output_layer.backward",
    "stage.forward",
)


def chunks_of(places: Sequence[Place]) -> int:
    """The model chunks per pipeline rank (vpp) that ``places`` lay the layers out in."""
    return 1 + max(chunk for _, chunk in places)


def inside_ops_s(visits: Sequence[Visit]) -> float:
    """The seconds of a timeline inside some op visit (the union of their spans; the stage's forward,
    which holds the ops, left out): the rest of the rank's forward-backward is between its ops."""
    spans = sorted((start, end) for key, _, start, end in visits if not key.startswith("stage."))
    total, reached = 0.0, -math.inf
    for start, end in spans:
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def host_work_s(visits: Sequence[Visit], forward_backward_s: float, microbatches: int) -> tuple[float, float]:
    """One rank's time outside its ops per micro-batch, (forward, backward), from a timed step's visits:
    the forward's is the model forward's span less the ops inside it (GPTModel's own work: the rotary
    table, the block's); the backward's is the rest of the time between the ops (the loss function, the
    schedule's forward and backward steps, autograd's start). The calibration times it on a minimal model
    (autotuner.calibrate), where it is the schedule's and the model's host work, not its ops'."""
    forwards = [(start, end) for key, _, start, end in visits if key == "stage.forward"]
    ops = [v for v in visits if not v[0].startswith("stage.")]
    forward = sum(
        (end - start) - inside_ops_s([v for v in ops if start <= v[2] and v[3] <= end])
        for start, end in forwards
    )
    between = forward_backward_s - inside_ops_s(ops)
    return max(forward, 0.0) / microbatches, max(between - forward, 0.0) / microbatches


# A rank's forward or backward of one micro-batch and model chunk, as it ran: (phase, micro-batch, chunk)
# -> (start, end), the key of autotuner.predict.schedule's boxes less the stage.
Boxes = dict[tuple[str, int, int], tuple[float, float]]


def measured_boxes(visits: Sequence[Visit], places: Sequence[Place], stage: int) -> Boxes | None:
    """Pipeline rank ``stage``'s timeline cut into the boxes of the pipeline schedule, each from its first
    op's start to its last op's end; ``places``: each layer's (rank, chunk), in Megatron's numbering
    (``Layout.layer_places``). None where a chunk's forward holds no layer's or a chunk of the rank holds
    no layer.

    A forward is one ``stage.forward`` (the chunk's model forward, the loss in the last chunk's), its
    chunk the one whose layers run inside it; a backward is a chunk's backward visits up to and with its
    last layer's (on the model's last chunk the output layer's and the final norm's come first; on its
    first, the embedding's ends it, where timed). A rank runs a
    chunk's micro-batches in order, so the k-th box of a chunk and phase is micro-batch k."""
    v = chunks_of(places)
    per_chunk = Counter(chunk for rank, chunk in places if rank == stage)
    if len(per_chunk) < v:
        return None

    def chunk_of(layer: int) -> int:
        return places[layer - 1][1]

    layer_visits = [x for x in visits if x[0].startswith("transformer_layer.")]
    found: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for _, _, start, end in sorted(x for x in visits if x[0] == "stage.forward"):
        inside = [x[1] for x in layer_visits if x[0].endswith(".forward") and start <= x[2] <= end]
        if not inside:
            return None
        found[("forward", chunk_of(inside[0]))].append((start, end))
    last_chunk = v - 1
    groups: dict[int, list[tuple[float, float]]] = defaultdict(list)
    counted: dict[int, int] = defaultdict(int)
    # the model's first chunk (pipeline rank 0's first) ends with the embedding's backward where timed
    lead = any(x[0] == "embedding.backward" for x in visits)
    for key, layer, start, end in sorted(
        (x for x in visits if x[0].endswith(".backward")), key=lambda x: x[2]
    ):
        if key.startswith("transformer_layer."):
            chunk = chunk_of(layer)
        else:
            chunk = 0 if key.startswith("embedding.") else last_chunk
        groups[chunk].append((start, end))
        counted[chunk] += key.startswith("transformer_layer.")
        ends = key.startswith("embedding.") if lead and chunk == 0 else counted[chunk] == per_chunk[chunk]
        if ends:
            found[("backward", chunk)].append((groups[chunk][0][0], max(e for _, e in groups[chunk])))
            groups[chunk], counted[chunk] = [], 0
    boxes: Boxes = {}
    for (phase, chunk), spans in found.items():
        boxes.update({(phase, mb, chunk): span for mb, span in enumerate(spans)})
    return boxes


def handovers(stages: Sequence[Sequence[Visit]], places: Sequence[Place]) -> list[tuple[str, float]]:
    """A pipeline's hand-overs that a stage waited for, from one step's timelines of its stages (one rank
    each, the same tp and dp rank, in stage order; ``places`` as for :func:`measured_boxes`): for each
    box whose input comes from another stage (autotuner.predict.schedule.dependency), ("forward" |
    "backward", seconds from the sender's box's end to the receiver's box's start), counted only where the
    receiver had nothing left to run when the sender finished (nothing of its own ran in between): then
    the gap is the exchange, both ends' schedule work and the receiver's wake-up, not work of its own."""
    from autotuner.predict.schedule import dependency

    p, v = len(stages), chunks_of(places)
    cut = [measured_boxes(visits, places, s) for s, visits in enumerate(stages)]
    if any(boxes is None for boxes in cut):
        return []
    found = []
    for s, boxes in enumerate(cut):
        for (phase, mb, chunk), (received, _) in boxes.items():
            needs = dependency((s, phase, mb, chunk), p, v)
            if needs is None or needs[0] == s or needs[1:] not in cut[needs[0]]:
                continue
            sent = cut[needs[0]][needs[1:]][1]
            idle = not any(  # nothing of the receiver's own ran after the sender's box ended
                end > sent and begin < received
                for key, _, begin, end in stages[s]
                if not key.startswith("stage.")
            )
            if sent < received and idle:
                found.append((phase, received - sent))
    return found


def replay(
    stages: Sequence[Sequence[Visit]],
    places: Sequence[Place],
    microbatches: int,
    exchange_s: float,
    overlapped: bool = False,
) -> float | None:
    """The measured step's boxes (:func:`measured_boxes`, one rank per stage) placed by the predictor's
    schedule (autotuner.predict.schedule; ``overlapped`` as there) with ``exchange_s`` per exchange:
    seconds from the first box's start to the last one's end; None where a rank's visits do not make
    every box. Beside the measured span from the first op's start to the last op's end it tests the
    schedule model alone, each box taking the time it took."""
    from autotuner.predict.schedule import simulate

    p, v = len(stages), chunks_of(places)
    own = {}
    for s, visits in enumerate(stages):
        boxes = measured_boxes(visits, places, s)
        if boxes is None or len(boxes) != 2 * microbatches * v:
            return None
        own.update({(s, *key): end - start for key, (start, end) in boxes.items()})
    return simulate(lambda key: own[key], p, v, microbatches, exchange_s, overlapped).end


class ModuleClock:
    """Hooks on one rank's model chunks; ``recording`` on for the timed steps only; :meth:`collect` after
    each timed step's synchronize; :meth:`per_visit` at the end."""

    def __init__(self, chunks: list[Any], device: Any) -> None:
        import torch

        self._torch = torch
        self._cuda = device.type == "cuda"
        self.recording = False
        self._open: list[tuple[str, int, Any, Any]] = []  # (key, layer, start, end mark) not yet read
        self._spans: dict[str, list[float]] = defaultdict(list)
        self._step_start: Any = None
        self._step_wall = 0.0
        self.timelines: list[list[Visit]] = []  # per timed step, its visits in the order they ended
        self.step_walls: list[float] = []  # per timed step, the wall clock (time.time) at its start mark
        for chunk in chunks:
            model = getattr(chunk, "module", chunk)  # past a DDP-style wrapper
            if getattr(model, "pre_process", False):
                # its input, token ids, has no gradient: the table's gradient accumulated ends its backward
                table = model.embedding.word_embeddings.weight
                self._hook(model.embedding, "embedding", ends_with=table)
            for layer in model.decoder.layers:
                self._hook(layer, "transformer_layer")
            if getattr(model, "post_process", False):
                if getattr(model.decoder, "final_layernorm", None) is not None:
                    self._hook(model.decoder.final_layernorm, "final_layernorm")
                self._hook_head(model)
            self._hook(model, "stage", backward=False)

    def _mark(self) -> Any:
        if self._cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start_step(self) -> None:
        """Mark a timed step's start (its visits' time origin) and record its visits from here."""
        self._step_wall = time.time()
        self._step_start = self._mark()
        self.recording = True

    def _span(self, key: str, start: Any, layer: int = 0) -> None:
        self._open.append((key, layer, start, self._mark()))

    def _hook(self, module: Any, name: str, backward: bool = True, ends_with: Any = None) -> None:
        """Time ``module``'s forward and (``backward``) its backward, which ends when the gradient of its
        input is complete or, with ``ends_with`` (a parameter), when that parameter's gradient has been
        accumulated (its last hook: the ones registered before it, as the main-gradient add, run first)."""
        torch = self._torch
        started: dict[str, Any] = {}  # this module's open forward, then its open backward
        layer = int(getattr(module, "layer_number", 0) or 0) if name == "transformer_layer" else 0
        if ends_with is not None:
            ends_with.register_post_accumulate_grad_hook(lambda _p: self._end_backward(name, started, layer))

        def before(_module: Any, args: tuple, kwargs: dict) -> None:
            if not self.recording:
                return
            started["forward"] = self._mark()
            if not backward or ends_with is not None:
                return
            given = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            if torch.is_tensor(given) and given.requires_grad:
                given.register_hook(lambda _grad: self._end_backward(name, started, layer))

        def after(_module: Any, _args: tuple, _kwargs: dict, output: Any) -> None:
            if not self.recording or "forward" not in started:
                return
            self._span(f"{name}.forward", started.pop("forward"), layer)
            out = output[0] if isinstance(output, tuple) else output
            if backward and torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda _grad: started.__setitem__("backward", self._mark()))

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)

    def _hook_head(self, model: Any) -> None:
        """The output layer and the loss after it, as one op (the row ``output_layer``)."""
        torch = self._torch
        started: dict[str, Any] = {}
        loss_of = model.compute_language_model_loss  # bound method; GPTModel calls it by attribute

        def before(_module: Any, args: tuple, kwargs: dict) -> None:
            if not self.recording:
                return
            started["forward"] = self._mark()
            given = args[0] if args else kwargs.get("input_")
            if torch.is_tensor(given) and given.requires_grad:
                given.register_hook(lambda _grad: self._end_backward("output_layer", started))

        def loss(*args: Any, **kwargs: Any) -> Any:
            per_token = loss_of(*args, **kwargs)
            if self.recording and "forward" in started:
                self._span("output_layer.forward", started.pop("forward"))
                if torch.is_tensor(per_token) and per_token.requires_grad:
                    per_token.register_hook(lambda _grad: started.__setitem__("backward", self._mark()))
            return per_token

        model.output_layer.register_forward_pre_hook(before, with_kwargs=True)
        model.compute_language_model_loss = loss

    def _end_backward(self, name: str, started: dict[str, Any], layer: int = 0) -> None:
        if "backward" in started:
            self._span(f"{name}.backward", started.pop("backward"), layer)

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self._cuda else end - start

    def collect(self) -> None:
        """Read the spans marked since the last call (on a GPU: after the device was synchronized); with
        a step's start mark (:meth:`start_step`), they are that step's timeline."""
        origin = self._step_start
        for key, _, start, end in self._open:
            self._spans[key].append(self._seconds(start, end))
        if origin is not None:
            self.timelines.append(
                [
                    (key, layer, self._seconds(origin, s), self._seconds(origin, e))
                    for key, layer, s, e in self._open
                ]
            )
            self.step_walls.append(self._step_wall)
        self._open.clear()
        self._step_start = None

    def per_visit(self) -> tuple[float, ...]:
        """Per IN_STEP_KEYS, the seconds per visit, their fenced mean (NaN where nothing was timed)."""
        return tuple(
            fenced_mean(self._spans[key]) if self._spans.get(key) else math.nan for key in IN_STEP_KEYS
        )
