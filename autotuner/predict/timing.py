"""Time per micro-batch of each pipeline stage, and the step time, from measured op rows.

**An op's time at the layout's point** (sequence length s, micro-batch b, tensor-parallel size t), tried
in this order, each result carrying its ``Source``:

1. *measured*: the op's row at exactly (s, b, t) (under torchrun: the ``rank="max"`` row, the slowest
   rank, which includes the TP collectives inside the op);
2. for a composite op (``transformer_layer``, ``self_attention``, ``mlp``, ...: the op tree of
   autotuner.ops_test.places): the sum of its direct sub-ops measured at exactly that point (recursively;
   a sub-op that a run ``skipped`` as not in this model, or an alternative at the same place, as the
   dense MLP beside an MoE layer, counts nothing);
3. *scaled* from the op's own row at the nearest measured point (s', b') at the same t, by the op's rule:
   GEMMs (``GEMM_OPS``, the dense MLP too) by FLOPs at the efficiency measured there (a GEMM's FLOPs grow
   with the tokens s*b, so t = t' * s*b / (s'*b') with the efficiency stated); ``core_attention`` by
   s^2*b (the score and value products); the layer and its attention block by their analytic FLOPs
   (GEMMs linear in tokens, attention 4*s^2*b*heads*head_dim); everything else (norms,
   bias-dropout-add, rope, the activation, the embedding) by tokens s*b; where the op has no row of its
   own, the sum of its sub-ops each scaled so;
   With expert parallelism (ep > 1), rows of the ops it changes count only if measured at that ep
   (autotuner.predict.inputs.EP_COMPOSITE_OPS, EP_LEAF_OPS); where the runs have none, the layer and
   the MoE layer are the sums of their sub-ops, and the expert ops come from rows measured without
   expert parallelism: ``experts`` divided by ep (each rank computes its 1/ep of the experts, as many
   tokens reach them as at ep=1 under balanced routing: *scaled*), ``token_dispatch`` and
   ``token_combine`` their measured permutation plus the collectives (*modelled* from the link
   calibration, each with its latency) of the dispatcher the row names (:func:`dispatcher_collectives`):
   Megatron's all-to-all dispatcher sends each rank's s*b*top-k*h routed elements and their
   probabilities, (ep-1)/ep of them to other ranks, as an all-gather of that buffer does, after
   gathering the tokens-per-expert counts; its all-gather dispatcher (the one a CPU runs) gathers every
   rank's routing map, probabilities and s*b*h tokens and reduce-scatters the results;
4. the same from rows measured without tensor parallelism (t=1), divided by t, except what Megatron
   does not split without sequence parallelism (``REPLICATED_WITHOUT_SP``: the layer norms and
   bias-dropout-adds, and the embedding), plus the TP collectives modelled from the calibrated link
   bandwidth (autotuner.predict.links): per layer 2 all-reduces of s*b*h elements forward and 2 backward
   (Shoeybi et al. 2019, Megatron-LM, section 3), or with sequence parallelism 2 all-gathers + 2
   reduce-scatters each way (Korthikanti et al. 2022, section 4.2.2);
5. *modelled*: the analytic FLOPs (backward: 2x forward) over the calibrated peak (``peak_flops[dtype]``),
   or, without a calibration, over the best throughput any GEMM row of the runs reached (said so); the
   embedding and norms as memory-bound, 2*s*b*h elements moved over the calibrated memory bandwidth.

A figure that is not measured at the exact point and TP also yields a ``Missing`` record: the profiling
run that would measure it (never a silent zero).

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

**Host work outside the ops.** A training step also spends time outside every op: Megatron's schedule
(each micro-batch's forward and backward steps, the loss function, autograd's start) and GPTModel's own
work (the rotary table, the block's own work around each layer). On a CPU, where the host is the device,
each stage's forward and backward per micro-batch add it (``host_work``, *scaled*): the calibration's
timed part for a stage (for each of its model chunks) plus its part per layer x the stage's layers
(``host_work_seconds_per_microbatch``, autotuner.calibrate.host_work, timed on a minimal GPTModel at two
depths). That work's own data (the interpreter's, the allocator's, autograd's) lives in the last-level
cache, which a large model's ops sweep out between its visits, and then comes back from memory: where a
micro-batch's ops on the stage touch more bytes than the shared cache holds (:func:`host_work_cached`,
from the same sweep as the ops' rule below; on a CPU the layout's processes all sweep one host's cache,
so their bytes add), the host work is the calibration's timed with the cache flushed inside every layer
(``host_work_seconds_per_microbatch_flushed``). On this project's VM the llama-shaped model's steps (four
layers, s128, one process) spent 0.37 ms forward and 0.73 backward a micro-batch outside their ops, the
minimal model at four layers, as one calibration timed it, 0.17 / 0.26 warm and 0.39 / 0.70 flushed; its
PP2 stages (two processes, each a stage of about 26 MB) 0.28-0.30 forward, the flushed figure at two
layers 0.26 (session 28). On a GPU the host
queues the kernels ahead of the device, which hides this behind them as long as the kernels outlast it:
not added.

**Warm or cold caches.** A row measured with warm caches (``cache_flush`` false, the profiler's default)
times an op that finds its weights and inputs in the cache from its previous call; one measured with
``timing.flush_cache=true`` starts each call with the caches evicted. Inside a step an op finds its data
again only if what the stage touched since its previous visit left it there. A micro-batch sweeps the
stage's ops forward (embedding, layers, final norm, output layer), then backward in reverse, so a
backward's previous visit is its own forward, with every op after it in between, and a forward's is the
last micro-batch's backward, with every op before it in between (1F1B's steady state alternates a forward
and a backward the same way; the interleaved schedule's chunks put more between, which this undercounts).
The distinct bytes of an op are its weights, their fp32 main gradients and what its forward saves, from
the model's sizes and the layer's measured ``activation_bytes`` (:func:`stage_sweep`,
:func:`warm_visits`). A visit takes the op's warm row when those bytes fit the cache its warm row ran
from: a core's own cache (calibration ``warm_cache_bytes``: a CPU core's L2, a GPU's L2) for an op that
fits there, else the shared last-level cache (``shared_cache_bytes``: the L3 of a CPU; a GPU's L2 again);
and, whatever lies between, when the visit right before it is the same op's in the same phase (a layer's
forward after the previous layer's, its backward after the next layer's); never for an op larger than the
shared cache, nor for the first op of a stage's forward, which follows a backward (the last micro-batch's,
ending with this op's own: in 1F1B's steady state every forward does). What a backward leaves cold is not
that op's data but, as a flush does, the code and the memory the allocator recycles: tiny's embedding
forward, the first op of each of its micro-batches, took 0.153 ms inside real steps, 0.026 back to back
and 0.187 right after a backward of the model, its flushed row 0.19 in an earlier profile (session 23, one
process); a layer's forward after its backward 1.11-1.20x its back-to-back time against 1.28-1.41x after a
flush (tiny) and 1.06-1.09x against 1.11-1.13x (llama-shaped; ``python -m
benchmarks.forward_after_backward``): between the two, the flushed one the nearer for the op that short. A
pipeline's later stage starts its forward with a layer, which this sends to its flushed row (tiny PP2's
layer forward took 1.96-2.01 ms inside the steps in session 15, its warm row then 1.28, its flushed row
1.72). Other visits take its flushed row, and an op visited both ways the mean of the two by its visits
(:func:`blend`, said in its source). Without cache sizes every visit is assumed cold. The rule is LRU-like
and ignores that a cache keeps some of a larger working set; it is what the measurements showed on this
project's 2-core CPU (1 MiB L2 per core, 32 MiB shared L3): the llama-shaped model's layers, timed by
hooks inside its real step, took 2.9-3.2 ms forward and 4.3-4.5 ms backward, their warm rows 2.82 and
4.30, their flushed rows 4.07 and 5.72; the tiny model's layers took 1.27-1.46 and 1.24 ms against warm
rows of 1.18 and 1.24 and flushed ones of 2.06 and 1.61. The stage-wide choice the rule replaced took the
flushed rows for both (their memory exceeds a core's L2) and over-predicted the llama-shaped
forward-backward by 6-25%. A layer that follows a layer: what makes a flushed row slow on a CPU is less
the op's own weights leaving the cache than what the flush evicts besides, the code and the memory the
allocator recycles, which the layer before it has just run and used (session 21, ``python -m
benchmarks.forward_after_backward``, one thread, a layer's forward over its back-to-back time: after a
flush 1.30-1.68x (tiny) and 1.09-1.16x (llama-shaped); after the flush and then another layer's forward,
this layer's weights still evicted, 1.01-1.09x and 1.03-1.06x; after another layer alone 0.98-1.02x and
1.00-1.01x). Without this clause the llama-shaped TP1 stage took 1 of its 4 layer visits a phase from the
flushed row and read 11% (forward) and 8% (backward) over the layers' time inside the steps, where its
warm rows read 0.99-1.04 of it (``python -m benchmarks.row_in_step``); inside the steps no visit of a
layer ran slower than the rest. On a GPU a real model's layer exceeds the L2 and takes its flushed row.
Where the runs hold only one kind of row, it stands in for the other and the prediction warns. A warm
forward row timed after the op's backward (``timing.forward_after_backward``, as every forward of an op in
a step runs) wins over one timed back to back, which on a CPU reads under a step's forward; a CPU
prediction from back-to-back ones says so (autotuner.measure.timer, "A forward follows its backward").

**The step**: the pipeline, simulated (autotuner.predict.schedule): every stage's forwards and backwards
placed in the order Megatron-Core's 1F1B schedule (interleaved with vpp) runs them, each taking its own
stage's time (/vpp per model chunk), each waiting for its input from the neighbour stage, and every
exchange charged to both ends (interleaved on GPUs: to the receiving box, the exchanges overlapped with
compute as Megatron-LM runs that schedule); the pipeline time is where the last box ends. For equal
stages and free exchanges that is Narayanan et al. 2021's (m + p - 1) x (t_f + t_b), m * (t_f + t_b) * (1
+ (p-1)/(v*m)) interleaved (section 2.2; printed beside it), which paces every stage at the slowest one.
Then the data-parallel gradient reduction after the backward (all-reduce of the stage's dense gradients
over dp and of its routed experts' over the tp*dp/ep ranks holding the same experts; with the distributed
optimizer reduce-scatter of the gradients + all-gather of the parameters) and the Adam step (bytes read
and written per parameter over the calibrated memory bandwidth), or, where the calibration timed it, the
Adam step's measured time per parameter (``adam_seconds_per_parameter``; for a layout of several CPU
processes, which share one memory, the rate timed with all of them at it) x the stage's parameters, plus
its measured time per tensor (``adam_seconds_per_tensor``: on a CPU torch's Adam loops over the tensors)
x the tensors it steps (the stage's parameter tensors, ``ModelShape.stage_tensors``; with the distributed
optimizer each flat buffer's share, as autotuner.predict.steps runs it), plus, where a CPU calibration
timed it inside real steps, what a step's Adam takes there beyond those back-to-back rates, once a step
(``adam_seconds_per_step_in_training``: autotuner.calibrate.adam_in_step), plus zeroing the gradients
for the next step (4 B written per parameter) and with bf16/fp16 the copy of the fp32 main parameters
into the model's dtype. Nothing is assumed to overlap: the step time is an upper bound, and the table says so.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from autotuner.ops.naming import PHASES
from autotuner.ops_test.places import OpTree, op_tree
from autotuner.predict.inputs import (
    EP_LEAF_OPS,
    GEMM_OPS,
    Measurements,
    Missing,
    ModelShape,
    describe_row,
    row_seconds,
)
from autotuner.predict.layout import Layout, Source, worst_kind
from autotuner.predict.links import collective_seconds
from autotuner.predict.memory import GRAD_BYTES
from autotuner.predict.schedule import Schedule, closed_form_s, overlaps_exchanges, simulate
from autotuner.results.calibration import (
    ADAM_IN_STEP,
    ADAM_PER_TENSOR,
    ADAM_TOGETHER,
    GRAD_ACCUMULATION,
    HOST_WORK,
    HOST_WORK_FLUSHED,
    link_key,
)
from autotuner.results.units import human_time

ATTENTION_OPS = frozenset({"core_attention"})
# What Megatron keeps whole on every TP rank unless sequence parallelism splits the sequence.
REPLICATED_WITHOUT_SP = frozenset(
    {"input_layernorm", "pre_mlp_layernorm", "self_attn_bda", "mlp_bda", "final_layernorm", "embedding"}
)
# Ops whose time the analytic FLOPs model (step 3 and 5 of the module docstring).
ANALYTIC_OPS = frozenset({"transformer_layer", "self_attention", "output_layer"})
# Without a calibration, and without any GEMM row to take a throughput from: said as an assumption.
ASSUMED_PEAK_FLOPS = 1e12
ASSUMED_MEMORY_BANDWIDTH = 1e10
# Adam with mixed precision (Megatron's DistributedOptimizer / FP32 main params): per parameter, read main
# grad, fp32 master, exp_avg, exp_avg_sq (4 B each), write master, exp_avg, exp_avg_sq (4 B) and the
# model's bf16/fp16 copy (2 B); in fp32 the master is the parameter itself.
ADAM_BYTES = {"bf16": 16 + 14, "fp16": 16 + 14, "fp32": 16 + 12}
OVERLAP = (
    "nothing overlaps: TP collectives, DP gradient reduction and the optimizer step are added to the "
    "pipeline's time (an upper bound; Megatron can overlap the DP reduction with the backward)"
)


def dispatcher_collectives(
    dispatcher: str, op: str, phase: str, ep: int, tokens: float, model: ModelShape, per: int
) -> list[tuple[str, float, str]]:
    """The collectives Megatron-Core's token dispatcher makes in one phase of ``token_dispatch`` or
    ``token_combine`` over ``ep`` ranks, each as (collective, bytes of its full buffer, what it moves),
    with ``tokens`` = s*b a rank routes (s*b/tp with sequence parallelism), ``per`` bytes per element:

    * ``allgather`` (MoEAllGatherTokenDispatcher, 0.16; the one a CPU runs): forward dispatch gathers
      every rank's routing map (bool), probabilities and tokens (three all-gathers); its backward
      reduce-scatters the gradients of the last two; forward combine reduce-scatters the experts'
      outputs, its backward all-gathers their gradient;
    * ``alltoall`` (MoEAlltoAllTokenDispatcher): forward dispatch gathers every rank's tokens-per-expert
      counts (int64) to size the exchange, then exchanges the routed tokens, s*b*top-k*h, and their
      probabilities; backward exchanges both gradients; combine one exchange each way. Each rank keeps
      1/ep of what it sends, as an all-gather does: an all-to-all is charged as an all-gather of the
      buffer a rank sends.

    Small collectives cost their latency, so each counts: two processes' all-gathers of 64 KiB took
    ~0.3 ms apiece on this project's CPU VM, more than the bytes of a tiny model's tokens.
    """
    h, experts = model.hidden, model.experts or 1
    topk = int(model.config.get("moe_router_topk") or 1)
    forward = phase == "forward"
    if dispatcher == "allgather":
        everyone = ep * tokens
        hidden = (
            "all_gather" if (op == "token_dispatch") == forward else "reduce_scatter",
            everyone * h * per,
        )
        if op == "token_combine":
            return [(*hidden, "experts' outputs, all ranks' s*b*h")]
        if forward:
            return [
                ("all_gather", everyone * experts, "routing map, all ranks' s*b*experts (bool)"),
                ("all_gather", everyone * experts * per, "probabilities, all ranks' s*b*experts"),
                (*hidden, "tokens, all ranks' s*b*h"),
            ]
        return [
            ("reduce_scatter", everyone * experts * per, "probabilities' gradient, all ranks' s*b*experts"),
            (*hidden, "tokens' gradient, all ranks' s*b*h"),
        ]
    routed = tokens * topk
    exchange = [("all_gather", routed * h * per, "an all-to-all of s*b*top-k*h, as an all-gather")]
    if op == "token_combine":
        return exchange
    exchange.append(
        ("all_gather", routed * per, "an all-to-all of s*b*top-k probabilities, as an all-gather")
    )
    if forward:
        exchange.insert(0, ("all_gather", ep * experts * 8, "tokens-per-expert counts, ep*experts int64"))
    return exchange


# ---------------------------------------------------------------------------------------- one op


@dataclass(frozen=True)
class OpTime:
    """One op's time per micro-batch on one GPU, its source, the leaf ops it is made of (for the op that
    dominates), and what would measure it where it was not measured."""

    seconds: float
    source: Source
    parts: Mapping[str, float] = field(default_factory=dict)
    missing: tuple[Missing, ...] = ()
    rows_tp: int = 0  # the tensor-parallel size of the rows it came from (0: modelled)

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "source": self.source.to_json(), "parts": dict(self.parts)}


def _children(tree: OpTree, op: str) -> tuple[str, ...]:
    return tree.children(op) if op in tree.parents else ()


class TimeModel:
    """Resolves each op's time at one layout's point by the rules of the module docstring."""

    def __init__(
        self,
        meas: Measurements,
        model: ModelShape,
        layout: Layout,
        calibration: Mapping[str, Any] | None,
        tree: OpTree | None = None,
        without_ep: Measurements | None = None,
    ) -> None:
        self.meas, self.model, self.layout = meas, model, layout
        self.without_ep = without_ep  # rows measured at ep=1, for the expert ops at ep > 1
        self.calibration = dict(calibration or {})
        self.tree = tree or op_tree()
        self.warnings: list[str] = []
        self.cold, self.cache_reason = True, "assumed: the step's data exceeds the cache"
        self.other_cache_rows: set[str] = set()  # rows used that were measured the other way
        self._absent_ops: dict[str, bool] = {}  # _absent's answers: fixed by the rows and the model
        # _at_basis's answers, fixed by the rows, the model and the layout: an op tree is walked once per
        # (op, phase, basis) instead of once per question (autotuner.tune asks thousands of layouts)
        self._resolved: dict[tuple[str, str, int, bool], OpTime | None] = {}

    # -- calibration ----------------------------------------------------------------------------------
    def peak_flops(self) -> tuple[float, str]:
        peak = (self.calibration.get("peak_flops") or {}).get(self.layout.dtype)
        if peak:
            return float(peak), f"calibrated peak_flops[{self.layout.dtype}] {peak / 1e12:.4g} TFLOP/s"
        best = self.meas.best_gemm_throughput()
        if best:
            return best, f"no calibrated peak: the best GEMM row's {best / 1e12:.4g} TFLOP/s"
        self._warn(
            f"no calibration and no GEMM rows: assumed a peak of {ASSUMED_PEAK_FLOPS:.3g} FLOP/s (python -m "
            "autotuner.calibrate on the target device measures it: pass its file as calibration=FILE)"
        )
        return ASSUMED_PEAK_FLOPS, f"ASSUMED peak {ASSUMED_PEAK_FLOPS:.3g} FLOP/s (no calibration)"

    def memory_bandwidth(self) -> tuple[float, str]:
        bw = self.calibration.get("memory_bandwidth")
        if bw:
            return float(bw), f"calibrated memory_bandwidth {bw / 1e9:.4g} GB/s"
        self._warn(
            f"no calibrated memory_bandwidth: assumed {ASSUMED_MEMORY_BANDWIDTH / 1e9:.3g} GB/s "
            "(python -m autotuner.calibrate measures it)"
        )
        return ASSUMED_MEMORY_BANDWIDTH, f"ASSUMED memory bandwidth {ASSUMED_MEMORY_BANDWIDTH / 1e9:.3g} GB/s"

    def set_cache_mode(self, cold: bool, reason: str) -> None:
        """Which rows this model stands for (:func:`cache_plan`); ``meas`` should prefer them."""
        self.cold, self.cache_reason = cold, reason
        self.other_cache_rows.clear()
        self._resolved.clear()  # what was resolved before noted the rows of the other mode

    def _note_cache(self, row: Mapping[str, Any]) -> None:
        if bool(row.get("cache_flush")) != self.cold:
            self.other_cache_rows.add(f"{row['op']}.{row['phase']}")

    def cache_warning(self) -> str | None:
        """What to say when rows of the other cache mode went into the prediction (module docstring)."""
        rows = self.other_cache_rows
        if not rows:
            return None
        named = ", ".join(sorted(rows)[:4]) + (", ..." if len(rows) > 4 else "")
        if self.cold:
            return (
                f"{len(rows)} of the rows used ({named}) were measured with warm caches, but "
                f"{self.cache_reason}: inside the step each op starts cold, so these read fast (profile with "
                "timing.flush_cache=true; the commands printed for what is missing do)"
            )
        return (
            f"{len(rows)} of the rows used ({named}) were measured with a flushed cache, but "
            f"{self.cache_reason}: inside the step ops find their data cached, so these read slow "
            "(profile with timing.flush_cache=false timing.forward_after_backward=true; the commands printed "
            "for what is missing do)"
        )

    def _warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)

    # -- rows at one basis ----------------------------------------------------------------------------
    def _scale(self, op: str, row: Mapping[str, Any], s: int, b: int) -> tuple[float, str]:
        """(seconds at (s, b), the rule) from a row at another point."""
        rs, rb = int(row["seq_len"]), int(row["micro_batch_size"])
        t = row_seconds(row)
        if op in GEMM_OPS:
            ratio = (s * b) / (rs * rb)
            if row.get("flops"):
                eff = row["flops"] / t
                return row[
                    "flops"
                ] * ratio / eff, f"GEMM by FLOPs at the measured efficiency {eff / 1e12:.4g} TFLOP/s"
            return t * ratio, "GEMM by FLOPs (linear in tokens s*b)"
        if op in ATTENTION_OPS:
            return t * (s * s * b) / (rs * rs * rb), "attention by s^2*b"
        if op in ANALYTIC_OPS:
            ratio = self.model.forward_flops(op, s, b) / self.model.forward_flops(op, rs, rb)
            return t * ratio, "by the analytic FLOPs (GEMMs by tokens, attention by s^2*b)"
        return t * (s * b) / (rs * rb), "elementwise by tokens s*b"

    def _alternative_measured(self, op: str) -> bool:
        """Whether another op at the same place in the model was measured (the dense MLP vs the MoE layer):
        then this one is not part of this model."""
        test = self.tree.tests[op]
        return any(
            other != op
            and t.where == test.where
            and t.container == test.container
            and (other in self.meas.seen_ops or (self.without_ep and other in self.without_ep.seen_ops))
            for other, t in self.tree.tests.items()
        )

    def _absent(self, op: str) -> bool:
        """Whether ``op`` is not part of this model: a run skipped it, the op says so of the model's
        config (its ``missing_from``: the dense MLP of an all-MoE model, shared experts of a model
        without), or an alternative at its place was measured."""
        if op not in self._absent_ops:
            self._absent_ops[op] = self._is_absent(op)
        return self._absent_ops[op]

    def _is_absent(self, op: str) -> bool:
        if op in self.meas.skipped or self._alternative_measured(op):
            return True
        try:
            return self.tree.tests[op].absent_reason(SimpleNamespace(**self.model.config)) is not None
        except (AttributeError, TypeError, KeyError):  # a config recorded without the fields it reads
            return False

    def _row_seconds(
        self, meas: Measurements, op: str, phase: str, basis: int, nearest: bool
    ) -> tuple[float, str, Mapping[str, Any]] | None:
        """(seconds at the layout's (s, b), where from, the row) of ``op``'s row in ``meas`` at ``basis``:
        the exact point's, or with ``nearest`` the nearest point's scaled by the op's rule; None without
        one."""
        s, b = self.layout.seq_len, self.layout.micro_batch_size
        row = meas.nearest(op, phase, s, b, basis) if nearest else meas.exact(op, phase, s, b, basis)
        if row is None:
            return None
        self._note_cache(row)
        if not nearest:
            return row_seconds(row), describe_row(row), row
        seconds, rule = self._scale(op, row, s, b)
        return seconds, f"{rule}, from {describe_row(row)}", row

    def _at_basis(self, op: str, phase: str, basis: int, exact_only: bool) -> OpTime | None:
        """The op at the layout's (s, b) from rows at tensor-parallel size ``basis`` alone (no division by
        tp, no collectives added); None if these rows cannot give it."""
        key = (op, phase, basis, exact_only)
        if key not in self._resolved:
            self._resolved[key] = self._resolve_at_basis(op, phase, basis, exact_only)
        return self._resolved[key]

    def _resolve_at_basis(self, op: str, phase: str, basis: int, exact_only: bool) -> OpTime | None:
        found = self._row_seconds(self.meas, op, phase, basis, nearest=False)
        if found is not None:
            return OpTime(found[0], Source("measured", found[1]), {op: found[0]}, rows_tp=basis)
        if self.layout.ep > 1 and op in EP_LEAF_OPS:
            got = self._expert_op_without_ep(op, phase, basis, exact_only)
            if got is not None or exact_only:
                return got
        exact_sum = self._sub_op_sum(op, phase, basis, exact_only=True)
        if exact_sum is not None or exact_only:
            return exact_sum
        found = self._row_seconds(self.meas, op, phase, basis, nearest=True)
        if found is not None:
            return OpTime(found[0], Source("scaled", found[1]), {op: found[0]}, rows_tp=basis)
        return self._sub_op_sum(op, phase, basis, exact_only=False)

    def _expert_op_without_ep(self, op: str, phase: str, basis: int, exact_only: bool) -> OpTime | None:
        """An expert op at the layout's ep > 1 from rows measured without expert parallelism (module
        docstring, rule 3); None without such rows."""
        if self.without_ep is None:
            return None
        s, b, ep = self.layout.seq_len, self.layout.micro_batch_size, self.layout.ep
        found = self._row_seconds(self.without_ep, op, phase, basis, nearest=False)
        if found is None and not exact_only:
            found = self._row_seconds(self.without_ep, op, phase, basis, nearest=True)
        if found is None:
            return None
        seconds, origin, row = found
        if op == "experts":
            seconds /= ep
            detail = f"a rank's 1/ep={ep} of the experts: {origin} / {ep}"
            return OpTime(seconds, Source("scaled", detail), {op: seconds}, rows_tp=basis)
        tokens = s * b / (basis if self.layout.sequence_parallel else 1)
        dispatcher = str(row.get("token_dispatcher") or "alltoall")
        collectives = dispatcher_collectives(
            dispatcher, op, phase, ep, tokens, self.model, self.layout.bytes_per_element
        )
        exchange, details = 0.0, []
        for kind, nbytes, what in collectives:
            took, src = self.collective(kind, nbytes, ep)
            exchange += took
            details.append(f"{kind} of the {what}, {nbytes:.4g} B over ep={ep}: {src.detail}")
        detail = f"{origin} (the permutation) + the {dispatcher} dispatcher's {'; '.join(details)}"
        parts = {op: seconds, f"{op}_exchange": exchange}  # the dominant-op ranking names each apart
        return OpTime(seconds + exchange, Source("modelled", detail), parts, rows_tp=basis)

    def _sub_op_sum(self, op: str, phase: str, basis: int, exact_only: bool) -> OpTime | None:
        """The sum of a composite op's direct sub-ops at ``basis`` (None for a leaf, or if one is lacking)."""
        kids = [c for c in _children(self.tree, op) if not self._absent(c)]
        if not kids:
            return None
        got = [self._at_basis(c, phase, basis, exact_only) for c in kids]
        if any(p is None for p in got):
            return None
        parts = [p for p in got if p is not None]
        leaves: dict[str, float] = {}
        for p in parts:
            leaves.update(p.parts)
        detail = f"sum of {op}'s sub-ops ({', '.join(kids)}) at tp={basis}"
        return OpTime(
            sum(p.seconds for p in parts),
            Source(worst_kind([p.source for p in parts]), detail),
            leaves,
            rows_tp=basis,
        )

    def _divided(self, op: str, got: OpTime) -> OpTime:
        """A time from rows without TP, on one of tp ranks: divided by tp except where Megatron replicates
        the work on every rank (REPLICATED_WITHOUT_SP)."""
        tp, sp = self.layout.tp, self.layout.sequence_parallel
        parts = {}
        for leaf, sec in got.parts.items():
            parts[leaf] = sec if (leaf in REPLICATED_WITHOUT_SP and not sp) else sec / tp
        if op in REPLICATED_WITHOUT_SP and not sp:
            detail = f"{got.source.detail}; replicated on each of tp={tp} ranks"
            return OpTime(got.seconds, Source("scaled", detail), parts, rows_tp=1)
        detail = f"{got.source.detail}; divided over tp={tp} (TP=1 rows)"
        return OpTime(sum(parts.values()), Source("scaled", detail), parts, rows_tp=1)

    def _modelled(self, op: str, phase: str) -> OpTime | None:
        s, b = self.layout.seq_len, self.layout.micro_batch_size
        factor = 1.0 if phase == "forward" else 2.0  # backward: input and weight gradients, 2x forward
        if op in ANALYTIC_OPS or op in ATTENTION_OPS:
            peak, said = self.peak_flops()
            flops = factor * self.model.forward_flops(op, s, b) / self.layout.tp
            return OpTime(
                flops / peak,
                Source("modelled", f"{flops:.4g} FLOP ({phase}, analytic, /tp) / {said}"),
                {op: flops / peak},
            )
        # Memory-bound ops (the embedding, norms): read the input and write the output, s*b*h elements each.
        bw, said = self.memory_bandwidth()
        nbytes = factor * 2 * s * b * self.model.hidden * self.layout.bytes_per_element
        return OpTime(
            nbytes / bw, Source("modelled", f"{nbytes:.4g} B moved ({phase}) / {said}"), {op: nbytes / bw}
        )

    def op(self, op: str, phase: str) -> OpTime:
        """The op at the layout's point on one GPU, without TP collectives (see :meth:`collectives`);
        ``missing`` set unless measured at exactly this point and TP."""
        s, b, tp = self.layout.seq_len, self.layout.micro_batch_size, self.layout.tp
        miss = Missing(op, phase, s, b, tp, "not measured at this point and tensor-parallel size")
        for exact_only in (True, False):
            got = self._at_basis(op, phase, tp, exact_only)
            if got is not None:
                if got.source.kind == "measured":
                    return got
                return OpTime(got.seconds, got.source, got.parts, (miss,), rows_tp=tp)
        if tp > 1:
            for exact_only in (True, False):
                got = self._at_basis(op, phase, 1, exact_only)
                if got is not None:
                    d = self._divided(op, got)
                    return OpTime(d.seconds, d.source, d.parts, (miss,), rows_tp=1)
        got = self._modelled(op, phase)
        assert got is not None
        return OpTime(got.seconds, got.source, got.parts, (miss,))

    def sub_op_parts(self, op: str, phase: str) -> dict[str, float]:
        """The leaf times of ``op``'s sub-ops (ignoring the op's own row), for apportioning only."""
        for basis in dict.fromkeys((self.layout.tp, 1)):
            out: dict[str, float] = {}
            for kid in _children(self.tree, op):
                if self._absent(kid):
                    continue
                got = self._at_basis(kid, phase, basis, exact_only=False)
                if got is not None:
                    out.update(got.parts)
            if out:
                return out
        return {}

    def measured_at_tp(self, op: str, phase: str) -> bool:
        """Whether the op's time comes from rows measured at the layout's TP (under torchrun: the TP
        collectives are inside the rows)."""
        return self.op(op, phase).rows_tp == self.layout.tp

    # -- collectives ----------------------------------------------------------------------------------
    def collective(self, kind: str, nbytes: float, world: int) -> tuple[float, Source]:
        """A collective's time over the links (autotuner.predict.links); rows measured on CPUs only and no
        calibration naming its device: gloo's links, as such a layout runs (the validation on CPU)."""
        backend = "gloo" if self.meas.devices == {"cpu"} and "device_type" not in self.calibration else None
        return collective_seconds(self.calibration, kind, nbytes, world, backend)

    def tp_collectives(self, op: str, phase: str) -> tuple[float, Source] | None:
        """The TP collectives of one op per micro-batch when its rows did not include them (rows from
        TP=1); None when they are in the measured rows or tp=1. Layer: 2 all-reduces of s*b*h forward and
        2 backward (SP: 2 all-gathers + 2 reduce-scatters); embedding: 1 forward; output layer: 1 backward."""
        tp = self.layout.tp
        if tp == 1 or self.measured_at_tp(op, phase):
            return None
        count = {"transformer_layer": 2, "embedding": 1 if phase == "forward" else 0}.get(op, 0)
        if op == "output_layer":
            count = 1 if phase == "backward" else 0
        if not count:
            return None
        nbytes = (
            self.layout.seq_len
            * self.layout.micro_batch_size
            * self.model.hidden
            * self.layout.bytes_per_element
        )
        if self.layout.sequence_parallel:
            ag, src_ag = self.collective("all_gather", nbytes, tp)
            rs, src_rs = self.collective("reduce_scatter", nbytes, tp)
            seconds = count * (ag + rs)
            detail = (
                f"{count} all-gather + {count} reduce-scatter of {nbytes:.4g} B over tp={tp}: {src_ag.detail}"
            )
            return seconds, Source("modelled", detail)
        ar, src = self.collective("all_reduce", nbytes, tp)
        return count * ar, Source(
            "modelled", f"{count} all-reduce of {nbytes:.4g} B over tp={tp}: {src.detail}"
        )


