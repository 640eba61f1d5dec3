"""Memory per GPU of each pipeline stage: weights, gradients, optimizer states, activations, logits.

Terms (P: the parameters the stage's GPU holds, after tensor parallelism):

* **weights**: P x bytes of the dtype;
* **gradients**: P x 4 B: Megatron's DistributedDataParallel accumulates and reduces gradients in an fp32
  ``main_grad`` buffer for bf16/fp16 training (``grad_reduce_in_fp32``, which Megatron-LM turns on with
  ``--bf16``), and in fp32 training the gradients are fp32 anyway;
* **optimizer**: Adam's exp_avg and exp_avg_sq in fp32 (8 B) plus, for bf16/fp16, the fp32 master copy of
  the weights (4 B): 12 B per parameter (8 B in fp32), divided by dp with the distributed optimizer
  (Megatron's ``DistributedOptimizer`` shards them over the data-parallel ranks);
* **activations**: what one layer's forward saves for backward (the measured ``activation_bytes`` of the
  ``transformer_layer`` forward row) x the layers of the stage x the micro-batches the stage holds at
  once: under 1F1B stage i of p holds min(p - i, m) (its warm-up forwards plus one); interleaved with v
  chunks, rank i holds min((p - i - 1)*2 + (v - 1)*p + 1, m*v) chunk-micro-batches of L/(p*v) layers
  each (Megatron-Core's ``get_pipeline_parallel_forward_backward_func`` warm-up counts). Recompute:
  ``full`` keeps each layer's input (s*b*h elements, split over tp with sequence parallelism) and one
  layer's full activations during its backward; ``selective`` drops what core attention saves beyond its
  inputs q, k, v;
  The embedding's and the final norm's saved bytes (their rows' ``activation_bytes``) are added per
  micro-batch held;
* **logits** on the last stage: what the output layer and the loss save (the ``output_layer`` forward
  row's ``activation_bytes``: the fp32 logits the cross-entropy keeps and the layer's input), else
  s*b*vocab/tp x 4 B;
* **optimizer step**: what Adam allocates while it steps, beyond its states. ``torch.optim.Adam`` over CUDA
  tensors (torch's default there, the foreach kernels; also Megatron-Core's Adam without
  Transformer-Engine or Apex) takes the square root of every ``exp_avg_sq`` at once
  (``torch._foreach_sqrt``): an fp32 copy of them, 4 B per parameter it updates. On the CPU it steps
  one tensor at a time and holds two temporaries of that tensor (the square root, then its quotient):
  8 B x the largest tensor it updates. A fused Adam (Transformer-Engine's or Apex's FusedAdam, or
  ``fused=True``) makes neither, so there the term is an upper bound. The forward-backward's terms
  (activations, logits, in flight) are freed before the step, so a GPU's peak is the resident states
  plus the larger of the two phases': at a 32-layer Llama-2-7B with full recompute on an H200 the step's
  25 GiB copy was the peak, and the step ran out of memory where the sum without it fitted
  (docs/gpu_validation.md);
* **in flight**: memory an op allocates while it runs beyond what stays saved (its rows' ``peak_bytes``:
  a forward's intermediates; a backward's input gradients and temporaries, each weight gradient until
  it is added into the gradient buffers, the embedding's dense table gradient, net of the saved
  activations the backward frees as autograd consumes them, which the meter sees as they happen inside
  a training step: autotuner.measure.memory), less what is not live at that moment: walking the stage's
  ops of one micro-batch (embedding, layers, final norm, output layer), the forward of op k runs before
  the ops after it have saved anything (and its peak includes what it saves itself), the backward of op
  k after they have freed theirs. So the term is max over k of (forward peak_k - saved_k, backward
  peak_k) less the saved bytes of the ops after k, at least 0. A CPU row measured before the meter saw
  a backward's frees (it read the backward as keeping all it saved and every weight gradient) makes the
  term an upper bound. On this project's CPU (benchmarks/predict_accuracy.py) the stage's peak came at
  0.974-1.005 of the measured in all eleven validated layouts (tiny, llama-shaped, tiny_moe); the lower
  bound this replaced (every backward credited with freeing all it saved before its peak) read
  0.92-0.98. An op without a row adds nothing here (said in the source).

Side by side, the closed form of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4, Table 2) per stage, per layer and micro-batch for 2-byte activations (h
hidden, a heads, t tp): no recompute s*b*h*(10 + 24/t + 5*a*s/(h*t)), with sequence parallelism
s*b*h*(34 + 5*a*s/h)/t; selective recompute s*b*h*(10 + 24/t), with sequence parallelism 34*s*b*h/t;
full recompute 2*s*b*h (/t with sequence parallelism). It counts dropout masks (1 B per element), which
a model without dropout does not keep, and 2-byte tensors: in fp32 we scale it by 2. The 5*a*s/h term
is the attention's s x s scores and their softmax, which Megatron-Core's unfused ``DotProductAttention``
(the local spec, what this tool builds without Transformer-Engine) keeps and a fused or flash attention
does not.

And what Megatron-LM itself prints (``report_theoretical_memory`` in
``megatron/training/theoretical_memory_usage.py``), for the first pipeline stage only
(:func:`megatron_report`): its activations take Table 2's selective-recompute rows whatever the
recompute setting, so no attention scores: with sequence parallelism and selective recompute
s*b*h*(18 + 4*ffn/h) a layer (34 for ffn = 4h), else s*b*h*(10 + 24/t) with 5% added; times all L
layers (the first stage holds L/p layers of p micro-batches), plus the embedding's input (8*s*b*p) and
dropout mask (s*b*h*p), times 1 + (p-1)/(p*v) interleaved or min(1, m/p) otherwise, plus the output
layer's input and logits at p = 1, in bytes of 2-byte activations whatever the dtype; its weights and
optimizer 18 B a parameter (bf16 weights, fp32 gradients, Adam's fp32 master and states), 6 + 12/dp with
the distributed optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autotuner.ops.naming import PHASES
from autotuner.predict.inputs import Measurements, ModelShape, describe_row
from autotuner.predict.layout import DTYPE_BYTES, Figure, Layout, Source

GRAD_BYTES = 4
OPTIMIZER_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8}
LOGIT_BYTES = 4
# The fraction of a GPU's memory a layout must leave free to count as fitting (autotuner.tune's default
# ``margin``; ``num_layers=fit``): the allocator's fragmentation and what no prediction term holds.
MEMORY_MARGIN = 0.1


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str, dtype: str
) -> float:
    """Korthikanti et al. 2022's activation bytes of one layer for one micro-batch (module docstring)."""
    if recompute == "full":
        per = 2.0 / (t if sp else 1)
    elif recompute == "selective":
        per = 34.0 / t if sp else 10.0 + 24.0 / t
    else:
        per = (34.0 + 5.0 * a * s / h) / t if sp else 10.0 + 24.0 / t + 5.0 * a * s / (h * t)
    return s * b * h * per * DTYPE_BYTES[dtype] / 2


