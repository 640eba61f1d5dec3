"""What the predictor reads: the model's sizes (``ModelShape``), the runs' usable rows (``Measurements``),
and what it would still need measured (``Missing``).

The model's sizes come from a run's ``environment.json`` (the ``model_args`` of the HF mapping and the
``transformer_config`` Megatron was built with, as autotuner.launchers.common records them), or, without
one, from the case file through autotuner.model.hf_to_megatron.map_hf_config. Its parameters and
parameter tensors are counted on that model built on the meta device (autotuner.model.counts).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from autotuner.errors import UserError

GEMM_OPS = frozenset(
    {
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
        "mlp",
        "output_layer",
        "q_down_proj",
        "kv_down_proj",
        "mla_q_proj",
        "q_up_proj",
        "kv_up_proj",
        "router",
        "experts",
        "shared_experts",
        "matmul",
    }
)


@dataclass(frozen=True)
class ModelShape:
    """The model's sizes, from a run's environment.json (``transformer_config``, ``model_args``)."""

    case: str
    num_layers: int
    hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    ffn: int
    vocab: int
    tie_embeddings: bool
    experts: int | None
    layer_params: int
    layer_active_params: int
    final_norm_params: int
    expert_params: int = 0  # of a layer's routed experts (all of them), within layer_params
    # a layer's parameter tensors and, of them, its routed experts' (all of them): what torch's Adam,
    # unfused, loops over (:func:`layer_tensors`)
    layer_tensors: float = 0
    expert_tensors: float = 0
    final_norm_tensors: int = 1
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def at_depth(self, num_layers: int) -> ModelShape:
        """The same model with ``num_layers`` layers (op rows are per layer: they hold at any depth)."""
        return replace(self, num_layers=num_layers, config={**self.config, "num_layers": num_layers})

    @classmethod
    def from_environment(cls, env: Mapping[str, Any]) -> ModelShape:
        """From a run's environment.json: the HF mapping it recorded (``model_args``) with the values its
        TransformerConfig was built with (``transformer_config``: ``tf.`` overrides) where they differ."""
        tc = env.get("transformer_config")
        args = env.get("model_args")
        if not isinstance(tc, dict) or not isinstance(args, dict) or "num_layers" not in tc:
            if env.get("case"):
                return cls.from_case(str(env["case"]))
            raise UserError(
                "the run's environment.json holds no transformer_config and no case: pass a run directory "
                "written by python -m autotuner.main"
            )
        from autotuner.model.hf_to_megatron import MODEL_FIELDS, MegatronModelArgs

        known = {f.name for f in fields(MegatronModelArgs)}
        if "transformer" not in args:  # a record of the TransformerConfig alone: its model's sizes
            shape = {k: v for k, v in tc.items() if k in MODEL_FIELDS and _plain(v)}
            defaults = dict(activation="silu", max_sequence_length=2**31 - 1, rotary_base=10000.0)
            defaults.update(rotary_percent=1.0, tie_word_embeddings=False)
            args = {**defaults, **args, "transformer": shape}
        model_args = MegatronModelArgs(**{k: v for k, v in args.items() if k in known})
        mapped = model_args.transformer
        built = {k: tc[k] for k in mapped if k in tc and _plain(tc[k]) and tc[k] != _as_json(mapped[k])}
        shape = cls.from_args(str(env.get("case")), model_args, built)
        # the run's own settings (gradient_accumulation_fusion, the parallel sizes) as it recorded them
        return replace(shape, config={**shape.config, **{k: v for k, v in tc.items() if _plain(v)}})

    @classmethod
    def from_case(cls, name: str, case_dir: str | None = None) -> ModelShape:
        """From the case file, through the one HF mapping (the sizes as published; a run made with
        ``hf.*`` overrides records its own in environment.json, which wins)."""
        from autotuner.model.cases import build_hf_config, load_case
        from autotuner.model.hf_to_megatron import map_hf_config

        case = load_case(name, case_dir)
        return cls.from_args(name, map_hf_config(build_hf_config(case.hf_fields, {})))

    @classmethod
    def from_args(
        cls, case: str, args: Any, overrides: Mapping[str, Any] | None = None, tf_config: Any = None
    ) -> ModelShape:
        """From the HF mapping's output (autotuner.model.hf_to_megatron.MegatronModelArgs) and
        TransformerConfig ``overrides`` (or the TransformerConfig built from them, ``tf_config``): the counts
        are those of the model Megatron builds (autotuner.model.counts, on the meta device), a layer's the
        mean of the model's layers where dense and MoE layers mix."""
        import torch

        from autotuner.model.build import build_transformer_config
        from autotuner.model.counts import count_parameters
        from autotuner.model.runtime import quiet_megatron_import

        quiet_megatron_import()
        tf = tf_config
        if tf is None:
            tf = build_transformer_config(args, dict(overrides or {}), "fp32", torch.device("cpu"), 1)
        counts = count_parameters(args, tf)
        layers = [counts.layer(moe) for moe in counts.layers]

        def mean(values: Iterable[float]) -> float:
            values = list(values)
            total = sum(values)
            return total // len(values) if total % len(values) == 0 else total / len(values)

        experts = tf.num_moe_experts or None
        config = {k: v for k, v in vars(tf).items() if not k.startswith("_") and _plain(v)}
        return cls(
            case=case,
            num_layers=int(tf.num_layers),
            hidden=int(tf.hidden_size),
            heads=int(tf.num_attention_heads),
            query_groups=int(tf.num_query_groups or tf.num_attention_heads),
            kv_channels=int(tf.kv_channels),
            ffn=int(tf.ffn_hidden_size),
            vocab=int(args.vocab_size),
            tie_embeddings=bool(args.tie_word_embeddings),
            experts=experts,
            layer_params=mean(layer.parameters for layer in layers),
            layer_active_params=mean(layer.active for layer in layers),
            final_norm_params=counts.final_norm,
            expert_params=mean(layer.routed_experts for layer in layers),
            layer_tensors=mean(layer.tensors for layer in layers),
            expert_tensors=mean(layer.routed_expert_tensors for layer in layers),
            final_norm_tensors=counts.final_norm_tensors,
            config=config,
        )

    def expert_params_on_rank(self, tp: int, ep: int) -> float:
        """A layer's routed-expert parameters on one GPU: 1/ep of the experts, split over TP only at
        ep=1 (with ep > 1 the project runs expert_tensor_parallel_size=1: autotuner.runner.spec)."""
        return self.expert_params / (ep if ep > 1 else tp)

    def stage_expert_params(self, tp: int, ep: int, layers: int) -> float:
        """The routed-expert parameters on one GPU of a pipeline stage holding ``layers`` layers."""
        return self.expert_params_on_rank(tp, ep) * layers

    def largest_tensor(self, tp: int, ep: int, vocab_table: bool) -> float:
        """Elements of the largest parameter tensor on one GPU: the vocabulary table where it holds one,
        else a layer's fused QKV, its fc1 (both halves when gated) or an expert's fc1."""
        gated = 2 if self.config.get("gated_linear_unit") else 1
        sizes = [
            self.hidden * (self.heads + 2 * self.query_groups) * self.kv_channels / tp,
            self.hidden * self.ffn * gated / tp,
        ]
        if self.experts:
            width = self.config.get("moe_ffn_hidden_size") or self.ffn
            sizes.append(self.hidden * width * gated / (1 if ep > 1 else tp))
        if vocab_table:
            sizes.append(self.vocab * self.hidden / tp)
        return max(sizes)

    def stage_tensors(self, ep: int, layers: int, first: bool, last: bool) -> float:
        """The parameter tensors on one GPU of a stage of ``layers`` layers (TP splits tensors, it does not
        add any): its layers' (the routed experts' over ep), the embedding's table on the ``first``
        stage, the final norm and the output layer (untied) on the ``last``."""
        layer = self.layer_tensors - self.expert_tensors + self.expert_tensors // max(1, ep)
        count = layer * layers
        if first:
            count += 1
        if last:
            count += self.final_norm_tensors + (not self.tie_embeddings)
        return count

    def untouched_embedding_params(self, tp: int, tokens: int) -> float:
        """The embedding table's parameters on one GPU of the first stage in rows that none of ``tokens``
        tokens, drawn uniformly from the vocabulary, touches: (vocab / tp) x hidden x (1 - 1/vocab)^tokens
        expected. Their gradients, and so their Adam moments, stay zero. None where the table is tied to
        the output layer, whose gradient reaches every row."""
        if self.tie_embeddings:
            return 0.0
        return self.vocab / tp * self.hidden * (1 - 1 / self.vocab) ** tokens

    def layer_params_on_rank(self, tp: int, ep: int) -> float:
        """A layer's parameters on one GPU: everything but the routed experts / tp, plus their share."""
        return (self.layer_params - self.expert_params) / tp + self.expert_params_on_rank(tp, ep)

    @property
    def attention_width(self) -> int:
        return self.heads * self.kv_channels

    def forward_flops(self, op: str, s: int, b: int) -> float:
        """Analytic forward FLOPs: GEMMs 2 x active parameters per token, attention's two products
        2 x 2*s*heads*head_dim per token (the full square, Megatron's convention), the output layer
        2*h*vocab per token."""
        tokens = s * b
        attention = 4.0 * s * self.attention_width * tokens
        if op == "output_layer":
            return 2.0 * self.hidden * self.vocab * tokens
        if op == "core_attention":
            return attention
        if op == "self_attention":
            qkv_out = (self.heads + 2 * self.query_groups) * self.kv_channels
            return 2.0 * (self.hidden * qkv_out + self.attention_width * self.hidden) * tokens + attention
        if op == "transformer_layer":
            return 2.0 * self.layer_active_params * tokens + attention
        raise ValueError(f"no analytic FLOPs for {op}")

    def parameters(self) -> int:
        """All parameters: embedding, layers, final norm, output layer (unless tied)."""
        out = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.num_layers * self.layer_params + self.final_norm_params + out


