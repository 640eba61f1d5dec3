"""The device's last-level cache: its size, and a flush that evicts it between samples.

On a GPU the last-level cache is L2 (``L2_cache_size`` of the device properties). On a CPU it is the
largest cache the kernel reports in sysfs (usually the shared L3); 32 MiB where nothing is reported.
"""

from __future__ import annotations

from pathlib import Path

import torch

_DEFAULT_CPU_CACHE = 32 * 2**20


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
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return max((size for size, _ in _cpu_caches()), default=_DEFAULT_CPU_CACHE)


def warm_cache_bytes(device: torch.device) -> int:
    """The cache a warm sample's data sits in between calls: a GPU's L2; on a CPU the largest cache one
    core has to itself (usually L2; the L3 it shares with the other cores is slower, so an op whose data
    comes from there inside a step runs slower than the warm row measured). 1 MiB where none is reported."""
    if device.type == "cuda":
        return last_level_cache_bytes(device)
    return max((size for size, private in _cpu_caches() if private), default=2**20)


class CacheFlusher:
    """Writes over a buffer twice the last-level cache, so the next sample starts with a cold cache."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty(2 * last_level_cache_bytes(device), dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()
