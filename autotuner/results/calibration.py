"""A device's calibration file: where it is kept and how it is read back.

``python -m autotuner.calibrate`` measures the ceilings and writes the file; the get_data launcher reads it
to judge each op against them, and the report reads the copy a run keeps (``calibration.json`` in the run
directory) or one given with ``--calibration``. Both read it with :func:`load`, so a file one accepts the
other accepts too. The file is plain JSON::

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
     "reduce_scatter_bandwidth": {...},                      (python -m autotuner.calibrate --collectives)
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
where present they are checked like the ceilings. Bus bandwidth is nccl-tests' figure: the data a rank
sends over its link per second, whatever the world size, so it is comparable across sizes of group
(autotuner.predict.links turns it back into a collective's time).

Importing this module imports neither torch nor a model (the report reads calibrations without them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotuner.errors import UserError
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
_LINK_FIX = "run torchrun --nproc-per-node=N -m autotuner.calibrate --collectives to measure them again"


def default_path(device_type: str, device_name: str) -> Path:
    """``runs/calibration/<device type>-<device name>.json``: where a calibration of a device is kept
    (the name as autotuner.model.runtime.device_name gives it)."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", f"{device_type}-{device_name}").strip("-").lower()
    return DEFAULT_DIR / f"{stem}.json"


def _rate(value: Any) -> bool:
    """A positive, finite number (JSON's true/false are not rates)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def load(path: str | Path) -> dict[str, Any]:
    """Read and check a calibration file; UserError (one line, naming the file and the fix) when it is
    missing, not JSON, or lacks a positive number where a ceiling belongs."""
    try:
        data = json.loads(read_run_text(path, fix=_FIX))  # a FIFO or a device: refused, not waited on
    except ValueError as exc:
        raise UserError(
            f"cannot read the calibration file {path} ({str(exc).splitlines()[0]}): {_FIX}"
        ) from exc
    if not isinstance(data, dict):
        raise UserError(f"calibration file {path} holds no JSON object: {_FIX}")
    peak = data.get("peak_flops")
    if not isinstance(peak, dict) or not peak or not all(_rate(v) for v in peak.values()):
        raise UserError(
            f'calibration file {path} needs peak_flops, FLOP/s per dtype ({{"fp32": 1e12, ...}}): {_FIX}'
        )
    # optional: a CPU has no host transfers; a file from before the optimizer was timed has no Adam rate
    optional = (
        *TRANSFER_CEILINGS,
        "adam_seconds_per_parameter",
        "warm_cache_bytes",
        "shared_cache_bytes",
        "shared_cache_bytes_reported",
        ZEROING_BANDWIDTH,
    )
    given = [k for k in optional if k in data]
    wrong = [k for k in ("memory_bandwidth", *given) if not _rate(data.get(k))]
    if wrong:
        raise UserError(
            f"calibration file {path} needs {', '.join(wrong)} as a positive number (bytes/s, bytes, "
            f"seconds per parameter): {_FIX}"
        )
    for key, example in ((ADAM_PER_TENSOR, "4e-05"), (ADAM_ZERO_STATE, "3e-09"), (ADAM_IN_STEP, "5e-04")):
        seconds = data.get(key, 0.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise UserError(
                f"calibration file {path} has a bad {key}: it needs a number of seconds >= 0 (e.g. "
                f"{example}): {_FIX}"
            )
    accumulation = data.get(GRAD_ACCUMULATION, {})
    if not isinstance(accumulation, dict) or not all(
        isinstance(k, str) and _rate(v) for k, v in accumulation.items()
    ):
        raise UserError(
            f'calibration file {path} has a bad {GRAD_ACCUMULATION}: it needs {{"<dtype>": <seconds per '
            f'parameter>, ...}} with positive numbers (e.g. {{"bf16": 3.7e-12}}): {_FIX}'
        )
    for key in (HOST_WORK, HOST_WORK_FLUSHED):
        host = data.get(key, dict.fromkeys(HOST_WORK_PARTS, 0.0))
        if (
            not isinstance(host, dict)
            or set(host) != set(HOST_WORK_PARTS)
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf
                for v in host.values()
            )
        ):
            raise UserError(
                f"calibration file {path} has a bad {key}: it needs {', '.join(HOST_WORK_PARTS)} as "
                f'seconds >= 0 (e.g. {{"forward": 2e-4, "forward_per_layer": 5e-5, ...}}): {_FIX}'
            )
    for key in PER_LINK_KEYS:
        links = data.get(key, {})
        if not isinstance(links, dict) or not all(_LINK.match(k) and _rate(v) for k, v in links.items()):
            raise UserError(
                f'calibration file {path} has a bad {key}: it needs {{"<backend>:<world>": <number>, ...}} '
                f'with positive numbers (e.g. {{"nccl:8": 3.6e11}}): {_LINK_FIX}'
            )
    if not _points_ok(data.get("collective_points", {})):
        raise UserError(
            f'calibration file {path} has a bad collective_points: it needs {{"all_reduce": {{"<backend>:'
            f'<world>": {{"bytes": [...], "seconds": [...]}}}}, ...}}, lists of positive numbers of the same '
            f"length: {_LINK_FIX}"
        )
    return data


def _points_ok(points: Any) -> bool:
    """Whether ``collective_points`` is ``{collective: {link: {"bytes": [...], "seconds": [...]}}}``."""
    if not isinstance(points, dict):
        return False
    for kind, by_link in points.items():
        if kind not in COLLECTIVES or not isinstance(by_link, dict):
            return False
        for link, timed in by_link.items():
            if not _LINK.match(link) or not isinstance(timed, dict):
                return False
            sizes, seconds = timed.get("bytes"), timed.get("seconds")
            if not isinstance(sizes, list) or not isinstance(seconds, list) or len(sizes) != len(seconds):
                return False
            if not sizes or not all(_rate(v) for v in (*sizes, *seconds)):
                return False
    return True


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
    """``calibration`` with the link entries of ``measured`` (what ``calibrate --collectives`` returns:
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
