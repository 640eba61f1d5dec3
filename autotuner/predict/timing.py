"""Time per micro-batch of each pipeline stage, and the step time, from the ops' times.

Each op's time at the layout's point, measured, scaled or modelled and said which, comes from
autotuner.predict.op_time; which of an op's visits take its warm row and which its flushed one, from
autotuner.predict.caches.

**A stage's time per micro-batch**: the stage's layers (L/pp, or Megatron's uneven split:
``Layout.stage_layers``) x the layer's forward and backward, plus the
embedding on the first stage and the final norm + output layer on the last; recompute adds the forward it
re-runs inside the backward (full: every layer's forward; selective: core attention's forward, as
Megatron's ``recompute_granularity=selective``). With pp > 1 the stages exchange one micro-batch's s*b*h
activations (forward) or their gradients (backward): Megatron's 1F1B batches a stage's send and receive
into one call, one transfer's time (``pp_p2p``, *modelled* from the link calibration's ``send_recv``,
that exchange timed between two processes), which the schedule charges where it happens (below), not
inside a stage's time. With vpp model chunks per rank each chunk is a box of the schedule with its own
time (:func:`chunk_times`): its layers, and the embedding in the model's first chunk, the final norm and
the output layer in its last, as Megatron builds them (pre_process, post_process); the host work below
is paid per chunk, each running its own forward and backward step.

The op rows time a backward that hands its weight gradients back fresh; a training step adds each micro-
batch's into the gradient it keeps across them (torch's AccumulateGrad into ``.grad``; Megatron's DDP
into ``main_grad``): per micro-batch one pass over the stage's parameters, reading the new gradient and
the kept fp32 one and writing it back (``grad_accumulation``): the calibration's timed rate for the
model's dtype (``grad_accumulation_seconds_per_parameter``) x the stage's parameters, else those bytes
over the calibrated memory bandwidth, which undercounts a bf16 gradient's add (on an H200 it ran at 0.64x
the copy rate, and a Llama-2-7B layer's backward inside a real step was its row + that add's time).
Megatron's ``gradient_accumulation_fusion`` (its fused weight-gradient GEMM on GPUs) accumulates inside
the GEMM: then this is zero.

**Host work outside the ops.** A training step also spends time outside every op: Megatron's schedule (each
micro-batch's forward and backward steps, the loss function, autograd's start) and GPTModel's own work (the
rotary table, the block's own work around each layer). On a CPU, where the host is the device, each stage's
forward and backward per micro-batch add it (``host_work``, *scaled*): the calibration's timed part for a
stage (for each of its model chunks) plus its part per layer x the stage's layers
(``host_work_seconds_per_microbatch``, autotuner.calibrate.host_work, timed on a minimal GPTModel at two
depths). That work's own data (the interpreter's, the allocator's, autograd's) lives in the last-level cache,
which a large model's ops sweep out between its visits, and then comes back from memory: where a micro-batch's
ops on the stage touch more bytes than the shared cache holds (autotuner.predict.caches.host_work_cached, from
the same sweep as the ops' warm or flushed rows; on a CPU the layout's processes all sweep one host's cache,
so their bytes add), the host work is the calibration's timed with the cache flushed inside every layer
(``host_work_seconds_per_microbatch_flushed``). On this project's VM the llama-shaped model's steps (four
layers, s128, one process) spent 0.37 ms forward and 0.73 backward a micro-batch outside their ops, the
minimal model at four layers, as one calibration timed it, 0.17 / 0.26 warm and 0.39 / 0.70 flushed; its PP2
stages (two processes, each a stage of about 26 MB) 0.28-0.30 forward, the flushed figure at two layers 0.26.
On a GPU the host queues the kernels ahead of the device, which hides this behind them as long
as the kernels outlast it: not added.

**The step**: the pipeline, simulated (autotuner.predict.schedule): every stage's forwards and backwards
placed in the order Megatron-Core's 1F1B schedule (interleaved with vpp) runs them, each taking its own
stage's time (/vpp per model chunk), each waiting for its input from the neighbour stage, and every
exchange charged to both ends (interleaved on GPUs: to the receiving box, the exchanges overlapped with
compute as Megatron-LM runs that schedule); the pipeline time is where the last box ends. For equal
stages and free exchanges that is Narayanan et al. 2021's (m + p - 1) x (t_f + t_b), m * (t_f + t_b) * (1
+ (p-1)/(v*m)) interleaved (section 2.2; printed beside it), which paces every stage at the slowest one.
Then the data-parallel gradient reduction after the backward (all-reduce of the stage's dense gradients over
dp and of its routed experts' over the tp*dp/ep ranks holding the same experts; with the distributed optimizer
reduce-scatter of the gradients + all-gather of the parameters) and the Adam step (bytes read and written per
parameter over the calibrated memory bandwidth), or, where the calibration timed it, the Adam step's measured
time per parameter (``adam_seconds_per_parameter``; for a layout of several CPU processes, which share one
memory, the rate timed with all of them at it) x the stage's parameters, plus its measured time per tensor
(``adam_seconds_per_tensor``: on a CPU torch's Adam loops over the tensors) x the tensors it steps (the
stage's parameter tensors, ``ModelShape.stage_tensors``; with the distributed optimizer each flat buffer's
share, as autotuner.predict.steps runs it), plus its measured cost for each parameter whose gradient and
moments are zero (``adam_seconds_per_zero_state_parameter``) x the first stage's embedding parameters in rows
no token of the global batch touches (``ModelShape.untouched_embedding_params``: tokens drawn uniformly, as
the validation's steps draw them, one global batch every step; over a real run's varied text they dwindle to
the vocabulary's unused entries), plus, where a CPU calibration timed it inside real steps, what a step's Adam
takes there beyond those back-to-back rates, once a step (``adam_seconds_per_step_in_training``:
autotuner.calibrate.adam_in_step), plus zeroing the gradients for the next step (4 B per parameter at the
calibration's zeroing rate, ``zeroing_bandwidth``)
and with bf16/fp16 the copy of the fp32 main parameters into the model's dtype; the step waits for the slowest
stage's. Nothing is assumed to overlap: the step time is an upper bound, and the table says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotuner.ops.naming import PHASES
from autotuner.predict.caches import blend
from autotuner.predict.communication import (
    context_parallel_items,
    gather_total,
    grad_reduce_end,
    kv_exchange_bytes,
    param_gather_delays,
    tp_overlap_item,
)
from autotuner.predict.layout import Layout, Source
from autotuner.predict.memory import GRAD_BYTES
from autotuner.predict.op_time import OpTime, TimeModel
from autotuner.predict.overlap import Exposed
from autotuner.predict.schedule import Key, Schedule, closed_form_s, overlaps_exchanges, simulate
from autotuner.results.calibration import (
    ADAM_IN_STEP,
    ADAM_PER_TENSOR,
    ADAM_TOGETHER,
    ADAM_ZERO_STATE,
    GRAD_ACCUMULATION,
    HOST_WORK,
    HOST_WORK_FLUSHED,
    ZEROING_BANDWIDTH,
    link_key,
)
from autotuner.results.units import human_time

# Adam with mixed precision (Megatron's DistributedOptimizer / FP32 main params): per parameter, read main
# grad, fp32 master, exp_avg, exp_avg_sq (4 B each), write master, exp_avg, exp_avg_sq (4 B) and the
# model's bf16/fp16 copy (2 B); in fp32 the master is the parameter itself.
ADAM_BYTES = {"bf16": 16 + 14, "fp16": 16 + 14, "fp32": 16 + 12}
OVERLAP = (
    "nothing overlaps: TP collectives, DP gradient reduction and the optimizer step are added to the "
    "pipeline's time (an upper bound; Megatron can overlap the DP reduction with the backward)"
)


def overlap_statement(lay: Layout) -> str:
    """What of the step's communication the prediction lets overlap, in words (:data:`OVERLAP` where
    nothing does)."""
    on = [
        what
        for flag, what in (
            (
                lay.overlap_grad_reduce,
                "the DP gradient reduction with the last backward (overlap_grad_reduce)",
            ),
            (
                lay.overlap_param_gather,
                "the parameter all-gather with the next forward (overlap_param_gather)",
            ),
            (lay.tp_comm_overlap, "the TP collectives with their GEMMs (tp_comm_overlap, modelled)"),
            (lay.cp > 1, "context parallelism's key-value exchange with its attention"),
        )
        if flag
    ]
    if not on:
        return OVERLAP
    return (
        "overlapped: " + "; ".join(on) + "; each exposed term in the breakdown; the optimizer step is added"
    )


@dataclass(frozen=True)
class StageTime:
    """One pipeline stage (one rank's share; with vpp, its v chunks together) per micro-batch."""

    index: int
    layers: int
    forward: float
    backward: float
    items: tuple[tuple[str, str, OpTime, int], ...]  # (name, phase, time, count)
    dominant: str
    # each model chunk's (forward, backward) per micro-batch, adding up to the stage's: the schedule's
    # boxes (:func:`chunk_times`); one entry without vpp
    chunks: tuple[tuple[float, float], ...] = ()

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.index,
            "layers": self.layers,
            "forward_s": self.forward,
            "backward_s": self.backward,
            "dominant_op": self.dominant,
            "chunks": [{"forward_s": f, "backward_s": b} for f, b in self.chunks],
            "items": [
                {"name": n, "phase": p, "count": c, **t.to_json(), "total_s": t.seconds * c}
                for n, p, t, c in self.items
            ],
        }


