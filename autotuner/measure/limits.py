"""How much memory this process can hold, and whether the kernel's out-of-memory killer struck.

* On a CPU a process can grow by what the system has available (``MemAvailable`` of /proc/meminfo: free
  memory plus the page cache and slabs the kernel can reclaim) and by what its memory cgroup still allows
  (v2: ``memory.max`` less ``memory.current``; v1: ``memory.limit_in_bytes`` less
  ``memory.usage_in_bytes``; in both, less the cgroup's inactive file cache, which the kernel reclaims
  before it kills): the smaller of the two. The most the process can hold is that plus its own resident
  set (:func:`memory_limit`).
* On a GPU: ``torch.cuda.mem_get_info``'s free memory plus what this process's caching allocator already
  reserved (``max_memory_allocated``, which the estimates are compared with, counts inside it).
* The OOM killer: it counts its kills in ``oom_kill`` of the cgroup's ``memory.events`` (v2) or
  ``memory.oom_control`` (v1) and of /proc/vmstat (the whole system; since Linux 4.13).
  :func:`oom_kills` reads them, so a launcher can tell, around a child that died by SIGKILL, whether the
  kernel killed it for memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 and v2 write "no limit" as a number near 2^63 or as "max"
_NO_LIMIT = 2**60


def _fields(path: Path) -> dict[str, int]:
    """``name value`` lines of a kernel file as a dict; empty when the file cannot be read."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            found[parts[0]] = int(parts[1]) * (1024 if parts[-1] == "kB" else 1)
    return found


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class Cgroup:
    """This process's memory cgroup: its folder and version (1 or 2)."""

    path: Path
    version: int

    @property
    def room(self) -> int | None:
        """Bytes the cgroup still allows (limit less usage less its inactive file cache); None: no limit."""
        if self.version == 2:
            limit, usage = _number(self.path / "memory.max"), _number(self.path / "memory.current")
        else:
            limit = _number(self.path / "memory.limit_in_bytes")
            usage = _number(self.path / "memory.usage_in_bytes")
        if limit is None or usage is None or limit >= _NO_LIMIT:
            return None
        stat = _fields(self.path / "memory.stat")
        reclaimable = stat.get("inactive_file", stat.get("total_inactive_file", 0))
        return max(0, limit - max(0, usage - reclaimable))

    @property
    def oom_kills(self) -> int:
        events = "memory.events" if self.version == 2 else "memory.oom_control"
        return _fields(self.path / events).get("oom_kill", 0)


def memory_cgroup(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> Cgroup | None:
    """The memory cgroup /proc/self/cgroup names (v1's ``memory`` controller, else v2's unified one)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # v1 first: on a hybrid system its controller is the one that limits memory
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = root / "memory" / path.lstrip("/")
            if folder.is_dir():
                return Cgroup(folder, 1)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            for base in (root, root / "unified"):
                folder = base / path.lstrip("/")
                if (folder / "memory.current").is_file():
                    return Cgroup(folder, 2)
    return None


def resident_bytes(pid: int | str = "self") -> int:
    """The process's resident set (VmRSS); 0 where /proc has none."""
    return _fields(Path(f"/proc/{pid}/status")).get("VmRSS", 0)


def peak_resident_bytes(pid: int | str = "self") -> int:
    """The process's highest resident set so far (VmHWM); 0 where /proc has none."""
    return _fields(Path(f"/proc/{pid}/status")).get("VmHWM", 0)


@dataclass(frozen=True)
class MemoryLimit:
    """The most this process can hold (bytes), and where the bound comes from, in words."""

    bytes: int
    source: str


def memory_limit(device: torch.device) -> MemoryLimit:
    """The most memory this process can hold on ``device`` now (module docstring)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        return MemoryLimit(free + held, f"GPU free memory ({total / 2**30:.1f} GiB in all)")
    held = resident_bytes()
    available = _fields(Path("/proc/meminfo")).get("MemAvailable")
    cgroup = memory_cgroup()
    room = cgroup.room if cgroup is not None else None
    if available is None and room is None:
        return MemoryLimit(_NO_LIMIT, "no limit found (/proc/meminfo unreadable, no memory cgroup)")
    if room is not None and (available is None or room < available):
        return MemoryLimit(held + room, f"the memory cgroup's limit ({cgroup.path})")
    return MemoryLimit(held + int(available or 0), "the system's available memory (MemAvailable)")


def oom_kills() -> int:
    """The kernel's count of OOM kills that concern this process: its memory cgroup's, plus the system's
    (/proc/vmstat), so that a kill by either shows as a rise."""
    cgroup = memory_cgroup()
    system = _fields(Path("/proc/vmstat")).get("oom_kill", 0)
    return system + (cgroup.oom_kills if cgroup is not None else 0)
