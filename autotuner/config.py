"""The structured config: dataclasses registered in Hydra's ConfigStore, so a misspelt override fails at
composition, naming the key, before any work.

``configs/config.yaml`` is the root (it picks a launcher from ``configs/launcher/``); each launcher YAML
extends its schema here. Cases are not a config group: ``case=<name>`` names a YAML file in ``cases/``
or in ``case_dir`` (see autotuner.model.cases), loaded and validated by us.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from autotuner import shipped_folder
from autotuner.cli import setting, settings_help
from autotuner.errors import UserError
from autotuner.measure.timer import SamplingPolicy

CONFIG_DIR = shipped_folder("configs")  # the repository's configs/, carried by the wheel too


@dataclass
class Pow2Dim:
    min_power: int | None = setting(None, "with generator=pow2: the smallest size is 2**min_power", "N")
    max_power: int | None = setting(None, "with generator=pow2: the largest size is 2**max_power", "N")


@dataclass
class Pow2Shapes:
    seq_len: Pow2Dim = setting(Pow2Dim, "")
    micro_batch_size: Pow2Dim = setting(Pow2Dim, "")


@dataclass
class SweepDim:
    values: list[int] | None = setting(None, "with generator=sweep: these sizes, else start..stop", "[N,...]")
    start: int | None = setting(None, "with generator=sweep: the first size", "N")
    stop: int | None = setting(None, "with generator=sweep: the last size (included)", "N")
    step: int | None = setting(None, "with generator=sweep: the step from one size to the next", "N")
    multiple_of: int | None = setting(None, "with generator=sweep: keep only multiples of N", "N")


@dataclass
class SweepShapes:
    seq_len: SweepDim = setting(SweepDim, "")
    micro_batch_size: SweepDim = setting(SweepDim, "")


@dataclass
class FuzzDim:
    min: int | None = setting(None, "with generator=fuzz: the smallest size drawn", "N")
    max: int | None = setting(None, "with generator=fuzz: the largest size drawn", "N")
    multiple_of: int | None = setting(None, "with generator=fuzz: draw multiples of N only", "N")


@dataclass
class FuzzShapes:
    n: int | None = setting(None, "with generator=fuzz: how many shape points to draw", "N")
    seed: int | None = setting(None, "with generator=fuzz: the draw's seed (default: the run's seed)", "N")
    seq_len: FuzzDim = setting(FuzzDim, "")
    micro_batch_size: FuzzDim = setting(FuzzDim, "")


_CASE = " (default: the case's own)"


@dataclass
class ShapesConfig:
    """The shape sweep (autotuner.runner.shapes). Every key left unset (None) takes the case's value; the
    case's ``shapes:`` block has the same keys."""

    generator: str | None = setting(None, f"explicit (the lists below), pow2, sweep or fuzz{_CASE}", "NAME")
    seq_len: list[int] | None = setting(
        None, f"sequence lengths, each a shape point with each batch{_CASE}", "[S,...]"
    )
    micro_batch_size: list[int] | None = setting(None, f"micro-batch sizes{_CASE}", "[B,...]")
    pow2: Pow2Shapes = setting(Pow2Shapes, "")
    sweep: SweepShapes = setting(SweepShapes, "")
    fuzz: FuzzShapes = setting(FuzzShapes, "")


@dataclass
class TimingConfig(SamplingPolicy):
    """Sampling of the get_data launcher: the sampler's policy (autotuner.measure.timer.SamplingPolicy)
    plus the guards around it. docs/measurement.md says when to change each."""

    hide_launch: bool = setting(
        True,
        "CUDA: queue a spin kernel before each sample so the host's launch delay stays out of it",
        "BOOL",
    )
    flush_cache: bool = setting(
        False, "evict the last-level cache before every sample (the op as it runs after others)", "BOOL"
    )
    idle_before_ms: float = setting(
        0.0, "pause this long before every sample, device idle (the op after a wait; 0: never)", "MS"
    )
    forward_after_backward: bool = setting(
        False, "run the op's backward, untimed, after every forward sample, as in a training step", "BOOL"
    )
    held_activations_mib: float = setting(
        0.0, "keep at least this many MiB of earlier calls' forward graphs alive while sampling", "MIB"
    )
    rotate_inputs: bool = setting(
        True, "cycle copies of inputs that fit in the cache, so no call reads the last one's from it", "BOOL"
    )
    threads: int = setting(0, "torch intra-op threads (0: torch's default)", "N")
    cuda_graph: bool = setting(
        False, "CUDA: time phases shorter than cuda_graph_below_us as CUDA-graph replays", "BOOL"
    )
    cuda_graph_below_us: float = setting(
        200.0, "with cuda_graph: the eager time below which a phase is replayed", "US"
    )