@dataclass(frozen=True)
class SweepOp:
    """One op of a stage's sweep (module docstring, "Warm or cold caches") and the distinct bytes it
    touches on one GPU per micro-batch: its weights, their fp32 main gradients (written in its
    backward), and what its forward saves (the output layer: the logits)."""

    name: str
    weights: float
    grads: float
    activations: float

    @property
    def footprint(self) -> float:
        return self.weights + self.grads + self.activations

    def own(self, phase: str) -> float:
        """The bytes one visit touches: its warm row's data."""
        return self.weights + self.activations + (self.grads if phase == "backward" else 0.0)


@dataclass(frozen=True)
class CacheSizes:
    """``private``: the cache one core (or a GPU) has to itself, where a warm row of an op smaller than it
    ran (calibration ``warm_cache_bytes``); ``shared``: the last-level cache, where a larger op's warm row
    ran (``shared_cache_bytes``; a GPU's L2 is both)."""

    private: float
    shared: float

    @classmethod
    def from_calibration(cls, calibration: Mapping[str, Any] | None) -> CacheSizes | None:
        warm = (calibration or {}).get("warm_cache_bytes")
        if not warm:
            return None
        return cls(float(warm), float(max(warm, (calibration or {}).get("shared_cache_bytes") or warm)))


def stage_sweep(model: ModelShape, layout: Layout, stage: int, layer_activations: float) -> list[SweepOp]:
    """The ops one micro-batch visits on ``stage``'s GPU, in forward order, with their bytes (from the
    model's sizes and one layer's saved activations per micro-batch, autotuner.predict.memory)."""
    tp, per = layout.tp, layout.bytes_per_element
    tokens = layout.seq_len * layout.micro_batch_size
    table = model.vocab * model.hidden / tp
    layer = model.layer_params_on_rank(tp, layout.ep)
    ops = (
        [SweepOp("embedding", table * per, table * GRAD_BYTES, tokens * model.hidden * per)]
        if stage == 0
        else []
    )
    per_stage = layout.stage_layers(model.num_layers)[stage]
    ops += [SweepOp("transformer_layer", layer * per, layer * GRAD_BYTES, layer_activations)] * per_stage
    if stage == layout.pp - 1:
        norm = model.final_norm_params
        ops.append(SweepOp("final_layernorm", norm * per, norm * GRAD_BYTES, tokens * model.hidden * per))
        logits = tokens * model.vocab / tp * GRAD_BYTES  # fp32 for the loss
        ops.append(SweepOp("output_layer", table * per, table * GRAD_BYTES, logits))
    return ops