@dataclass(frozen=True)
class MegatronReport:
    """Megatron-LM's theoretical-memory report for a layout: its first pipeline stage (module docstring)."""

    activations: Figure
    weights_and_optimizer: Figure

    @property
    def total(self) -> float:
        return self.activations.value + self.weights_and_optimizer.value

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": 0,
            "total_bytes": self.total,
            "activations": self.activations.to_json(),
            "weights_and_optimizer": self.weights_and_optimizer.to_json(),
        }


def megatron_report(model: ModelShape, layout: Layout, first_stage_params: float) -> MegatronReport:
    """What Megatron-LM's ``report_theoretical_memory`` computes for ``layout`` (module docstring), its
    weights from this module's count of the first stage's parameters (routed experts divided by ep, where
    Megatron's own count does not divide them)."""
    s, b, h, t, p, v = (
        layout.seq_len,
        layout.micro_batch_size,
        model.hidden,
        layout.tp,
        layout.pp,
        layout.vpp,
    )
    m, vocab, layers = layout.microbatches, model.vocab, model.num_layers
    with_sp = layout.sequence_parallel and layout.recompute == "selective"
    per_layer = s * b * h * ((18 + 4 * model.ffn / h) if with_sp else (10 + 24 / t))
    value = per_layer * layers + 8 * s * b * p + s * b * h * p
    if v > 1:
        value *= 1 + (p - 1) / (p * v)
    elif p > 1:
        value *= min(1.0, m / p)
    if with_sp:
        rule = "s*b*h*(18 + 4*ffn/h) a layer (sequence parallelism, selective recompute)"
        if p == 1:
            value += s * b * h * 4 * (1 + vocab / h)
        value /= t
    else:
        rule = "s*b*h*(10 + 24/t) a layer, x 1.05"
        if p == 1:
            value += (s * b * vocab / t + s * b * h) * 2
        value *= 1.05
    activations = Figure(
        value,
        "B",
        Source(
            "modelled",
            f"Megatron-LM's theoretical-memory report: {rule}, x {layers} layers, the embedding's input "
            "and dropout, 2-byte activations, no attention scores",
        ),
    )
    per_param = 6 + 12 / layout.dp if layout.distributed_optimizer else 18.0
    weights = Figure(
        first_stage_params * per_param,
        "B",
        Source(
            "modelled",
            f"Megatron-LM's theoretical-memory report: {per_param:.4g} B a parameter x the first stage's "
            f"{first_stage_params:.6g} parameters",
        ),
    )
    return MegatronReport(activations, weights)