def grad_accumulation(tm: TimeModel, params: float) -> OpTime | None:
    """Adding one micro-batch's weight gradients into the kept fp32 gradients of ``params`` parameters
    (module docstring); None under Megatron's gradient_accumulation_fusion."""
    if tm.model.config.get("gradient_accumulation_fusion"):
        return None
    dtype = tm.layout.dtype
    what = f"each micro-batch's {dtype} weight gradients added into the kept fp32 gradients"
    rate = (tm.calibration.get(GRAD_ACCUMULATION) or {}).get(dtype)
    if rate:
        seconds = rate * params
        detail = (
            f"{what}, timed by autotuner.calibrate: {rate * 1e12:.4g} ps per parameter x {params:.4g} "
            f"params = {seconds:.4g} s (none with gradient_accumulation_fusion)"
        )
        return OpTime(seconds, Source("scaled", detail), {"grad_accumulation": seconds})
    bw, said = tm.memory_bandwidth()
    per_param = tm.layout.bytes_per_element + 8  # read the new gradient, read and write the fp32 one
    nbytes = per_param * params
    detail = (
        f"{what}: {per_param} B x {params:.4g} params = {nbytes:.4g} B / {said} (none with "
        f"gradient_accumulation_fusion; {tm.untimed('it')}, python -m autotuner.calibrate does: "
        "a bf16 gradient's add ran at 0.64x the copy rate on an H200)"
    )
    return OpTime(nbytes / bw, Source("modelled", detail), {"grad_accumulation": nbytes / bw})