# What expert parallelism changes: the MoE layer's expert work (each rank computes its experts' share)
# and its token exchange (all-to-all), so every op that contains them. Rows of these ops stand for the
# expert-parallel size they were measured at; every other op's rows stand for any.
EP_COMPOSITE_OPS = frozenset({"transformer_layer", "transformer_block", "moe_layer"})
EP_LEAF_OPS = frozenset({"experts", "token_dispatch", "token_combine"})


def row_expert_parallel(row: Mapping[str, Any]) -> int:
    """The expert-parallel size a row was measured at: its own column (MoE ops), else its run's
    (``run_expert_parallel``, set by autotuner.predict.prediction.load_runs from environment.json)."""
    return int(row.get("expert_parallel") or row.get("run_expert_parallel") or 1)


def ran_collectives(row: Mapping[str, Any]) -> bool:
    """Whether the ranks that timed the row's op waited for each other inside it: a tensor-parallel op's
    collectives, or a MoE op's token exchange at expert parallelism. Such an op is as slow as its slowest
    rank (the ``rank="max"`` row). Any other op ran in each rank on its own, however many profiled it
    (a data-parallel or pipeline layout's ops, profiled beside each other on a CPU host)."""
    return int(row.get("tensor_parallel") or 1) > 1 or (
        row_expert_parallel(row) > 1 and row.get("op") in EP_COMPOSITE_OPS | EP_LEAF_OPS
    )