def held_microbatches(stage: int, pp: int, vpp: int, microbatches: int) -> int:
    """Chunk-micro-batches whose activations a stage holds at its peak (1F1B: p - i; interleaved: Megatron's
    warm-up count + 1), capped by what the step has."""
    if vpp == 1:
        return min(pp - stage, microbatches)
    return min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, microbatches * vpp)


@dataclass(frozen=True)
class StageMemory:
    stage: int
    params: Figure
    weights: Figure
    gradients: Figure
    optimizer: Figure
    activations: Figure
    logits: Figure
    in_flight: Figure
    korthikanti_activations: Figure
    held: int
    optimizer_step: Figure

    @property
    def resident(self) -> float:
        """What the GPU holds through the step: weights, gradients, optimizer states."""
        return self.weights.value + self.gradients.value + self.optimizer.value

    @property
    def forward_backward(self) -> float:
        """What the forward-backward adds at its peak; freed before the optimizer's step."""
        return self.activations.value + self.logits.value + self.in_flight.value

    @property
    def total(self) -> float:
        """The peak: the resident states plus the larger of the two phases' own."""
        return self.resident + max(self.forward_backward, self.optimizer_step.value)

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "held_microbatches": self.held,
            "total_bytes": self.total,
            **{
                name: getattr(self, name).to_json()
                for name in (
                    "params",
                    "weights",
                    "gradients",
                    "optimizer",
                    "activations",
                    "logits",
                    "in_flight",
                    "optimizer_step",
                    "korthikanti_activations",
                )
            },
        }


def _ratio(model: ModelShape, layout: Layout, s: int, b: int, t: int) -> float:
    return korthikanti_layer_bytes(
        s, b, model.hidden, model.heads, t, layout.sequence_parallel and t > 1, "none", layout.dtype
    )


def layer_activation(
    meas: Measurements, model: ModelShape, layout: Layout, without_ep: Measurements | None = None
) -> Figure:
    """One layer's saved activations per micro-batch without recompute, on one GPU. At ep > 1 without a
    layer row at that ep, the row measured without expert parallelism: a rank's experts save as much
    under balanced routing (each gets ep times the tokens for 1/ep of the experts)."""
    s, b, tp = layout.seq_len, layout.micro_batch_size, layout.tp
    target = _ratio(model, layout, s, b, tp)
    sources = [(meas, basis) for basis in dict.fromkeys((tp, 1))]
    sources += [(without_ep, basis) for basis in dict.fromkeys((tp, 1)) if without_ep is not None]
    for rows, basis in sources:
        row = rows.exact("transformer_layer", "forward", s, b, basis)
        if row is None or row.get("activation_bytes") is None:
            row = rows.nearest("transformer_layer", "forward", s, b, basis)
        if row is None or row.get("activation_bytes") is None:
            continue
        value = float(row["activation_bytes"])
        rs, rb = int(row["seq_len"]), int(row["micro_batch_size"])
        if rows is without_ep:
            value *= target / _ratio(model, layout, rs, rb, basis)
            detail = f"the row at ep=1 (as many tokens per expert rank): {describe_row(row)}"
            return Figure(value, "B", Source("scaled", detail))
        if (rs, rb, basis) == (s, b, tp):
            return Figure(value, "B", Source("measured", f"activation_bytes of {describe_row(row)}"))
        value *= target / _ratio(model, layout, rs, rb, basis)
        return Figure(
            value,
            "B",
            Source(
                "scaled",
                f"by Korthikanti's per-layer formula from s{rs}_b{rb} tp={basis}: {describe_row(row)}",
            ),
        )
    return Figure(target, "B", Source("modelled", "Korthikanti et al. 2022 per-layer formula (no layer row)"))


