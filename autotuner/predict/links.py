"""The time of a collective over the links between GPUs (or CPU processes), from the calibrated bus
bandwidth: what the predictor charges for a collective no row measured (data-parallel gradient
reduction, the distributed optimizer's gathers, tensor-parallel collectives at an unmeasured point).

The model is the ring algorithm's, as NCCL's ring and nccl-tests' "bus bandwidth" define it. A
collective over ``n`` ranks on a buffer of ``B`` bytes (the all-reduced tensor, the gathered output, the
scattered input) makes every rank send ``f * B`` bytes over its link, with

* all-reduce: ``f = 2(n-1)/n`` (a reduce-scatter, then an all-gather);
* all-gather and reduce-scatter: ``f = (n-1)/n`` (each rank passes on the n-1 shards it does not own);
* send_recv, a pipeline stage's exchange (the buffer ``B`` is what each rank sends): ``f = 1``;

so at a bus bandwidth ``W`` the collective takes ``f * B / W``. ``W`` is the calibration's
``<collective>_bandwidth["<backend>:<n>"]`` (``torchrun --nproc-per-node=n -m autotuner.calibrate
collectives=true``: the bus bandwidth of its largest size, the plateau). Where the calibration also keeps
the times of its sizes (``collective_points``), those decide, as measured times of this link:

* between two calibrated sizes, the time is interpolated linearly in bytes (a collective's time is
  about affine in its size: a latency plus bytes over bandwidth; measured curves bend where caches or
  protocols change, which the points follow and one bandwidth would not);
* above the largest, its time plus the extra bytes at the plateau: ``t_max + f * (B - B_max) / W``;
* below the smallest, the latency that size paid beyond its bandwidth term, plus the rest of its time
  scaled by bytes: ``a + (t_min - a) * B / B_min`` with ``a = t_min - f * B_min / W``, which is
  ``a + f * B / W``, the bytes at the plateau; where the smallest size ran faster than the plateau's
  bandwidth gives (noise, or a size that fits a cache), ``a`` is 0 and the bytes go at that size's own
  rate, so that each calibrated size gets its own time back.

Bus bandwidth hardly depends on ``n`` for a ring on one kind of link, so a world size not calibrated
takes the nearest one calibrated on the same backend (its bandwidth, not its points); with nothing
calibrated, an assumed bandwidth (:data:`ASSUMED_BUS_BANDWIDTH`). Both are said in the figure's source
and warned about (:class:`LinkWarning`, which carries the gap as data: a prediction, and tune over its
shown layouts, says the gaps a line per bandwidth that stood in): such a time is never 0 and never
silent. Tree algorithms, NVLS/SHARP in-network reduction and the hierarchy of a multi-node ring
(intra-node NVLink, inter-node network) are not modelled: calibrate at the world size the job uses.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from autotuner.predict.layout import Source
from autotuner.results.calibration import COLLECTIVES, LINK_KEYS, bus_factor, link_key

# Bus bandwidths assumed where the calibration has none (bytes/s), stated in every figure that uses them.
# NCCL: a conservative figure for GPUs of one node (NVLink rings reach 150-450 GB/s of bus bandwidth in
# nccl-tests on A100/H100; PCIe Gen4 x16 about 20). gloo: TCP over loopback between CPU processes.
ASSUMED_BUS_BANDWIDTH = {"nccl": 100e9, "gloo": 1e9}

FORMULAS = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n", "send_recv": "1"}


@dataclass(frozen=True)
class LinkGap:
    """A collective timed without a calibration of its link: its bus bandwidth ``borrowed_from`` the
    nearest calibrated world size on the same backend, or (None) assumed."""

    kind: str
    world: int
    backend: str
    bandwidth: float
    borrowed_from: int | None = None


class LinkWarning(UserWarning):
    """A collective's time rests on an assumed or borrowed bandwidth, not a calibration of its link;
    ``gap`` says which, so that many of them can be said in a few lines (:func:`describe_gaps`)."""

    def __init__(self, message: str, gap: LinkGap) -> None:
        super().__init__(message)
        self.gap = gap


def _calibrate_command(worlds: list[int]) -> str:
    if len(worlds) == 1:
        return f"torchrun --nproc-per-node={worlds[0]} -m autotuner.calibrate collectives=true"
    sizes = ", ".join(map(str, worlds))
    return f"torchrun --nproc-per-node=N -m autotuner.calibrate collectives=true for N = {sizes}"


def describe_gaps(gaps: Iterable[LinkGap]) -> list[str]:
    """The gaps in a calibration's links, one line per bandwidth that stood in: a layout ranking of a
    thousand GPUs meets the same missing link at many world sizes and collectives, and a line for each
    pair buried the table's other warnings (tune printed six for Llama-2-7B on 64 GPUs)."""
    assumed: dict[tuple[str, float], list[LinkGap]] = {}
    borrowed: dict[tuple[str, int], list[LinkGap]] = {}
    for gap in dict.fromkeys(gaps):
        if gap.borrowed_from is None:
            assumed.setdefault((gap.backend, gap.bandwidth), []).append(gap)
        else:
            borrowed.setdefault((gap.backend, gap.borrowed_from), []).append(gap)
    lines = []
    for (backend, bandwidth), group in assumed.items():
        kinds = ", ".join(sorted({g.kind for g in group}))
        worlds = sorted({g.world for g in group})
        lines.append(
            f"{kinds} over {', '.join(map(str, worlds))} ranks: ASSUMED bus bandwidth {bandwidth / 1e9:.3g} "
            f"GB/s, the calibration has no {backend} entry for them; run {_calibrate_command(worlds)}"
        )
    for (backend, nearest), group in borrowed.items():
        lent = {g.kind: g.bandwidth for g in group}  # one lending size's bandwidth per collective
        kinds = ", ".join(sorted(lent))
        rates = ", ".join(f"{kind} {lent[kind] / 1e9:.3g} GB/s" for kind in sorted(lent))
        worlds = sorted({g.world for g in group})
        lines.append(
            f"{kinds} over {', '.join(map(str, worlds))} ranks: bus bandwidth borrowed from the calibration "
            f"at {link_key(backend, nearest)} ({rates}), none at these sizes; "
            f"run {_calibrate_command(worlds)}"
        )
    return lines