@dataclass(frozen=True)
class Missing:
    """A figure the runs lack at the layout's exact point: what to profile to measure it."""

    op: str
    phase: str
    seq_len: int
    micro_batch_size: int
    tp: int
    why: str

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "phase": self.phase,
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "tp": self.tp,
            "why": self.why,
        }


def measured_on_cpu(rows: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the ``ok`` rows were all measured on a CPU (a layout's processes then share one host)."""
    return {r.get("device") for r in rows if r.get("status") == "ok"} == {"cpu"}


def _fits(row: Mapping[str, Any], cold: bool | None, processes: int | None) -> tuple[bool, bool, bool, bool]:
    """How a row fits what ``Measurements`` asks for, in the order it weighs them (tuples compare so):
    its cache mode, then the processes it was profiled in (True where nothing is asked), then whether its
    samples ran without earlier calls' held activations (``held_activation_bytes``: the predictor's rows;
    held ones are another condition, autotuner.measure.timer, "Activations a step holds"), then, for a
    forward, whether each sample followed the op's backward as in a step (``forward_after_backward``)."""
    return (
        cold is None or bool(row.get("cache_flush")) == cold,
        processes is None or row.get("run_processes") == processes,
        not row.get("held_activation_bytes"),
        row.get("phase") != "forward" or bool(row.get("forward_after_backward")),
    )


class Measurements:
    """The usable rows of one or more runs, indexed by (op, phase, seq_len, micro_batch_size, tp), in one
    dtype. Under torchrun the ``rank="max"`` row stands for an op whose ranks waited for each other inside it
    (the slowest rank: :func:`ran_collectives`); of any other op each rank's row is a repeat (below): each
    rank timed the same op on its own, and the slowest of their medians is the largest of a few draws of the
    machine's noise, not a time a step waits for (three profiles of the llama-shaped layer in two processes on
    a CPU: the ranks' medians up to 1.26 apart; over the same 4 rounds each, the slowest ranks' rows predicted
    the llama-shaped PP2 and DP2 steps at 1.064 and 1.047 of the measured, the ranks' repeats at 1.034 and
    1.018: ``python -m benchmarks.predict_accuracy --layouts pp2,dp2`` prints both); a step's wait for its
    slowest rank is the step's own spread. Otherwise the single process's row. With ``ep``, rows of the ops
    expert parallelism changes (``EP_COMPOSITE_OPS``, ``EP_LEAF_OPS``) count only if measured at that size. A
    row measured with the cache mode ``cold`` asks for (``cache_flush``; None: either) wins over one measured
    the other way; then one profiled in ``processes`` processes (``run_processes``; None: any), as a CPU
    layout's ops run beside that many (autotuner.predict.prediction), over one profiled in another count; then
    one timed without held activations (``timing.held_activations_mib``) over one timed beside them; then
    a forward timed after the op's backward (``timing.forward_after_backward``), as a step runs it, over one
    timed back to back. Rows that fit equally from different runs (``run_dir``, set by
    autotuner.predict.prediction.load_runs), or from different ranks of one where the op ran on its own in
    each, are repeats, and the op stands for their median (two: their mean; :func:`repeated`); within one run
    a later row replaces an earlier one of the same rank at the same key. Rows timed after a pause
    (``idle_before_ms`` above 0) are left out: they time another condition than a step's back-to-back ops, not
    another sample of the same."""

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]],
        dtype: str,
        cold: bool | None = None,
        ep: int | None = None,
        processes: int | None = None,
    ):
        self.dtype = dtype
        repeats: dict[tuple[str, str, int, int, int], list[dict[str, Any]]] = {}
        self.skipped: set[str] = set()
        self.seen_ops: set[str] = set()
        self.devices: set[str] = set()  # of the rows kept
        # where the runs were profiled, whatever a row's dtype or status: the device a layout's memory
        # follows where no row of its dtype is (the Adam step: autotuner.predict.memory)
        self.profiled_on: set[str] = set()
        for row in rows:
            if row.get("device"):
                self.profiled_on.add(str(row["device"]))
            if row.get("status") == "skipped":
                self.skipped.add(str(row.get("op")))
                continue
            if row.get("status") != "ok" or row.get("median_us") is None or row.get("dtype") != dtype:
                continue
            rank = _rank(row)
            on_its_own = not ran_collectives(row)
            if rank not in (None, "0", "max") and not on_its_own:
                continue  # the slowest rank's row stands for the op
            if float(row.get("idle_before_ms") or 0) > 0:
                continue
            if ep is not None and row.get("op") in EP_COMPOSITE_OPS | EP_LEAF_OPS:
                if row_expert_parallel(row) != ep:
                    continue  # measured at another expert-parallel size: not this op's time here
            key = (
                str(row["op"]),
                str(row["phase"]),
                int(row["seq_len"]),
                int(row["micro_batch_size"]),
                int(row.get("tensor_parallel") or 1),
            )
            held = repeats.get(key, [])  # rows that fit equally, each from another run
            if held:
                had, has = (_fits(r, cold, processes) for r in (held[-1], row))
                if had > has:
                    continue  # what was asked for stands, whatever came later
                if has > had:
                    held = []
            run, row_max = row.get("run_dir"), rank == "max"
            if on_its_own:
                # each rank's row a repeat; the cross-rank row only where its run left no rank's row (a file
                # of the merged rows alone): a run writes its ranks' rows before it (results.merge_ranks)
                if row_max and any(r.get("run_dir") == run for r in held):
                    continue
                held = [r for r in held if r.get("run_dir") != run or _rank(r) not in ("max", rank)]
            else:
                held_max = bool(held) and _rank(held[-1]) == "max"
                if held_max and not row_max:
                    continue  # the cross-rank row stands for the op, not one rank's
                if row_max and not held_max:
                    held = []
                held = [r for r in held if r.get("run_dir") != run]
            repeats[key] = [*held, dict(row)]
            self.seen_ops.add(key[0])
            self.devices.add(str(row.get("device")))
        self.index: dict[tuple[str, str, int, int, int], dict[str, Any]] = {
            key: repeated(rows) for key, rows in repeats.items()
        }

    def exact(self, op: str, phase: str, s: int, b: int, tp: int) -> dict[str, Any] | None:
        return self.index.get((op, phase, s, b, tp))

    def nearest(self, op: str, phase: str, s: int, b: int, tp: int) -> dict[str, Any] | None:
        """The measured point closest to (s, b) at ``tp``: smallest |log s'/s| + |log b'/b|, ties to the
        larger point (a larger GEMM is nearer its sustained efficiency)."""
        found = [r for (o, p, _, _, t), r in self.index.items() if (o, p, t) == (op, phase, tp)]
        if not found:
            return None

        def distance(r: dict[str, Any]) -> tuple[float, int]:
            rs, rb = int(r["seq_len"]), int(r["micro_batch_size"])
            return abs(math.log(rs / s)) + abs(math.log(rb / b)), -(rs * rb)

        return min(found, key=distance)

    def best_gemm_throughput(self) -> float | None:
        """The highest FLOP/s any GEMM row reached (a stand-in for the peak without a calibration)."""
        rates = [
            r["flops"] / (r["median_us"] * 1e-6)
            for (op, *_), r in self.index.items()
            if op in GEMM_OPS and r.get("flops") and r["median_us"] > 0
        ]
        return max(rates) if rates else None

    def best_memory_throughput(self) -> tuple[float, dict[str, Any]] | None:
        """(bytes/s, the row): the fastest any row moved its counted bytes (``bytes_moved``, a minimum of
        what it reads and writes) at; a CPU prediction's stand-in for the copy bandwidth without a
        calibration. None without such a row."""
        rated = [
            (r["bytes_moved"] / (r["median_us"] * 1e-6), r)
            for r in self.index.values()
            if r.get("bytes_moved") and r["median_us"] > 0
        ]
        return max(rated, key=lambda pair: pair[0]) if rated else None