def host_work(tm: TimeModel, phase: str, layers: int, cached: tuple[bool, str] = (True, "")) -> OpTime | None:
    """The host work outside the ops of one micro-batch's ``phase`` on a stage of ``layers`` layers in the
    layout's vpp model chunks, each its own forward and backward step of the schedule and its own
    GPTModel forward, as timed with warm caches or, where ``cached``
    (autotuner.predict.caches.host_work_cached) says the stage's ops sweep them out, with the caches flushed
    (module docstring); None on a GPU, and on a CPU without it in the calibration (said in a warning)."""
    if tm.meas.devices != {"cpu"}:
        return None
    timed = tm.calibration.get(HOST_WORK)
    if not timed:
        what = "a step's host work outside its ops"
        tm._warn(
            f"{tm.untimed(what)} (Megatron's schedule, "
            "GPTModel's own work; about 1 ms a micro-batch on this project's CPU VM): not added, "
            "python -m autotuner.calibrate times it"
        )
        return None
    warm, why = cached
    how = f" ({why})" if why else ""
    if not warm and tm.calibration.get(HOST_WORK_FLUSHED):
        timed, how = tm.calibration[HOST_WORK_FLUSHED], f", the caches flushed inside each layer ({why})"
    elif not warm:
        tm._warn(
            f"the stage's host work runs with the caches swept out ({why}), and the calibration timed it "
            "only with them warm: under-counted, python -m autotuner.calibrate times it both ways"
        )
    base, per_layer, chunks = timed[phase], timed[f"{phase}_per_layer"], tm.layout.vpp
    seconds = base * chunks + per_layer * layers
    per_chunk = f" per model chunk x {chunks}" if chunks > 1 else ""
    detail = (
        f"the step's {phase} host work outside its ops (Megatron's schedule, GPTModel's own), timed by "
        f"autotuner.calibrate on a minimal GPTModel{how}: {human_time(base * 1e6)}{per_chunk} + "
        f"{human_time(per_layer * 1e6)} per layer x {layers} = {human_time(seconds * 1e6)} per micro-batch"
    )
    return OpTime(seconds, Source("scaled", detail), {"host_work": seconds})


def pipeline_transfer(tm: TimeModel) -> OpTime:
    """One micro-batch's exchange between pipeline stages in one phase (module docstring)."""
    lay = tm.layout
    nbytes = lay.seq_len * lay.micro_batch_size * tm.model.hidden * lay.bytes_per_element
    nbytes /= lay.tp if lay.sequence_parallel else 1
    seconds, src = tm.collective("send_recv", nbytes, 2, "pp_pair")
    detail = (
        f"one s*b*h = {nbytes:.4g} B transfer per micro-batch (send and receive batched, as Megatron's "
        f"1F1B does): {src.detail}"
    )
    return OpTime(seconds, Source("modelled", detail), {"pp_p2p": seconds})


