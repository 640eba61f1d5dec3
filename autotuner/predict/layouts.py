"""Every layout Megatron-Core accepts for a model on a number of GPUs, a global batch and a sequence
length: the candidates ``python -m autotuner.tune`` predicts and ranks.

The rules, each what Megatron-Core checks (or fails on) when it builds the model or the schedule:

* ``tp`` divides the attention heads and the query groups (each rank holds whole heads:
  ``TransformerConfig``/``divide`` in the attention's column-parallel projections), the dense MLP's
  ``ffn_hidden_size`` and the routed experts' ``moe_ffn_hidden_size`` (``ColumnParallelLinear`` divides
  its output size by tp);
* the layers split over the ``pp`` ranks as ``Layout.stage_layers`` says Megatron splits them: evenly,
  or with the first and/or last rank's own count (``num_layers_in_first_pipeline_stage`` /
  ``..._last_...``) and the ranks between sharing the rest evenly; with the interleaved schedule every
  rank's count a multiple of ``vpp``. Of the uneven splits, those whose ranks' layers per model chunk
  differ by at most :data:`UNEVEN_SPREAD` (:func:`pipeline_splits`): a pp that does not divide the layers,
  or a first or last stage relieved of the embedding's or the output layer's time; ``vpp > 1`` only with
  ``pp > 1``, and then the micro-batches per step are a multiple of ``pp`` (the interleaved 1F1B
  schedule's rule);
* ``dp = gpus / (tp * pp)``, a whole number (``initialize_model_parallel``);
* the global batch is a whole number of ``micro_batch_size * dp`` (``get_num_microbatches``);
* MoE models: ``ep`` divides the experts and ``dp * tp`` (the expert-parallel groups are carved out of
  the data- and tensor-parallel ranks); with ``tp > 1`` sequence parallelism is on (Megatron-Core's MoE
  layer refuses tensor parallelism without it in training). Dense models: ``ep = 1``;
* ``sequence_parallel`` only with ``tp > 1`` (Megatron turns it off at tp = 1), and then tp divides the
  sequence length (the sequence is scattered over the tp ranks);
* ``cp`` (context parallelism) up to ``max_cp`` (1 unless asked: Megatron runs it in Transformer-Engine,
  and its rows are an emulated rank's at s/cp), where 2*cp divides the sequence; then the data-parallel
  size is gpus / (tp * cp * pp) and, with sequence parallelism, tp divides s/cp;
* with ``overlap``, Megatron's overlaps where they apply: ``overlap_grad_reduce`` with dp*cp > 1 (not
  at ep > 1, which the predictor does not model), ``overlap_param_gather`` with it and the distributed
  optimizer, ``tp_comm_overlap`` with sequence parallelism;
* with ``max_tp`` (autotuner.tune's ``gpus_per_node``), tp at most that: a tensor-parallel group's
  collectives run inside every layer, forward and backward, so it is kept inside one node's fast links,
  which Megatron-Core does not check and practice does (it places tp ranks on consecutive GPUs);
* ``micro_batch_size`` from a small set (:data:`MICRO_BATCH_SIZES`), ``recompute`` none / selective /
  full, ``distributed_optimizer`` off and on.

The order is deterministic: the loops nest in the order of :class:`~autotuner.predict.layout.Layout`'s
fields (tp, cp, pp, vpp, the split, ep, micro-batch size, recompute, sequence parallel, distributed
optimizer), each in ascending order (False before True; the even split first), so two runs list (and
tie-break) the same layouts alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotuner.errors import UserError
from autotuner.predict.layout import MAX_MICROBATCHES, RECOMPUTE, Layout, split_or_none

MICRO_BATCH_SIZES = (1, 2, 4, 8)
# The most the pipeline ranks' layers per model chunk may differ in an enumerated uneven split: enough to
# relieve the first or last stage by a layer or two, or to split a depth pp does not divide, without
# listing every split (a 32-layer model at pp=4: the even one and 7-9-9-7, of 225 that Megatron accepts).
UNEVEN_SPREAD = 2


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a model that decide which layouts it accepts (the divisors of its splits; the
    predictor's fuller ``timing.ModelShape`` holds its ``transformer_config`` as ``config``, from which
    :meth:`from_transformer` reads these)."""

    num_layers: int
    heads: int
    query_groups: int
    ffn_hidden_size: int | None = None
    experts: int | None = None
    moe_ffn_hidden_size: int | None = None

    @classmethod
    def from_transformer(cls, transformer: Mapping[str, Any]) -> ModelDims:
        """From TransformerConfig arguments (``MegatronModelArgs.transformer``, or a run's
        ``environment.json`` ``transformer_config``)."""
        heads = int(transformer["num_attention_heads"])
        experts = transformer.get("num_moe_experts") or None
        return cls(
            num_layers=int(transformer["num_layers"]),
            heads=heads,
            query_groups=int(transformer.get("num_query_groups") or heads),
            ffn_hidden_size=transformer.get("ffn_hidden_size"),
            experts=experts,
            moe_ffn_hidden_size=transformer.get("moe_ffn_hidden_size") if experts else None,
        )