@dataclass
class MoeConfig:
    """Mixture-of-Experts settings (autotuner.model.routing)."""

    routing: str = setting(
        "learned", "where the MoE ops' router output comes from: learned, uniform, balanced or zipf", "MODE"
    )
    zipf_s: float = setting(
        1.2, "routing=zipf: expert i drawn with weight 1 / (i + 1) ** zipf_s (above 0)", "S"
    )


@dataclass
class ParallelConfig:
    """Without torchrun, a layout of TP or EP above 1 runs as one of its ranks in this process
    (autotuner.model.emulation, docs/parallel_emulation.md). ``rank``: which one, 0 <= rank < the
    layout's world size; None: the busiest (under EP the rank whose experts get the most tokens under
    ``moe.routing``; TP ranks are alike, so 0)."""

    rank: int | None = setting(
        None, "without torchrun, the rank of a TP/EP layout to run (default: the busiest)", "N"
    )


@dataclass
class LauncherConfig:
    name: str = MISSING


@dataclass
class GetDataLauncherConfig(LauncherConfig):
    """Our own timers and memory sensors (sampling: the ``timing`` settings)."""

    name: str = "get_data"


@dataclass
class NsysLauncherConfig(LauncherConfig):
    """``nsys profile`` around our worker, NVTX ranges from the instrumented ops (launchers/nsys.py)."""

    name: str = "nsys"
    nsys_bin: str = setting(
        "nsys",
        "the nsys to run; nsys is looked for on the PATH, in .tools, then the CUDA and Nsight Systems "
        "folders, newest first; any other name or path is used alone",
        "PATH",
    )
    trace: list[str] | None = setting(
        None,
        "the APIs nsys traces (-t), holding nvtx (default per device: CUDA cuda,nvtx,osrt,cublas,cudnn; "
        "CPU nvtx,osrt)",
        "[API,...]",
    )
    extra_args: list[str] = setting(
        [], "more nsys profile switches, one per item; one naming a default switch replaces it", "[ARG,...]"
    )
    warmup: int = setting(2, "unmeasured iterations per phase", "N")
    iterations: int = setting(5, "measured iterations per phase: one NVTX range, one sample each", "N")
    sub_op_ranges: bool = setting(
        True,
        "ranges for the measured op's sub-ops too (nested on the timeline, a small cost in its time)",
        "BOOL",
    )
    start_timeout_s: float = setting(
        300.0, "seconds nsys may take to start the worker before it is killed and the run refused", "S"
    )


@dataclass
class TorchProfilerLauncherConfig(LauncherConfig):
    """``torch.profiler`` around the same plan (autotuner.launchers.torch_profiler): per (op, shape point),
    sessions of ``wait + warmup + active`` training-like steps (forward then backward)."""

    name: str = "torch_profiler"
    wait: int = setting(0, "steps run unrecorded before the warm-up", "N")
    warmup: int = setting(2, "steps recorded and discarded (the profiler's start-up cost lands here)", "N")
    active: int = setting(5, "steps recorded: the rows' statistics are over these (at least 1)", "N")
    record_shapes: bool = setting(True, "the detailed session records the operators' input shapes", "BOOL")
    profile_memory: bool = setting(True, "the detailed session records allocations", "BOOL")
    with_stack: bool = setting(
        False,
        "the detailed session records Python stacks, for the stack files (as large as the traces)",
        "BOOL",
    )
    with_flops: bool = setting(
        True, "the detailed session estimates FLOPs of matmuls and convolutions", "BOOL"
    )
    memory_snapshot: bool = setting(False, "GPU: a CUDA allocator snapshot per op and point", "BOOL")
    compress_over_bytes: int = setting(
        0, "traces larger than this are written gzip-compressed, .json.gz (0: every trace)", "BYTES"
    )
    output_dir: str = setting("profiles", "the traces' folder, relative to the run directory", "DIR")
    lean_timing: bool = setting(
        True, "take the rows' times from a separate session recording only ranges and operators", "BOOL"
    )