def warm_visits(sweep: list[SweepOp], caches: CacheSizes | None) -> dict[tuple[str, str], int]:
    """{(op, phase): how many of its visits per micro-batch find their data where its warm row did}
    (module docstring): the bytes touched since the op's previous visit (its backward's previous
    visit is its forward; its forward's, the last micro-batch's backward) fit the cache the warm row ran
    in, or the visit right before it in the step is the same op's, in the same phase (a layer after the
    layer before it). Never the sweep's first forward, which follows a backward (a forward after a
    backward), nor without cache sizes (assumed exceeded), nor for an op larger than the shared cache."""
    found = {(op.name, phase): 0 for op in sweep for phase in PHASES}
    if caches is None:
        return found
    before = [0.0, *itertools.accumulate(op.footprint for op in sweep)]  # bytes of the ops before each
    for i, op in enumerate(sweep):
        for phase in PHASES:
            distance = before[i] if phase == "forward" else before[-1] - before[i + 1]
            own = op.own(phase)
            room = caches.private if own <= caches.private else caches.shared
            just_before = i - 1 if phase == "forward" else i + 1  # the backward sweeps in reverse
            follows_itself = 0 <= just_before < len(sweep) and sweep[just_before].name == op.name
            after_backward = phase == "forward" and i == 0
            warm = own <= caches.shared and not after_backward and (distance <= room or follows_itself)
            found[(op.name, phase)] += int(warm)
    return found