def stage_times(
    tm: TimeModel,
    stage_params: list[float] | None = None,
    warm_tm: TimeModel | None = None,
    warm: list[dict[tuple[str, str], int]] | None = None,
    host_cached: Sequence[tuple[bool, str]] | None = None,
) -> list[StageTime]:
    """Each stage's forward and backward per micro-batch (module docstring); ``stage_params``: the
    parameters each stage's GPU holds, for the gradient accumulation. With ``warm_tm`` (its rows the
    warm ones, ``tm``'s the flushed ones) and ``warm``, each stage's warm visits
    (autotuner.predict.caches.cache_plan), an op's visits that find their data cached take its warm rows,
    the others its flushed ones; ``host_cached``: per stage, autotuner.predict.caches.host_work_cached
    (else its host work is the warm one)."""
    lay, model = tm.layout, tm.model
    stages = []
    for index, per_stage in enumerate(lay.stage_layers(model.num_layers)):
        plan = warm[index] if warm_tm is not None and warm else {}

        def visited(op: str, phase: str, count: int, plan: dict = plan) -> tuple[str, str, OpTime, int]:
            cached = plan.get((op, phase), 0)
            if warm_tm is None or cached == 0:
                return op, phase, tm.op(op, phase), count
            if cached == count:
                return op, phase, warm_tm.op(op, phase), count
            return op, phase, blend(warm_tm.op(op, phase), tm.op(op, phase), cached, count), count

        items: list[tuple[str, str, OpTime, int]] = []
        for phase in PHASES:
            items.append(visited("transformer_layer", phase, per_stage))
            if index == 0:
                items.append(visited("embedding", phase, 1))
            if index == lay.pp - 1:
                items.append(visited("final_layernorm", phase, 1))
                items.append(visited("output_layer", phase, 1))
        for name, phase, _, count in list(items):
            comm = tm.tp_collectives(name, phase)
            if comm is not None:
                timed = OpTime(comm[0], comm[1], {"tp_collectives": comm[0]})
                if lay.tp_comm_overlap and name == "transformer_layer":
                    timed = tp_overlap_item(tm, phase, timed)
                items.append((f"tp_collectives:{name}", phase, timed, count))
        for phase in PHASES:
            items += context_parallel_items(tm, phase, per_stage)
        for phase in PHASES:
            work = host_work(tm, phase, per_stage, host_cached[index] if host_cached else (True, ""))
            if work is not None:
                items.append(("host_work", phase, work, 1))
        accumulate = grad_accumulation(tm, stage_params[index]) if stage_params else None
        if accumulate is not None:
            items.append(("grad_accumulation", "backward", accumulate, 1))
        if lay.recompute == "full":
            items.append(
                ("recompute:transformer_layer", "backward", tm.op("transformer_layer", "forward"), per_stage)
            )
        elif lay.recompute == "selective":
            items.append(
                ("recompute:core_attention", "backward", tm.op("core_attention", "forward"), per_stage)
            )
        if lay.recompute != "none":  # the attention's other context-parallel steps are re-run too
            items += [
                (f"recompute:{name}", "backward", t, c)
                for name, phase, t, c in context_parallel_items(tm, "forward", per_stage)
                if name == "cp_attention"
            ]
        forward = sum(t.seconds * c for _, p, t, c in items if p == "forward")
        backward = sum(t.seconds * c for _, p, t, c in items if p == "backward")
        # the stage's parameters outside its layers: the embedding's, the final norm's, the output layer's
        outside = 0.0
        if stage_params and stage_params[index] > 0:
            layers_params = per_stage * model.layer_params_on_rank(lay.tp, lay.ep)
            outside = max(0.0, 1 - layers_params / stage_params[index])
        chunks = chunk_times(items, index, lay, outside)
        stages.append(
            StageTime(index, per_stage, forward, backward, tuple(items), _dominant(tm, items), chunks)
        )
    return stages


# What lies outside the layers, by the model chunk that holds it: Megatron builds the embedding into the
# model's first chunk (pre_process) and the final norm, the output layer and the loss into its last
# (post_process); everything else of a stage is spread over its chunks with their layers (equal counts).
FIRST_CHUNK_OPS = ("embedding",)
LAST_CHUNK_OPS = ("final_layernorm", "output_layer")