def row_seconds(row: Mapping[str, Any]) -> float:
    """What one visit of the row's op adds to a step: its fenced mean (a step adds its visits up, and the
    typical value of a sum of skewed times is near the sum of their means: autotuner.measure.timer,
    "A sum of calls is not a sum of medians"); the median in rows written before that column."""
    fenced = row.get("fenced_mean_us")
    return (fenced if fenced is not None else row["median_us"]) * 1e-6


def repeated(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for the repeats of an op at a point (rows measured alike by different runs): the last, with the
    median of their times (the fenced means where every row has one, else the medians; of two, their mean) and
    each run's directory and time in ``repeats_us``. A row times the machine in the second or so its samples
    took, and its confidence interval (the sampler stops at 2% wide) says how well it knows that second, not
    the machine: on a shared host the speed moves from one second to the next. On this project's VMs a
    llama-shaped layer's rows moved by 6.8-7.7% (forward) and 2.8-6.1% (backward) of their mean between
    profiles of one thread, largest over smallest 1.10-1.28 (``python -m benchmarks.thread_noise``),
    and the accuracy benchmark's whole prediction by 1.22 over six rounds where the steps moved by 1.04
    (a step runs for seconds and pays the machine's mean speed). Rows of runs made at different
    moments average it, as the accuracy benchmark's two warm profiles a round do
    (benchmarks.predict_accuracy). The median, not the mean: a second of a shared host can also be taken by
    another tenant whole, and a row inside it reads slow all through, past any fence its own samples set
    (seen: one of a round's four warm profiles read the layer 13-14% over the other three, forward and
    backward, and moved the mean of the round's two by 6-7%); from three runs a disturbed one is out-voted,
    and the middle one still stands between the moments the runs sampled."""
    if len(rows) == 1:
        return rows[0]
    statistic = "fenced_mean_us" if all(r.get("fenced_mean_us") is not None for r in rows) else "median_us"
    middle = dict(rows[-1], median_us=statistics.median(float(r["median_us"]) for r in rows))
    middle.pop("fenced_mean_us", None)
    middle[statistic] = statistics.median(float(r[statistic]) for r in rows)
    middle["repeats_us"] = [(_repeat_name(r), float(r[statistic])) for r in rows]
    if len({_rank(r) for r in rows}) > 1:
        middle["rank"] = None  # the repeats name their ranks
    return middle


def _rank(row: Mapping[str, Any]) -> str | None:
    """A row's rank as text (a CSV's and a JSONL's alike; "max": the merged row), None where it has none."""
    return None if row.get("rank") in (None, "") else str(row["rank"])


def _repeat_name(row: Mapping[str, Any]) -> str:
    """A repeat's run directory, and its rank where its run profiled the op in several processes."""
    rank = _rank(row)
    several = int(row.get("run_processes") or 1) > 1 and rank not in (None, "max")
    return f"{row.get('run_dir', '')} rank {rank}" if several else str(row.get("run_dir", ""))


def describe_row(row: Mapping[str, Any], run: str = "results.jsonl") -> str:
    rank = f" rank={row['rank']}" if row.get("rank") not in (None, 0) else ""
    statistic = "median" if row.get("fenced_mean_us") is None else "fenced mean"
    repeats = row.get("repeats_us")
    each = ", ".join(f"{Path(run).name} {us:.4g}" for run, us in repeats or ())
    taken = "mean" if repeats and len(repeats) == 2 else "median"
    said = f" (the {taken} of {len(repeats)} repeats: {each}us)" if repeats else ""
    return (
        f"{run} {row['op']}.{row['phase']} {row['point']} tp={row.get('tensor_parallel') or 1}{rank} "
        f"{row_seconds(row) * 1e6:.4g}us {statistic}{said}"
    )


def _plain(value: Any) -> bool:
    """Whether a recorded config value is plain data (not the repr of a function, dtype or enum)."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, (int, float, str, bool, type(None)))


def _as_json(value: Any) -> Any:
    """A value as environment.json records it (tuples as lists)."""
    return [_as_json(v) for v in value] if isinstance(value, (list, tuple)) else value
