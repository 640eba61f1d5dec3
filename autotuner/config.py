"""The structured config: dataclasses registered in Hydra's ConfigStore, so a misspelt override fails at
composition, naming the key, before any work.

``configs/config.yaml`` is the root (it picks a launcher from ``configs/launcher/``); each launcher YAML
extends its schema here. Cases are not a config group: ``case=<name>`` names a YAML file in ``cases/``
or in ``case_dir`` (see autotuner.model.cases), loaded and validated by us.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from autotuner import shipped_folder
from autotuner.errors import UserError
from autotuner.measure.timer import SamplingPolicy

CONFIG_DIR = shipped_folder("configs")  # the repository's configs/, carried by the wheel too


@dataclass
class Pow2Dim:
    min_power: int | None = None
    max_power: int | None = None


@dataclass
class Pow2Shapes:
    seq_len: Pow2Dim = field(default_factory=Pow2Dim)
    micro_batch_size: Pow2Dim = field(default_factory=Pow2Dim)


@dataclass
class SweepDim:
    values: list[int] | None = None
    start: int | None = None
    stop: int | None = None
    step: int | None = None
    multiple_of: int | None = None


@dataclass
class SweepShapes:
    seq_len: SweepDim = field(default_factory=SweepDim)
    micro_batch_size: SweepDim = field(default_factory=SweepDim)


@dataclass
class FuzzDim:
    min: int | None = None
    max: int | None = None
    multiple_of: int | None = None


@dataclass
class FuzzShapes:
    n: int | None = None
    seed: int | None = None
    seq_len: FuzzDim = field(default_factory=FuzzDim)
    micro_batch_size: FuzzDim = field(default_factory=FuzzDim)


@dataclass
class ShapesConfig:
    """The shape sweep (autotuner.runner.shapes). Every key left unset (None) takes the case's value; the
    case's ``shapes:`` block has the same keys. ``generator``: explicit (default), pow2, sweep or fuzz."""

    generator: str | None = None
    seq_len: list[int] | None = None
    micro_batch_size: list[int] | None = None
    pow2: Pow2Shapes = field(default_factory=Pow2Shapes)
    sweep: SweepShapes = field(default_factory=SweepShapes)
    fuzz: FuzzShapes = field(default_factory=FuzzShapes)


@dataclass
class TimingConfig(SamplingPolicy):
    """Sampling of the get_data launcher: the sampler's policy (autotuner.measure.timer.SamplingPolicy,
    whose docstring and module explain each field and guard) plus the guards around it.

    ``flush_cache`` evicts the last-level cache before every sample; otherwise ``rotate_inputs`` cycles
    copies of inputs that fit in it. ``idle_before_ms`` pauses (sleeps, the device idle) that long before
    every sample, which is then one call: the op as it runs after a wait (a pipeline stage's first op after
    its neighbour's hand-over; autotuner.measure.timer); 0, the default, pauses never.
    ``forward_after_backward`` runs the op's backward, untimed, after every forward sample, so that each
    sample follows one, as each forward of an op in a training step follows its previous micro-batch's
    backward (autotuner.measure.timer); the rows record it. False, the default, times forwards back to
    back, as torch.utils.benchmark does.
    ``held_activations_mib`` keeps earlier calls' forward graphs (their outputs and saved activations) alive
    while each sample runs, at least that many MiB of them (whole graphs, at most 256), as a step holds its
    micro-batches' activations until their backward: each forward writes, and each backward reads, memory
    as far from the cache as the step's are (autotuner.measure.timer, "Activations a step holds"); a forward
    sample then follows the backward of the oldest held graph. The rows record the bytes held
    (``held_activation_bytes``); the predictor takes rows timed without where it has them. 0, the
    default: each sample finds only its own.
    ``threads``: torch intra-op threads (0 keeps torch's default); the rows record the number used.
    ``cuda_graph`` (CUDA only) times phases whose eager call is shorter than ``cuda_graph_below_us`` as
    CUDA-graph replays, without host launch overhead (autotuner.measure.graphs); the rows say which were.
    ``hide_launch`` (CUDA only) queues a spin kernel before each sample so the sample's kernels are queued
    before its start event runs (autotuner.measure.timer); the rows record it in ``launch_hidden``.
    """

    hide_launch: bool = True
    flush_cache: bool = False
    idle_before_ms: float = 0.0
    forward_after_backward: bool = False
    held_activations_mib: float = 0.0
    rotate_inputs: bool = True
    threads: int = 0
    cuda_graph: bool = False
    cuda_graph_below_us: float = 200.0


@dataclass
class MoeConfig:
    """Mixture-of-Experts settings (autotuner.model.routing). ``routing``: where the router output of the
    MoE ops comes from: learned (the model's seeded router), uniform, balanced or zipf (forced);
    ``zipf_s``: the zipf mode's exponent (expert i drawn with weight 1 / (i + 1) ** zipf_s, above 0)."""

    routing: str = "learned"
    zipf_s: float = 1.2


@dataclass
class LauncherConfig:
    name: str = MISSING


@dataclass
class GetDataLauncherConfig(LauncherConfig):
    name: str = "get_data"


