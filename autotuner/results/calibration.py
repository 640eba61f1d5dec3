"""A device's calibration file: where it is kept and how it is read back.

``python -m autotuner.calibrate`` measures the ceilings and writes the file; the get_data launcher reads it
to judge each op against them, and the report reads the copy a run keeps (``calibration.json`` in the run
directory) or one given with ``--calibration``. Both read it with :func:`load`, so a file one accepts the
other accepts too. The file is plain JSON::

    {"peak_flops": {"fp32": <FLOP/s>, "bf16": ..., ...},   the matrix-product ceiling per dtype
     "memory_bandwidth": <bytes/s>,                          the copy ceiling
     "h2d_pinned": <bytes/s>, ...}                           on a GPU, the host-transfer ceilings

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

DEFAULT_DIR = Path("runs") / "calibration"
# Host-transfer ceilings a calibration of a GPU holds (an op names the one it is judged against).
TRANSFER_CEILINGS = ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned")
_FIX = "run python -m autotuner.calibrate to write one"


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
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UserError(f"cannot read the calibration file {path} ({why}): {_FIX}") from exc
    if not isinstance(data, dict):
        raise UserError(f"calibration file {path} holds no JSON object: {_FIX}")
    peak = data.get("peak_flops")
    if not isinstance(peak, dict) or not peak or not all(_rate(v) for v in peak.values()):
        raise UserError(
            f'calibration file {path} needs peak_flops, FLOP/s per dtype ({{"fp32": 1e12, ...}}): {_FIX}'
        )
    given = [k for k in TRANSFER_CEILINGS if k in data]  # optional: a CPU has no host transfers
    wrong = [k for k in ("memory_bandwidth", *given) if not _rate(data.get(k))]
    if wrong:
        raise UserError(
            f"calibration file {path} needs {', '.join(wrong)} as a positive number of bytes/s: {_FIX}"
        )
    return data


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
