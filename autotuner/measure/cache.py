"""The device's caches: their sizes, and a flush that evicts the shared one between samples.

On a GPU the last-level cache is L2 (``L2_cache_size`` of the device properties), and its size is what the
device has. On a CPU the kernel's sysfs reports each cache's size, but under a hypervisor the shared L3 it
reports is the host socket's, which the guest's cores share with every other tenant's: this project's
development VM reports 480 MiB, yet a core re-reads 32 MiB at 20-27 GB/s, 64 MiB mostly at 11-15 and 128 MiB
at the 11-12 GB/s of memory (one thread). A flush sized by the report wrote 960 MiB before every
sample (about 0.1 s: a flushed profile got 8-10 samples an op in its budget) and the predictor counted 480 MiB
of room for a stage's data. So on a CPU the shared cache's size is measured (:func:`shared_cache_bytes`): the
largest buffer that one core re-reads clearly faster than memory, found by reading buffers of doubling size up
to twice the reported size, three times over. It takes a few seconds, once a process.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from pathlib import Path

import torch

_DEFAULT_CPU_CACHE = 32 * 2**20
# A size still counts as cached while one core re-reads it this much faster than the largest size probed
# (which no cache holds: twice the reported one). The VM above, one sweep's medians of five reads: 1.9-2.3x
# at 32 MiB, 1.0-1.3x at 64 MiB (at times 1.9x by the fastest read: the fastest read of one sweep and a
# threshold of 1.3 put the end at 32 MiB in some processes and 64 in others, and the predictor's plan
# with it; medians over three sweeps and 1.5: 32 MiB in 6 processes of 6, 64 in a calibration half an hour
# later: what the other tenants leave of the L3 moves, and no statistic of one process pins it).
CACHED_OVER_MEMORY = 1.5
# Reading more than this to find the cache's end costs more time and memory than it tells.
_PROBE_LIMIT = 2 * 2**30


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def _cpu_caches() -> list[tuple[int, bool]]:
    """(size, private to one core) of each data or unified cache of CPU 0, as sysfs reports them."""
    caches = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            private = (index / "shared_cpu_list").read_text().strip().isdigit()
            caches.append((_parse_size((index / "size").read_text()), private))
        except (OSError, ValueError):
            continue
    return caches


def last_level_cache_bytes(device: torch.device) -> int:
    """The last-level cache as the device reports it: a GPU's L2; the largest cache in a CPU's sysfs
    (32 MiB where none is reported), which may be more than this process can keep (module docstring)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return max((size for size, _ in _cpu_caches()), default=_DEFAULT_CPU_CACHE)


def rotation_sets(input_bytes: int, cache_bytes: int) -> int:
    """How many sets of inputs (the original included) get_data cycles through: enough copies of inputs
    smaller than the cache that cycling through them overflows it, at most 8 (runner.Phase.rotate)."""
    if input_bytes == 0 or input_bytes >= cache_bytes:
        return 1
    return min(8, math.ceil(2 * cache_bytes / input_bytes))


def warm_cache_bytes(device: torch.device) -> int:
    """The cache a warm sample's data sits in between calls: a GPU's L2; on a CPU the largest cache one
    core has to itself (usually L2; the L3 it shares with the other cores is slower, so an op whose data
    comes from there inside a step runs slower than the warm row measured). 1 MiB where none is reported."""
    if device.type == "cuda":
        return last_level_cache_bytes(device)
    return max((size for size, private in _cpu_caches() if private), default=2**20)


def _read_seconds(buffer: torch.Tensor, reads: int = 3) -> float:
    """The median of ``reads`` passes over ``buffer`` (a sum reads every byte once), after one that brings
    it in: what the other tenants of a shared cache typically leave of it, as a step meets it."""
    buffer.sum()
    seconds = []
    for _ in range(reads):
        start = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def read_rates(sizes: list[int], sweeps: int = 3) -> dict[int, float]:
    """Bytes per second at which one thread re-reads a buffer of each size (fp32, so whole multiples of 4):
    the median over ``sweeps`` sweeps through the sizes, each a second or so apart, since what the other
    tenants leave of a shared cache changes from one second to the next."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's view: with more, each core's share of the cache and the memory
    try:
        rates: dict[int, list[float]] = {size: [] for size in sizes}
        for _ in range(sweeps):
            for size in sizes:
                buffer = torch.ones(size // 4, dtype=torch.float32)
                rates[size].append(size / _read_seconds(buffer))
                del buffer
        return {size: statistics.median(seen) for size, seen in rates.items()}
    finally:
        torch.set_num_threads(threads)


def cached_extent(rates: dict[int, float]) -> int | None:
    """The largest of ``rates``' sizes, short of the largest (taken as memory's rate), that reads at least
    CACHED_OVER_MEMORY times faster than it; None where none does. The largest, not the last before the
    first that fails: a smaller size read during a neighbour's burst does not end the cache."""
    *probed, memory = sorted(rates)
    cached = [size for size in probed if rates[size] >= CACHED_OVER_MEMORY * rates[memory]]
    return max(cached, default=None)


@functools.cache
def shared_cache_bytes(device: torch.device) -> int:
    """The shared cache this process can keep data in: a GPU's L2; on a CPU the largest buffer of doubling
    size, from twice a core's own cache to the reported last-level cache, that one core re-reads at
    least CACHED_OVER_MEMORY times faster than twice the reported size (module docstring). At most the
    reported size; a core's own cache where none reads faster than memory."""
    reported = last_level_cache_bytes(device)
    if device.type == "cuda":
        return reported
    private = warm_cache_bytes(device)
    largest = min(max(2 * reported, 4 * private), _PROBE_LIMIT)
    sizes = []
    size = 2 * private
    while size < largest:
        sizes.append(size)
        size *= 2
    sizes.append(largest)
    extent = cached_extent(read_rates(sizes))
    return min(reported, extent) if extent is not None else private


class CacheFlusher:
    """Writes over a buffer four times the shared cache this process can keep (:func:`shared_cache_bytes`:
    twice the first size that no longer stays), so the next sample starts with a cold cache."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty(4 * shared_cache_bytes(device), dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()
