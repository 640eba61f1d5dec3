"""The host heap of a process that times work on a CPU: freed memory kept for the next allocation, never
given back to the system, so that no sample pays page faults that depend on the process's history.

glibc's malloc serves a large request (from 128 KiB, a threshold it raises as large blocks are freed)
with a fresh ``mmap`` and unmaps it when freed, and gives the top of its heap back to the system once
more than a threshold of it is free. Memory given back costs a page fault for every 4 KiB page written
next time (the kernel hands out zeroed pages), so how many faults a timed call pays depends on what the
process allocated and freed before it, not on the call. On this project's CPU VM (one
thread), torch's Adam step over the calibration's layer-shaped tensors (autotuner.calibrate) took 10,400
page faults a step and 4.1 ns per parameter: its temporaries, each a tensor's size, mapped and unmapped
tensor by tensor. The same process's training steps, whose heap had settled, took none in their Adam
step (2.7 ns per parameter); with the heap kept, the calibration's step took none either (2.3 ns). A
get_data profile's samples took 0-183 faults each (the output layer's backward the most), and one
process timed a SwiGLU activation's forward at 2.26 ms with 1,024 faults a call where another, with a
settled heap, read 0.27 ms.

:func:`keep_freed_memory` fixes glibc's mmap threshold at its ceiling (32 MiB on a 64-bit system) and
turns trimming off (``mallopt``): a freed block stays in the heap and the next allocation reuses it, the
state a long training process's heap settles into. Every process that times on a CPU calls it: a run's
main process and the launchers' sessions (autotuner.main, autotuner.runner.spec.open_session: the nsys
launcher's worker too), the calibration and the validated training steps (autotuner.predict.steps), so
rows, rates and the steps they predict share it. A block above the ceiling is still mapped per
allocation. A C library other than glibc (macOS, musl) is left as it is. The run's environment records
which (``host_heap``). On a GPU the CUDA caching allocator already keeps device memory: the host's heap
is left alone there.
"""

from __future__ import annotations

import ctypes
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# glibc's malloc.h: mallopt's parameters, and the largest mmap threshold it accepts on a 64-bit system
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_CEILING = 32 * 2**20
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: 2 GiB free at the heap's top before it would trim

_state: str | None = None  # what keep_freed_memory did in this process; None: not called


def keep_freed_memory(device: torch.device) -> None:
    """Where ``device`` is a CPU, keep freed memory in this process's heap (module docstring); once per
    process. :func:`host_heap` says what it did."""
    global _state
    if device.type == "cpu" and _state is None:
        _state = _keep()


def _keep() -> str:
    if platform.libc_ver()[0] != "glibc":
        return "system allocator, left as it is (not glibc)"
    libc = ctypes.CDLL(None)
    kept = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_CEILING) and libc.mallopt(
        M_TRIM_THRESHOLD, NEVER_TRIM
    )
    if not kept:
        return "glibc defaults (mallopt refused the settings)"
    return f"glibc, freed memory kept: mmap from {MMAP_THRESHOLD_CEILING >> 20} MiB, never trimmed"


def host_heap() -> str:
    """This process's host heap, for the run's environment."""
    return _state or "allocator defaults"
