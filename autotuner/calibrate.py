"""Device calibration: the ceilings an op's achieved rate is judged against.

``python -m autotuner.calibrate [--device auto|cpu|cuda] [--out FILE]`` measures, with the same sampler
as the get_data launcher:

* matrix-product FLOP/s per dtype (square ``a @ b``; 2*n^3 FLOPs), the compute ceiling;
* memory copy bandwidth (``dst.copy_(src)`` of a buffer far larger than the last-level cache; each copy
  reads and writes the buffer, 2 x its bytes), the memory ceiling;
* on a GPU, host-to-device and device-to-host bandwidth from pageable and from pinned host memory.

The calls are the ``functional`` op group's (autotuner.ops_test.functional_ops), at sizes that reach the
peak. The result is a JSON file, by default ``runs/calibration/<device>.json``, which get_data runs read (the
``calibration`` config key, or that default file) to add each op's bound and the fraction of its ceiling
it reaches. Calibrate once per machine; the file names the device and versions it was measured with.
Where it is kept and how it is read back: autotuner.results.calibration.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from autotuner.errors import UserError
from autotuner.measure.cache import last_level_cache_bytes
from autotuner.measure.timer import DeviceTimer, SamplingPolicy, sample
from autotuner.model.runtime import DTYPES, device_name, environment, resolve_device
from autotuner.ops_test.base import OpCall
from autotuner.ops_test.functional_ops import copy_call, matmul_call, transfer_call
from autotuner.results.atomic import atomic_write_text
from autotuner.results.calibration import default_path

# Matrix sizes: big enough to reach the unit's peak, small enough for a CPU in seconds. CPUs without
# bf16/fp16 units run those products ~250x slower than fp32, hence the small CPU sizes for them.
MATMUL_SIZE = {
    "cuda": {"fp32": 8192, "bf16": 8192, "fp16": 8192},
    "cpu": {"fp32": 1024, "bf16": 128, "fp16": 128},
}

# Host transfer sizes tried for the pageable ceilings (the best rate is kept).
TRANSFER_SIZES = (16 * 2**20, 64 * 2**20, 256 * 2**20)


def _median_s(call: OpCall, device: torch.device, policy: SamplingPolicy) -> float:
    return sample(DeviceTimer(device), lambda: call.fn(*call.inputs), policy).median_ns * 1e-9


def calibrate(device: torch.device, policy: SamplingPolicy | None = None) -> dict[str, Any]:
    """Measure the ceilings of ``device`` with the functional ops' calls at peak sizes; plain data."""
    policy = policy or SamplingPolicy(warmup=2, min_samples=5, budget_s=1.0, target_rel_ci=0.02)
    peak_flops = {}
    for dtype, n in MATMUL_SIZE[device.type].items():
        peak_flops[dtype] = 2 * n**3 / _median_s(matmul_call(n, n, n, device, DTYPES[dtype]), device, policy)
    size = max(8 * last_level_cache_bytes(device), 64 * 2**20)
    copy = copy_call(size, device)
    result: dict[str, Any] = {
        "device_type": device.type,
        "environment": environment(device),
        "peak_flops": peak_flops,
        "memory_bandwidth": copy.bytes_moved["forward"] / _median_s(copy, device, policy),
        "buffer_bytes": size,
    }
    if device.type == "cuda":
        # A pageable copy is staged through a pinned buffer by the driver, and its rate depends on the size
        # (seen on an H100: 9.7 GB/s at 400 MiB, 16 GB/s at 32 MiB); the ceiling is the best of a few sizes.
        for direction in ("h2d", "d2h"):
            for pinned in (False, True):
                rates = []
                for nbytes in TRANSFER_SIZES if not pinned else (size,):
                    transfer = transfer_call(direction, pinned, min(nbytes, size), device)
                    rates.append(transfer.bytes_moved["forward"] / _median_s(transfer, device, policy))
                result[transfer.ceiling] = max(rates)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autotuner.calibrate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    parser.add_argument("--out", help="where to write the JSON (default runs/calibration/<device>.json)")
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except UserError as exc:
        print(f"autotuner.calibrate: error: {exc}", file=sys.stderr)
        return 2
    result = calibrate(device)
    out = Path(args.out) if args.out else default_path(device.type, device_name(device))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")  # a run reading it sees all or nothing
    for dtype, flops in result["peak_flops"].items():
        print(f"matmul {dtype:5}  {flops / 1e12:10.4f} TFLOP/s")
    print(f"copy          {result['memory_bandwidth'] / 1e9:10.2f} GB/s")
    for key in ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned"):
        if key in result:
            print(f"{key:13} {result[key] / 1e9:10.2f} GB/s")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
