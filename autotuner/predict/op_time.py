"""One op's time per micro-batch on one GPU at a layout's point, from measured op rows (or a model).

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
5. *modelled*: the analytic FLOPs (backward: 2x forward) over the calibrated peak (``peak_flops[dtype]``);
   the embedding and norms as memory-bound, 2*s*b*h elements moved over the calibrated memory bandwidth.
   A CPU prediction from CPU rows may go without a calibration (autotuner.predict.prediction refuses a
   GPU's): its rows are the measurement, the peak the best throughput any GEMM row reached, the bandwidth
   the fastest any row moved its counted bytes at (said so); where the rows have neither, refused in one
   line naming the command that measures it. No figure is assumed.

A figure that is not measured at the exact point and TP also yields a ``Missing`` record: the profiling
run that would measure it (never a silent zero).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from autotuner.errors import UserError
from autotuner.ops_test.places import OpTree, op_tree
from autotuner.predict.cluster import Cluster
from autotuner.predict.collectives import KIND_NAMES, Group, collective_time, megatron_groups
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

ATTENTION_OPS = frozenset({"core_attention"})
# What Megatron keeps whole on every TP rank unless sequence parallelism splits the sequence.
REPLICATED_WITHOUT_SP = frozenset(
    {"input_layernorm", "pre_mlp_layernorm", "self_attn_bda", "mlp_bda", "final_layernorm", "embedding"}
)
# Ops whose time the analytic FLOPs model (step 3 and 5 of the module docstring).
ANALYTIC_OPS = frozenset({"transformer_layer", "self_attention", "output_layer"})
# Repeats of a row (autotuner.predict.inputs.repeated) further apart than this fraction are said: the CPU
# target's 5%.
REPEATS_APART = 0.05


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
      1/ep of what it sends, as an all-gather does: without a cluster (autotuner.predict.collectives)
      an all-to-all is charged as an all-gather of the buffer a rank sends.

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
    exchange = [("all_to_all", routed * h * per, "an all-to-all of s*b*top-k*h")]
    if op == "token_combine":
        return exchange
    exchange.append(("all_to_all", routed * per, "an all-to-all of s*b*top-k probabilities"))
    if forward:
        exchange.insert(0, ("all_gather", ep * experts * 8, "tokens-per-expert counts, ep*experts int64"))
    return exchange


@dataclass(frozen=True)
class OpTime:
    """One op's time per micro-batch on one GPU, its source, the leaf ops it is made of (for the op that
    dominates), and what would measure it where it was not measured."""

    seconds: float
    source: Source
    parts: Mapping[str, float] = field(default_factory=dict)
    missing: tuple[Missing, ...] = ()
    rows_tp: int = 0  # the tensor-parallel size of the rows it came from (0: modelled)
    # the collectives its rows recorded and did not run (an emulated rank's: :func:`recorded_collectives`),
    # as (kind, bytes at the layout's point, group), for the step to price
    recorded: tuple[tuple[str, float, str], ...] = ()

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
        cluster: Cluster | None = None,
        cp: int = 1,
    ) -> None:
        self.meas, self.model, self.layout = meas, model, layout
        self.without_ep = without_ep  # rows measured at ep=1, for the expert ops at ep > 1
        # the links collectives are priced over where given (autotuner.predict.collectives), and the
        # context-parallel size ``layout`` is one rank's view of (Layout.context_rank_view)
        self.cluster, self.cp = cluster, cp
        # kept as given, not copied: the prediction names the figures read from it (prediction.FiguresRead)
        self.calibration: Mapping[str, Any] = calibration if calibration is not None else {}
        self.tree = tree or op_tree()
        self.warnings: list[str] = []
        self.cold, self.cache_reason = True, "assumed: the step's data exceeds the cache"
        self.other_cache_rows: set[str] = set()  # rows used that were measured the other way
        # rows used whose samples spread widely ("op.phase": their warning's figure, e.g. "iqr=36%")
        self.noisy_rows: dict[str, str] = {}
        self.apart_rows: dict[str, str] = {}  # repeats further apart than REPEATS_APART (_note_noise)
        self._absent_ops: dict[str, bool] = {}  # _absent's answers: fixed by the rows and the model
        # _at_basis's answers, fixed by the rows, the model and the layout: an op tree is walked once per
        # (op, phase, basis) instead of once per question (autotuner.tune asks thousands of layouts)
        self._resolved: dict[tuple[str, str, int, bool], OpTime | None] = {}

    # -- calibration ----------------------------------------------------------------------------------
    def peak_flops(self) -> tuple[float, str]:
        dtype = self.layout.dtype
        peak = (self.calibration.get("peak_flops") or {}).get(dtype)
        if peak:
            return float(peak), f"calibrated peak_flops[{dtype}] {peak / 1e12:.4g} TFLOP/s"
        best = self.meas.best_gemm_throughput()
        if best:
            return best, f"no calibration: the best {dtype} GEMM row's {best / 1e12:.4g} TFLOP/s"
        raise UserError(
            f"no calibration, and no {dtype} GEMM row in the runs to take a peak from for the ops modelled "
            f"from their FLOPs: give calibration=FILE ({self.calibrate_command()} writes one), or profile "
            f"the model in {dtype} (python -m autotuner.main case={self.model.case} dtype={dtype})"
        )

    def memory_bandwidth(self) -> tuple[float, str]:
        bw = self.calibration.get("memory_bandwidth")
        if bw:
            return float(bw), f"calibrated memory_bandwidth {bw / 1e9:.4g} GB/s"
        best = self.meas.best_memory_throughput()
        if best is None:
            raise UserError(
                "no calibration, and no row in the runs counts its bytes moved to take a memory bandwidth "
                f"from: give calibration=FILE ({self.calibrate_command()} writes one)"
            )
        rate, row = best
        said = f"the rows' fastest bytes moved, {rate / 1e9:.4g} GB/s ({describe_row(row)})"
        self._warn(
            f"no calibration: the memory bandwidth is {said}, a stand-in for the copy bandwidth "
            f"({self.calibrate_command()} measures it: pass its file as calibration=FILE)"
        )
        return rate, f"no calibration: {said}"

    def untimed(self, what: str) -> str:
        """ "the calibration did not time <what>", or without one "no calibration timed <what>"."""
        return f"{'the calibration did not time' if self.calibration else 'no calibration timed'} {what}"

    def calibrate_command(self) -> str:
        """The command that calibrates the device the rows were profiled on."""
        device = "cpu" if self.meas.profiled_on == {"cpu"} else "cuda"
        return f"python -m autotuner.calibrate device={device}"

    def set_cache_mode(self, cold: bool, reason: str) -> None:
        """Which rows this model stands for (autotuner.predict.caches.cache_plan); ``meas`` should prefer
        them."""
        self.cold, self.cache_reason = cold, reason
        self.other_cache_rows.clear()
        self._resolved.clear()  # what was resolved before noted the rows of the other mode

    def _note_cache(self, row: Mapping[str, Any]) -> None:
        if bool(row.get("cache_flush")) != self.cold:
            self.other_cache_rows.add(f"{row['op']}.{row['phase']}")

    def _note_noise(self, row: Mapping[str, Any]) -> None:
        """A row the timer warned ``noisy`` (its IQR over autotuner.measure.timer.NOISY_IQR_FRACTION of its
        median): its mean moves between profiles more than its samples show. And repeats (rows of several
        runs: autotuner.predict.inputs.repeated) that lie further apart than REPEATS_APART: the machine's
        speed moved between the runs."""
        said = next((w for w in str(row.get("warnings") or "").split(";") if w.startswith("noisy(")), None)
        if said is not None:
            self.noisy_rows[f"{row['op']}.{row['phase']}"] = said[len("noisy(") : -1]
        repeats = [us for _, us in row.get("repeats_us") or ()]
        if repeats and max(repeats) > (1 + REPEATS_APART) * min(repeats):
            self.apart_rows[f"{row['op']}.{row['phase']}"] = f"{min(repeats):.4g}-{max(repeats):.4g}us"

    def cache_warning(self, used: set[str]) -> str | None:
        """What to say when rows of the other cache mode went into the prediction
        (autotuner.predict.caches): those of them ``used`` (``op.phase``: the rows its times came from)."""
        rows = self.other_cache_rows & used
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
        self._note_noise(row)
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
            recorded = recorded_collectives(found[2], self.layout)
            return OpTime(
                found[0], Source("measured", found[1]), {op: found[0]}, rows_tp=basis, recorded=recorded
            )
        if self.layout.ep > 1 and op in EP_LEAF_OPS:
            got = self._expert_op_without_ep(op, phase, basis, exact_only)
            if got is not None or exact_only:
                return got
        exact_sum = self._sub_op_sum(op, phase, basis, exact_only=True)
        if exact_sum is not None or exact_only:
            return exact_sum
        found = self._row_seconds(self.meas, op, phase, basis, nearest=True)
        if found is not None:
            recorded = recorded_collectives(found[2], self.layout)
            return OpTime(
                found[0], Source("scaled", found[1]), {op: found[0]}, rows_tp=basis, recorded=recorded
            )
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
            took, src = self.collective(kind, nbytes, ep, "ep")
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
            recorded=tuple(c for p in parts for c in p.recorded),
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
                return OpTime(got.seconds, got.source, got.parts, (miss,), rows_tp=tp, recorded=got.recorded)
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
    def group(self, name: str) -> Group:
        """The layout's process group ``name`` (autotuner.predict.collectives.megatron_groups; ``pp_pair``:
        two neighbouring pipeline stages); UserError (one line) for a name it has none of."""
        lay = self.layout  # one rank's view: its dp is Megatron's dp-cp group
        groups = megatron_groups(lay.tp, 1, lay.dp, lay.pp, lay.ep)
        groups["cp"] = Group("cp", self.cp, lay.tp)
        groups["pp_pair"] = Group("pp", 2, groups["pp"].stride)
        if name not in groups:
            raise UserError(
                f"a collective over the {name!r} group, which the predictor cannot place: record one of "
                f"{', '.join(sorted(groups))}"
            )
        return groups[name]

    def collective(
        self, kind: str, nbytes: float, world: int, group: str | None = None
    ) -> tuple[float, Source]:
        """A collective's time: over the cluster's links where a cluster is given and the ``group`` named
        (autotuner.predict.collectives: where the group's ranks lie), else over the calibration's
        (autotuner.predict.links; an all-to-all as an all-gather of what a rank sends); rows measured on
        CPUs only and no calibration naming its device: gloo's links, as such a layout runs (the
        validation on CPU)."""
        if self.cluster is not None and group is not None:
            seconds, detail = collective_time(self.cluster, kind, nbytes, self.group(group))
            return seconds, Source("modelled", f"{detail} ({self.cluster.origin})")
        backend = "gloo" if self.meas.devices == {"cpu"} and "device_type" not in self.calibration else None
        kind = "all_gather" if kind == "all_to_all" else kind
        return collective_seconds(self.calibration, kind, nbytes, world, backend)

    def recorded_seconds(self, got: OpTime) -> tuple[float, Source] | None:
        """The collectives an op's rows recorded without running them (an emulated rank's), priced over
        the links, each over its group; None where they recorded none."""
        if not got.recorded:
            return None
        seconds, details = 0.0, []
        for kind, nbytes, group in got.recorded:
            took, src = self.collective(kind, nbytes, self.group(group).size, group)
            seconds += took
            details.append(src.detail)
        detail = f"{len(got.recorded)} collective(s) the rows recorded and did not run: " + "; ".join(details)
        return seconds, Source("modelled", detail)

    def tp_collectives(self, op: str, phase: str) -> tuple[float, Source] | None:
        """The TP collectives of one op per micro-batch when its rows did not include them (rows from
        TP=1); None when they are in the measured rows or tp=1. Layer: 2 all-reduces of s*b*h forward and
        2 backward (SP: 2 all-gathers + 2 reduce-scatters); embedding: 1 forward; output layer: 1 backward."""
        tp = self.layout.tp
        recorded = self.recorded_seconds(self.op(op, phase))
        if recorded is not None:
            return recorded
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
            ag, src_ag = self.collective("all_gather", nbytes, tp, "tp")
            rs, src_rs = self.collective("reduce_scatter", nbytes, tp, "tp")
            seconds = count * (ag + rs)
            detail = (
                f"{count} all-gather + {count} reduce-scatter of {nbytes:.4g} B over tp={tp}: {src_ag.detail}"
            )
            return seconds, Source("modelled", detail)
        ar, src = self.collective("all_reduce", nbytes, tp, "tp")
        return count * ar, Source(
            "modelled", f"{count} all-reduce of {nbytes:.4g} B over tp={tp}: {src.detail}"
        )


def recorded_collectives(row: Mapping[str, Any], layout: Layout) -> tuple[tuple[str, float, str], ...]:
    """The collectives a row recorded without running them (its ``collectives``: an emulated rank's op,
    each ``{"kind", "bytes", "group"}``), as (kind, bytes at ``layout``'s point, group): bytes scale with
    the tokens s*b from the row's point, as every collective of a layer moves a token's share. UserError
    (one line) for a kind the predictor cannot price."""
    listed = row.get("collectives")
    if not listed:
        return ()
    scale = layout.seq_len * layout.micro_batch_size / (int(row["seq_len"]) * int(row["micro_batch_size"]))
    out = []
    for item in listed:
        kind = KIND_NAMES.get(str(item.get("kind")))
        if kind is None:
            raise UserError(
                f"{describe_row(row)} records a {item.get('kind')!r} collective, which the predictor cannot "
                f"price: one of {', '.join(sorted(KIND_NAMES))}"
            )
        out.append((kind, float(item["bytes"]) * scale, str(item.get("group") or "tp")))
    return tuple(out)