@dataclass
class AutotunerConfig:
    """The root config. ``hf`` and ``tf`` hold overrides of the HF config and TransformerConfig fields
    (``hf.hidden_size=128``, ``tf.apply_rope_fusion=true``); both are checked against the real field names."""

    launcher: Any = MISSING
    case: str = setting("tiny", "the model: a YAML file in cases/ or case_dir", "NAME")
    case_dir: str | None = setting(None, "a folder of your own case files, searched before cases/", "DIR")
    hf: dict[str, Any] = setting(
        {}, "a field of the case's HuggingFace config, set before the mapping", "FIELD"
    )
    tf: dict[str, Any] = setting({}, "a TransformerConfig field, set after the mapping", "FIELD")
    shapes: ShapesConfig = setting(ShapesConfig, "")
    ops: list[str] = setting(
        ["all"],
        "ops to run, names or aliases (all: every op of the model; functional: the device ops)",
        "[OP,...]",
    )
    device: str = setting("auto", "auto, cpu or cuda (auto: cuda where there is a GPU)", "DEVICE")
    dtype: str = setting("auto", "auto, fp32, bf16 or fp16 (auto: bf16 on a GPU, fp32 on a CPU)", "DTYPE")
    attention: str = setting(
        "auto",
        "core attention: auto (Transformer-Engine's where its spec is used, sdpa on a GPU without it, "
        "local on a CPU), local, sdpa or te",
        "KIND",
    )
    seed: int = setting(1234, "seeds weights and inputs: the same seed gives the same inputs everywhere", "N")
    transformer_block_layers: int = setting(2, "layers in the transformer_block op", "N")
    timing: TimingConfig = setting(TimingConfig, "")
    moe: MoeConfig = setting(MoeConfig, "")
    parallel: ParallelConfig = setting(ParallelConfig, "")
    resume: bool = setting(
        False,
        "with hydra.run.dir=<an earlier run>: measure only what that run lacks, with its settings",
        "BOOL",
    )
    resume_across_versions: bool = setting(
        False,
        "resume a run another autotuner version or environment measured (each new row names it)",
        "BOOL",
    )
    calibration: str | None = setting(
        None,
        "the device calibration rows are judged against (default runs/calibration/<device>.json)",
        "FILE",
    )
    progress: bool = setting(True, "a progress bar while measuring", "BOOL")
    report: bool = setting(True, "write report.html and its figures into the run directory", "BOOL")
    capture: str | None = setting(
        None, "profile the calls an autotuner-capture file holds instead of the case's shapes", "FILE"
    )
    run_unfit: bool = setting(
        False,
        "run the rows whose estimated peak memory is over what the process can hold (the fit check "
        "refuses them: docs/memory_and_fit.md)",
        "BOOL",
    )
    memory_limit_gib: float | None = setting(
        None,
        "the most memory the fit check lets a measuring process hold: the smaller of this and what the "
        "device has (default: what the device has)",
        "GIB",
    )
    dry_run: bool = setting(
        False, "print the plan, parameter counts, FLOPs, bytes and memory; run nothing", "BOOL"
    )


LAUNCHER_SCHEMAS = {
    "get_data": GetDataLauncherConfig,
    "nsys": NsysLauncherConfig,
    "torch_profiler": TorchProfilerLauncherConfig,
}


def settings_listing() -> str:
    """Every setting of ``autotuner`` with its meaning and default, the launchers' under their own
    heading (the ``--help`` text)."""
    lines = settings_help(AutotunerConfig)
    for name, schema in LAUNCHER_SCHEMAS.items():
        summary = " ".join((schema.__doc__ or "").replace("``", "").split())
        lines += ["", *textwrap.wrap(f"launcher={name}: {summary}", 110, subsequent_indent="  ")]
        lines += settings_help(schema, "launcher.")[2:]  # launcher.name is the group's choice itself
    return "\n".join(lines)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="autotuner_schema", node=AutotunerConfig)
    for name, schema in LAUNCHER_SCHEMAS.items():
        cs.store(group="launcher", name=f"{name}_schema", node=schema)


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