def backend_of(calibration: Mapping[str, Any] | None) -> str:
    """The backend a calibration's links use: NCCL for a GPU's, gloo for a CPU's; NCCL without one (the
    predictor's subject is GPU training)."""
    if calibration and calibration.get("device_type") == "cpu":
        return "gloo"
    return "nccl"


def _calibrated(calibration: Mapping[str, Any] | None, kind: str, backend: str) -> dict[int, float]:
    """{world size: bus bandwidth} the calibration holds for ``kind`` on ``backend``."""
    links = (calibration or {}).get(LINK_KEYS[kind]) or {}
    found = {}
    for key, bandwidth in links.items():
        name, _, world = key.partition(":")
        if name == backend and world.isdigit():
            found[int(world)] = float(bandwidth)
    return found


def _from_points(
    calibration: Mapping[str, Any], kind: str, key: str, nbytes: float, factor: float, bandwidth: float
) -> tuple[float, str] | None:
    """(seconds, how) from the calibrated sizes' times of ``key`` (module docstring); None without them."""
    timed = ((calibration.get("collective_points") or {}).get(kind) or {}).get(key)
    if not timed:
        return None
    points = sorted(zip(timed["bytes"], timed["seconds"], strict=True))
    where = f"calibration collective_points[{kind}][{key}]"
    (low_n, low_t), (high_n, high_t) = points[0], points[-1]
    if nbytes >= high_n:
        extra = factor * (nbytes - high_n) / bandwidth
        return (
            high_t + extra,
            f"{high_t * 1e6:.1f} us at {high_n} B + {factor:.3g} * {nbytes - high_n:.0f} B / "
            f"{bandwidth / 1e9:.3g} GB/s ({where}, {LINK_KEYS[kind]}[{key}])",
        )
    if nbytes <= low_n:
        latency = max(0.0, low_t - factor * low_n / bandwidth)
        return (
            latency + (low_t - latency) * nbytes / low_n,
            f"latency {latency * 1e6:.1f} us (of {low_n} B's {low_t * 1e6:.1f} us) + the rest of its time "
            f"x {nbytes:.0f} / {low_n} B ({where}; the rest is {factor:.3g} * bytes / {bandwidth / 1e9:.3g} "
            "GB/s where that size ran no faster than the plateau)",
        )
    for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
        if n0 <= nbytes <= n1:
            seconds = t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)
            return (
                seconds,
                f"interpolated between {t0 * 1e6:.1f} us at {n0} B and {t1 * 1e6:.1f} us at {n1} B ({where})",
            )
    return None