def cache_plan(
    sweeps: list[list[SweepOp]], calibration: Mapping[str, Any] | None
) -> tuple[list[dict], bool, bool, str]:
    """Per stage the warm visits (:func:`warm_visits`) with the calibration's cache sizes, whether any
    visit wants warm rows, any flushed ones, and why, in words."""
    from autotuner.results.units import human_bytes

    caches = CacheSizes.from_calibration(calibration)
    plans = [warm_visits(sweep, caches) for sweep in sweeps]
    visits = sum(len(sweep) for sweep in sweeps) * len(PHASES)
    warm = sum(sum(plan.values()) for plan in plans)
    if caches is None:
        why = "the calibration names no warm_cache_bytes: assumed every op's data leaves the cache"
    else:
        why = (
            f"{warm} of {visits} op visits per micro-batch find their data where a warm row had it (the "
            f"bytes touched since the op's last visit within the {human_bytes(caches.private)} private or "
            f"{human_bytes(caches.shared)} shared cache it ran from, or the visit before it the same op's; "
            "never a stage's first forward op, which follows a backward)"
        )
        if not (calibration or {}).get("shared_cache_bytes"):
            why += "; the calibration names no shared_cache_bytes (python -m autotuner.calibrate records it)"
    return plans, warm > 0, warm < visits, why


