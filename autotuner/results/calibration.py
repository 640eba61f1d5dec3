"""A device's calibration file: where it is kept and how it is read back.

``python -m autotuner.calibrate`` measures the ceilings and writes the file; the get_data launcher reads it
to judge each op against them, and the report reads the copy a run keeps (``calibration.json`` in the run
directory) or one given with ``calibration=``; the predictor reads it for what the rows do not hold. All
read it with :func:`load`, so a file one accepts the others accept too; it is checked against
:class:`CalibrationFile` (pydantic, strict), and a wrong type is one line naming the field. Where a file is
named, so may be a shipped preset (``h100``, ``h200``: ``presets/``, calibrations measured on those GPUs,
each with a ``preset`` block saying where, when and from what record: docs/predict_presets.md). The file
is plain JSON::

    {"peak_flops": {"fp32": <FLOP/s>, "bf16": ..., ...},   the matrix-product ceiling per dtype
     "memory_bandwidth": <bytes/s>,                          the copy ceiling
     "zeroing_bandwidth": <bytes/s>,                         optional: bytes zeroed per second (a
                                                             training step zeroes its gradients)
     "h2d_pinned": <bytes/s>, ...,                           on a GPU, the host-transfer ceilings
     "adam_seconds_per_parameter": <s>,                      optional: torch's Adam step per fp32
     "adam_parameters": <count>,                             parameter, and the count timed
     "adam_seconds_per_tensor": <s>,                         optional: its cost per tensor (>= 0)
     "grad_accumulation_seconds_per_parameter": {"bf16": <s>, ...},  optional: a gradient of that
                                                             dtype added into an fp32 one, per parameter
     "warm_cache_bytes": <bytes>,                            optional: the GPU's L2, a CPU core's own
     "shared_cache_bytes": <bytes>,                          optional: the last-level cache (CPU: the
                                                             L3 a core keeps data in, as measured)
     "shared_cache_bytes_reported": <bytes>,                 optional: the size the device reports
     "all_reduce_bandwidth": {"nccl:8": <bytes/s>, ...},     optional: the links' bus bandwidth per
     "all_gather_bandwidth": {...},                          collective, keyed "<backend>:<world size>"
     "reduce_scatter_bandwidth": {...},                      (python -m autotuner.calibrate collectives=true)
     "send_recv_bandwidth": {...},                           and the point-to-point exchange's
     "collective_points": {"all_reduce": {"nccl:8": {"bytes": [...], "seconds": [...]}}, ...},
                                                             the timed sizes behind them
     "adam_seconds_per_parameter_together": {"gloo:2": <s>},  optional, CPU processes: the Adam step
                                                             per parameter with every rank at it
     "host_work_seconds_per_microbatch": {"forward": <s>, "forward_per_layer": <s>, "backward": <s>,
                                          "backward_per_layer": <s>}}  optional, CPU: a training step's
                                                             time outside its ops per micro-batch, a
                                                             stage's part and a part per layer

The link entries are optional (a file written before them, or on one process, is still a calibration);
where present they are checked like the ceilings. Other keys (``device_type``, ``environment``, ...) are
kept as written. Bus bandwidth is nccl-tests' figure: the data a rank
sends over its link per second, whatever the world size, so it is comparable across sizes of group
(autotuner.predict.links turns it back into a collective's time).

Importing this module imports neither torch nor a model (the report reads calibrations without them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from autotuner.errors import UserError, schema_problem
from autotuner.results.reading import read_run_text

DEFAULT_DIR = Path("runs") / "calibration"
# Host-transfer ceilings a calibration of a GPU holds (an op names the one it is judged against).
TRANSFER_CEILINGS = ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned")
_FIX = "run python -m autotuner.calibrate to write one"
# The collectives a calibration may hold the links' bus bandwidth of, and their keys in the file.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
LINK_KEYS = {kind: f"{kind}_bandwidth" for kind in COLLECTIVES}
# Per-link entries besides the bandwidths (the same "<backend>:<world>" keys, positive numbers).
ADAM_TOGETHER = "adam_seconds_per_parameter_together"
# Seconds per tensor of torch's Adam step, besides its seconds per parameter (zero where it hides).
ADAM_PER_TENSOR = "adam_seconds_per_tensor"
# Seconds per parameter more, beside ``adam_seconds_per_parameter``, that Adam takes for a parameter whose
# gradient and moments are zero (an embedding row no token touched: autotuner.predict.timing.optimizer_step).
ADAM_ZERO_STATE = "adam_seconds_per_zero_state_parameter"
# Bytes per second that ``zero_()`` clears in a buffer far past the cache, as a step zeroes its gradients.
ZEROING_BANDWIDTH = "zeroing_bandwidth"
# Seconds an Adam step inside a training step takes beyond its rates per parameter and per tensor (timed
# back to back), once a step: on a CPU, from the host work's real steps (autotuner.calibrate.adam_in_step).
ADAM_IN_STEP = "adam_seconds_per_step_in_training"
# Per gradient dtype ("fp32", "bf16", ...): seconds per parameter of adding it into an fp32 gradient.
GRAD_ACCUMULATION = "grad_accumulation_seconds_per_parameter"
# Seconds per micro-batch a training step spends outside its ops (the schedule's and GPTModel's own host
# work), timed on a CPU (autotuner.calibrate.host_work): per phase a stage's part and a part per layer.
HOST_WORK = "host_work_seconds_per_microbatch"
# The same, timed with the last-level cache flushed inside every layer: the host work of a model whose ops
# sweep more than the cache between its visits (autotuner.predict.caches.host_work_cached).
HOST_WORK_FLUSHED = "host_work_seconds_per_microbatch_flushed"
HOST_WORK_PARTS = ("forward", "forward_per_layer", "backward", "backward_per_layer")
PER_LINK_KEYS = (*LINK_KEYS.values(), ADAM_TOGETHER)
_LINK = re.compile(r"^[a-z][a-z0-9_]*:[1-9][0-9]*$")  # "<backend>:<world size>", e.g. "nccl:8"
_LINK_FIX = "run torchrun --nproc-per-node=N -m autotuner.calibrate collectives=true to measure them again"


def default_path(device_type: str, device_name: str) -> Path:
    """``runs/calibration/<device type>-<device name>.json``: where a calibration of a device is kept
    (the name as autotuner.model.runtime.device_name gives it)."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", f"{device_type}-{device_name}").strip("-").lower()
    return DEFAULT_DIR / f"{stem}.json"