def model_dims(
    case: str, case_dir: str | None = None, hf_overrides: Mapping[str, Any] | None = None
) -> ModelDims:
    """The sizes of a case (``case=<name>``, with ``hf.*`` overrides), as the profiler maps it."""
    from autotuner.model.cases import build_hf_config, load_case
    from autotuner.model.hf_to_megatron import map_hf_config

    loaded = load_case(case, case_dir)
    return ModelDims.from_transformer(
        map_hf_config(build_hf_config(loaded.hf_fields, dict(hf_overrides or {}))).transformer
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_splits(num_layers: int, pp: int, vpp: int) -> list[tuple[int | None, int | None]]:
    """The (first_stage_layers, last_stage_layers) of the splits of ``num_layers`` over ``pp`` ranks with
    ``vpp`` chunks each that Megatron accepts (:func:`~autotuner.predict.layout.split_layers`), whose
    per-chunk layer counts differ by at most UNEVEN_SPREAD, and whose first and last ranks, which hold the
    embedding and the output layer besides, hold no more layers than the ranks between (at pp=2 either
    may hold more); (None, None) is the even split, listed first where it exists. A rank's own count is
    given only where it differs from the ranks between (at pp=2 the first rank's alone)."""
    if pp == 1:
        return [(None, None)] if num_layers % vpp == 0 else []
    counts_given = [None, *range(vpp, num_layers, vpp)]
    found = []
    for first, last in itertools.product(counts_given, counts_given if pp > 2 else [None]):
        counts = split_or_none(num_layers, pp, vpp, first, last)
        if counts is None:
            continue
        middle = counts[1] if pp > 2 else None  # the ranks between the ends (none at pp=2)
        if first is not None and first == counts[1] or last is not None and last == middle:
            continue  # the split of fewer counts given (at pp=2 first == last: the even one)
        if (max(counts) - min(counts)) // vpp > UNEVEN_SPREAD:
            continue
        if middle is not None and max(counts[0], counts[-1]) > middle:  # an end loaded beyond the others
            continue
        found.append((first, last))
    return found


def _tp_fits(model: ModelDims, tp: int) -> bool:
    sizes = (model.heads, model.query_groups, model.ffn_hidden_size, model.moe_ffn_hidden_size)
    return all(size % tp == 0 for size in sizes if size)


def _iter_layouts(
    model: ModelDims,
    gpus: int,
    global_batch_size: int,
    seq_len: int,
    dtype: str,
    micro_batch_sizes: Sequence[int],
    recompute: Sequence[str],
    max_tp: int | None,
    max_cp: int = 1,
    overlap: bool = False,
) -> Iterator[Layout]:
    for tp, cp in ((t, c) for t in _divisors(gpus) for c in _divisors(gpus // t)):
        if not _tp_fits(model, tp) or (max_tp is not None and tp > max_tp):
            continue
        if cp > max_cp or seq_len % (2 * cp) and cp > 1:
            continue
        for pp in _divisors(gpus // (tp * cp)):
            if pp > model.num_layers:
                continue
            dp = gpus // (tp * cp * pp)
            vpps = [1] + (
                [v for v in _divisors(model.num_layers) if 1 < v <= model.num_layers // pp] if pp > 1 else []
            )
            eps = [e for e in _divisors(model.experts) if (dp * cp * tp) % e == 0] if model.experts else [1]
            splits = [(v, split) for v in vpps for split in pipeline_splits(model.num_layers, pp, v)]
            for vpp, (first, last) in splits:
                for ep in eps:
                    for mbs in sorted(micro_batch_sizes):
                        if (
                            global_batch_size % (mbs * dp)
                            or global_batch_size // (mbs * dp) > MAX_MICROBATCHES
                        ):
                            continue
                        if vpp > 1 and (global_batch_size // (mbs * dp)) % pp:
                            continue
                        for how in recompute:
                            sps = [False, True] if tp > 1 and (seq_len // cp) % tp == 0 else [False]
                            if model.experts and tp > 1:
                                sps = [sp for sp in sps if sp]
                            for sp in sps:
                                for distopt in (False, True):
                                    reduce = overlap and dp * cp > 1 and ep == 1
                                    yield Layout(
                                        seq_len=seq_len,
                                        tp=tp,
                                        cp=cp,
                                        pp=pp,
                                        vpp=vpp,
                                        dp=dp,
                                        ep=ep,
                                        micro_batch_size=mbs,
                                        global_batch_size=global_batch_size,
                                        recompute=how,
                                        sequence_parallel=sp,
                                        distributed_optimizer=distopt,
                                        dtype=dtype,
                                        first_stage_layers=first,
                                        last_stage_layers=last,
                                        overlap_grad_reduce=reduce,
                                        overlap_param_gather=reduce and distopt,
                                        tp_comm_overlap=overlap and sp,
                                    )


def enumerate_layouts(
    model: ModelDims,
    gpus: int,
    global_batch_size: int,
    seq_len: int,
    dtype: str = "bf16",
    micro_batch_sizes: Sequence[int] = MICRO_BATCH_SIZES,
    recompute: Sequence[str] = RECOMPUTE,
    max_tp: int | None = None,
    max_cp: int = 1,
    overlap: bool = False,
) -> list[Layout]:
    """Every layout of ``model`` on ``gpus`` GPUs that Megatron-Core accepts (module docstring), in a
    deterministic order. UserError (one line) for a request no layout can meet, naming what to change."""
    sizes = [("gpus", gpus), ("global_batch_size", global_batch_size), ("seq_len", seq_len)]
    for name, value in sizes + ([("gpus_per_node", max_tp)] if max_tp is not None else []):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name}={value!r} must be a positive integer: give e.g. {name}=8")
    unknown = [r for r in recompute if r not in RECOMPUTE]
    if unknown:
        raise UserError(f"recompute {unknown} unknown: choose from {', '.join(RECOMPUTE)}")
    if isinstance(max_cp, bool) or not isinstance(max_cp, int) or max_cp < 1:
        raise UserError(f"max_cp={max_cp!r} must be a positive integer: give e.g. max_cp=1")
    layouts = list(
        _iter_layouts(
            model,
            gpus,
            global_batch_size,
            seq_len,
            dtype,
            micro_batch_sizes,
            recompute,
            max_tp,
            max_cp,
            overlap,
        )
    )
    for layout in layouts:  # the enumeration's rules imply Layout's own; a failure here is a bug here
        layout.check(model.num_layers, model.heads, model.query_groups, model.experts)
    if not layouts:
        raise UserError(
            f"no layout of {gpus} GPUs fits this model ({model.num_layers} layers, {model.heads} heads) with "
            f"global batch {global_batch_size} and micro-batch sizes {list(micro_batch_sizes)}"
            + (f", tp at most {max_tp}" if max_tp is not None else "")
            + ": use a global batch that is a multiple of the data-parallel size, or another number of GPUs"
        )
    return layouts
