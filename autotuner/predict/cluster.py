"""A cluster: nodes of GPUs and the links inside a node and between nodes, read from a file or a preset.

The file (JSON, checked against :class:`ClusterFile`; docs/cluster_model.md) says, each figure with where
it comes from::

    {"name": "dgx_h100", "gpus_per_node": 8, "nodes": null,
     "intra_node": {"bandwidth": 4.5e11, "latency": 3.4e-6, "bandwidth_source": "...",
                    "latency_source": "..."},
     "inter_node": {"nic_bandwidth": 5e10, "nics_per_node": 8, "latency": 1.4e-5, "bandwidth_source": "...",
                    "latency_source": "..."},
     "base_latency": 8.4e-6, "base_latency_source": "...",
     "measured": {"intra_node": {"all_reduce": {"ranks": 8, "bus_bandwidth": ..., "latency": ...,
                                                "bytes": [...], "seconds": [...]}, ...}, "inter_node": {...}}}

``bandwidth`` is what one GPU sends each way over that level (bytes/s; NVLink 4's 900 GB/s both ways is
450e9), ``latency`` the time one step of a ring over that level adds, ``base_latency`` what any
collective pays once. Between nodes a GPU's share is ``nic_bandwidth * nics_per_node / gpus_per_node``.
``nodes`` may be absent (a kind of machine, as the presets are): then as many as a layout needs.
``measured`` is what ``autotuner-calibrate links=true`` timed on the machine it ran on, per level and
collective: an affine fit of time against bytes (latency + bytes x bus factor / bus bandwidth, as
nccl-tests defines bus bandwidth) and the points it was fitted to; where present it prices that
collective at that level in place of the link's nominal figures (autotuner.predict.collectives).
``inter_node`` is absent in a file measured on one node: a layout that crosses nodes is then refused.

The presets (``autotuner/predict/clusters/*.json``, ``cluster=dgx_h100``) hold the machines' published link
rates and NCCL's own latency constants, each with its source: nominal figures, which nccl-tests reaches
only in part, so a prediction from a preset says so; a measured file replaces them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from autotuner.errors import UserError, schema_problem

PRESET_DIR = Path(__file__).resolve().parent / "clusters"
LEVELS = ("intra_node", "inter_node")
# The collectives a cluster's links price (autotuner.predict.collectives) and calibrate links=true measures.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
_FIX = "give a preset (cluster=dgx_h100) or a file autotuner-calibrate links=true wrote"

_Rate = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_Text = Annotated[str, Field(min_length=1)]


class _IntraNode(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    bandwidth: _Rate
    latency: _Seconds
    bandwidth_source: _Text
    latency_source: _Text


class _InterNode(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    nic_bandwidth: _Rate
    nics_per_node: Annotated[int, Field(ge=1)]
    latency: _Seconds
    bandwidth_source: _Text
    latency_source: _Text


class _Fit(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    ranks: Annotated[int, Field(ge=2)]
    bus_bandwidth: _Rate
    latency: _Seconds
    worst_error: _Seconds = 0.0  # the fit's largest |fit / measured - 1| over its sizes
    bytes: Annotated[list[_Rate], Field(min_length=2)]
    seconds: Annotated[list[_Rate], Field(min_length=2)]

    @model_validator(mode="after")
    def _paired(self) -> _Fit:
        if len(self.bytes) != len(self.seconds):
            raise ValueError(
                f"has {len(self.bytes)} bytes and {len(self.seconds)} seconds: one each per size"
            )
        return self


class ClusterFile(BaseModel):
    """The schema of a cluster file (module docstring). Strict: JSON types, nothing coerced."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: _Text
    description: str = ""
    gpus_per_node: Annotated[int, Field(ge=1)]
    nodes: Annotated[int, Field(ge=1)] | None = None
    intra_node: _IntraNode
    inter_node: _InterNode | None = None
    base_latency: _Seconds
    base_latency_source: _Text
    measured: dict[Literal[LEVELS], dict[Literal[KINDS], _Fit]] = {}  # type: ignore[valid-type]
    measured_on: dict[str, Any] = {}  # where and when calibrate links=true ran (host, backend, date, ...)