@dataclass(frozen=True)
class OpMemory:
    """One op of a micro-batch of the stage: what its forward saves, and what its forward and backward
    allocate beyond that while they run (rows' activation_bytes and peak_bytes); None: no row."""

    name: str
    saved: float
    forward_peak: float | None
    backward_peak: float | None
    row: str
    exact: bool  # rows at the layout's point and TP (else scaled from the nearest)
    split: int = 1  # the layout's tp over the rows' (rows at TP=1 for a TP layout: their share)


def _op_memory(meas: Measurements, layout: Layout, op: str, saved: float | None = None) -> OpMemory | None:
    """The op's rows at the layout's point and TP, else the nearest point at that TP scaled by tokens
    (memory of these ops grows with s*b), else the same at the largest measured TP that divides it, divided
    by their ratio (each rank holds its share of the split tensors, as layer_activation scales a layer's;
    what no TP splits, such as a norm's output without sequence parallelism, is divided too: an
    underestimate there), else None."""
    s, b, tp = layout.seq_len, layout.micro_batch_size, layout.tp
    rows: dict[str, Mapping[str, Any]] = {}
    measured = sorted({key[4] for key in meas.index if key[0] == op and tp % key[4] == 0}, reverse=True)
    for basis in dict.fromkeys((tp, *measured)):
        rows = {}
        for phase in PHASES:
            row = meas.exact(op, phase, s, b, basis) or meas.nearest(op, phase, s, b, basis)
            if row is not None:
                rows[phase] = row
        if "forward" in rows:
            break
    forward = rows.get("forward")
    if forward is None:
        return None
    split = tp // int(forward.get("tensor_parallel") or 1)
    scale = {ph: s * b / (int(r["seq_len"]) * int(r["micro_batch_size"])) / split for ph, r in rows.items()}

    def peak(phase: str) -> float | None:
        value = rows[phase].get("peak_bytes") if phase in rows else None
        return None if value is None else float(value) * scale[phase]

    if saved is None:
        saved = float(forward.get("activation_bytes") or 0) * scale["forward"]
    exact = all(v == 1.0 for v in scale.values()) and all(
        int(r.get("tensor_parallel") or 1) == tp for r in rows.values()
    )
    return OpMemory(op, saved, peak("forward"), peak("backward"), describe_row(forward), exact, split)


def in_flight_bytes(ops: list[OpMemory]) -> float:
    """max over the ops of one micro-batch of (the op's peak - the saved bytes not live when it runs), at
    least 0 (module docstring)."""
    worst = 0.0
    for k, op in enumerate(ops):
        after = sum(o.saved for o in ops[k + 1 :])
        if op.forward_peak is not None:  # the forward of k: its own saved bytes are part of its peak
            worst = max(worst, op.forward_peak - op.saved - after)
        if op.backward_peak is not None:  # the backward of k: the ops after it have freed theirs
            worst = max(worst, op.backward_peak - after)
    return worst


def optimizer_step_memory(
    model: ModelShape, layout: Layout, stage: int, params: float, experts: float, kept: float, cuda: bool
) -> Figure:
    """What torch.optim.Adam allocates while it steps (the module's docstring: optimizer step)."""
    if cuda:
        return Figure(
            kept * 4,
            "B",
            Source(
                "modelled",
                f"torch.optim.Adam's foreach step on CUDA tensors: an fp32 copy of every exp_avg_sq at once "
                f"(torch._foreach_sqrt), 4 B x {kept:.6g} params it updates (none with a fused Adam)",
            ),
        )
    if layout.distributed_optimizer:  # it updates each flat buffer's share as one tensor
        largest = max((params - experts) / layout.dp, experts / layout.expert_data_parallel)
        what = "the largest share of a flat gradient buffer"
    else:
        first, last = stage == 0, stage == layout.pp - 1
        table = first or (last and (not model.tie_embeddings or layout.pp > 1))
        largest = model.largest_tensor(layout.tp, layout.ep, table)
        what = "the largest parameter tensor"
    return Figure(
        largest * 8,
        "B",
        Source(
            "modelled",
            f"torch.optim.Adam's step on the CPU, one tensor at a time: two fp32 temporaries of the tensor "
            f"(its exp_avg_sq's square root, then the quotient), 8 B x {largest:.6g} elements ({what})",
        ),
    )