def chunk_times(
    items: list[tuple[str, str, OpTime, int]], stage: int, lay: Layout, extras_share: float
) -> tuple[tuple[float, float], ...]:
    """Each model chunk's (forward, backward) per micro-batch on pipeline rank ``stage``: the embedding
    (and its TP collectives) in the model's first chunk (rank 0's chunk 0), the final norm and the output
    layer in its last (rank p-1's chunk v-1), the layers, their collectives and recompute, and the host
    work (:func:`host_work`, per chunk and per layer) a 1/v share each, the gradients' accumulation by
    parameters (``extras_share``: the stage's share outside its layers, which is the first or the last
    chunk's). An even 1/v of the stage per chunk would put half the last chunk's output layer into the
    chunk before it (on the llama-shaped VPP2 2.1 ms forward, 3.1 backward a micro-batch), and pay the host
    work's part for a stage once, not per chunk."""
    v = lay.vpp
    edge = 0 if stage == 0 else v - 1  # the chunk holding what lies outside the layers, if any
    times = [[0.0, 0.0] for _ in range(v)]
    for name, phase, t, count in items:
        op, column, seconds = name.split(":", 1)[-1], PHASES.index(phase), t.seconds * count
        if op in FIRST_CHUNK_OPS:
            times[0][column] += seconds
        elif op in LAST_CHUNK_OPS:
            times[-1][column] += seconds
        else:  # spread with the layers; the accumulation's share outside them to the edge chunk
            own = extras_share if name == "grad_accumulation" else 0.0
            for chunk in times:
                chunk[column] += seconds * (1 - own) / v
            times[edge][column] += seconds * own
    return tuple((f, b) for f, b in times)


def _dominant(tm: TimeModel, items: list[tuple[str, str, OpTime, int]]) -> str:
    """The leaf op with the most time in the stage (forward + backward, x its count). Where the layer was
    measured whole, its sub-ops' rows (any point) apportion its time."""
    totals: dict[str, float] = {}
    for _, phase, t, count in items:
        parts = dict(t.parts)
        if set(parts) == {"transformer_layer"}:
            kids = tm.sub_op_parts("transformer_layer", phase)
            if kids:
                share = parts["transformer_layer"] / sum(kids.values())
                parts = {k: v * share for k, v in kids.items()}
        for leaf, sec in parts.items():
            totals[leaf] = totals.get(leaf, 0.0) + sec * count
    return max(totals, key=lambda k: totals[k]) if totals else "-"


@dataclass(frozen=True)
class StepTime:
    """The step: pipeline (simulated schedule), DP gradient reduction, optimizer; all in seconds."""

    pipeline: float
    bubble_fraction: float  # the pipeline over the slowest stage's m * (t_f + t_b), less 1
    slowest_stage: int
    dp_reduction: float
    dp_source: Source
    optimizer: float
    optimizer_source: Source
    formula: str
    schedule: Schedule
    closed_form: float  # Narayanan et al.'s pipeline time, for comparison (module docstring)
    exchange: OpTime | None = None  # one pipeline exchange (pp_p2p); None at pp = 1
    exchange_overlapped: bool = False  # charged to the receiving box alone (schedule.overlaps_exchanges)
    # each communication term: its seconds and what of it the step pays (autotuner.predict.communication)
    terms: tuple[Exposed, ...] = ()
    statement: str = OVERLAP  # what the prediction lets overlap (overlap_statement)

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_reduction + self.optimizer


def pipeline_schedule(
    stages: list[StageTime],
    lay: Layout,
    exchange_s: float,
    overlapped: bool,
    longer: dict[Key, float] | None = None,
) -> Schedule:
    """Each stage's forwards and backwards placed by Megatron-Core's schedule (module docstring), a box
    per micro-batch and model chunk, each taking its chunk's own time (:func:`chunk_times`), ``longer``
    boxes that much longer (a first forward waiting for its parameters' all-gather); ``overlapped``: the
    exchanges cost the receiving box alone (autotuner.predict.schedule.overlaps_exchanges)."""
    own = {
        (st.index, phase, chunk): times[PHASES.index(phase)]
        for st in stages
        for chunk, times in enumerate(st.chunks)
        for phase in PHASES
    }
    if longer:
        extra = longer
        return simulate(
            lambda key: own[(key[0], key[1], key[3])] + extra.get(key, 0.0),
            lay.pp,
            lay.vpp,
            lay.microbatches,
            exchange_s,
            overlapped,
        )
    return simulate(
        lambda key: own[(key[0], key[1], key[3])], lay.pp, lay.vpp, lay.microbatches, exchange_s, overlapped
    )