@dataclass
class NsysLauncherConfig(LauncherConfig):
    """``nsys profile`` around our worker (see autotuner.launchers.nsys).

    ``nsys_bin``: a path, or a name; the default ``nsys`` is looked for on the PATH, then in the project's
    ``.tools``, then in the CUDA and Nsight Systems folders, newest first (autotuner.launchers.nsys).
    ``trace``: the APIs nsys traces (``-t``); None takes the device's default (CUDA: cuda, nvtx, osrt,
    cublas, cudnn; CPU: nvtx, osrt), and it must hold nvtx.
    ``extra_args``: more ``nsys profile`` switches, each one list item (``--sample=process-tree``); one that
    names a switch the launcher sets by default replaces that default. ``warmup``/``iterations``: per
    phase, unmeasured then measured iterations (each measured one is one NVTX range, one sample).
    ``sub_op_ranges``: give the sub-ops of the op being measured their ranges too (nested in its range
    on the timeline, at a small cost inside its time); false marks the measured op alone.
    ``start_timeout_s``: how long nsys may take to start the worker (its Python, torch imported) before it
    is killed and the run refused in one line: an nsys that never starts its program would wait for ever.
    """

    name: str = "nsys"
    nsys_bin: str = "nsys"
    trace: list[str] | None = None
    extra_args: list[str] = field(default_factory=list)
    warmup: int = 2
    iterations: int = 5
    sub_op_ranges: bool = True
    start_timeout_s: float = 300.0


@dataclass
class TorchProfilerLauncherConfig(LauncherConfig):
    """``torch.profiler`` around the same plan (autotuner.launchers.torch_profiler).

    Per (op, shape point), sessions of ``wait + warmup + active`` training-like steps (forward then
    backward); only the ``active`` steps are recorded and give the row's statistics (``active`` >= 1).
    ``record_shapes``/``profile_memory``/``with_stack``/``with_flops`` set what the detailed session
    records for the trace, stacks and tables. ``lean_timing``: take the row's times from a separate
    session that records only the ranges and operators (true), or from the detailed one, its recording
    overhead included (false). ``memory_snapshot`` (GPU only): a CUDA allocator snapshot per op and point.
    ``output_dir`` (relative to the run directory) receives ``<point>/<op>/`` folders; traces over
    ``compress_over_bytes`` are written as ``.json.gz``.
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
    lean_timing: bool = True


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
    moe: MoeConfig = field(default_factory=MoeConfig)
    resume: bool = False
    # resume=true into a run another autotuner version or environment measured (environment.json): false
    # refuses in one line; true measures the rest, each new row naming its environment (measured_by)
    resume_across_versions: bool = False
    calibration: str | None = None
    progress: bool = True
    report: bool = True  # write report.html and its figures into the run directory (autotuner.report)
    capture: str | None = None  # a python -m autotuner.capture file: profile its calls (capture/replay.py)
    # run the rows whose estimated peak memory is over what the process can hold (the fit check refuses
    # them: autotuner.runner.fit, docs/memory_and_fit.md)
    run_unfit: bool = False
    # the most memory (GiB) the fit check lets a measuring process hold: the smaller of this and what the
    # device has (None: what the device has; autotuner.runner.fit.run_limit)
    memory_limit_gib: float | None = None
    dry_run: bool = (
        False  # print the plan, parameter counts, FLOPs, bytes and memory; run nothing (runner/dry_run.py)
    )


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="autotuner_schema", node=AutotunerConfig)
    cs.store(group="launcher", name="get_data_schema", node=GetDataLauncherConfig)
    cs.store(group="launcher", name="nsys_schema", node=NsysLauncherConfig)
    cs.store(group="launcher", name="torch_profiler_schema", node=TorchProfilerLauncherConfig)


def open_dict_overrides(argv: list[str]) -> list[str]:
    """``hf.<field>=`` and ``tf.<field>=`` set fields the root schema cannot list (they depend on the
    model); Hydra's ``++`` adds-or-sets them. Their names are validated against the real HF config and
    TransformerConfig fields by autotuner.runner.spec, so a typo is still an error."""
    return [f"++{arg}" if arg.startswith(("hf.", "tf.")) and "=" in arg else arg for arg in argv]


def short_error(exc: BaseException) -> str:
    """Hydra's or OmegaConf's error in one line: its first lines, without their hints about debugging."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [
        line
        for line in lines
        if not line.startswith(("Set the environment variable", "full_key", "object_type", "reference_type"))
    ]
    return "; ".join(lines[:3]) or type(exc).__name__


def _why(exc: BaseException) -> str:
    """Hydra's error and what it was caused by ("Error merging override ops=x" says which, not why), with
    the fix where it is plain: a single value given for a list setting."""
    said, root = short_error(exc), exc
    while root.__cause__ is not None:
        root = root.__cause__
    if root is not exc:
        said += f": {short_error(root).rstrip('.')}"
    merging = re.search(r"Error merging override ([^=\s]+)=(\S*)", str(exc))
    if merging and "is not a ListConfig" in str(root):
        said += f": give a list, e.g. {merging[1]}=[{merging[2]}]"
    return said


def compose_config(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """Compose the config for one job's overrides without running it (the command line's checks, tests,
    benchmarks); ``with_hydra`` keeps Hydra's own node (where the run goes). Raises UserError for an
    unknown launcher or a bad override."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    overrides = open_dict_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides, return_hydra_config=with_hydra)
    except MissingConfigException as exc:
        if any(o.split("=", 1)[0].lstrip("+") == "launcher" for o in overrides):
            raise UserError(
                f"unknown launcher in {overrides}: use launcher=get_data, nsys or torch_profiler"
            ) from exc
        raise UserError(f"config not found: {short_error(exc)}") from exc
    except (HydraException, OmegaConfBaseException) as exc:
        raise UserError(f"bad override: {_why(exc)}: see python -m autotuner.main --help") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:  # a config file of the user's (--config-dir)
        mark = getattr(exc, "problem_mark", None)
        where = f" ({mark.name}, line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"a config file is not valid YAML: {problem}{where}: fix the file") from exc
    finally:
        GlobalHydra.instance().clear()