def collective_seconds(
    calibration: Mapping[str, Any] | None,
    kind: str,
    nbytes: int | float,
    world: int,
    backend: str | None = None,
) -> tuple[float, Source]:
    """Seconds one ``kind`` collective (all_reduce, all_gather, reduce_scatter) of ``nbytes`` (the full
    buffer) takes over ``world`` ranks, and where that came from (always ``modelled``: a formula over a
    calibrated, borrowed or assumed bandwidth; see the module docstring). ``backend`` defaults to the
    calibration's (:func:`backend_of`). One rank, or no bytes, communicates nothing: 0 seconds."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}: one of {', '.join(COLLECTIVES)}")
    if world < 1 or nbytes < 0:
        raise ValueError(f"a collective needs world >= 1 and nbytes >= 0, got world={world}, nbytes={nbytes}")
    if world == 1 or nbytes == 0:
        return 0.0, Source("modelled", f"{kind} over {world} rank(s) of {nbytes} B: nothing to send")
    backend = backend or backend_of(calibration)
    factor = bus_factor(kind, world)
    formula = f"ring {kind} {FORMULAS[kind]} * bytes / bus bandwidth"
    calibrated = _calibrated(calibration, kind, backend)
    if world in calibrated:
        key = link_key(backend, world)
        bandwidth = calibrated[world]
        found = _from_points(calibration or {}, kind, key, nbytes, factor, bandwidth)
        if found is not None:
            return found[0], Source("modelled", f"{kind} of {nbytes:.0f} B over {world} ranks: {found[1]}")
        detail = (
            f"{formula}: {factor:.3g} * {nbytes:.0f} B / {bandwidth / 1e9:.3g} GB/s "
            f"(calibration {LINK_KEYS[kind]}[{key}])"
        )
        return factor * nbytes / bandwidth, Source("modelled", detail)
    fix = _calibrate_command([world])
    nearest = None
    if calibrated:
        # The nearest world size by ratio (bus bandwidth is about flat in n): 8 is nearer 4 than 16 is.
        nearest = min(calibrated, key=lambda n: (abs(math.log(n / world)), -n))
        bandwidth = calibrated[nearest]
        why = (
            f"bus bandwidth {bandwidth / 1e9:.3g} GB/s borrowed from calibration "
            f"{LINK_KEYS[kind]}[{link_key(backend, nearest)}], none at {link_key(backend, world)}: run {fix}"
        )
    else:
        bandwidth = ASSUMED_BUS_BANDWIDTH.get(backend, ASSUMED_BUS_BANDWIDTH["nccl"])
        why = (
            f"ASSUMED bus bandwidth {bandwidth / 1e9:.3g} GB/s: the calibration has no {backend} {kind} "
            f"entry; run {fix}"
        )
    gap = LinkGap(kind, world, backend, bandwidth, nearest)
    warnings.warn(LinkWarning(f"{kind} over {world} ranks: {why}", gap), stacklevel=2)
    detail = f"{formula}: {factor:.3g} * {nbytes:.0f} B / {bandwidth / 1e9:.3g} GB/s ({why})"
    return factor * nbytes / bandwidth, Source("modelled", detail)