def step_time(
    tm: TimeModel, stages: list[StageTime], stage_params: list[float], stage_expert_params: list[float]
) -> StepTime:
    """The step from the stages; ``stage_params``: parameters each stage's GPU holds (after TP and EP),
    ``stage_expert_params``: how many of them are routed experts'."""
    lay = tm.layout
    exchange = pipeline_transfer(tm) if lay.pp > 1 else None
    overlapped = overlaps_exchanges(lay.vpp, "cpu" if tm.meas.devices == {"cpu"} else "cuda")
    exchange_s = exchange.seconds if exchange else 0.0
    waits = param_gather_delays(tm, stages) if lay.overlap_param_gather and lay.dp > 1 else {}
    sched = pipeline_schedule(stages, lay, exchange_s, overlapped, waits)
    slowest = max(range(len(stages)), key=lambda i: stages[i].total)
    pace = stages[slowest].total
    closed = closed_form_s(pace, lay.pp, lay.vpp, lay.microbatches)
    pipe = sched.end
    terms = [*_stage_terms(tm, stages[slowest], slowest)]
    if exchange is not None:
        alone = pipeline_schedule(stages, lay, 0.0, overlapped, waits).end
        per_rank = [0] * lay.pp
        for key, _, _, before in sched.placed:
            per_rank[key[0]] += before
        terms.append(
            Exposed(
                "pp_exchanges",
                max(per_rank) * exchange_s,
                pipe - alone,
                "the other stages' boxes (the schedule)",
                f"the schedule with its exchanges ({human_time(exchange_s * 1e6)} each, "
                f"{'to the receiver' if overlapped else 'to both ends'}) less the same without them",
            )
        )
    if exchange is None:  # Megatron's forward_backward_no_pipelining: the micro-batches in turn
        formula = f"no pipeline: m x (t_f + t_b) = {lay.microbatches} x t"
    else:
        name = "m*t*(1+(p-1)/(v*m))" if lay.vpp > 1 else "(m+p-1)*t"
        charged = "to the receiver (overlapped)" if overlapped else "to both ends"
        box = "model chunk" if lay.vpp > 1 else "stage"
        formula = (
            f"Megatron's {'interleaved ' if lay.vpp > 1 else ''}1F1B order simulated, each {box} its own "
            f"time, {human_time(exchange.seconds * 1e6)} per exchange {charged} (Narayanan's {name} with t "
            f"of stage {slowest}: {human_time(closed * 1e6)})"
        )
    # DP: the largest stage's gradients (fp32 main grads, 4 B) over dp ranks; the slowest stage gates.
    largest = max(range(len(stage_params)), key=lambda i: stage_params[i])
    dp_s, dp_src = dp_reduction(tm, stage_params[largest], stage_expert_params[largest])
    if waits:
        gathers = gather_total(tm, stage_params[largest])
        alone = pipeline_schedule(stages, lay, exchange_s, overlapped).end
        terms.append(
            Exposed(
                "param_gather",
                gathers,
                pipe - alone,
                "each model chunk's first forward",
                "overlap_param_gather: each bucket's all-gather waited for before its first module, the next "
                "one dispatched then: f_j = max(e_(j-1), g_j), g_(j+1) = f_j + t_(j+1); the first forwards' "
                "waits placed in the schedule",
            )
        )
    if lay.overlap_grad_reduce and lay.dp > 1:
        dp_s, dp_src, term = _overlapped_reduction(tm, stages, sched, stage_params[largest], dp_src)
        terms.append(term)
    # Adam: the next step waits for the slowest stage's
    untouched = tm.model.untouched_embedding_params(lay.tp, lay.global_batch_size * lay.seq_len)
    optimizer, opt_src = max(
        (
            optimizer_step(
                tm,
                stage_params[i],
                stage_expert_params[i],
                tm.model.stage_tensors(lay.ep, st.layers, i == 0, i == lay.pp - 1),
                untouched if i == 0 else 0.0,
            )
            for i, st in enumerate(stages)
        ),
        key=lambda timed: timed[0],
    )
    bubble = pipe / (lay.microbatches * pace) - 1 if pace > 0 else 0.0
    return StepTime(
        pipe,
        bubble,
        slowest,
        dp_s,
        dp_src,
        optimizer,
        opt_src,
        formula,
        sched,
        closed,
        exchange,
        overlapped,
        tuple(terms),
        overlap_statement(lay),
    )


def _stage_terms(tm: TimeModel, stage: StageTime, index: int) -> list[Exposed]:
    """The slowest stage's TP and context-parallel communication a step (micro-batches x its items):
    their total and what of it the stage's time holds (exposed)."""
    lay, terms = tm.layout, []
    m = lay.microbatches
    comm = [(n, p, t, c) for n, p, t, c in stage.items if n == "tp_collectives:transformer_layer"]
    if comm:
        exposed = sum(t.seconds * c for _, _, t, c in comm) * m
        whole = sum(tm.tp_collectives("transformer_layer", p)[0] * c for _, p, _, c in comm) * m
        how = "tp_comm_overlap (modelled)" if lay.tp_comm_overlap else "the local spec: between the GEMMs"
        terms.append(
            Exposed(
                "tp_collectives",
                whole,
                exposed,
                "the layer's GEMMs" if lay.tp_comm_overlap else "nothing",
                f"stage {index}'s layers' TP collectives, {m} micro-batches: {how}",
            )
        )
    kv = [(t, c, p) for n, p, t, c in stage.items if n == "cp_kv_exchange"]
    if kv:
        whole = sum(
            (tm.cp - 1) * tm.collective("send_recv", kv_exchange_bytes(tm, p), 2, "cp")[0] * c
            for _, c, p in kv
        )
        terms.append(
            Exposed(
                "cp_kv_exchange",
                whole * m,
                sum(t.seconds * c for t, c, _ in kv) * m,
                "the attention's ring steps",
                f"stage {index}'s layers, {m} micro-batches: (cp-1) x max(0, exchange - step) a layer",
            )
        )
    return terms


