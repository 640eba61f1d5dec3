"""The one naming scheme for profiler ranges (NVTX and ``record_function`` alike).

A range name reads well on the Nsight Systems / Perfetto timeline and parses back to the
measurement it belongs to::

    linear_qkv.forward [s256_b1] #3      measured iteration 3 of linear_qkv's forward at s=256, b=1
    linear_qkv.backward [s256_b1] #w0    warm-up iteration 0 (not part of any statistic)

Sub-op ranges inside a ``transformer_layer`` carry the same point and iteration as the layer's range,
so a reader can tell which measurement every range belongs to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PHASES = ("forward", "backward")

_RANGE_RE = re.compile(
    r"^(?P<op>[a-z0-9_]+)\.(?P<phase>forward|backward) "
    r"\[(?P<point>[^\]]+)\] #(?P<warmup>w?)(?P<iteration>\d+)$"
)


@dataclass(frozen=True)
class RangeName:
    """The parsed form of a range name."""

    op: str
    phase: str
    point: str
    iteration: int
    warmup: bool = False

    def __str__(self) -> str:
        mark = "w" if self.warmup else ""
        return f"{self.op}.{self.phase} [{self.point}] #{mark}{self.iteration}"


def format_range(op: str, phase: str, point: str, iteration: int, warmup: bool = False) -> str:
    """Build a range name; ``parse_range(format_range(...))`` gives the same fields back."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return str(RangeName(op, phase, point, iteration, warmup))


def parse_range(name: str) -> RangeName | None:
    """Parse a range name; None for ranges that are not ours (Megatron's own, NCCL's, ...)."""
    match = _RANGE_RE.match(name)
    if match is None:
        return None
    return RangeName(
        op=match["op"],
        phase=match["phase"],
        point=match["point"],
        iteration=int(match["iteration"]),
        warmup=bool(match["warmup"]),
    )