@dataclass(frozen=True)
class Link:
    """One level of the cluster: what one GPU sends each way over it (bytes/s), the time a ring's step
    over it adds (s), and where both figures come from."""

    bandwidth: float
    latency: float
    bandwidth_source: str
    latency_source: str


@dataclass(frozen=True)
class Fit:
    """A collective timed at one level by ``autotuner-calibrate links=true``: ``ranks`` of that level, the
    fitted latency (s) and bus bandwidth (bytes/s), and the sizes and times fitted."""

    ranks: int
    bus_bandwidth: float
    latency: float
    points: tuple[tuple[float, float], ...]
    worst_error: float = 0.0


@dataclass(frozen=True)
class Cluster:
    """A cluster's links (module docstring); ``origin`` names the preset or the file."""

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link | None
    nics_per_node: int | None
    base_latency: float
    base_latency_source: str
    origin: str
    nodes: int | None = None
    measured: Mapping[tuple[str, str], Fit] = field(default_factory=dict)

    @property
    def nominal(self) -> bool:
        """Whether the links are published rates (a preset) rather than measured ones."""
        return not self.measured

    def link(self, level: str) -> Link:
        """The link of ``level``; UserError (one line) for a crossing of nodes the file did not measure."""
        if level == "intra_node":
            return self.intra
        if self.inter is None:
            raise UserError(
                f"cluster {self.origin} has no inter_node link (it was measured on one node), and the "
                "layout's groups cross nodes: run autotuner-calibrate links=true on two nodes or more, or "
                "give a preset (cluster=dgx_h100)"
            )
        return self.inter

    def nodes_for(self, gpus: int) -> int:
        """The nodes a layout of ``gpus`` GPUs occupies; UserError where the cluster has fewer."""
        needed = math.ceil(gpus / self.gpus_per_node)
        if self.nodes is not None and needed > self.nodes:
            raise UserError(
                f"{gpus} GPUs need {needed} nodes of {self.gpus_per_node}, and cluster {self.origin} has "
                f"{self.nodes}: give fewer GPUs or a larger cluster"
            )
        return needed

    def describe(self) -> str:
        """One line: the cluster, its links and whether they are measured or published."""
        inter = (
            f"{self.inter.bandwidth / 1e9:.4g} GB/s a GPU between nodes ({self.nics_per_node} NICs a node), "
            f"{self.inter.latency * 1e6:.3g} us a step"
            if self.inter
            else "no link between nodes"
        )
        how = (
            f"measured ({', '.join(f'{level} {kind}' for level, kind in self.measured)})"
            if self.measured
            else "published rates, which nccl-tests reaches only in part: measure them with "
            "autotuner-calibrate links=true"
        )
        return (
            f"cluster {self.origin}: {self.gpus_per_node} GPUs a node, {self.intra.bandwidth / 1e9:.4g} GB/s "
            f"a GPU inside a node ({self.intra.latency * 1e6:.3g} us a step), {inter}, "
            f"{self.base_latency * 1e6:.3g} us a collective; {how}"
        )

    def to_json(self) -> dict[str, Any]:
        return {"origin": self.origin, "name": self.name, "description": self.describe()}


def presets() -> tuple[str, ...]:
    """The names of the shipped cluster presets (``dgx_h100``, ...)."""
    return tuple(sorted(path.stem for path in PRESET_DIR.glob("*.json")))