def _overlapped_reduction(
    tm: TimeModel, stages: list[StageTime], sched: Schedule, params: float, whole: Source
) -> tuple[float, Source, Exposed]:
    """The gradient reduction with overlap_grad_reduce: what it adds after the pipeline (and, with the
    distributed optimizer without overlap_param_gather, the parameters' all-gather after it), its source
    and its term."""
    lay = tm.layout
    end, busiest = grad_reduce_end(tm, sched, stages)
    exposed = max(0.0, end - sched.end)
    gathered = 0.0
    if lay.distributed_optimizer and not lay.overlap_param_gather:
        gathered = gather_total(tm, params)
    rule = (
        "overlap_grad_reduce: buckets of max(4e7, 1e6 x dp) parameters in the order the last backward makes "
        "them, each's collective started when its last gradient is made, one after another: "
        f"c_j = max(c_(j-1), r_j) + t_j; {human_time(busiest * 1e6)} of collectives, "
        f"{human_time(exposed * 1e6)} after the last backward"
    )
    if gathered:
        rule += f"; + the parameters' all-gather after the optimizer, {human_time(gathered * 1e6)}"
    detail = f"{rule} (the same collectives unoverlapped: {whole.detail})"
    term = Exposed("dp_grad_reduce", busiest + gathered, exposed + gathered, "the last backward", rule)
    return exposed + gathered, Source("modelled", detail), term


def dp_reduction(tm: TimeModel, params: float, expert_params: float) -> tuple[float, Source]:
    """The gradient reduction after the backward, as Megatron's DDP does it by default (no overlap): the
    dense gradients over the dp ranks, the routed experts' over the expert-data-parallel ranks (the
    tp*dp/ep ranks holding the same experts; dp at ep=1), each one bucket of fp32 main grads; with the
    distributed optimizer a reduce-scatter of them and an all-gather of the updated parameters."""
    lay = tm.layout
    groups = [("dense", params - expert_params, lay.dp), ("expert", expert_params, lay.expert_data_parallel)]
    seconds, details = 0.0, []
    for name, count, ranks in groups:
        if count <= 0:
            continue
        if ranks == 1:
            details.append(f"{name} grads: {ranks} rank, nothing to reduce")
            continue
        group = "dp" if name == "dense" else "expert_dp"
        if lay.distributed_optimizer:
            rs, rs_src = tm.collective("reduce_scatter", count * 4, ranks, group)
            ag, ag_src = tm.collective("all_gather", count * lay.bytes_per_element, ranks, group)
            seconds += rs + ag
            details.append(
                f"{name}: reduce-scatter of {count * 4:.4g} B fp32 grads + all-gather of "
                f"{count * lay.bytes_per_element:.4g} B params over {ranks} ranks: {rs_src.detail}; "
                f"{ag_src.detail}"
            )
        else:
            s, src = tm.collective("all_reduce", count * 4, ranks, group)
            seconds += s
            details.append(
                f"{name}: all-reduce of {count * 4:.4g} B fp32 grads over {ranks} ranks: {src.detail}"
            )
    if not seconds:
        return 0.0, Source("modelled", f"dp={lay.dp}: no gradient reduction ({'; '.join(details) or 'dp=1'})")
    return seconds, Source("modelled", "; ".join(details))


