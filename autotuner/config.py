"""The structured config: dataclasses registered in Hydra's ConfigStore, so a misspelt override fails at
composition, naming the key, before any work.

``configs/config.yaml`` is the root (it picks a launcher from ``configs/launcher/``); each launcher YAML
extends its schema here. Cases are not a config group: ``case=<name>`` names a YAML file in ``cases/``
or in ``case_dir`` (see autotuner.cases), loaded and validated by us.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ShapesConfig:
    """Shape sweep overrides; None takes the case's own list."""

    seq_len: list[int] | None = None
    micro_batch_size: list[int] | None = None


@dataclass
class TimingConfig:
    """Sampling of the get_data launcher: warm-up calls, then at least ``min_samples`` and until
    ``budget_s`` of sampling has passed or ``max_samples`` were taken."""

    warmup: int = 2
    min_samples: int = 5
    max_samples: int = 100
    budget_s: float = 1.0


@dataclass
class LauncherConfig:
    name: str = MISSING


@dataclass
class GetDataLauncherConfig(LauncherConfig):
    name: str = "get_data"


@dataclass
class NsysLauncherConfig(LauncherConfig):
    """``nsys profile`` around our worker (see autotuner.launchers.nsys).

    ``nsys_bin``: a name on the PATH or a path. ``trace``: the APIs nsys traces (``-t``); None takes the
    device's default (CUDA: cuda, nvtx, osrt, cublas, cudnn; CPU: nvtx, osrt), and it must hold nvtx.
    ``extra_args``: more ``nsys profile`` switches, each one list item (``--sample=process-tree``); one that
    names a switch the launcher sets by default replaces that default. ``warmup``/``iterations``: per
    phase, unmeasured then measured iterations (each measured one is one NVTX range, one sample).
    """

    name: str = "nsys"
    nsys_bin: str = "nsys"
    trace: list[str] | None = None
    extra_args: list[str] = field(default_factory=list)
    warmup: int = 2
    iterations: int = 5


@dataclass
class TorchProfilerLauncherConfig(LauncherConfig):
    """``torch.profiler`` around the same plan (autotuner.launchers.torch_profiler).

    Each (op, shape point) is one profiling session of ``wait + warmup + active`` training-like steps
    (forward then backward); only the ``active`` steps are recorded and give the row's statistics.
    ``output_dir`` (relative to the run directory) receives ``<point>/<op>/`` folders with the trace,
    stacks and operator tables; traces over ``compress_over_bytes`` are written as ``.json.gz``.
    """

    name: str = "torch_profiler"
    wait: int = 0
    warmup: int = 2
    active: int = 5
    record_shapes: bool = True
    profile_memory: bool = True
    with_stack: bool = True
    with_flops: bool = True
    memory_snapshot: bool = False
    compress_over_bytes: int = 20_000_000
    output_dir: str = "profiles"


@dataclass
class AutotunerConfig:
    """The root config. ``hf`` and ``tf`` hold overrides of the HF config and TransformerConfig fields
    (``hf.hidden_size=128``, ``tf.apply_rope_fusion=true``); both are checked against the real field names."""

    launcher: Any = MISSING
    case: str = "tiny"
    case_dir: str | None = None
    hf: dict[str, Any] = field(default_factory=dict)
    tf: dict[str, Any] = field(default_factory=dict)
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
    ops: list[str] = field(default_factory=lambda: ["all"])
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 1234
    transformer_block_layers: int = 2
    timing: TimingConfig = field(default_factory=TimingConfig)
    resume: bool = False
    progress: bool = True


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="autotuner_schema", node=AutotunerConfig)
    cs.store(group="launcher", name="get_data_schema", node=GetDataLauncherConfig)
    cs.store(group="launcher", name="nsys_schema", node=NsysLauncherConfig)
    cs.store(group="launcher", name="torch_profiler_schema", node=TorchProfilerLauncherConfig)