def stage_params(meas: Measurements, model: ModelShape, layout: Layout, stage: int) -> Figure:
    """Parameters on one GPU of ``stage``: its layers (from the layer row's weight_bytes where measured,
    else counted from the config), the embedding on the first stage, the final norm and the output layer
    (a copy of the embedding when tied and pp > 1, as Megatron keeps) on the last; all divided by tp."""
    tp = layout.tp
    per_stage = layout.stage_layers(model.num_layers)[stage]
    layer, how = model.layer_params_on_rank(tp, layout.ep), "counted from the model config"
    if layout.ep > 1:
        how += f", routed experts / ep={layout.ep}, whole on each TP rank"
    kind = "modelled"
    for basis in dict.fromkeys((tp, 1)):
        row = meas.nearest("transformer_layer", "forward", layout.seq_len, layout.micro_batch_size, basis)
        if row is not None and row.get("weight_bytes"):
            layer = row["weight_bytes"] / DTYPE_BYTES.get(str(row["dtype"]), 4) / (tp // basis)
            how, kind = (
                f"weight_bytes of {describe_row(row)}" + ("" if basis == tp else f", /tp={tp}"),
                "measured",
            )
            break
    params = per_stage * layer
    extra = []
    if stage == 0:
        params += model.vocab * model.hidden / tp
        extra.append("embedding vocab*h/tp")
    if stage == layout.pp - 1:
        params += model.final_norm_params
        if not model.tie_embeddings or layout.pp > 1:
            params += model.vocab * model.hidden / tp
            extra.append("output layer vocab*h/tp")
    detail = f"{per_stage} layers x {layer:.6g} params ({how})" + "".join(f" + {e}" for e in extra)
    return Figure(params, "params", Source(kind, detail))


def stage_memory(
    meas: Measurements,
    model: ModelShape,
    layout: Layout,
    stage: int,
    core_attention: Mapping[str, Any] | None = None,
    without_ep: Measurements | None = None,
) -> StageMemory:
    """The memory terms of one stage's GPU. ``core_attention``: its forward row at the layout's exact
    point and TP, for selective recompute."""
    s, b, tp, sp = layout.seq_len, layout.micro_batch_size, layout.tp, layout.sequence_parallel
    params = stage_params(meas, model, layout, stage)
    p = params.value
    psrc = params.source
    nbytes = DTYPE_BYTES[layout.dtype]
    weights = Figure(p * nbytes, "B", Source(psrc.kind, f"params x {nbytes} B ({layout.dtype})"))
    grads = Figure(p * GRAD_BYTES, "B", Source(psrc.kind, "params x 4 B (DDP's fp32 main grads)"))
    opt_per = OPTIMIZER_BYTES[layout.dtype]
    layers = layout.stage_layers(model.num_layers)[stage]
    experts = model.stage_expert_params(tp, layout.ep, layers)
    kept = layout.optimizer_params(p, experts)
    shards = ""
    if layout.distributed_optimizer:
        shards = f" / dp={layout.dp}" + (
            f", experts' / {layout.expert_data_parallel}" if layout.ep > 1 else ""
        )
    optimizer = Figure(
        kept * opt_per,
        "B",
        Source(
            psrc.kind,
            f"params x {opt_per} B (Adam m, v" + (", fp32 master" if opt_per == 12 else "") + ")" + shards,
        ),
    )
    per_layer_chunk = layers // layout.vpp
    held = held_microbatches(stage, layout.pp, layout.vpp, layout.microbatches)
    layers_held = held * per_layer_chunk
    act = layer_activation(meas, model, layout, without_ep)
    if layout.recompute == "none":
        value, rule = act.value * layers_held, "no recompute"
        kind = act.source.kind
    elif layout.recompute == "full":
        inputs = s * b * model.hidden * nbytes / (tp if sp else 1)
        value = inputs * layers_held + act.value
        rule, kind = (
            "full recompute: each layer's input (s*b*h) + one layer's activations in its backward",
            "modelled",
        )
    else:
        if core_attention is not None and core_attention.get("activation_bytes") is not None:
            qkv = s * b * (model.heads + 2 * model.query_groups) * model.kv_channels * nbytes / tp
            dropped = max(0.0, float(core_attention["activation_bytes"]) - qkv)
            rule = (
                f"selective: minus core attention's saved bytes beyond q,k,v ({describe_row(core_attention)})"
            )
            kind = act.source.kind
        else:
            k_none = korthikanti_layer_bytes(s, b, model.hidden, model.heads, tp, sp, "none", layout.dtype)
            k_sel = korthikanti_layer_bytes(
                s, b, model.hidden, model.heads, tp, sp, "selective", layout.dtype
            )
            dropped = act.value * (1 - k_sel / k_none)
            rule, kind = (
                "selective: scaled by Korthikanti's selective/none ratio (no core_attention row)",
                "scaled",
            )
        value = (act.value - dropped) * layers_held
    # One micro-batch of the stage in forward order, for the saved bytes beside the layers' and in flight.
    first, last = stage == 0, stage == layout.pp - 1
    per_layer = value / layers_held if layers_held else 0.0
    layer_op = _op_memory(meas, layout, "transformer_layer", per_layer)
    if layer_op is None and without_ep is not None:  # a rank's experts hold as much at any ep (above)
        layer_op = _op_memory(without_ep, layout, "transformer_layer", per_layer)
    embedding = _op_memory(meas, layout, "embedding") if first else None
    final_norm = _op_memory(meas, layout, "final_layernorm") if last else None
    head = _op_memory(meas, layout, "output_layer") if last else None
    outside = [o for o in (embedding, final_norm) if o is not None]
    if outside:
        value += held * sum(o.saved for o in outside)
        rule += "; + " + ", ".join(f"{o.name} {o.saved:.4g} B" for o in outside) + " per micro-batch held"
    activations = Figure(
        value,
        "B",
        Source(kind, f"{rule}; layer: {act.source.detail}; x {layers_held} layer-micro-batches held"),
    )
    if not last:
        logits = Figure(0.0, "B", Source("modelled", "not the last stage"))
    elif head is not None and head.saved:
        logits = Figure(head.saved, "B", Source("measured", f"activation_bytes of {head.row}"))
    else:
        logits = Figure(
            s * b * model.vocab / tp * LOGIT_BYTES,
            "B",
            Source("modelled", "s*b*vocab/tp x 4 B (fp32 logits)"),
        )
    parts = [*([("embedding", embedding)] if first else []), ("transformer_layer", layer_op)]
    parts += [("final_layernorm", final_norm), ("output_layer", head)] if last else []
    lacking = [name for name, o in parts if o is None]
    walk = [
        o
        for o in (embedding, *[layer_op] * (per_layer_chunk * layout.vpp), final_norm, head)
        if o is not None
    ]
    said = "max over one micro-batch's ops of (peak_bytes - saved bytes not live then)"
    if lacking:
        said += f"; no rows for {', '.join(lacking)}: they add nothing"
    shared = list(dict.fromkeys(o.name for o in walk if o.split > 1))
    if shared:
        said += f"; {', '.join(shared)} from rows at a smaller TP, divided by the ratio to tp={layout.tp}"
    exact = not lacking and all(o.exact for o in walk)
    kind = "measured" if exact else "scaled" if walk else "modelled"  # modelled: no row, nothing counted
    in_flight = Figure(in_flight_bytes(walk), "B", Source(kind, said))
    k = (
        korthikanti_layer_bytes(s, b, model.hidden, model.heads, tp, sp, layout.recompute, layout.dtype)
        * layers_held
    )
    korth = Figure(
        k, "B", Source("modelled", f"Korthikanti et al. 2022, recompute={layout.recompute}, x {layers_held}")
    )
    step = optimizer_step_memory(model, layout, stage, p, experts, kept, "cuda" in meas.profiled_on)
    return StageMemory(
        stage, params, weights, grads, optimizer, activations, logits, in_flight, korth, held, step
    )
