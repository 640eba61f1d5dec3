"""The ``functional`` op group: the device's base capabilities, measured as ops of the plan.

``ops=[functional]`` (or any of its ops by name) adds rows for what every layer op is built from:

* ``matmul``: a matrix product in the run's dtype, ``[s*b, h] @ [h, h]`` at each shape point (the token
  count times the model width, the shape of the attention output projection), 2*m*k*n FLOPs;
* ``copy``: a device-to-device copy of the point's hidden states ``[s, b, h]``; it reads and writes
  them, so bytes moved are twice their size;
* ``h2d_pageable``, ``h2d_pinned``, ``d2h_pageable``, ``d2h_pinned`` (CUDA only; ``skipped`` on a CPU):
  the hidden states copied host-to-device and device-to-host, from ordinary (pageable) and from
  page-locked (pinned) host memory, the copies activation offloading makes. Bytes moved are their size
  once (what crosses the link).

Rows report TFLOP/s or GB/s, and with a calibration the fraction of the matching ceiling. The calibration
itself (``python -m autotuner.calibrate``) measures the same calls at sizes large enough to reach the
device's peak: the call builders below are the one home of both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotuner.ops_test.base import FUNCTIONAL, OpCall, OpContext, OpNotApplicable, ShapePoint, register_op

if TYPE_CHECKING:
    import torch


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.matmul(b)  # torch.matmul's aten op, with no module to import in the timed call


def _copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return dst.copy_(src)


def _copy_async(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    # non_blocking only matters with pinned host memory: the copy engine then runs it asynchronously
    return dst.copy_(src, non_blocking=True)


def matmul_call(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> OpCall:
    """``a @ b`` with ``a`` [m, k], ``b`` [k, n] (no gradients: this is the device's rate, not an op)."""
    import torch

    from autotuner.ops.instrument import instrumented_function

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(k, n, generator=gen).to(device, dtype)
    return OpCall(instrumented_function(_matmul, "matmul"), (a, b))


def copy_call(nbytes: int, device: torch.device) -> OpCall:
    """``dst.copy_(src)`` of ``nbytes`` on ``device``: read once, written once."""
    import torch

    from autotuner.ops.instrument import instrumented_function

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return OpCall(
        instrumented_function(_copy, "copy"),
        (dst, src),
        bytes_moved={"forward": 2 * nbytes},
        ceiling="memory_bandwidth",
    )


def transfer_call(direction: str, pinned: bool, nbytes: int, device: torch.device) -> OpCall:
    """A host-to-device (``h2d``) or device-to-host (``d2h``) copy of ``nbytes`` through pageable or
    pinned host memory. Raises OpNotApplicable without a CUDA device."""
    import torch

    from autotuner.ops.instrument import instrumented_function

    if device.type != "cuda":
        raise OpNotApplicable(f"{direction} needs a CUDA device (host and device memory are one on a CPU)")
    name = f"{direction}_{'pinned' if pinned else 'pageable'}"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst, src = (on_device, host) if direction == "h2d" else (host, on_device)
    fn = instrumented_function(_copy_async if pinned else _copy, name)
    # a pageable copy is staged through a driver buffer synchronously: CUDA graphs cannot capture it
    return OpCall(fn, (dst, src), bytes_moved={"forward": nbytes}, ceiling=name, graphable=pinned)


def _hidden_bytes(ctx: OpContext, point: ShapePoint) -> int:
    return point.seq_len * point.micro_batch_size * ctx.config.hidden_size * ctx.dtype.itemsize


@register_op("matmul", aliases=("gemm",), needs=FUNCTIONAL, phases=("forward",))
def matmul(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Matrix product [s*b, h] @ [h, h] in the run's dtype: the device's GEMM rate at this point."""
    hidden = ctx.config.hidden_size
    return matmul_call(
        point.seq_len * point.micro_batch_size, hidden, hidden, ctx.device, ctx.dtype, ctx.seed
    )


@register_op("copy", aliases=("memcpy", "d2d"), needs=FUNCTIONAL, phases=("forward",))
def copy(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Device memory copy of the hidden states [s, b, h]: the device's copy bandwidth at this size."""
    return copy_call(_hidden_bytes(ctx, point), ctx.device)


def _register_transfer(direction: str, pinned: bool) -> None:
    name = f"{direction}_{'pinned' if pinned else 'pageable'}"

    def build(ctx: OpContext, point: ShapePoint) -> OpCall:
        return transfer_call(direction, pinned, _hidden_bytes(ctx, point), ctx.device)

    where = "host to device" if direction == "h2d" else "device to host"
    memory = "pinned" if pinned else "pageable"
    build.__doc__ = f"Copy of the hidden states [s, b, h] {where}, {memory} host memory (CUDA only)."
    register_op(name, needs=FUNCTIONAL, phases=("forward",))(build)


for _direction in ("h2d", "d2h"):
    for _pinned in (False, True):
        _register_transfer(_direction, _pinned)