def from_file_data(data: Mapping[str, Any], origin: str) -> Cluster:
    """A :class:`Cluster` from a file's data already checked against :class:`ClusterFile`."""
    intra = data["intra_node"]
    inter = data.get("inter_node")
    measured = {
        (level, kind): Fit(
            fit["ranks"],
            fit["bus_bandwidth"],
            fit["latency"],
            tuple(zip(fit["bytes"], fit["seconds"], strict=True)),
        )
        for level, kinds in (data.get("measured") or {}).items()
        for kind, fit in kinds.items()
    }
    per_gpu = (
        Link(
            inter["nic_bandwidth"] * inter["nics_per_node"] / data["gpus_per_node"],
            inter["latency"],
            f"{inter['nics_per_node']} NICs x {inter['nic_bandwidth'] / 1e9:.4g} GB/s / "
            f"{data['gpus_per_node']} GPUs ({inter['bandwidth_source']})",
            inter["latency_source"],
        )
        if inter
        else None
    )
    return Cluster(
        name=data["name"],
        gpus_per_node=data["gpus_per_node"],
        intra=Link(intra["bandwidth"], intra["latency"], intra["bandwidth_source"], intra["latency_source"]),
        inter=per_gpu,
        nics_per_node=inter["nics_per_node"] if inter else None,
        base_latency=data["base_latency"],
        base_latency_source=data["base_latency_source"],
        origin=origin,
        nodes=data.get("nodes"),
        measured=measured,
    )


def check(data: Any, where: str) -> None:
    """UserError (one line naming ``where``, the field and the fix) for data that is not a cluster file."""
    if not isinstance(data, dict):
        raise UserError(f"cluster file {where} holds no JSON object: {_FIX}")
    try:
        ClusterFile.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"cluster file {where}: {schema_problem(exc)}: {_FIX}") from None
    if data.get("nodes") and data["nodes"] > 1 and not data.get("inter_node"):
        raise UserError(f"cluster file {where}: nodes={data['nodes']} and no inter_node link: {_FIX}")


def load(given: str | Path) -> Cluster:
    """A cluster by preset name or file path; UserError (one line) for what cannot be read or checked. A
    name that is both a preset and a file here is refused (give ``./name`` for the file)."""
    name = str(given)
    if name in presets():
        if Path(name).exists():
            raise UserError(
                f"cluster {name} names both the preset {name} and the file ./{name}: give ./{name} for the "
                "file"
            )
        path, origin = PRESET_DIR / f"{name}.json", f"preset {name}"
    else:
        path, origin = Path(given), str(given)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UserError(
            f"cannot read the cluster file {path} ({why}): {_FIX}; presets: {', '.join(presets())}"
        ) from exc
    check(data, str(path))
    return from_file_data(data, origin)


def bus_factor(kind: str, ranks: int) -> float:
    """Bytes a rank sends per byte of a collective's buffer (nccl-tests' bus factor): all-reduce 2(n-1)/n,
    all-gather, reduce-scatter and all-to-all (n-1)/n, a pairwise exchange 1."""
    if kind == "send_recv":
        return 1.0
    return (2.0 if kind == "all_reduce" else 1.0) * (ranks - 1) / ranks