def blend(warm: OpTime, cold: OpTime, warm_count: int, count: int) -> OpTime:
    """An op visited ``count`` times per micro-batch, ``warm_count`` of them with its data cached: the
    mean time per visit, from its warm and its flushed rows."""
    share = warm_count / count
    parts = {
        k: share * warm.parts.get(k, 0.0) + (1 - share) * cold.parts.get(k, 0.0)
        for k in dict.fromkeys([*warm.parts, *cold.parts])
    }
    detail = (
        f"{warm_count} of {count} visits per micro-batch with the data cached: {warm.source.detail}; "
        f"the other {count - warm_count} flushed: {cold.source.detail}"
    )
    return OpTime(
        share * warm.seconds + (1 - share) * cold.seconds,
        Source(worst_kind([warm.source, cold.source]), detail),
        parts,
        tuple(dict.fromkeys([*warm.missing, *cold.missing])),
        cold.rows_tp,
    )


# ------------------------------------------------------------------------------------ stages and step


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
        "gradient_accumulation_fusion; the calibration did not time it, python -m autotuner.calibrate does: "
        "a bf16 gradient's add ran at 0.64x the copy rate on an H200)"
    )
    return OpTime(nbytes / bw, Source("modelled", detail), {"grad_accumulation": nbytes / bw})