def optimizer_step(
    tm: TimeModel, params: float, expert_params: float, tensors: int, zero_state: float = 0.0
) -> tuple[float, Source]:
    """The optimizer's part of a step on the GPU holding ``params`` parameters, ``expert_params`` of them
    routed experts', in ``tensors`` parameter tensors, ``zero_state`` of them with zero gradients and
    moments (module docstring)."""
    lay = tm.layout
    bw, said = tm.memory_bandwidth()
    per_rank = lay.optimizer_params(params, expert_params)
    rate = tm.calibration.get("adam_seconds_per_parameter")
    if not rate:
        tm._warn(
            f"{tm.untimed('the Adam step')}: it is modelled from the memory bandwidth (one "
            "pass per tensor, an underestimate where the step makes several: python -m autotuner.calibrate "
            "times it)"
        )
        nbytes = per_rank * ADAM_BYTES[lay.dtype]
        detail = f"Adam: {ADAM_BYTES[lay.dtype]} B read+written per parameter x {per_rank:.4g} params = "
        return nbytes / bw, Source("modelled", f"{detail}{nbytes:.4g} B / {said}")
    timed = tm.calibration.get("adam_parameters")
    how = f"Adam step timed by autotuner.calibrate: {rate * 1e9:.4g} ns per fp32 parameter"
    how += f" (over {timed:.3g})" if timed else ""
    if tm.meas.devices == {"cpu"} and lay.gpus > 1:
        # CPU processes share one memory: every rank's Adam runs at once, each slower than one alone
        link = link_key("gloo", lay.gpus)
        together = tm.calibration.get(ADAM_TOGETHER, {}).get(link)
        if together:
            rate = together
            how = f"Adam step timed by autotuner.calibrate collectives=true on {link}, every rank at once: "
            how += f"{rate * 1e9:.4g} ns per fp32 parameter"
        else:
            tm._warn(
                f"{tm.untimed(f'Adam on {lay.gpus} CPU processes at once')} (they share the "
                f"memory: each runs slower than one alone): torchrun --nproc-per-node={lay.gpus} -m "
                "autotuner.calibrate collectives=true times it"
            )
    adam = per_rank * rate
    detail = f"{how} x {per_rank:.4g} params = {adam:.4g} s"
    per_tensor = tm.calibration.get(ADAM_PER_TENSOR)
    if per_tensor is None:
        detail += (
            " (its cost per tensor not timed by this calibration: python -m autotuner.calibrate times it)"
        )
    elif per_tensor > 0:
        # what Adam loops over: each parameter tensor, or with the distributed optimizer each flat
        # buffer's share (dense, routed experts), as autotuner.predict.steps steps them
        stepped = (1 + (expert_params > 0)) if lay.distributed_optimizer else tensors
        adam += stepped * per_tensor
        what = "flat buffer shares" if lay.distributed_optimizer else "parameter tensors"
        detail += f"; + {per_tensor * 1e6:.3g} us per tensor x {stepped} {what}"
    per_zero = tm.calibration.get(ADAM_ZERO_STATE)
    if per_zero and zero_state:
        # with the distributed optimizer the rank whose share holds the table's rows steps them all
        zeros = min(zero_state, per_rank)
        adam += zeros * per_zero
        detail += (
            f"; + {per_zero * 1e9:.3g} ns per parameter whose moments are zero x {zeros:.4g} (embedding rows "
            "no token of the global batch touches, tokens drawn uniformly)"
        )
    in_training = tm.calibration.get(ADAM_IN_STEP)
    if in_training:
        adam += in_training
        detail += f"; + {in_training * 1e6:.3g} us a step more inside training steps (timed in real ones)"
    zeroing, zeroing_said = gradient_zeroing_seconds(tm.calibration, params, bw)
    detail += f"; + zeroing the gradients for the next step: {zeroing_said}"
    if lay.dtype in ("bf16", "fp16"):
        # the updated fp32 main parameters cast into the model's copy: read 4 B, write 2 B
        adam += 6 * per_rank / bw
        detail += f"; + 6 B per parameter (the cast to the model's dtype) / {said}"
    return adam + zeroing, Source("scaled", detail)


def gradient_zeroing_seconds(
    calibration: Mapping[str, Any], params: float, copy_bandwidth: float
) -> tuple[float, str]:
    """Seconds a step takes to zero ``params`` fp32 gradients for the next one, and how, in words: at the
    calibration's zeroing rate, else at ``copy_bandwidth``. They differ on a CPU,
    whose core reads a line before writing it: on a 2-core CPU VM the llama-shaped model's steps zeroed
    their 21 MB in 2.43-2.90 ms, the zeroing rate gave 2.77-2.82, the copy bandwidth (2 B moved a byte
    copied) 1.79-1.84 (autotuner.calibrate)."""
    nbytes = GRAD_BYTES * params
    rate = calibration.get(ZEROING_BANDWIDTH)
    if rate:
        return nbytes / rate, f"{GRAD_BYTES} B per parameter at the calibrated zeroing {rate / 1e9:.4g} GB/s"
    lacking = "no zeroing_bandwidth in the calibration" if calibration else "no calibration"
    return nbytes / copy_bandwidth, (
        f"{GRAD_BYTES} B per parameter at the copy bandwidth {copy_bandwidth / 1e9:.4g} GB/s ({lacking}: "
        "python -m autotuner.calibrate times zeroing)"
    )