def fit(kind: str, ranks: int, sizes: list[float], seconds: list[float]) -> dict[str, Any]:
    """The fit of ``seconds`` against ``sizes`` of one collective over ``ranks``: time = latency + bus
    factor x bytes / bus bandwidth, least squares of the relative error (each size weighs alike, so the
    small sizes set the latency and the large ones the bandwidth), the latency at least 0 (refitted
    through the origin where the free fit's is negative); ``worst_error``: the largest |fit / measured -
    1| over the sizes, the rule's error at them. ValueError where the times do not grow with the bytes."""
    x = [bus_factor(kind, ranks) * b for b in sizes]
    w = [1 / (t * t) for t in seconds]
    sw, sx, st = (
        sum(w),
        sum(wi * xi for wi, xi in zip(w, x, strict=True)),
        sum(wi * t for wi, t in zip(w, seconds, strict=True)),
    )
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x, strict=True))
    sxt = sum(wi * xi * t for wi, xi, t in zip(w, x, seconds, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / det if det else 0.0
    latency = (st - slope * sx) / sw
    if latency < 0:
        latency, slope = 0.0, sxt / sxx
    if slope <= 0 or len(x) < 2:
        raise ValueError(f"{kind} over {ranks} ranks: its times {seconds} do not grow with its sizes {sizes}")
    worst = max(abs((latency + slope * xi) / t - 1) for xi, t in zip(x, seconds, strict=True))
    return {
        "ranks": ranks,
        "bus_bandwidth": 1 / slope,
        "latency": latency,
        "worst_error": worst,
        "bytes": sizes,
        "seconds": seconds,
    }


def measured_file(
    measured: Mapping[str, Mapping[str, Mapping[str, Any]]],
    gpus_per_node: int,
    nodes: int,
    measured_on: Mapping[str, Any],
    base: Cluster | None = None,
) -> dict[str, Any]:
    """A cluster file of what autotuner-calibrate links=true measured (``{level: {kind: {"ranks", "bytes",
    "seconds"}}}``): each collective's fit per level, and each level's link from its all-reduce's fit (a
    ring step's latency, its bus bandwidth a GPU's); a level not measured taken from ``base`` (a preset),
    else refused (ValueError naming it)."""
    fits = {
        level: {
            kind: fit(kind, m["ranks"], list(m["bytes"]), list(m["seconds"])) for kind, m in kinds.items()
        }
        for level, kinds in measured.items()
    }
    where = f"measured by autotuner-calibrate links=true on {measured_on.get('host', 'this machine')}"
    where += f" ({measured_on.get('backend', '?')}, {measured_on.get('date', '?')})"

    def from_fit(level: str) -> tuple[float, float, str]:
        kind = "all_reduce" if "all_reduce" in fits[level] else next(iter(fits[level]))
        f = fits[level][kind]
        steps = 2 * (f["ranks"] - 1) if kind == "all_reduce" else f["ranks"] - 1
        how = f"{where}: the {kind} over {f['ranks']} ranks, fitted to {len(f['bytes'])} sizes"
        return f["bus_bandwidth"], f["latency"] / max(1, steps), how

    data: dict[str, Any] = {
        "name": f"measured-{measured_on.get('host', 'cluster')}",
        "description": f"{nodes} node(s) of {gpus_per_node} ranks, {where}",
        "gpus_per_node": gpus_per_node,
        "nodes": nodes,
        "base_latency": base.base_latency if base else 0.0,
        "base_latency_source": base.base_latency_source
        if base
        else "none beside the measured latencies, which hold it",
        "measured": fits,
        "measured_on": dict(measured_on),
    }
    for level in LEVELS:
        if level in fits:
            bandwidth, latency, how = from_fit(level)
            link = {
                "bandwidth": bandwidth,
                "latency": latency,
                "bandwidth_source": how,
                "latency_source": how,
            }
            if level == "inter_node":  # a GPU's share, measured: one NIC's worth a GPU
                link = {"nic_bandwidth": bandwidth, "nics_per_node": gpus_per_node, **link}
                link["bandwidth_source"] += " (a GPU's share, written as one NIC a GPU)"
                del link["bandwidth"]
        elif base is not None and (level == "intra_node" or base.inter is not None):
            nominal = base.link(level)
            link = {
                "bandwidth": nominal.bandwidth,
                "latency": nominal.latency,
                "bandwidth_source": f"{base.origin}: {nominal.bandwidth_source}",
                "latency_source": f"{base.origin}: {nominal.latency_source}",
            }
            if level == "inter_node":
                link = {"nic_bandwidth": nominal.bandwidth, "nics_per_node": gpus_per_node, **link}
                del link["bandwidth"]
        elif level == "inter_node" and nodes == 1:
            continue
        else:
            raise ValueError(
                f"no {level} link was measured ({gpus_per_node} rank(s) a node, {nodes} node(s)): give "
                "cluster=PRESET for the figures not measured"
            )
        data[level] = link
    return data
