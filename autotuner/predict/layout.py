"""A training layout (how a model is split over GPUs), its checks, and the provenance records of figures.

``Layout`` is the question the predictor answers: tensor (``tp``), context (``cp``), pipeline (``pp``, with
``vpp`` virtual stages per rank for the interleaved schedule), data (``dp``) and expert (``ep``) parallel
sizes, the batch (micro-batch size, global batch size, sequence length), the memory-saving settings
(``recompute``, ``sequence_parallel``, ``distributed_optimizer``), and Megatron's overlaps of
communication with compute (``overlap_grad_reduce``, ``overlap_param_gather``, ``tp_comm_overlap``:
autotuner.predict.overlap), in a ``dtype``.

Megatron-Core's rules, kept here so that a layout Megatron would refuse is refused before any arithmetic
(``Layout.check``):
- world size = tp * cp * pp * dp (``parallel_state.initialize_model_parallel``); expert parallelism lives
  inside tp * cp * dp, so ep must divide it, and ep must divide the number of experts;
- context parallelism splits the sequence into 2*cp chunks (each rank two, for a balanced causal mask), so
  2*cp divides seq_len (Megatron-LM's argument check); with sequence parallelism tp divides s/cp;
- tp divides the attention heads and the query groups (each rank holds whole heads);
- the layers split over the pipeline ranks evenly (pp * vpp divides them: every virtual stage holds the
  same number), or, with Megatron's ``num_layers_in_first_pipeline_stage`` /
  ``num_layers_in_last_pipeline_stage`` (``first_stage_layers`` / ``last_stage_layers`` here), the first
  and/or the last rank hold as many as given and the ranks between them share the rest evenly (a whole
  number each, and none left over when no rank lies between); with vpp, every rank's count is a multiple
  of vpp (:func:`split_layers`, ``Layout.layer_places``); the interleaved schedule needs pp > 1;
- the global batch is a whole number of (micro-batch size * dp): the micro-batches per step
  (``get_num_microbatches``); with the interleaved schedule that number is a multiple of pp;
- sequence parallelism needs tp > 1 (Megatron turns it off otherwise);
- ``overlap_param_gather`` needs the distributed optimizer and ``overlap_grad_reduce``, ``tp_comm_overlap``
  sequence parallelism (Megatron-LM's argument checks; the latter runs in Transformer-Engine).

Every figure the predictor reports carries a ``Source``: ``measured`` (a row at that exact point),
``scaled`` (a neighbouring point by a named rule) or ``modelled`` (a formula and the constants it used),
with a detail that names the row, the rule or the model, so a reader can trace each number.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from autotuner.errors import UserError

RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp16", "fp32")
SOURCE_KINDS = ("measured", "scaled", "modelled")

# Bytes per element of the training dtype.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Source:
    """Where a number came from: ``kind`` in measured / scaled / modelled; ``detail`` names the row, the
    scaling rule or the model (with its constants)."""

    kind: str
    detail: str

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"Source kind must be one of {SOURCE_KINDS}, not {self.kind!r}")

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "detail": self.detail}


@dataclass(frozen=True)
class Figure:
    """One number with its unit and its source."""

    value: float
    unit: str
    source: Source

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "unit": self.unit, "source": self.source.to_json()}


def worst_kind(sources: list[Source]) -> str:
    """The least direct kind among several sources (modelled > scaled > measured): a sum is only as
    measured as its least measured part."""
    kinds = {s.kind for s in sources}
    for kind in ("modelled", "scaled"):
        if kind in kinds:
            return kind
    return "measured"


def split_layers(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> tuple[int, ...]:
    """The layers on each of ``pp`` pipeline ranks (``vpp`` chunks each), as Megatron-Core's
    ``get_num_layers_to_build`` splits ``num_layers``: evenly, or the ``first`` and/or ``last`` rank as
    given (``num_layers_in_first/last_pipeline_stage``) and the ranks between the rest evenly. A one-line
    UserError, naming the fix, for a split it refuses."""
    if first is None and last is None:
        if num_layers % (pp * vpp):
            raise UserError(
                f"pp*vpp = {pp}*{vpp} does not divide the {num_layers} layers: give pp and vpp whose product "
                f"divides {num_layers}, or first_stage_layers / last_stage_layers"
            )
        return (num_layers // pp,) * pp
    given = {stage: n for stage, n in ((0, first), (pp - 1, last)) if n is not None}
    between = pp - len(given)
    rest = num_layers - sum(given.values())
    split = ", ".join(f"{'first' if s == 0 else 'last'}_stage_layers={n}" for s, n in given.items())
    if between == 0 and rest != 0:
        raise UserError(f"{split} must add up to the {num_layers} layers: change them")
    if between and (rest < between or rest % between):
        raise UserError(
            f"{split} leaves {rest} of the {num_layers} layers to the {between} other pipeline "
            f"rank{'s' if between > 1 else ''}: give counts that leave a positive multiple of {between}"
        )
    counts = tuple(given.get(stage, rest // between if between else 0) for stage in range(pp))
    if any(n % vpp for n in counts):
        raise UserError(
            f"{split} gives the pipeline ranks {list(counts)} layers: with vpp={vpp} each must be a "
            f"multiple of {vpp}"
        )
    return counts


def split_or_none(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> tuple[int, ...] | None:
    """:func:`split_layers`, or None for a split Megatron-Core refuses: for callers that try several."""
    try:
        return split_layers(num_layers, pp, vpp, first, last)
    except UserError:
        return None


MAX_MICROBATCHES = 100_000  # a step's micro-batches on one data-parallel rank (the schedule simulates each)
MAX_SEQ_LEN = 2**24


@dataclass(frozen=True)
class Layout:
    """A parallel layout and batch; see the module docstring for Megatron-Core's rules."""

    seq_len: int
    tp: int = 1
    cp: int = 1  # Megatron's context_parallel_size
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    ep: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    dtype: str = "bf16"
    first_stage_layers: int | None = None  # Megatron's num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # Megatron's num_layers_in_last_pipeline_stage
    overlap_grad_reduce: bool = False  # Megatron's DDP overlap_grad_reduce (autotuner.predict.overlap)
    overlap_param_gather: bool = False  # the distributed optimizer's overlap_param_gather
    tp_comm_overlap: bool = False  # Transformer-Engine's TP communication overlap (tp_comm_overlap)

    def __post_init__(self) -> None:
        for name in ("seq_len", "tp", "cp", "pp", "vpp", "dp", "ep", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"layout {name}={value!r} must be a positive integer: give e.g. {name}=1")
        for name in (
            "sequence_parallel",
            "distributed_optimizer",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "tp_comm_overlap",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise UserError(
                    f"layout {name}={value!r} must be true or false: give {name}=true or {name}=false"
                )
        if self.recompute not in RECOMPUTE:
            raise UserError(
                f"layout recompute={self.recompute!r} is unknown: give one of {', '.join(RECOMPUTE)}"
            )
        if self.dtype not in DTYPES:
            raise UserError(f"layout dtype={self.dtype!r} is unknown: give one of {', '.join(DTYPES)}")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise UserError(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size * dp = "
                f"{self.micro_batch_size}*{self.dp}: give a global batch divisible by "
                f"{self.micro_batch_size * self.dp}"
            )
        if self.vpp > 1 and self.pp == 1:
            raise UserError(f"vpp={self.vpp} needs pipeline parallelism: give pp>1 or vpp=1")
        # Sizes no one means (a typo's extra zeros): each micro-batch is simulated through the schedule
        # (10^6 took a minute and 5 GB), and a sequence of 10^24 tokens gave PiB of activations.
        if self.microbatches > MAX_MICROBATCHES:
            raise UserError(
                f"global_batch_size={self.global_batch_size} is {self.microbatches} micro-batches a step on "
                f"each data-parallel rank, above {MAX_MICROBATCHES}: give a smaller global_batch_size"
            )
        if self.seq_len > MAX_SEQ_LEN:
            raise UserError(f"seq_len={self.seq_len} is above {MAX_SEQ_LEN} tokens: give a shorter sequence")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"layout {name}={value!r} must be a positive integer: give e.g. {name}=1")
            if self.pp == 1:
                raise UserError(f"{name}={value} needs pipeline parallelism: give pp>1, or leave {name} out")
        if self.vpp > 1 and self.microbatches % self.pp:
            raise UserError(
                f"the interleaved schedule (vpp={self.vpp}) needs the micro-batches per step "
                f"({self.microbatches}) to be a multiple of pp={self.pp}: change global_batch_size"
            )
        if self.sequence_parallel and self.tp == 1:
            raise UserError("sequence_parallel=true needs tp>1 (Megatron turns it off at tp=1): set it false")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise UserError(
                f"ep={self.ep} must divide tp*cp*dp = {self.tp * self.cp * self.dp} (Megatron places experts "
                "inside the data-, context- and tensor-parallel ranks): change ep or dp"
            )
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise UserError(
                f"seq_len={self.seq_len} is not a multiple of 2*cp = {2 * self.cp} (context parallelism "
                "gives each rank two of 2*cp chunks): give a sequence length or cp that divides"
            )
        if self.cp > 1 and self.sequence_parallel and (self.seq_len // self.cp) % self.tp:
            raise UserError(
                f"seq_len/cp = {self.seq_len // self.cp} is not a multiple of tp={self.tp} (sequence "
                "parallelism splits each rank's tokens over tp): change seq_len, cp or tp"
            )
        if self.overlap_param_gather and not (self.distributed_optimizer and self.overlap_grad_reduce):
            raise UserError(
                "overlap_param_gather=true needs distributed_optimizer=true and overlap_grad_reduce=true (as "
                "Megatron-LM checks): set them, or overlap_param_gather=false"
            )
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise UserError(
                "tp_comm_overlap=true needs sequence_parallel=true (Transformer-Engine overlaps the "
                "all-gathers and reduce-scatters of sequence parallelism): set it, or tp_comm_overlap=false"
            )

    @property
    def gpus(self) -> int:
        """World size: tp * cp * pp * dp (expert parallelism is carved out of tp * cp * dp)."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same routed experts, over which their gradients are reduced and, with the
        distributed optimizer, their optimizer states sharded: the tp*cp*dp ranks carved into ep groups
        (Megatron's expert-data-parallel group; expert_tensor_parallel_size=1 at ep > 1), dp*cp at
        ep=1."""
        return self.tp * self.cp * self.dp // self.ep if self.ep > 1 else self.dp * self.cp

    def context_rank_view(self) -> Layout:
        """What one rank of a context-parallel layout computes, as a layout without context parallelism:
        ``s/cp`` tokens of each sequence, ``dp*cp`` ranks over which the gradients are reduced and the
        distributed optimizer shards (Megatron's dp-cp group), and ``cp`` times the global batch of those
        shorter sequences, so that the micro-batches per step and the tokens per step stay the layout's.
        Every op but attention runs on a rank exactly as at that view (its tokens, its collectives' bytes,
        its memory); the attention over the whole sequence and its key-value exchange are added by
        autotuner.predict.overlap.context_attention. The layout itself at cp=1."""
        if self.cp == 1:
            return self
        return replace(
            self,
            seq_len=self.seq_len // self.cp,
            dp=self.dp * self.cp,
            global_batch_size=self.global_batch_size * self.cp,
            cp=1,
        )

    def optimizer_params(self, params: float, expert_params: float) -> float:
        """Of a GPU's ``params`` (``expert_params`` of them routed experts'), those whose optimizer states
        and update it keeps: all of them, or with the distributed optimizer the dense ones over dp*cp and
        the experts' over their expert-data-parallel ranks (Megatron shards each over its own group)."""
        if not self.distributed_optimizer:
            return params
        return (params - expert_params) / (self.dp * self.cp) + expert_params / self.expert_data_parallel

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each data-parallel rank (Megatron's ``get_num_microbatches``)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def check(
        self, num_layers: int, heads: int, query_groups: int | None = None, experts: int | None = None
    ) -> None:
        """Raise a one-line UserError for what Megatron-Core would refuse for a model of this shape."""
        groups = query_groups or heads
        if heads % self.tp:
            raise UserError(
                f"tp={self.tp} does not divide the {heads} attention heads: give a tp that divides {heads}"
            )
        if groups % self.tp:
            raise UserError(
                f"tp={self.tp} does not divide the {groups} query groups: give a tp that divides {groups}"
            )
        self.stage_layers(num_layers)
        if experts:
            if experts % self.ep:
                raise UserError(
                    f"ep={self.ep} does not divide the {experts} experts: give an ep that divides {experts}"
                )
        elif self.ep > 1:
            raise UserError(
                f"ep={self.ep} needs a mixture-of-experts model: this model has no experts, give ep=1"
            )

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers on each pipeline rank (all its virtual stages together), as Megatron-Core splits
        ``num_layers`` (:func:`split_layers`); a one-line UserError for a split it refuses."""
        return split_layers(num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers)

    def splits(self, num_layers: int) -> bool:
        """Whether Megatron-Core accepts this layout's split of ``num_layers`` (:meth:`stage_layers`)."""
        return (
            split_or_none(num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers)
            is not None
        )

    def layer_places(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """(pipeline rank, model chunk) of each layer, in Megatron's numbering (layer_number - 1): the
        chunks in turn, chunk c of rank 0 first, then c of rank 1, ... (``get_transformer_layer_offset``);
        without vpp, rank 0's layers, then rank 1's."""
        places = []
        per_chunk = [n // self.vpp for n in self.stage_layers(num_layers)]
        for chunk in range(self.vpp):
            for stage, count in enumerate(per_chunk):
                places += [(stage, chunk)] * count
        return tuple(places)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gpus": self.gpus, "microbatches": self.microbatches}

    def describe(self) -> str:
        """A one-line summary, e.g. ``tp=2 pp=4 vpp=1 dp=8 ep=1 mbs=1 gbs=512 s=2048 recompute=none ...``:
        the page's (autotuner.report.prediction.describe_layout, which reads the JSON) of this layout."""
        from autotuner.report.prediction import describe_layout

        return describe_layout(self.to_json())