def host_work_cached(sweep: list[SweepOp], caches: CacheSizes | None, processes: int) -> tuple[bool, str]:
    """Whether a stage's host work finds its own data in the shared cache (module docstring, "Host work
    outside the ops"): a micro-batch's ops on the stage, in each of the ``processes`` that share the host,
    touch no more bytes than it holds; and why, in words. Without cache sizes, assumed not."""
    from autotuner.results.units import human_bytes

    if caches is None:
        return False, "the calibration names no cache sizes: assumed swept out"
    touched = sum(op.footprint for op in sweep)
    beside = f" x {processes} processes on one host" if processes > 1 else ""
    cached = touched * processes <= caches.shared
    return cached, (
        f"a micro-batch's ops touch {human_bytes(touched)}{beside}, "
        f"{'within' if cached else 'beyond'} the {human_bytes(caches.shared)} shared cache"
    )


def host_work(tm: TimeModel, phase: str, layers: int, cached: tuple[bool, str] = (True, "")) -> OpTime | None:
    """The host work outside the ops of one micro-batch's ``phase`` on a stage of ``layers`` layers in the
    layout's vpp model chunks, each its own forward and backward step of the schedule and its own
    GPTModel forward, as timed with warm caches or, where ``cached`` (:func:`host_work_cached`) says the
    stage's ops sweep them out, with the caches flushed (module docstring); None on a GPU, and on a CPU
    without it in the calibration (said in a warning)."""
    if tm.meas.devices != {"cpu"}:
        return None
    timed = tm.calibration.get(HOST_WORK)
    if not timed:
        tm._warn(
            "the calibration did not time a step's host work outside its ops (Megatron's schedule, "
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
    seconds, src = tm.collective("send_recv", nbytes, 2)
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
    warm ones, ``tm``'s the flushed ones) and ``warm``, each stage's warm visits (:func:`cache_plan`),
    an op's visits that find their data cached take its warm rows, the others its flushed ones;
    ``host_cached``: per stage, :func:`host_work_cached` (else its host work is the warm one)."""
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
                items.append(
                    (
                        f"tp_collectives:{name}",
                        phase,
                        OpTime(comm[0], comm[1], {"tp_collectives": comm[0]}),
                        count,
                    )
                )
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
    chunk's). Before session 27 each chunk took 1/v of its stage, which on the llama-shaped VPP2 put
    half the last chunk's output layer (2.1 ms forward, 3.1 backward a micro-batch) into the chunk before
    it, and paid the host work's part for a stage once, not per chunk."""
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

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_reduction + self.optimizer


def pipeline_schedule(stages: list[StageTime], lay: Layout, exchange_s: float, overlapped: bool) -> Schedule:
    """Each stage's forwards and backwards placed by Megatron-Core's schedule (module docstring), a box
    per micro-batch and model chunk, each taking its chunk's own time (:func:`chunk_times`);
    ``overlapped``: the exchanges cost the receiving box alone (autotuner.predict.schedule.
    overlaps_exchanges)."""
    own = {
        (st.index, phase, chunk): times[PHASES.index(phase)]
        for st in stages
        for chunk, times in enumerate(st.chunks)
        for phase in PHASES
    }
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
    sched = pipeline_schedule(stages, lay, exchange.seconds if exchange else 0.0, overlapped)
    slowest = max(range(len(stages)), key=lambda i: stages[i].total)
    pace = stages[slowest].total
    closed = closed_form_s(pace, lay.pp, lay.vpp, lay.microbatches)
    pipe = sched.end
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
    tensors = tm.model.stage_tensors(lay.ep, stages[largest].layers, largest == 0, largest == lay.pp - 1)
    optimizer, opt_src = optimizer_step(tm, stage_params[largest], stage_expert_params[largest], tensors)
    bubble = pipe / (lay.microbatches * pace) - 1 if pace > 0 else 0.0
    return StepTime(
        pipe, bubble, slowest, dp_s, dp_src, optimizer, opt_src, formula, sched, closed, exchange, overlapped
    )


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
        if lay.distributed_optimizer:
            rs, rs_src = tm.collective("reduce_scatter", count * 4, ranks)
            ag, ag_src = tm.collective("all_gather", count * lay.bytes_per_element, ranks)
            seconds += rs + ag
            details.append(
                f"{name}: reduce-scatter of {count * 4:.4g} B fp32 grads + all-gather of "
                f"{count * lay.bytes_per_element:.4g} B params over {ranks} ranks: {rs_src.detail}; "
                f"{ag_src.detail}"
            )
        else:
            s, src = tm.collective("all_reduce", count * 4, ranks)
            seconds += s
            details.append(
                f"{name}: all-reduce of {count * 4:.4g} B fp32 grads over {ranks} ranks: {src.detail}"
            )
    if not seconds:
        return 0.0, Source("modelled", f"dp={lay.dp}: no gradient reduction ({'; '.join(details) or 'dp=1'})")
    return seconds, Source("modelled", "; ".join(details))


def optimizer_step(tm: TimeModel, params: float, expert_params: float, tensors: int) -> tuple[float, Source]:
    """The optimizer's part of a step on the GPU holding ``params`` parameters, ``expert_params`` of them
    routed experts', in ``tensors`` parameter tensors (module docstring)."""
    lay = tm.layout
    bw, said = tm.memory_bandwidth()
    per_rank = lay.optimizer_params(params, expert_params)
    rate = tm.calibration.get("adam_seconds_per_parameter")
    if not rate:
        tm._warn(
            "the calibration did not time the Adam step: it is modelled from the memory bandwidth (one "
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
            how = f"Adam step timed by autotuner.calibrate --collectives on {link}, every rank at once: "
            how += f"{rate * 1e9:.4g} ns per fp32 parameter"
        else:
            tm._warn(
                f"the calibration did not time Adam on {lay.gpus} CPU processes at once (they share the "
                f"memory: each runs slower than one alone): torchrun --nproc-per-node={lay.gpus} -m "
                "autotuner.calibrate --collectives times it"
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
    in_training = tm.calibration.get(ADAM_IN_STEP)
    if in_training:
        adam += in_training
        detail += f"; + {in_training * 1e6:.3g} us a step more inside training steps (timed in real ones)"
    # Zeroing every gradient for the next step; mixed precision also casts the updated fp32 main
    # parameters into the model's copy (read 4 B, write 2 B).
    extra = GRAD_BYTES * params + (6 * per_rank if lay.dtype in ("bf16", "fp16") else 0)
    detail += f"; + {extra / params:g} B per parameter (zeroing the gradients"
    detail += ", the cast to the model's dtype" if lay.dtype in ("bf16", "fp16") else ""
    detail += f") / {said}"
    return adam + extra / bw, Source("scaled", detail)