# Where a figure of a calibration file is wrong, what it holds (the schema's own words say the type).
_HINTS = {
    "peak_flops": 'FLOP/s per dtype, e.g. {"bf16": 8e14, "fp32": 5e13}',
    "memory_bandwidth": "bytes/s",
    GRAD_ACCUMULATION: 'seconds per parameter per gradient dtype, e.g. {"bf16": 3.7e-12}',
    HOST_WORK: 'seconds, e.g. {"forward": 2e-4, "forward_per_layer": 5e-5, ...}',
    HOST_WORK_FLUSHED: "seconds, as host_work_seconds_per_microbatch",
    "collective_points": 'e.g. {"all_reduce": {"nccl:8": {"bytes": [...], "seconds": [...]}}}',
    **{key: 'e.g. {"nccl:8": 3.6e11}' for key in PER_LINK_KEYS},
}

# A positive, finite number (bytes/s, FLOP/s, bytes, seconds per parameter); seconds that may be zero.
_Rate = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_Link = Annotated[str, StringConstraints(pattern=_LINK.pattern)]


class _HostWork(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    forward: _Seconds
    forward_per_layer: _Seconds
    backward: _Seconds
    backward_per_layer: _Seconds


class _Points(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    bytes: Annotated[list[_Rate], Field(min_length=1)]
    seconds: Annotated[list[_Rate], Field(min_length=1)]

    @model_validator(mode="after")
    def _paired(self) -> _Points:
        if len(self.bytes) != len(self.seconds):
            raise ValueError(
                f"has {len(self.bytes)} bytes and {len(self.seconds)} seconds: one each per size"
            )
        return self


class _Source(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    record: str  # where the figures were recorded when measured (a file, a section of docs/gpu_validation.md)
    figures: Annotated[list[str], Field(min_length=1)]  # "peak_flops.bf16", "memory_bandwidth", ...


class _Preset(BaseModel):
    """Where a shipped preset's figures were measured (docs/predict_presets.md)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: str
    device: str  # the GPU, its driver and host, as recorded where it was measured
    measured: Annotated[str, StringConstraints(pattern=r"^\d{4}-\d{2}-\d{2}$")]  # the date
    command: str  # what measured the figures, and reproduces them on such a GPU
    sources: Annotated[list[_Source], Field(min_length=1)]  # each figure's record, each figure once


class CalibrationFile(BaseModel):
    """The schema of a calibration file (module docstring). Strict: JSON types as autotuner.calibrate writes
    them, nothing coerced. An optional figure, where present, must hold a number (null is not a figure);
    other keys are kept as written and not read."""

    model_config = ConfigDict(strict=True, extra="allow")

    device_type: str = None  # type: ignore[assignment]
    environment: dict[str, Any] = None  # type: ignore[assignment]
    preset: _Preset = None  # type: ignore[assignment]
    peak_flops: Annotated[dict[str, _Rate], Field(min_length=1)]
    memory_bandwidth: _Rate
    zeroing_bandwidth: _Rate = None  # type: ignore[assignment]
    h2d_pageable: _Rate = None  # type: ignore[assignment]
    h2d_pinned: _Rate = None  # type: ignore[assignment]
    d2h_pageable: _Rate = None  # type: ignore[assignment]
    d2h_pinned: _Rate = None  # type: ignore[assignment]
    buffer_bytes: _Rate = None  # type: ignore[assignment]
    warm_cache_bytes: _Rate = None  # type: ignore[assignment]
    shared_cache_bytes: _Rate = None  # type: ignore[assignment]
    shared_cache_bytes_reported: _Rate = None  # type: ignore[assignment]
    adam_seconds_per_parameter: _Rate = None  # type: ignore[assignment]
    adam_parameters: _Rate = None  # type: ignore[assignment]
    adam_seconds_per_tensor: _Seconds = None  # type: ignore[assignment]
    adam_seconds_per_zero_state_parameter: _Seconds = None  # type: ignore[assignment]
    adam_seconds_per_step_in_training: _Seconds = None  # type: ignore[assignment]
    grad_accumulation_seconds_per_parameter: dict[str, _Rate] = {}
    host_work_seconds_per_microbatch: _HostWork = None  # type: ignore[assignment]
    host_work_seconds_per_microbatch_flushed: _HostWork = None  # type: ignore[assignment]
    all_reduce_bandwidth: dict[_Link, _Rate] = {}
    all_gather_bandwidth: dict[_Link, _Rate] = {}
    reduce_scatter_bandwidth: dict[_Link, _Rate] = {}
    send_recv_bandwidth: dict[_Link, _Rate] = {}
    adam_seconds_per_parameter_together: dict[_Link, _Rate] = {}
    collective_points: dict[Literal[COLLECTIVES], dict[_Link, _Points]] = {}  # type: ignore[valid-type]


# The shipped presets: calibrations measured on real GPUs, named by ``calibration=<name>`` wherever a
# calibration file is read (docs/predict_presets.md); package data beside this module.
PRESET_DIR = Path(__file__).resolve().parent / "presets"


def presets() -> tuple[str, ...]:
    """The names of the shipped presets (``h100``, ``h200``)."""
    return tuple(sorted(path.stem for path in PRESET_DIR.glob("*.json")))


def resolve(given: str | Path) -> Path:
    """The file a calibration setting names: a preset's name (:func:`presets`) is the shipped file, any
    other value a path. UserError (one line) where a name is both a preset and a file here."""
    name = str(given)
    if name not in presets():
        return Path(given)
    if Path(name).exists():
        raise UserError(
            f"calibration {name} names both the preset {name} and the file ./{name}: give ./{name} for the "
            "file, or rename it to use the preset"
        )
    return PRESET_DIR / f"{name}.json"


def load(path: str | Path) -> dict[str, Any]:
    """Read and check a calibration file, or a preset by name (:func:`resolve`), against
    :class:`CalibrationFile`; UserError (one line, naming the file, the field and the fix) when it is
    missing, not JSON, or a figure is absent or of the wrong type. Returns the file's data as written."""
    path = resolve(path)
    try:
        # a FIFO or a device is refused, not waited on; a missing file says the presets
        data = json.loads(read_run_text(path, fix=f"{_FIX}, or name a preset: {', '.join(presets())}"))
    except ValueError as exc:
        raise UserError(
            f"cannot read the calibration file {path} ({str(exc).splitlines()[0]}): {_FIX}, or name a "
            f"preset: {', '.join(presets())}"
        ) from exc
    if not isinstance(data, dict):
        raise UserError(f"calibration file {path} holds no JSON object: {_FIX}")
    try:
        CalibrationFile.model_validate(data)
    except ValidationError as exc:
        field = str(exc.errors(include_url=False)[0]["loc"][0])
        hint = f" ({_HINTS[field]})" if field in _HINTS else ""
        fix = _LINK_FIX if field in (*PER_LINK_KEYS, "collective_points") else _FIX
        raise UserError(f"calibration file {path}: {schema_problem(exc)}{hint}: {fix}") from None
    return data


def preset_for(device_name: str) -> str | None:
    """The preset measured on a device of this name (as autotuner.model.runtime.device_name gives it)."""
    for name in presets():
        env = json.loads((PRESET_DIR / f"{name}.json").read_text(encoding="utf-8")).get("environment") or {}
        if env.get("device_name") == device_name:
            return name
    return None


def label(calibration: Mapping[str, Any], given: str | Path | None) -> str:
    """A calibration's name: ``preset <name>``, or the file it was read from."""
    preset = calibration.get("preset")
    return f"preset {preset['name']}" if preset else str(given)


def describe(calibration: Mapping[str, Any], given: str | Path | None) -> str:
    """Where a calibration comes from, in one line: a preset's name, device, software and date, or the
    file's path and the device and software its environment records."""
    env = calibration.get("environment") or {}
    software = ", ".join(
        f"{name} {env[key]}"
        for key, name in (("python", "Python"), ("torch", "torch"), ("megatron_core", "Megatron-Core"))
        if env.get(key)
    )
    preset = calibration.get("preset")
    if preset:
        return (
            f"{label(calibration, given)}: {preset['device']}; {software}; measured {preset['measured']} by "
            f"{preset['command']}"
        )
    device = " ".join(str(v) for v in (calibration.get("device_type"), env.get("device_name")) if v)
    about = "; ".join(part for part in (device, software) if part)
    return label(calibration, given) + (f" ({about})" if about else "")


def bus_factor(kind: str, world: int) -> float:
    """Bytes each rank sends over its link per byte of the collective's full buffer (the all-reduced
    tensor, the gathered output, the scattered input) in a ring of ``world`` ranks, nccl-tests'
    ``busbw = algbw * factor``: an all-reduce is a reduce-scatter then an all-gather, 2(n-1)/n; an
    all-gather or a reduce-scatter passes n-1 of the n shards, (n-1)/n. A ``send_recv`` (each rank sends
    its buffer to the next rank and receives the previous rank's, batched, as a pipeline stage exchanges
    activations) sends the whole buffer: 1."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}: one of {', '.join(COLLECTIVES)}")
    if kind == "send_recv":
        return 1.0
    return (2 if kind == "all_reduce" else 1) * (world - 1) / world


def link_key(backend: str, world: int) -> str:
    """The key of a link measurement in a calibration file: ``"<backend>:<world size>"``."""
    return f"{backend}:{world}"


def merge_links(calibration: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, Any]:
    """``calibration`` with the link entries of ``measured`` (what ``calibrate collectives=true`` returns:
    the ``*_bandwidth`` and ``collective_points`` keys) added: a key measured again replaces its old
    value, every other entry (the compute and memory ceilings, other worlds and backends) is kept."""
    merged = dict(calibration)
    for key in PER_LINK_KEYS:
        if key in measured:
            merged[key] = {**merged.get(key, {}), **measured[key]}
    points = dict(merged.get("collective_points", {}))
    for kind, by_link in measured.get("collective_points", {}).items():
        points[kind] = {**points.get(kind, {}), **by_link}
    if points:
        merged["collective_points"] = points
    return merged


def ceilings(calibration: Mapping[str, Any] | None, dtype: str | None) -> tuple[float | None, float | None]:
    """(the matmul FLOP/s of ``dtype``, the copy bandwidth in bytes/s) of a calibration (None: absent)."""
    if not calibration:
        return None, None
    peak = calibration.get("peak_flops")
    peak = peak.get(dtype) if isinstance(peak, Mapping) else None
    bandwidth = calibration.get("memory_bandwidth")
    return (float(peak) if peak else None, float(bandwidth) if bandwidth else None)


def roofline(
    flops: int,
    bytes_moved: int,
    seconds: float,
    calibration: Mapping[str, Any] | None,
    dtype: str | None,
    ceiling: str | None = None,
) -> dict[str, Any]:
    """The op's bound and the fraction of that ceiling it reaches, from the device's calibration (the
    get_data rows' ``bound`` and ``ceiling_fraction``; the report draws the same ceilings).

    The ridge point is the calibrated FLOP/s over the calibrated bandwidth: an op whose FLOPs per byte
    moved lie above it is compute-bound (judged against the matmul FLOP/s of its dtype), below it
    memory-bound (judged against the copy bandwidth). An op that names its ``ceiling`` (a calibration
    key: a host transfer's "h2d_pinned", ...) is judged by bytes against that one. Without a calibration
    the columns stay empty.
    """
    if not calibration or not seconds or not bytes_moved:
        return {}
    if ceiling is not None:
        limit = calibration.get(ceiling)
        if not limit:
            return {}
        bound = "memory" if ceiling == "memory_bandwidth" else ceiling
        return {"bound": bound, "ceiling_fraction": bytes_moved / seconds / limit}
    peak, bandwidth = ceilings(calibration, dtype)
    if not peak or not bandwidth:
        return {}
    compute_bound = flops / bytes_moved > peak / bandwidth
    achieved = flops / seconds if compute_bound else bytes_moved / seconds
    return {
        "bound": "compute" if compute_bound else "memory",
        "ceiling_fraction": achieved / (peak if compute_bound else bandwidth),
    }
